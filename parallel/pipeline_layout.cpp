#include "parallel/pipeline_layout.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "core/config.h"
#include "core/error.h"

namespace mt {

PipelineSplit PipelineSplit::from_config(const Config& cfg) {
  PipelineSplit s;
  s.num_layers = cfg.model.num_layers;
  s.pp = cfg.parallel.pipeline_model_parallel_size;
  s.vpp = cfg.parallel.virtual_pipeline_size;
  s.first_stage_layers = cfg.parallel.decoder_first_pipeline_num_layers;
  s.last_stage_layers = cfg.parallel.decoder_last_pipeline_num_layers;
  s.account_for_embedding = cfg.parallel.account_for_embedding_in_pipeline_split;
  s.account_for_loss = cfg.parallel.account_for_loss_in_pipeline_split;
  if (cfg.parallel.num_layers_per_virtual_pipeline_stage)
    s.vpp_flag = "--num-layers-per-virtual-pipeline-stage";
  if (cfg.parallel.pipeline_model_parallel_layout)
    s.layout = parse_pipeline_layout(*cfg.parallel.pipeline_model_parallel_layout);
  s.mtp = cfg.model.mtp_num_layers.value_or(0);
  return s;
}

namespace {

// Layer slots per stage (before taking the embedding/loss slots away).
std::vector<int> stage_slots(const PipelineSplit& s) {
  const int P = s.pp, V = s.vpp, L = s.num_layers;
  if (L <= 0) fail("--num-layers must be > 0 (got {})", L);
  if (P <= 0) fail("--pipeline-model-parallel-size must be > 0 (got {})", P);
  if (V <= 0) fail("the virtual pipeline size must be > 0 (got {})", V);
  std::vector<int> slots(P, 0);
  const bool uneven = s.first_stage_layers.has_value() || s.last_stage_layers.has_value();
  if (uneven) {
    if (s.account_for_embedding || s.account_for_loss)
      fail("--decoder-first-pipeline-num-layers/--decoder-last-pipeline-num-layers cannot be combined with "
           "--account-for-embedding-in-pipeline-split or --account-for-loss-in-pipeline-split");
    if (P < 2)
      fail("--decoder-first-pipeline-num-layers/--decoder-last-pipeline-num-layers need "
           "--pipeline-model-parallel-size > 1 (got {})", P);
    int remaining = L, middle = P;
    if (s.first_stage_layers) {
      const int f = *s.first_stage_layers;
      if (f <= 0) fail("--decoder-first-pipeline-num-layers must be > 0 (got {})", f);
      if (f % V != 0)
        fail("--decoder-first-pipeline-num-layers {} is not divisible by the virtual pipeline size {} ({})", f, V,
             s.vpp_flag);
      slots[0] = f;
      remaining -= f;
      --middle;
    }
    if (s.last_stage_layers) {
      const int l = *s.last_stage_layers;
      if (l <= 0) fail("--decoder-last-pipeline-num-layers must be > 0 (got {})", l);
      if (l % V != 0)
        fail("--decoder-last-pipeline-num-layers {} is not divisible by the virtual pipeline size {} ({})", l, V,
             s.vpp_flag);
      slots[P - 1] = l;
      remaining -= l;
      --middle;
    }
    if (remaining < 0)
      fail("--decoder-first-pipeline-num-layers plus --decoder-last-pipeline-num-layers exceed --num-layers {}", L);
    if (middle == 0 && remaining != 0)
      fail("--decoder-first/last-pipeline-num-layers place {} of --num-layers {} layers and "
           "--pipeline-model-parallel-size {} leaves no middle stage for the other {}",
           L - remaining, L, P, remaining);
    if (middle > 0 && remaining == 0)
      fail("--decoder-first/last-pipeline-num-layers leave no layers for the {} middle pipeline stages "
           "(--num-layers {}, --pipeline-model-parallel-size {})", middle, L, P);
    if (middle > 0) {
      if (remaining % middle != 0)
        fail("the {} layers left for the {} middle pipeline stages (--num-layers {} minus "
             "--decoder-first/last-pipeline-num-layers) are not divisible by {}",
             remaining, middle, L, middle);
      const int per = remaining / middle;
      if (per % V != 0)
        fail("the {} layers of each middle pipeline stage are not divisible by the virtual pipeline size {} ({})",
             per, V, s.vpp_flag);
      for (int p = 0; p < P; ++p) {
        if (p == 0 && s.first_stage_layers) continue;
        if (p == P - 1 && s.last_stage_layers) continue;
        slots[p] = per;
      }
    }
    return slots;
  }
  const int extra = (s.account_for_embedding ? 1 : 0) + (s.account_for_loss ? 1 : 0);
  const int total = L + extra;
  std::string what = fmt::format("--num-layers {}", L);
  if (extra > 0) {
    what += " plus";
    if (s.account_for_embedding) what += " 1 (--account-for-embedding-in-pipeline-split)";
    if (s.account_for_embedding && s.account_for_loss) what += " and";
    if (s.account_for_loss) what += " 1 (--account-for-loss-in-pipeline-split)";
    what += fmt::format(" = {}", total);
  }
  if (total % P != 0) fail("{} is not divisible by --pipeline-model-parallel-size {}", what, P);
  const int per = total / P;
  if (per % V != 0)
    fail("the {} layers per pipeline stage ({} / --pipeline-model-parallel-size {}) are not divisible by the "
         "virtual pipeline size {} ({})", per, what, P, V, s.vpp_flag);
  for (int p = 0; p < P; ++p) slots[p] = per;
  return slots;
}

}  // namespace

std::vector<std::string> parse_pipeline_layout(const std::string& layout) {
  std::string s;
  for (char c : layout)
    if (c != ',') s.push_back(c);  // purely cosmetic
  auto digits_at = [](const std::string& t, size_t i) {
    size_t e = i;
    while (e < t.size() && std::isdigit(static_cast<unsigned char>(t[e]))) ++e;
    return e;
  };
  auto repeat = [&](const std::string& what, const std::string& count) {
    const long n = std::strtol(count.c_str(), nullptr, 10);
    if (n > 100000) fail("--pipeline-model-parallel-layout {}: the repeat count {} is too large", layout, count);
    std::string out;
    for (long k = 0; k < n; ++k) out += what;
    return out;
  };
  // "(...)*n" (the group holds no ')'), left to right, each match once; then "x*n".
  std::string groups;
  for (size_t i = 0; i < s.size();) {
    if (s[i] == '(') {
      const size_t close = s.find(')', i + 1);
      if (close != std::string::npos && close > i + 1 && close + 1 < s.size() && s[close + 1] == '*') {
        const size_t end = digits_at(s, close + 2);
        if (end > close + 2) {
          groups += repeat(s.substr(i + 1, close - i - 1), s.substr(close + 2, end - close - 2));
          i = end;
          continue;
        }
      }
    }
    groups.push_back(s[i++]);
  }
  std::string flat;
  for (size_t i = 0; i < groups.size();) {
    if (i + 1 < groups.size() && groups[i + 1] == '*') {
      const size_t end = digits_at(groups, i + 2);
      if (end > i + 2) {
        flat += repeat(std::string(1, groups[i]), groups.substr(i + 2, end - i - 2));
        i = end;
        continue;
      }
    }
    flat.push_back(groups[i++]);
  }
  std::vector<std::string> stages(1);
  for (char c : flat) {
    if (c == '|') {
      stages.emplace_back();
    } else if (c == 'E' || c == 'L' || c == 't' || c == 'm') {
      stages.back().push_back(c);
    } else {
      fail("--pipeline-model-parallel-layout {}: invalid layer character '{}' (known: E embedding, t a transformer "
           "layer, m a multi-token prediction layer, L the loss; '|' ends a stage, (..)*n and x*n repeat)",
           layout, c);
    }
  }
  return stages;
}

namespace {

// The model chunks of an explicit layout, after Megatron's checks of it (PipelineParallelLayerLayout).
std::vector<ModelChunk> layout_chunks(const PipelineSplit& s) {
  const int P = s.pp, V = s.vpp;
  const char* flag = "--pipeline-model-parallel-layout";
  if (static_cast<int>(s.layout.size()) != P * V)
    fail("{} has {} stages, not --pipeline-model-parallel-size {} x {} virtual stages", flag, s.layout.size(), P, V);
  std::string all;
  for (const std::string& stage : s.layout) all += stage;
  auto count = [&](char c) { return static_cast<int>(std::count(all.begin(), all.end(), c)); };
  if (all.empty() || all.front() != 'E') fail("{}: the first layer must be the embedding (E)", flag);
  if (all.back() != 'L') fail("{}: the last layer must be the loss (L)", flag);
  if (count('E') != 1) fail("{}: the embedding (E) must be given exactly once", flag);
  if (count('L') != 1) fail("{}: the loss (L) must be given exactly once", flag);
  if (count('t') != s.num_layers)
    fail("{}: it holds {} decoder layers (t), --num-layers is {}", flag, count('t'), s.num_layers);
  if (count('m') != s.mtp)
    fail("{}: it holds {} multi-token prediction layers (m), --mtp-num-layers is {}", flag, count('m'), s.mtp);
  for (const std::string& stage : s.layout) {
    // megatrain runs the depths in the head: where Megatron's layout puts them at the end of the
    // stage with the loss, after its decoder layers.
    if (stage.find('m') == std::string::npos) continue;
    if (stage.find('L') == std::string::npos || stage.rfind('t') != std::string::npos && stage.rfind('t') > stage.find('m'))
      throw Unsupported(fmt::format("megatrain does not support multi-token prediction layers (m) in {} other than "
                                    "after the decoder layers of the stage with the loss (L) yet",
                                    flag));
  }
  if (s.layout.front().empty() || s.layout.front().front() != 'E')
    fail("{}: megatrain holds the embedding in the first stage (pipeline rank 0, virtual stage 0): the layout's first "
         "stage must start with E", flag);
  std::vector<ModelChunk> chunks;
  int next_layer = 0;
  for (int v = 0; v < V; ++v)
    for (int p = 0; p < P; ++p) {
      const std::string& stage = s.layout[static_cast<size_t>(v * P + p)];
      ModelChunk c;
      c.pp_rank = p;
      c.vp_stage = v;
      c.has_embedding = stage.find('E') != std::string::npos;
      c.has_output = stage.find('L') != std::string::npos;
      c.first_layer = next_layer;
      c.num_layers = static_cast<int>(std::count(stage.begin(), stage.end(), 't'));
      next_layer += c.num_layers;
      chunks.push_back(c);
    }
  return chunks;
}

}  // namespace

std::vector<ModelChunk> pipeline_chunks(const PipelineSplit& s) {
  if (!s.layout.empty()) return layout_chunks(s);
  const std::vector<int> slots = stage_slots(s);
  const int P = s.pp, V = s.vpp;
  std::vector<ModelChunk> chunks;
  chunks.reserve(static_cast<size_t>(P) * V);
  int next_layer = 0;
  for (int v = 0; v < V; ++v) {
    for (int p = 0; p < P; ++p) {
      ModelChunk c;
      c.pp_rank = p;
      c.vp_stage = v;
      c.has_embedding = (p == 0 && v == 0);
      c.has_output = (p == P - 1 && v == V - 1);
      int n = slots[p] / V;
      if (c.has_embedding && s.account_for_embedding) --n;
      if (c.has_output && s.account_for_loss) --n;
      if (n < 0)
        fail("pipeline stage {} chunk {} has no room for the embedding/loss slot (--num-layers {})", p, v,
             s.num_layers);
      c.first_layer = next_layer;
      c.num_layers = n;
      next_layer += n;
      chunks.push_back(c);
    }
  }
  MT_CHECK(next_layer == s.num_layers, "pipeline layout placed {} of {} layers", next_layer, s.num_layers);
  return chunks;
}

std::vector<ModelChunk> stage_chunks(const PipelineSplit& split, int pp_rank) {
  std::vector<ModelChunk> out;
  for (const ModelChunk& c : pipeline_chunks(split))
    if (c.pp_rank == pp_rank) out.push_back(c);
  return out;
}

std::vector<int> layers_per_stage(const PipelineSplit& split) {
  std::vector<int> out(split.pp, 0);
  for (const ModelChunk& c : pipeline_chunks(split)) out[c.pp_rank] += c.num_layers;
  return out;
}

}  // namespace mt

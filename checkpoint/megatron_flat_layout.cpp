#include "checkpoint/megatron_flat_layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>

#include "checkpoint/megatron_checkpoint.h"
#include "checkpoint/megatron_names.h"
#include "core/config.h"
#include "core/error.h"
#include "core/shape_text.h"
#include "core/shard.h"
#include "engine/model_dims.h"
#include "engine/param_layout.h"
#include "parallel/pipeline_layout.h"

namespace mt {

namespace {

constexpr int64_t kMegatronParamAlignment = 64;  // pad_param_start: elements, not bytes

// A layer's parameters in registration order (names after "decoder.layers.N.").
const std::vector<std::string>& layer_order(bool te_spec) {
  static const std::vector<std::string> local = {
      "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",  // input_layernorm
      "self_attention.core_attention.softmax_offset",  // (Attention registers core_attention before linear_proj)
      "self_attention.linear_proj.weight",          "self_attention.linear_proj.bias",
      "self_attention.linear_qkv.weight",           "self_attention.linear_qkv.bias",
      "self_attention.q_layernorm.weight",          "self_attention.q_layernorm.bias",
      "self_attention.k_layernorm.weight",          "self_attention.k_layernorm.bias",
      "mlp.linear_fc1.layer_norm_weight",           "mlp.linear_fc1.layer_norm_bias",  // pre_mlp_layernorm
      "mlp.linear_fc1.weight",                      "mlp.linear_fc1.bias",
      "mlp.linear_fc2.weight",                      "mlp.linear_fc2.bias",
      // a mixture-of-experts layer's MLP: its own pre-MLP norm, then the MoELayer's router (the
      // weight; its expert_bias is a buffer), experts and shared expert (its gate, a parameter of its
      // own, before its linears)
      "pre_mlp_layernorm.weight",                   "pre_mlp_layernorm.bias",
      "mlp.router.weight",                          "mlp.router.bias",
      "mlp.experts.linear_fc1.weight",              "mlp.experts.linear_fc2.weight",
      "mlp.experts.linear_fc1.bias",                "mlp.experts.linear_fc2.bias",  // (placed by add_experts)
      "mlp.shared_experts.gate_weight",
      "mlp.shared_experts.linear_fc1.weight",       "mlp.shared_experts.linear_fc2.weight"};
  static const std::vector<std::string> te = [] {
    std::vector<std::string> o = local;  // the input norm moves into linear_qkv, after linear_proj
    std::rotate(o.begin(), o.begin() + 2, o.begin() + 5);
    return o;
  }();
  return te_spec ? te : local;
}

}  // namespace

namespace {

// Megatron's walk over one chunk's parameters: reverse registration order, each start rounded up to
// 64 elements, the tied embedding copies in a bucket of their own (the bucket before them closed
// where they would have started); a bucket also closes after the parameter for which
// closes(bucket, end) holds. Each parameter's slot, and the buckets' unpadded sizes.
struct BucketWalk {
  std::vector<FlatSlot> slots;
  std::vector<int64_t> sizes;
  std::vector<std::string> last;  // the last parameter of each bucket
};
template <typename Closes>
BucketWalk walk_buckets(const std::vector<FlatParam>& params, Closes closes) {
  BucketWalk w;
  w.slots.resize(params.size());
  int64_t next = 0;   // where the next parameter may start, within the bucket
  bool open = false;  // the bucket holds a parameter
  std::string last;
  auto close = [&](int64_t end) {
    w.sizes.push_back(end);
    w.last.push_back(last);
    next = 0;
    open = false;
  };
  for (size_t k = params.size(); k-- > 0;) {
    const FlatParam& p = params[k];
    int64_t start = (next + kMegatronParamAlignment - 1) / kMegatronParamAlignment * kMegatronParamAlignment;
    if (p.shared_embedding && open) {
      close(start);
      start = 0;
    }
    const int bucket = static_cast<int>(w.sizes.size());
    w.slots[k] = {bucket, start};
    const int64_t end = start + p.numel;
    open = true;
    last = p.name.empty() ? "the tied output-layer copy" : p.name;
    if (p.shared_embedding || closes(bucket, end)) close(end);
    else next = end;
  }
  if (open) close(next);
  return w;
}

}  // namespace

std::vector<FlatSlot> megatron_flat_slots(const std::vector<FlatParam>& params, const std::vector<int64_t>& bucket_sizes,
                                          const std::string& what) {
  // A bucket closes at the first parameter end that reaches its stored size; a walk that does not
  // land on every stored size exactly is not the layout that was saved.
  const BucketWalk w = walk_buckets(params, [&](int b, int64_t end) {
    return static_cast<size_t>(b) < bucket_sizes.size() && end >= bucket_sizes[static_cast<size_t>(b)];
  });
  for (size_t b = 0; b < std::min(w.sizes.size(), bucket_sizes.size()); ++b)
    if (w.sizes[b] != bucket_sizes[b])
      fail("{}: bucket {} is stored with {} elements, but its parameters end at {} (after '{}')", what, b,
           bucket_sizes[b], w.sizes[b], w.last[b]);
  if (w.sizes.size() > bucket_sizes.size())
    fail("{}: the parameters need more than the {} stored buckets", what, bucket_sizes.size());
  if (w.sizes.size() < bucket_sizes.size())
    fail("{}: the parameters fill {} of the {} stored buckets", what, w.sizes.size(), bucket_sizes.size());
  return w.slots;
}

std::vector<int64_t> megatron_flat_bucket_sizes(const std::vector<FlatParam>& params, std::optional<int64_t> bucket_size) {
  return walk_buckets(params, [&](int, int64_t end) { return bucket_size && end >= *bucket_size; }).sizes;
}

std::vector<FlatParam> megatron_chunk_params(const Config& cfg, int tp, int tp_rank, int first_layer, int num_layers,
                                             bool has_embedding, bool has_output, bool pipelined, bool te_spec) {
  const ModelDims dims = ModelDims::from_config(cfg, RankPosition::split(cfg, tp, tp_rank));
  int64_t total = 0;
  const std::vector<ParamDesc> descs = build_param_descs(dims, &total);
  std::map<std::string, const ParamDesc*> by_name;
  for (const ParamDesc& d : descs)
    if (!d.shared_copy) by_name[d.name] = &d;
  std::vector<FlatParam> out;
  auto add = [&](const std::string& name, bool required) {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      if (required) fail("the model has no '{}'", name);
      return;
    }
    const ParamDesc& d = *it->second;
    std::vector<int64_t> local = {d.local_rows()};
    if (!d.is_1d()) local.push_back(d.local_cols());
    out.push_back({name, d.numel(), false, d.weight_decay, local});
  };
  const bool tied = dims.tied_embeddings;
  if (has_embedding) {
    add("embedding.word_embeddings.weight", true);
    out.back().shared_embedding = tied && pipelined;
    add("embedding.position_embeddings.weight", false);
  }
  const std::vector<std::string>& order = layer_order(te_spec);
  // A layer's routed experts: each expert's fc1 and fc2 a parameter of Megatron's own, in turn
  // (the local spec's SequentialMLP: fc1's weight and bias, then fc2's), or every expert's fc1, then
  // every fc2 (Transformer Engine's grouped linears weight0, weight1, ...).
  const auto add_experts = [&](const std::string& prefix, bool fc1_entry) {
    const int E = dims.experts;
    const std::string fc1 = prefix + "mlp.experts.linear_fc1.weight", fc2 = prefix + "mlp.experts.linear_fc2.weight";
    const std::string fc1_b = prefix + "mlp.experts.linear_fc1.bias", fc2_b = prefix + "mlp.experts.linear_fc2.bias";
    const bool biases = by_name.count(fc1_b) > 0;
    if (biases && te_spec)
      fail("'{}': megatrain lays out MoE layers with linear biases as Megatron-LM's local spec only (its "
           "SequentialMLP), not Transformer Engine's grouped linears",
           fc1_b);
    auto one = [&](const std::string& name, bool is_fc1, int e) {
      const ParamDesc& d = *by_name.at(name);
      const ShardIndex sh = megatron_expert_shard(is_fc1, d.global_shape, E, e, dims.swiglu, tp, tp_rank);
      out.push_back({name, sh.local_numel(), false, d.weight_decay, megatron_shard_shape(sh, d.global_shape), e});
    };
    for (int e = 0; e < E; ++e) {
      if (fc1_entry || !te_spec) one(fc1_entry ? fc1 : fc2, fc1_entry, e);
      if (fc1_entry && !te_spec) {
        if (biases) one(fc1_b, true, e);
        one(fc2, false, e);
        if (biases) one(fc2_b, false, e);
      }
    }
  };
  // Layer l's parameters named `prefix` + the layer's own names; `extra`: those of an MTP depth's
  // that are not its inner layer's (each layer's parameters must all have a place).
  const auto add_layer = [&](int l, const std::string& prefix, size_t extra) {
    size_t found = extra;
    for (const std::string& suffix : order)
      if (by_name.count(prefix + suffix)) {
        if (suffix == "mlp.experts.linear_fc1.weight") add_experts(prefix, true);
        else if (suffix == "mlp.experts.linear_fc2.weight") { if (te_spec) add_experts(prefix, false); }
        else if (suffix != "mlp.experts.linear_fc1.bias" && suffix != "mlp.experts.linear_fc2.bias")
          add(prefix + suffix, true);
        ++found;
      }
    size_t held = 0;
    for (const ParamDesc& d : descs)
      if (d.layer == l && !d.shared_copy) ++held;
    if (found != held) {
      for (const ParamDesc& d : descs)
        if (d.layer == l && !d.shared_copy && d.name.compare(0, prefix.size(), prefix) == 0 &&
            std::find(order.begin(), order.end(), d.name.substr(prefix.size())) == order.end())
          fail("'{}' has no known place in Megatron's registration order", d.name);
    }
  };
  for (int l = first_layer; l < first_layer + num_layers; ++l) add_layer(l, fmt::format("decoder.layers.{}.", l), 0);
  if (has_output) {
    add("decoder.final_layernorm.weight", false);
    add("decoder.final_layernorm.bias", false);
    // Multi-token prediction (GPTModel registers its MultiTokenPredictionBlock after the decoder,
    // before the output layer): each depth's enorm, hnorm, eh_proj, its inner layer, final_layernorm.
    for (int j = 0; j < dims.mtp; ++j) {
      const std::string mtp = fmt::format("mtp.layers.{}.", j);
      if (!by_name.count(mtp + "eh_proj.weight")) continue;
      const size_t before = out.size();
      for (const char* norm : {"enorm", "hnorm"}) {
        add(mtp + norm + ".weight", true);
        add(mtp + norm + ".bias", false);
      }
      add(mtp + "eh_proj.weight", true);
      const size_t outer = out.size() - before;
      add_layer(dims.num_layers + j, mtp + "transformer_layer.", outer + (by_name.count(mtp + "final_layernorm.weight") +
                                                                          by_name.count(mtp + "final_layernorm.bias")));
      add(mtp + "final_layernorm.weight", true);
      add(mtp + "final_layernorm.bias", false);
    }
    if (!tied) {
      add("output_layer.weight", true);
    } else if (pipelined) {  // the last stage's copy of the word embeddings, in a bucket of its own
      FlatParam copy;
      const ParamDesc& emb = *by_name.at("embedding.word_embeddings.weight");
      copy.numel = emb.numel();
      copy.shared_embedding = true;
      copy.local_shape = {emb.local_rows(), emb.local_cols()};
      out.push_back(copy);
    }
  }
  return out;
}

namespace {

// Calls fn(pp_rank, tp_rank, chunk, params) for every model chunk of every model-parallel rank of
// `cfg`'s model saved with tensor parallel `tp` and `split`.
template <typename Fn>
void for_each_chunk(const Config& cfg, int tp, const PipelineSplit& split, bool te_spec, Fn fn) {
  for (int p = 0; p < split.pp; ++p) {
    const std::vector<ModelChunk> chunks = stage_chunks(split, p);
    for (int t = 0; t < tp; ++t)
      for (size_t v = 0; v < chunks.size(); ++v) {
        const ModelChunk& c = chunks[v];
        fn(p, t, static_cast<int>(v),
           megatron_chunk_params(cfg, tp, t, c.first_layer, c.num_layers, c.has_embedding, c.has_output, split.pp > 1,
                                 te_spec));
      }
  }
}

// How each parameter's TP shards make its global tensor: its global shape and each rank's ShardIndex.
struct Joins {
  std::map<std::string, std::vector<int64_t>> global_shape;
  std::map<std::string, std::vector<ShardIndex>> shards;  // by TP rank
};
Joins tp_joins(const Config& cfg, int tp) {
  Joins j;
  for (int t = 0; t < tp; ++t) {
    int64_t total = 0;
    for (const ParamDesc& d : build_param_descs(ModelDims::from_config(cfg, RankPosition::split(cfg, tp, t)), &total)) {
      j.shards[d.name].push_back(d.shard);
      j.global_shape[d.name] = d.global_shape;
    }
  }
  return j;
}

}  // namespace

std::optional<int64_t> saved_bucket_size(const PickleValue& args, int pp_rank, int chunk) {
  if (!megatron_bool_arg(args, "overlap_grad_reduce") || pp_rank > 0 || chunk > 0 ||
      megatron_bool_arg(args, "overlap_param_gather_with_optimizer_step"))
    return std::nullopt;
  if (megatron_arg(args, "ddp_num_buckets"))
    fail("it was saved with --ddp-num-buckets, whose bucket sizes megatrain does not rebuild");
  const int64_t size = megatron_int_arg(args, "ddp_bucket_size", 0);
  if (size > 0) return size;
  const int64_t dp_cp =
      megatron_int_arg(args, "data_parallel_size", 1) * megatron_int_arg(args, "context_parallel_size", 1);
  return std::max<int64_t>(40000000, 1000000 * dp_cp);
}

std::string place_flat_optimizer_state(MegatronCheckpoint& ck, const Config& cfg, int tp, const PipelineSplit& split,
                                       bool te_spec) {
  // The stored buckets: sizes by (chained optimizer, model-parallel rank, chunk), in bucket order.
  std::map<std::tuple<int, int, int>, std::vector<int64_t>> stored;
  for (const auto& [b, size] : ck.flat_buckets()) {
    std::vector<int64_t>& sizes = stored[{b.chain, b.mp_rank, b.gbuf}];
    if (b.bucket != static_cast<int>(sizes.size()))
      return fmt::format("its flat optimizer buffers of dp_group_idx_{} gbuf_idx_{} skip bucket {}", b.mp_rank, b.gbuf,
                         sizes.size());
    sizes.push_back(size);
  }
  std::map<std::string, std::vector<MegatronCheckpoint::FlatPiece>> found;  // by TP rank (experts: e x TP + t)
  try {
    // Under expert parallelism the routed experts have an optimizer of their own (Megatron's
    // ChainedOptimizer: chained_1), one buffer per experts' model-parallel rank (ETP x EP x PP: the
    // TP rank, then the EP rank, then the stage), holding its local experts; chained_0 the rest.
    const int ep = cfg.model.moe.enabled() ? static_cast<int>(megatron_int_arg(ck.args(), "expert_model_parallel_size", 1)) : 1;
    if (ep > 1 && megatron_int_arg(ck.args(), "expert_tensor_parallel_size", tp) != tp)
      fail("the experts' tensor-parallel size differs from TP, whose buffers megatrain does not lay out yet");
    const int local_experts = ep > 1 ? cfg.model.moe.num_experts / ep : 0;
    size_t used = 0;
    // One stored buffer (chain, mp, chunk v) of tensor rank t, stage p, holding `params`.
    const auto place = [&](int chain, int mp, int p, int t, int v, const std::vector<FlatParam>& params) {
      const std::string what = fmt::format("{}dp_group_idx_{}.gbuf_idx_{} (tensor rank {}, pipeline rank {}, chunk {})",
                                           chain > 0 ? fmt::format("chained_{}.", chain) : std::string(), mp, v, t, p, v);
      auto s = stored.find({chain, mp, v});
      if (s == stored.end()) fail("{} is not stored", what);
      ++used;
      std::vector<int64_t> sizes = s->second;
      std::vector<int64_t> starts(sizes.size(), 0);  // of each bucket in the stored buffer
      if (ck.flat_coalesced()) {
        // One buffer: the buckets end to end, their sizes from Megatron's bucketing rule.
        sizes = megatron_flat_bucket_sizes(params, saved_bucket_size(ck.args(), p, v));
        starts.assign(sizes.size(), 0);
        for (size_t b = 1; b < sizes.size(); ++b) starts[b] = starts[b - 1] + sizes[b - 1];
        const int64_t total = sizes.empty() ? 0 : starts.back() + sizes.back();
        if (total != s->second[0])
          fail("{} holds {} elements, but its parameters in Megatron's buckets make {}", what, s->second[0], total);
      }
      const std::vector<FlatSlot> slots = megatron_flat_slots(params, sizes, what);
      for (size_t k = 0; k < params.size(); ++k) {
        if (params[k].name.empty()) continue;
        const int bucket = ck.flat_coalesced() ? 0 : slots[k].bucket;
        const int64_t offset = starts[static_cast<size_t>(slots[k].bucket)] + slots[k].offset;
        std::vector<MegatronCheckpoint::FlatPiece>& pieces = found[params[k].name];
        const int e = params[k].expert;
        pieces.resize(static_cast<size_t>(tp) * (e >= 0 ? cfg.model.moe.num_experts : 1));
        pieces[static_cast<size_t>((e >= 0 ? e * tp : 0) + t)] = {{mp, v, bucket, chain}, offset, params[k].numel};
      }
    };
    for_each_chunk(cfg, tp, split, te_spec, [&](int p, int t, int v, const std::vector<FlatParam>& params) {
      if (ep == 1) return place(0, t + tp * p, p, t, v, params);
      std::vector<FlatParam> dense;
      std::vector<std::vector<FlatParam>> experts(static_cast<size_t>(ep));
      for (const FlatParam& fp : params)
        (fp.expert < 0 ? dense : experts[static_cast<size_t>(fp.expert / local_experts)]).push_back(fp);
      place(0, t + tp * p, p, t, v, dense);
      for (int e = 0; e < ep; ++e) place(1, t + tp * (e + ep * p), p, t, v, experts[static_cast<size_t>(e)]);
    });
    if (used != stored.size())
      fail("it stores {} flat buffers (model chunks and optimizers), but its layout makes {}", stored.size(), used);
  } catch (const Error& e) {
    return std::string("its distributed optimizer's flat buffers do not fit the model megatrain derives from its "
                       "args: ") + e.what();
  }
  const Joins joins = tp_joins(cfg, tp);
  for (auto& [name, pieces] : found) {
    const std::vector<int64_t>& shape = joins.global_shape.at(name);
    std::vector<ShardIndex> shards = joins.shards.at(name);
    if (pieces.size() > static_cast<size_t>(tp)) {  // routed experts: each expert's TP shards
      const int E = cfg.model.moe.num_experts;
      const bool fc1 = name.find("mlp.experts.linear_fc1.") != std::string::npos;  // (weight or bias)
      shards.clear();
      for (int e = 0; e < E; ++e)
        for (int t = 0; t < tp; ++t) shards.push_back(megatron_expert_shard(fc1, shape, E, e, cfg.model.swiglu, tp, t));
    }
    ck.set_flat_placement(name, std::move(pieces), shape, std::move(shards));
  }
  return "";
}

std::string place_indexed_optimizer_state(MegatronCheckpoint& ck, const Config& cfg, int tp,
                                          const PipelineSplit& split, bool te_spec) {
  std::map<std::string, std::vector<MegatronCheckpoint::IndexedPiece>> found;  // by TP rank
  try {
    // Each rank's parameters over its chunks, in registration order.
    std::map<std::pair<int, int>, std::vector<FlatParam>> rank_params;
    for_each_chunk(cfg, tp, split, te_spec, [&](int p, int t, int, const std::vector<FlatParam>& params) {
      std::vector<FlatParam>& all = rank_params[{p, t}];
      all.insert(all.end(), params.begin(), params.end());
    });
    for (const auto& [rank, params] : rank_params) {
      const auto [p, t] = rank;
      const std::string what = fmt::format("the rank file of tensor rank {}, pipeline rank {}", t, p);
      const std::vector<MegatronCheckpoint::IndexedGroup> groups = ck.indexed_groups(t, p);
      // Megatron's groups sort the default (weight decay) before the no-weight-decay override.
      const std::vector<bool> group_decays = {true, false};
      if (groups.size() != group_decays.size())
        fail("{} has {} param groups, not the 2 (with and without weight decay) megatrain rebuilds", what, groups.size());
      for (size_t g = 0; g < groups.size(); ++g) {
        if (groups[g].decoupled_lr) fail("{} has a --decoupled-lr param group", what);
        if ((groups[g].wd_mult != 0) != group_decays[g])
          fail("{}: param group {} has wd_mult {}", what, g, groups[g].wd_mult);
        int64_t position = 0;
        for (const FlatParam& fp : params) {
          if (fp.weight_decay != group_decays[g]) continue;
          if (!fp.name.empty()) {
            std::vector<MegatronCheckpoint::IndexedPiece>& pieces = found[fp.name];
            pieces.resize(static_cast<size_t>(tp));
            pieces[static_cast<size_t>(t)] = {p, static_cast<int>(g), position, fp.local_shape};
          }
          ++position;
        }
        if (position != groups[g].size)
          fail("{}: param group {} holds {} parameters, the model megatrain derives {}", what, g, groups[g].size,
               position);
      }
    }
  } catch (const Error& e) {
    return std::string("its optimizer state does not fit the model megatrain derives from its args: ") + e.what();
  }
  const Joins joins = tp_joins(cfg, tp);
  for (auto& [name, pieces] : found)
    ck.set_indexed_placement(name, std::move(pieces), joins.global_shape.at(name), joins.shards.at(name));
  return "";
}

// The distributed optimizer's float32 main weights of `name` against its model weights (the same
// values, or them rounded to bf16/fp16).
void check_main_weights(const HostArray& main, const HostArray& model, const std::string& name, const std::string& where) {
  if (main.dtype != DType::f32 || main.shape != model.shape)
    fail("{}: the main weights of '{}' are {} {}, the model weights {}", where, name, dtype_name(main.dtype),
         shape_text(main.shape), shape_text(model.shape));
  const float* m = main.ptr<float>();
  int64_t differ = 0, first = -1;
  for (int64_t i = 0; i < main.numel(); ++i) {
    bool same = false;
    switch (model.dtype) {
      case DType::f32: same = std::memcmp(&m[i], model.ptr<float>() + i, 4) == 0; break;
      case DType::bf16: same = float_to_bf16_bits(m[i]) == model.ptr<uint16_t>()[i]; break;
      default: same = true;  // fp16 runs are refused before this
    }
    if (!same && differ++ == 0) first = i;
  }
  if (differ)
    fail("{}: the optimizer's main weights of '{}' do not match its model weights ({} of {} elements differ, the "
         "first at {}): megatrain placed the optimizer state wrongly for this checkpoint's layout. --weights-only "
         "imports the weights alone",
         where, name, differ, main.numel(), first);
}


}  // namespace mt

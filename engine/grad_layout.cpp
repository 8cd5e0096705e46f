#include "engine/grad_layout.h"

#include <algorithm>
#include <map>

#include "core/error.h"

namespace mt {

std::vector<ShardSegment> GradLayout::shard_segments(int b) const {
  std::vector<ShardSegment> segs = plan.shard_segments(b, bucket_rank(b));
  for (ShardSegment& s : segs) s.param = plan_param[static_cast<size_t>(s.param)];
  return segs;
}

namespace {

// Appends the region's plan to the whole: its parameters and buckets after those already there.
void append_region(GradBufferPlan& whole, const GradBufferPlan& region) {
  const int64_t shift = whole.numel;
  const int first_param = static_cast<int>(whole.params.size());
  for (ParamPlacement p : region.params) {
    p.offset += shift;
    p.bucket += static_cast<int>(whole.buckets.size());
    whole.params.push_back(p);
  }
  for (GradBucket b : region.buckets) {
    b.offset += shift;
    for (int& k : b.params) k += first_param;
    whole.buckets.push_back(std::move(b));
  }
  whole.numel += region.numel;
}

}  // namespace

GradLayout layout_grad_buffer(std::vector<ParamDesc>& params, int dp_size, int dp_rank,
                              std::optional<int64_t> bucket_size, bool sharded, bool pipeline,
                              int64_t* total_elements, ExpertDpGroup experts, std::optional<int> unit_layers) {
  MT_CHECK(dp_rank >= 0 && dp_rank < dp_size, "dp rank {} of {}", dp_rank, dp_size);
  MT_CHECK(experts.size == 0 || (experts.rank >= 0 && experts.rank < experts.size), "expert-dp rank {} of {}",
           experts.rank, experts.size);
  GradLayout g;
  g.dp_rank = dp_rank;
  g.expert_dp_rank = experts.rank;
  g.sharded = sharded;

  // Backward order: runs of parameters of one layer (params() is in forward order, so a layer's
  // parameters are adjacent), last run first; in each run the TP-partial ones first. Per region:
  // 0 the compute-dtype parameters, 1 the routed experts' (with an expert-DP group), 2 the FP8 ones,
  // 3 the routed experts' FP8 ones (with an expert-DP group).
  constexpr int kRegions = 4, kExpertRegion = 1, kFp8Region = 2, kFp8ExpertRegion = 3;
  auto expert_region = [](int region) { return region == kExpertRegion || region == kFp8ExpertRegion; };
  std::vector<GradParam> order[kRegions];
  std::vector<int> order_param[kRegions];
  const int n = static_cast<int>(params.size());
  for (int end = n; end > 0;) {
    int begin = end - 1;
    while (begin > 0 && params[static_cast<size_t>(begin - 1)].layer == params[static_cast<size_t>(end - 1)].layer)
      --begin;
    for (int pass = 0; pass < 2; ++pass)
      for (int i = end - 1; i >= begin; --i) {
        const ParamDesc& p = params[static_cast<size_t>(i)];
        if (p.tp_partial_grad != (pass == 0)) continue;
        const bool tied_copy = pipeline && (p.name == "embedding.word_embeddings.weight" ||
                                            (p.name == "output_layer.weight" && p.shared_copy));
        const bool own_group = p.expert && experts.size > 0;
        const int region = p.fp8_storage ? (own_group ? kFp8ExpertRegion : kFp8Region) : own_group ? kExpertRegion : 0;
        GradParam gp{p.name, p.numel(), tied_copy, std::nullopt};
        if (unit_layers) gp.unit = p.layer >= 0 && p.layer < *unit_layers ? p.layer : -1;
        order[region].push_back(std::move(gp));
        order_param[region].push_back(i);
      }
    end = begin;
  }
  g.plan.dp_size = dp_size;
  std::vector<size_t> region_buckets;  // per region in use: its first bucket
  std::vector<char> expert_flag;       // per bucket
  for (int region = 0; region < kRegions; ++region) {
    if (region == kFp8Region) g.fp8_begin = g.plan.numel;
    if (order[region].empty()) continue;
    region_buckets.push_back(g.plan.buckets.size());
    append_region(g.plan, plan_grad_buffer(order[region], expert_region(region) ? experts.size : dp_size,
                                           unit_layers ? std::nullopt : bucket_size));
    expert_flag.resize(g.plan.buckets.size(), expert_region(region) ? 1 : 0);
    g.plan_param.insert(g.plan_param.end(), order_param[region].begin(), order_param[region].end());
  }
  for (size_t k = 0; k < g.plan_param.size(); ++k)
    params[static_cast<size_t>(g.plan_param[k])].offset = g.plan.params[k].offset;
  *total_elements = g.plan.numel;

  auto first_param = [&](const GradBucket& b) {
    int first = n;
    for (int k : b.params) first = std::min(first, g.plan_param[static_cast<size_t>(k)]);
    return first;
  };
  // With several regions, their buckets interleave in the order their gradients become final (the
  // reductions' launch order: a bucket is final once the backward has passed its first parameter in
  // forward order; on a tie the earlier region first); each region keeps its own order.
  if (region_buckets.size() > 1) {
    std::vector<size_t> next = region_buckets, end(region_buckets.begin() + 1, region_buckets.end());
    end.push_back(g.plan.buckets.size());
    std::vector<GradBucket> merged;
    std::vector<char> merged_flag;
    while (merged.size() < g.plan.buckets.size()) {
      size_t best = next.size();
      for (size_t r = 0; r < next.size(); ++r)
        if (next[r] < end[r] &&
            (best == next.size() || first_param(g.plan.buckets[next[r]]) > first_param(g.plan.buckets[next[best]])))
          best = r;
      merged_flag.push_back(expert_flag[next[best]]);
      merged.push_back(std::move(g.plan.buckets[next[best]++]));
    }
    g.plan.buckets = std::move(merged);
    expert_flag = std::move(merged_flag);
  }
  g.expert_bucket = std::move(expert_flag);
  for (size_t b = 0; b < g.plan.buckets.size(); ++b) {
    for (int k : g.plan.buckets[b].params) g.plan.params[static_cast<size_t>(k)].bucket = static_cast<int>(b);
    g.bucket_first_param.push_back(first_param(g.plan.buckets[b]));
    if (unit_layers) {
      const int first = g.plan.buckets[b].params.front();
      const int layer = params[static_cast<size_t>(g.plan_param[static_cast<size_t>(first)])].layer;
      g.bucket_unit.push_back(layer >= 0 && layer < *unit_layers ? layer : -1);
    }
  }
  int64_t state = 0;
  for (int b = 0; b < g.num_buckets(); ++b) {
    g.state_offset.push_back(sharded ? state : g.plan.buckets[static_cast<size_t>(b)].offset);
    state += g.shard_numel(b);
  }
  g.state_numel = sharded ? state : g.plan.numel;
  return g;
}

std::vector<std::pair<int, FlatRange>> tp_partial_ranges(const std::vector<ParamDesc>& params) {
  // (layer, FP8 region) -> [lo, hi): FP8 parameters lie in a region of their own
  std::map<std::pair<int, bool>, std::pair<int64_t, int64_t>> span;
  for (const ParamDesc& p : params) {
    if (!p.tp_partial_grad) continue;
    auto [it, fresh] = span.try_emplace({p.layer, p.fp8_storage}, p.offset, p.offset + p.numel());
    if (!fresh) {
      it->second.first = std::min(it->second.first, p.offset);
      it->second.second = std::max(it->second.second, p.offset + p.numel());
    }
  }
  std::vector<std::pair<int, FlatRange>> out;
  for (const auto& [key, r] : span) {
    const int layer = key.first;
    for (const ParamDesc& p : params)
      MT_CHECK(p.tp_partial_grad || p.offset + p.numel() <= r.first || p.offset >= r.second,
               "parameter {} lies among the TP-partial gradients of layer {}", p.name, layer);
    out.push_back({layer, FlatRange{r.first, r.second - r.first}});
  }
  return out;
}

}  // namespace mt

#include "engine/grad_layout.h"

#include <algorithm>
#include <map>

#include "core/error.h"

namespace mt {

std::vector<ShardSegment> GradLayout::shard_segments(int b) const {
  std::vector<ShardSegment> segs = plan.shard_segments(b, dp_rank);
  for (ShardSegment& s : segs) s.param = plan_param[static_cast<size_t>(s.param)];
  return segs;
}

GradLayout layout_grad_buffer(std::vector<ParamDesc>& params, int dp_size, int dp_rank,
                              std::optional<int64_t> bucket_size, bool sharded, bool pipeline,
                              int64_t* total_elements) {
  MT_CHECK(dp_rank >= 0 && dp_rank < dp_size, "dp rank {} of {}", dp_rank, dp_size);
  GradLayout g;
  g.dp_rank = dp_rank;
  g.sharded = sharded;

  // Backward order: runs of parameters of one layer (params() is in forward order, so a layer's
  // parameters are adjacent), last run first; in each run the TP-partial ones first.
  std::vector<GradParam> order;
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
        order.push_back(GradParam{p.name, p.numel(), tied_copy});
        g.plan_param.push_back(i);
      }
    end = begin;
  }
  g.plan = plan_grad_buffer(order, dp_size, bucket_size);
  for (size_t k = 0; k < order.size(); ++k)
    params[static_cast<size_t>(g.plan_param[k])].offset = g.plan.params[k].offset;
  *total_elements = g.plan.numel;

  for (const GradBucket& b : g.plan.buckets) {
    int first = n;
    for (int k : b.params) first = std::min(first, g.plan_param[static_cast<size_t>(k)]);
    g.bucket_first_param.push_back(first);
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
  std::map<int, std::pair<int64_t, int64_t>> span;  // layer -> [lo, hi)
  for (const ParamDesc& p : params) {
    if (!p.tp_partial_grad) continue;
    auto [it, fresh] = span.try_emplace(p.layer, p.offset, p.offset + p.numel());
    if (!fresh) {
      it->second.first = std::min(it->second.first, p.offset);
      it->second.second = std::max(it->second.second, p.offset + p.numel());
    }
  }
  std::vector<std::pair<int, FlatRange>> out;
  for (const auto& [layer, r] : span) {
    for (const ParamDesc& p : params)
      MT_CHECK(p.tp_partial_grad || p.offset + p.numel() <= r.first || p.offset >= r.second,
               "parameter {} lies among the TP-partial gradients of layer {}", p.name, layer);
    out.push_back({layer, FlatRange{r.first, r.second - r.first}});
  }
  return out;
}

}  // namespace mt

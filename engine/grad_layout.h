// Where a model chunk's parameters sit in its flat buffers: the data-parallel bucket layout of
// parallel/grad_buckets.h applied to the chunk's ParamDescs, and (with --use-distributed-optimizer)
// where this DP rank's shard of each bucket lives in the sharded master-weight and optimizer-state
// buffers.
//
// The parameter, gradient, master and optimizer buffers all share one layout, so a bucket is one
// contiguous range of each and is reduced in place. Parameters are placed in backward order (the
// order their gradients become final); within each layer the parameters whose gradients are only
// partial on each TP rank (ParamDesc::tp_partial_grad) come first, so that one all-reduce covers
// them.
//
// FP8 parameters (--fp8-param-gather, ParamDesc::fp8_storage) form a region of their own after all
// the others, [fp8_begin, end), cut into buckets of its own (Megatron gives them a buffer of their
// own): the model stores that region as FP8 bytes and the rest in the compute dtype, and a bucket
// never mixes the two, so each bucket's parameter all-gather moves one dtype. Buckets are numbered
// in the order their gradients become final across both regions (the order the reductions are
// launched in), so bucket b no longer need lie before bucket b + 1 in the buffer.
//
// Under expert parallelism the routed experts' weights (ParamDesc::expert) likewise form a region
// of their own, before the FP8 one: their buckets are reduced, and with the distributed optimizer
// sharded, over the expert-data-parallel group (GradBucket::shards = its size; this rank's shard
// is its expert-DP rank's), the other buckets over the whole DP group. FP8 expert weights likewise
// form the last region, inside the FP8 one: FP8 buckets reduced over the expert-DP group.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/tensor.h"
#include "engine/param_layout.h"
#include "parallel/grad_buckets.h"

namespace mt {

struct GradLayout {
  GradBufferPlan plan;                  // over params in backward order (plan.params[k] <-> plan_param[k])
  std::vector<int> plan_param;          // plan parameter k -> index into the model's params()
  std::vector<int> bucket_first_param;  // per bucket: its smallest params() index
  int dp_rank = 0;
  int expert_dp_rank = 0;
  std::vector<char> expert_bucket;  // per bucket: the routed experts' region (expert parallelism)
  // Distributed optimizer: master weights and optimizer states hold only this rank's shard of
  // every bucket, one after the other.
  bool sharded = false;
  std::vector<int64_t> state_offset;  // per bucket: where its shard starts in the sharded buffers
  int64_t state_numel = 0;            // size of the sharded buffers (the full size when not sharded)
  int64_t fp8_begin = 0;              // first element of the FP8 region (plan.numel: none)
  // Unit buckets (sharded gradients, ModelOptions::shard_grads): per bucket the decoder layer whose
  // parameters it holds, or -1 for one of the parameters outside the layers. Empty otherwise.
  std::vector<int> bucket_unit;

  bool fp8_bucket(int b) const { return plan.buckets[static_cast<size_t>(b)].offset >= fp8_begin; }
  bool is_expert_bucket(int b) const { return expert_bucket[static_cast<size_t>(b)] != 0; }
  int bucket_rank(int b) const { return is_expert_bucket(b) ? expert_dp_rank : dp_rank; }  // in its group

  int num_buckets() const { return static_cast<int>(plan.buckets.size()); }
  int64_t shard_offset(int b) const { return plan.shard_offset(b, bucket_rank(b)); }  // in the flat buffers
  int64_t shard_numel(int b) const { return plan.shard_numel(b); }
  // The parameter pieces of this rank's shard of bucket b, with param = params() index.
  std::vector<ShardSegment> shard_segments(int b) const;
};

// The expert-data-parallel group of the routed experts' region: size 0 (no region: the experts'
// weights are bucketed with the others), or its size and this rank's place in it.
struct ExpertDpGroup {
  int size = 0, rank = 0;
};

// Assigns every ParamDesc::offset from the bucket plan and returns it; *total_elements becomes the
// padded size of the flat buffers. bucket_size: nullopt = one bucket. Tied word embeddings shared
// between the first and last pipeline stage get a bucket of their own (pipeline true).
// unit_layers (sharded gradients): every decoder layer below it is a unit, whose parameters are a
// bucket of their own, and so is each run of the other parameters (bucket_size then unused).
GradLayout layout_grad_buffer(std::vector<ParamDesc>& params, int dp_size, int dp_rank,
                              std::optional<int64_t> bucket_size, bool sharded, bool pipeline,
                              int64_t* total_elements, ExpertDpGroup experts = {},
                              std::optional<int> unit_layers = std::nullopt);

// Contiguous ranges [offset, offset + count) of the flat buffers that hold all parameters with
// tp_partial_grad of one layer (layer -1: the final norm), padding between them included (it holds
// zeros): one per layer, two where some of them are FP8 parameters (their region). Empty when the
// chunk has none.
std::vector<std::pair<int, FlatRange>> tp_partial_ranges(const std::vector<ParamDesc>& params);

}  // namespace mt

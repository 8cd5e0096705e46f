// Data-parallel gradient buckets, planned up front (pure arithmetic, no communication).
//
// All gradients of a model chunk live in one flat buffer (Megatron's main_grad buffer; the bf16
// parameters use the same index layout in their own flat buffer). The buffer is cut into buckets; a
// bucket is reduced across data-parallel ranks (all-reduce, or reduce-scatter with the distributed
// optimizer) as soon as the backward has produced all of its gradients, overlapping the rest of the
// backward (--overlap-grad-reduce).
//
// Layout rules (Megatron's DistributedOptimizer layout, megatron/core/optimizer/param_layout.py):
//  * parameters are placed in backward order (the reverse of the model's forward order), which is
//    the order their gradients become final, so the first bucket is ready first;
//  * each parameter starts at a multiple of 64 elements (aligned views for vectorized kernels);
//  * a bucket closes after the parameter that brings it to >= bucket_size elements; a parameter
//    marked own_bucket (the tied word embedding, Megatron's shared_embedding) gets a bucket alone,
//    so the embedding-group all-reduce can wait for it separately;
//  * each bucket's end is padded to a multiple of lcm(DP, 128) elements, so its DP shards (the
//    reduce-scatter outputs the distributed optimizer owns) are equal and stay 128-element aligned
//    for every DP size, odd ones included.
// Megatron pads only with the distributed optimizer; here the same layout serves both (the padding
// is never user-visible: checkpoints hold global tensor coordinates).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace mt {

struct GradParam {
  std::string name;
  int64_t numel = 0;
  bool own_bucket = false;  // put in a bucket of its own (tied word embedding)
  // Fully sharded data parallelism's units (engine/grad_layout.h): when set, a bucket never holds
  // two units' parameters (a decoder layer is a unit; -1 the parameters outside them).
  std::optional<int> unit;
};

struct ParamPlacement {
  int64_t offset = 0;  // first element in the flat buffer
  int64_t numel = 0;
  int bucket = 0;
};

struct GradBucket {
  int64_t offset = 0;          // first element in the flat buffer
  int64_t numel = 0;           // padded size: a multiple of lcm(DP, 128)
  int64_t numel_unpadded = 0;  // up to the end of its last parameter
  std::vector<int> params;     // indices into the parameter list, in placement order
  // The ranks it is reduced (and sharded) over: the plan's dp_size, or for the routed experts'
  // buckets under expert parallelism the expert-data-parallel size (engine/grad_layout.h).
  int shards = 1;
};

// A piece of one parameter inside one DP rank's shard of a bucket.
struct ShardSegment {
  int param = 0;              // index into the parameter list
  int64_t param_offset = 0;   // first element within the parameter (flattened)
  int64_t shard_offset = 0;   // first element within the shard
  int64_t numel = 0;
};

struct GradBufferPlan {
  int dp_size = 1;
  int64_t numel = 0;  // whole flat buffer, padding included
  std::vector<ParamPlacement> params;  // same order as the input list
  std::vector<GradBucket> buckets;

  int64_t shard_numel(int bucket) const;   // buckets[b].numel / buckets[b].shards
  int64_t shard_offset(int bucket, int dp_rank) const;  // flat-buffer offset of that rank's shard
  // The parameter pieces rank dp_rank's shard of bucket b covers, in shard order (padding gaps
  // between and after parameters belong to no segment).
  std::vector<ShardSegment> shard_segments(int bucket, int dp_rank) const;
};

// Megatron's bucket size (megatron/training/training.py resolve_ddp_bucket_size): with
// --ddp-num-buckets, num_parameters / num_buckets; else --ddp-bucket-size, or by default
// max(40M, 1M * DP) elements; no bucketing (one bucket, nullopt) without --overlap-grad-reduce.
// num_parameters: this rank's parameters over all its model chunks; dp_size counts DP x CP.
std::optional<int64_t> resolve_ddp_bucket_size(std::optional<int64_t> ddp_bucket_size,
                                               std::optional<int> ddp_num_buckets, bool overlap_grad_reduce,
                                               int dp_size, int64_t num_parameters);

// params: in backward order (last layer's parameters first). bucket_size: nullopt = one bucket.
GradBufferPlan plan_grad_buffer(const std::vector<GradParam>& params, int dp_size,
                                std::optional<int64_t> bucket_size);

// One line per bucket, for --dry-run and logs.
std::string describe(const GradBufferPlan& plan, const std::vector<GradParam>& params);

}  // namespace mt

// What the optimizer updates on this rank, and (--use-distributed-optimizer) how the updated
// parameters get back to every data-parallel rank.
//
// Without the distributed optimizer each rank updates every parameter of its model chunks: one
// range per chunk covering the whole flat buffer. With it (Megatron's DistributedOptimizer, ZeRO-1)
// the gradients were reduce-scattered, and each DP rank updates only its shard of every bucket:
// one range per bucket, whose master weights and Adam moments live in the chunk's sharded buffers
// (GradLayout::state_offset); afterwards every bucket's parameters are all-gathered from the
// shards. Any DP size works: buckets are padded to a multiple of lcm(DP, 128) elements.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "engine/backend.h"
#include "engine/gpt_model.h"

namespace mt {

struct ParallelState;
class Communicator;

// Megatron's parameter groups: weight decay or not (no decay on biases and 1-D parameters),
// --decoupled-lr for the word embeddings and the output layer, and --use-mup's hidden matrices
// (ParamDesc::mup_hidden; not the matrices Muon updates: muon_managed).
enum OptimGroup {
  kOptimDecay = 0, kOptimNoDecay = 1, kOptimDecoupledDecay = 2, kOptimDecoupledNoDecay = 3, kOptimMupHidden = 4
};
int optim_group(const ParamDesc& p, bool decoupled_lr, bool muon_managed = false);

// One contiguous range of a chunk's flat buffers that this rank updates.
struct OptimRange {
  int chunk = 0;
  int bucket = -1;           // -1: the whole buffer (not sharded)
  int64_t flat_offset = 0;   // in the parameter and gradient buffers
  int64_t state_offset = 0;  // in the master-weight and optimizer-state buffers
  int64_t numel = 0;
  // Relative to the range's start. Update segments merge neighbours of one group across the
  // alignment padding (it holds zeros with zero gradients, which AdamW and SGD leave at zero),
  // except FP8 parameters' pieces: one segment each, with the weight's scale and amax;
  // norm segments cover exactly the parameters counted in the gradient norm: every parameter
  // once, TP-duplicated ones on TP rank 0 only, never the last stage's tied-embedding copy.
  std::vector<OptimSegment> update, norm;
  // Under expert parallelism the routed experts' pieces count in expert_norm instead of norm: their
  // squares are summed over the experts' groups (engine/optimizer.h), the others' over the dense ones.
  std::vector<OptimSegment> expert_norm;
  // norm and expert_norm less the parameters whose squares the model sums as their gradients are
  // written (GptModel::sumsq_fused): what the gradient norm reads from the buffer (the Optimizer
  // sets them; the parameters' norm and the zero count take norm and expert_norm).
  std::vector<OptimSegment> grad_norm, expert_grad_norm;
};

// The ranges of one chunk (the model's grad_layout() says whether it is sharded).
std::vector<OptimRange> plan_optim_ranges(const GptModel& model, int chunk, int tp_rank, bool decoupled_lr);

// segments less the elements of the parameters `leave` picks (each parameter's [offset, offset +
// numel) of the flat buffers, relative to a range starting at flat_offset); every piece keeps its
// segment's group and scales.
std::vector<OptimSegment> without_params(const std::vector<OptimSegment>& segments, const std::vector<ParamDesc>& params,
                                         int64_t flat_offset, const std::function<bool(const ParamDesc&)>& leave);

// The views of one range.
struct OptimViews {
  Tensor master, grad, state1, state2, model_copy;  // model_copy: the compute-dtype params (separate master only)
  TieBits ties;  // master weights kept as remainders rounded to nearest even (GptModel::master_ties)
};
OptimViews optim_views(const GptModel& model, const OptimRange& r);

// The parameter all-gather after a distributed-optimizer step: per bucket, from each rank's shard
// (in place, in the compute dtype, or FP8 for FP8 parameters) on the data-parallel communicator. With overlap
// (--overlap-param-gather, a backend with a communication stream) the gathers run on that stream
// and each forward waits, before its first use of a bucket's parameters, for that bucket alone.
class ParamGather {
 public:
  // expert_dp: the group of the routed experts' buckets under expert parallelism (else null).
  ParamGather(std::vector<GptModel*> chunks, Communicator& dp, Communicator* expert_dp, bool overlap);
  ~ParamGather();
  ParamGather(const ParamGather&) = delete;
  ParamGather& operator=(const ParamGather&) = delete;

  // After the update of this rank's shards.
  void start();
  // Before anything reads whole parameter buffers outside a forward pass (checkpoint saving).
  void wait_all();

 private:
  void wait_needed(int chunk, int end);

  std::vector<GptModel*> chunks_;
  Communicator& dp_;
  Communicator* expert_dp_;
  bool overlap_;
  std::vector<int> first_mark_;           // per chunk: the comm mark of its bucket 0
  std::vector<std::vector<char>> pending_;  // per chunk, per bucket: gathered but not yet waited for
  int num_pending_ = 0;
};

}  // namespace mt

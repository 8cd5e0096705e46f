// Data-parallel gradient reduction (Megatron's DistributedDataParallel + finalize_model_grads).
//
// Each model chunk's gradient buffer is cut into buckets (engine/grad_layout.h). In the chunk's
// last backward of the step (PipelineAction::grad_sync) the model reports as gradients become
// final; with --overlap-grad-reduce a bucket's reduction starts as soon as its last gradient is
// final, on the backend's communication stream (CUDA), overlapping the rest of the backward pass.
// Without it, or on the reference backend (synchronous MPI), the same calls run in order. The
// reduction is an all-reduce, or with --use-distributed-optimizer a reduce-scatter (each DP rank
// keeps the sum of its shard), in the main gradients' dtype (bf16 with --grad-reduce-in-bf16).
//
// finish(), before the optimizer, completes every reduction and then sums the tied word-embedding gradients of the first and last pipeline stage over the embedding
// group, so that both copies receive identical updates.
//
// The gradients are summed, not averaged: the optimizer folds 1/DP into its gradient scale (the
// same arithmetic as Megatron's pre-division, without an extra pass over the buffer).
//
// Under expert parallelism the routed experts' buckets (GradLayout::is_expert_bucket) are reduced
// over the expert-data-parallel group instead: each expert's gradient already holds the tokens of
// every EP rank, so the sum over its replicas is the sum over all DP ranks, as for the others.
#pragma once

#include <memory>
#include <vector>

#include "engine/gpt_model.h"
#include "engine/phase_timers.h"

namespace mt {

struct Config;
struct ParallelState;
class Communicator;

class DpGradSync {
 public:
  DpGradSync(const Config& cfg, ParallelState& ps, std::vector<GptModel*> chunks);
  ~DpGradSync();
  DpGradSync(const DpGradSync&) = delete;
  DpGradSync& operator=(const DpGradSync&) = delete;

  // The communicator of the data-parallel reductions and parameter gathers: the DP group (with
  // the distributed optimizer: its instance, ps.dist_opt_group()), on the backend's communication
  // stream where it has one.
  Communicator& comm() { return *comm_; }
  // The same for the routed experts' buckets under expert parallelism (the expert-data-parallel
  // group); null without expert parallelism.
  Communicator* expert_comm() { return ecomm_; }

  void start_step();
  // Completes the step's reductions (see above). Once per step: later calls before the next
  // start_step() (or step_done()) do nothing, so the trainer can finish inside forward-backward
  // as Megatron's finalize_model_grads does and the optimizer's own call finds it done.
  void finish();
  void step_done() { finished_ = false; }

  // Timers (engine/phase_timers.h): all-grads-sync, embedding-grads-all-reduce.
  TimerHook timer;

 private:
  void grads_final(int chunk, int first_param);
  void launch(int chunk, int bucket);
  void finish_dp();
  void finish_embeddings();
  void add_shard(GptModel& m, int bucket);
  void finish_slot(int chunk, int slot);

  ParallelState& ps_;
  std::vector<GptModel*> chunks_;
  std::unique_ptr<Communicator> own_comm_;  // split of the reduction group onto the communication stream
  Communicator* comm_ = nullptr;
  // --num-distributed-optimizer-instances > 1: the shards' all-reduce across the instances.
  std::unique_ptr<Communicator> own_inter_;
  Communicator* inter_ = nullptr;
  std::unique_ptr<Communicator> own_ecomm_;  // the expert-DP group on the communication stream
  // With optimizer instances: the experts' inter-instance group (their shards' sums), else null.
  std::unique_ptr<Communicator> own_einter_;
  Communicator* einter_ = nullptr;
  Communicator* ecomm_ = nullptr;
  bool overlap_ = false, sharded_ = false, reduce_ = false, shard_grads_ = false;
  std::vector<int> next_bucket_;  // per chunk: the first bucket not launched in this step
  // Sharded gradients with --overlap-grad-reduce: per chunk and gradient slot, the buckets whose
  // reduce-scatter is issued and whose sum is not yet added (finish_slot); per chunk the first of
  // its comm marks (-1: none).
  bool defer_units_ = false;
  std::vector<std::vector<std::vector<int>>> deferred_;
  std::vector<int> unit_marks_;
  bool finished_ = false;
};

}  // namespace mt

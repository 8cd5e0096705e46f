// Pipeline schedules as data. For each pipeline rank, the ordered list of what it does in one
// training step: forward or backward of (micro-batch, model chunk), and groups of point-to-point
// transfers (activations to the next stage, gradients to the previous one). The engine executes the
// list; nothing here does math, so every property of a schedule is testable on its own.
//
// The compute order on each rank is Megatron-LM's (megatron/core/pipeline_parallel/schedules.py):
//   no pipelining (PP = 1):  F(0) B(0) F(1) B(1) ... ; gradient sync allowed on the last backward.
//   1F1B (PP > 1, V = 1):    W = min(P - r - 1, M) warm-up forwards, then one forward + one
//                            backward per step, then W cool-down backwards.
//   interleaved (V > 1):     Megatron's schedule table of (micro-batch, chunk) pairs in groups of N
//                            micro-batches, W = min(M V, 2 (P - r - 1) + (V - 1) N) warm-up forwards,
//                            then forward virtual k + W with backward virtual k, then the cool-down.
//
// Where the transfers go is derived, not hand-written: the builder replays all ranks together in
// rounds (each rank runs its next compute when its input has arrived; every tensor sent in a round
// is received by its peer in that same round, as one group per rank and round). Groups that meet in
// the same round complete together, so the result is deadlock-free by construction;
// check_pipeline_schedules() verifies it independently, together with the order of the messages.
//
// Executing a communicate action: issue all its transfers between Communicator::group_start() and
// group_end() (in list order) and wait for them before the next action. That fully ordered
// execution is what the checker proves deadlock-free. An executor may relax it: run the groups in
// list order on a communication stream, have each group wait only for the computes that produced
// what it sends, and each compute wait only for the receive it consumes. Those dependencies are a
// subset of the fully ordered ones, so the relaxed run cannot deadlock either, and a receive posted
// early (the builder receives a tensor in the round it is sent, which may be well before its
// consumer runs) then never holds up computation. Activations and gradients
// travel on separate channels: with NCCL use one communicator per channel (ParallelState::pp for
// activations, ParallelState::pp_grad for gradients), with MPI a tag per channel. Messages on one
// channel between two ranks are matched in the order they are issued; with PP = 2 both channels
// connect the same two ranks in both directions, and a single channel could pair an activation with
// a gradient of the same shape without any error.
#pragma once

#include <string>
#include <vector>

namespace mt {

enum class PipelineChannel : unsigned char { activation, gradient };

// One point-to-point transfer of a pipeline stage's boundary tensor ([s/CP(/TP with SP), b, h]).
struct P2PTransfer {
  bool is_send = false;
  PipelineChannel channel = PipelineChannel::activation;
  int peer = 0;        // pipeline rank on the other side
  int microbatch = 0;  // micro-batch the tensor belongs to
  int chunk = 0;       // this rank's model chunk: for a send the chunk that produced it, for a
                       // receive the chunk that will consume it
};

enum class PipelineOp : unsigned char { forward, backward, communicate };

struct PipelineAction {
  PipelineOp op = PipelineOp::forward;
  int microbatch = -1;  // forward / backward
  int chunk = -1;       // forward / backward: model chunk on this rank (0 .. V-1)
  // backward only: the last backward of this chunk in the step. Gradient reduction for the chunk's
  // parameters (DP buckets) is enabled from this backward on: Megatron's enable_grad_sync().
  bool grad_sync = false;
  std::vector<P2PTransfer> transfers;  // communicate only: one group

  static PipelineAction forward(int mb, int chunk) { return {PipelineOp::forward, mb, chunk, false, {}}; }
  static PipelineAction backward(int mb, int chunk, bool sync) {
    return {PipelineOp::backward, mb, chunk, sync, {}};
  }
};

enum class ScheduleKind { no_pipelining, one_f_one_b, interleaved };

struct ScheduleSpec {
  int pp_size = 1;
  int num_microbatches = 1;         // M
  int num_chunks = 1;               // V: model chunks per pipeline rank (virtual pipeline size)
  int microbatch_group_size = 0;    // N (--microbatch-group-size-per-virtual-pipeline-stage); 0 = P
};

struct PipelineSchedule {
  ScheduleKind kind = ScheduleKind::no_pipelining;
  int pp_size = 1, pp_rank = 0, num_chunks = 1, num_microbatches = 1;
  int num_warmup = 0;                  // forwards before the first backward (Megatron's warm-up)
  std::vector<PipelineAction> actions;

  // Peak number of forwards whose backward has not run yet: activations the rank holds at once.
  int peak_inflight_forwards() const;
  // Peak number of received tensors waiting for the compute that consumes them (receive buffers
  // the executor needs per channel, activations and gradients counted together).
  int peak_pending_receives() const;
};

ScheduleKind schedule_kind(const ScheduleSpec& spec);

// Megatron's rules for the interleaved schedule, as one-line mt::Error messages naming the flags:
// V > 1 needs P > 1; P <= N <= M; M % N == 0 or M % N >= P.
void validate_schedule_spec(const ScheduleSpec& spec);

// Interleaved forward order shared by all ranks: entry k is (micro-batch, chunk) of forward virtual
// micro-batch k. Backward virtual k is (table[k].first, V - 1 - table[k].second).
std::vector<std::pair<int, int>> interleaved_schedule_table(int num_microbatches, int num_chunks, int group_size);

// Warm-up forwards of pipeline rank r (Megatron's get_pp_rank_microbatches, training mode).
int num_warmup_forwards(const ScheduleSpec& spec, int pp_rank);

// The schedule of every pipeline rank (index = pipeline rank). Throws mt::Error for invalid specs.
std::vector<PipelineSchedule> build_pipeline_schedules(const ScheduleSpec& spec);
PipelineSchedule build_pipeline_schedule(const ScheduleSpec& spec, int pp_rank);

// Replays all ranks' lists together with grouped send/receive semantics (a group waits until every
// transfer in it has met its peer's matching transfer in the peer's current group; messages on one
// channel between two ranks pair up in issue order) and checks: no deadlock; each paired send and
// receive name the same micro-batch and the receiver's chunk is the one that follows (activations)
// or precedes (gradients) the sender's in the virtual pipeline; every transfer is paired; every
// compute has its input before it runs; each (micro-batch, chunk) runs forward once and backward
// once, backward after forward, backwards of a chunk in micro-batch order; exactly one grad_sync
// backward per chunk, on its last backward. Returns "" when all hold, else the first violation.
std::string check_pipeline_schedules(const std::vector<PipelineSchedule>& schedules);

// Human-readable list, e.g. "F0.0 [s a0.0->1] B0.0 ...", for logs and test failures.
std::string describe(const PipelineSchedule& schedule);

}  // namespace mt

// Executes a pipeline schedule (parallel/schedules.h) on this rank's model chunks: forwards,
// backwards and the grouped point-to-point transfers between stages (activations on ps.pp,
// gradients on ps.pp_grad), in the schedule's fully ordered form. The same runner drives the
// single-stage case (the no-pipelining schedule).
//
// Activation slots are planned up front from the schedule: a (micro-batch, chunk) takes a slot of
// its chunk when its input arrives (the receive may come well before the forward runs) or when its
// forward starts, and frees it after its backward; each chunk gets the peak number it holds at once.
// Received activations land directly in the slot's stage input, received gradients in its output
// gradient; a backward's input gradient is sent in the group right after it (the schedule builder
// puts every send in the round its tensor is produced), before the next compute overwrites it.
//
// Data: the chunks holding the embedding or the loss read their micro-batches from the data source
// (in micro-batch order, once per micro-batch); the other chunks need none.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "core/config.h"
#include "data/batch.h"
#include "engine/gpt_model.h"
#include "engine/phase_timers.h"
#include "parallel/schedules.h"

namespace mt {

class StragglerDetector;

struct ParallelState;

struct PipelinePlan {
  PipelineSchedule schedule;
  std::vector<int> num_slots;           // per chunk
  // Per action: forward/backward: {slot}; communicate: one slot per transfer (-1 for a sent
  // input gradient, which lives in the chunk's workspace).
  std::vector<std::vector<int>> slots;
  // Per action: the slot whose backward is its chunk's next compute action (-1: a forward comes
  // first, or none, or a communicate action): activation offloading's GptModel::prefetch_backward
  // and backward_follows.
  std::vector<int> next_backward;

  // The schedule of this config for pipeline rank pp_rank, with num_microbatches micro-batches
  // (default: the config's constant number).
  static PipelinePlan build(const Config& cfg, int pp_rank, int num_microbatches = 0);
  static PipelinePlan from_schedule(PipelineSchedule schedule);
};

// Whether every pipeline stage reads the micro-batches, not only the first (embedding) and the last
// (loss): when each stage's layers need something of the data beyond the activations they
// receive: the document starts of --reset-attention-mask, or --reset-position-ids' positions with
// rotary embeddings (RoPE, YaRN, MLA), which every layer's attention reads.
bool every_stage_reads_data(const Config& cfg);

// The numbers of micro-batches per iteration a run can take: the constant one, or with
// --step-batch-size-schedule each scheduled batch's (batches that micro-batch x DP does not divide
// are left out: the trainer refuses them when the schedule reaches them).
std::vector<int> scheduled_microbatch_counts(const Config& cfg);

// Activation slots per chunk that every schedule of the run fits in (the largest of each chunk).
std::vector<int> pipeline_slots_needed(const Config& cfg, int pp_rank);

class PipelineRunner {
 public:
  // chunks: this rank's model chunks in chunk order, each built with at least plan.num_slots[c] slots.
  PipelineRunner(const Config& cfg, ParallelState& ps, std::vector<GptModel*> chunks);

  // One training step of num_microbatches micro-batches (one of scheduled_microbatch_counts):
  // every micro-batch's forward and backward. serial numbers the first micro-batch (dropout keys);
  // iteration names the step in errors.
  void train_step(BatchSource* data, double loss_grad_scale, bool per_token_loss, uint64_t serial, int64_t iteration,
                  int num_microbatches);
  // One evaluation step (forward only, no dropout) over one evaluation global batch
  // (--eval-global-batch-size, default the training one): the loss sums accumulate on the last stage.
  // Returns false when the data ran out on a rank that reads data.
  bool eval_step(BatchSource* data);
  // Reads and drops one step's micro-batches (--iterations-to-skip), on ranks that read data.
  void skip_step(BatchSource* data, int64_t iteration, int num_microbatches);

  bool reads_data() const { return reads_data_; }
  // The plan of a step of num_microbatches micro-batches.
  const PipelinePlan& plan(int num_microbatches) const;
  // Optional timers (--timing-log-level, engine/phase_timers.h): called with a name and start
  // (true) or stop (false): batch-generator, forward-compute, backward-compute, the p2p names.
  TimerHook timer;
  // --log-straggler (engine/straggler.h): times each training forward and micro-batch fetch.
  StragglerDetector* straggler = nullptr;

 private:
  bool needs_data(int chunk) const;
  bool fetch(BatchSource* data, int mb);
  void communicate(const PipelineAction& a, const std::vector<int>& slots);
  void connect_neighbours();
  void time(const char* name, bool start) {
    if (timer) timer(name, start);
  }

  const Config& cfg_;
  ParallelState& ps_;
  std::vector<GptModel*> chunks_;
  std::map<int, PipelinePlan> plans_;  // by number of micro-batches
  bool reads_data_ = false;
  MicroBatch mb_;  // skip_step's reads
  // This step's micro-batches, each read once: with one chunk of this rank reading data, the last
  // one read (step_mbs_[0]); with several (every_stage_reads_data under the interleaved
  // schedules, which visit them out of micro-batch order), all of the step's, by index.
  std::vector<MicroBatch> step_mbs_;
  bool keep_step_ = false;  // several chunks of this rank read data
  int fetched_ = 0;         // micro-batches of this step read so far
  const MicroBatch& batch(int mb) const { return step_mbs_[keep_step_ ? static_cast<size_t>(mb) : 0]; }
};

}  // namespace mt

// Training checkpoints: what --save writes and --load restores, with Megatron's semantics
// (Megatron-LM's megatron/training/checkpointing.py), on the storage layer (checkpoint/checkpoint_io.h,
// checkpoint/FORMAT.md).
//
// A checkpoint holds, under global names with each rank's ShardIndex (so that any TP/PP/DP layout
// loads it):
//   model   every parameter in the compute dtype (one replica: DP rank 0, TP rank 0 for the
//           TP-duplicated norms; the last stage's copy of tied embeddings is not saved)
//   main    the fp32 master weights when they are a separate copy (bf16/fp16 training)
//   optim   <param>.exp_avg / <param>.exp_avg_sq (Adam) or <param>.momentum_buffer (SGD)
// With --use-distributed-optimizer every DP rank writes its own shard of the master weights and
// optimizer states (flat ranges of the parameters' TP blocks); the model weights still come from
// DP rank 0. Loading assembles whatever slices this rank's layout needs, so checkpoints move
// between TP/PP/DP layouts with or without the distributed optimizer.
// and in the manifest: iteration, consumed train/valid samples, the LR scheduler, the optimizer's
// step count, the loss scaler, the config (app/checkpoint_args.h), and per rank the dropout RNG
// state (the micro-batch serial the counter-based dropout keys are made from).
//
// Loading (Megatron's load_checkpoint):
//   resume          everything: iteration, consumed samples, optimizer + scheduler + scaler, RNG
//   --finetune      weights only; iteration and consumed samples start at 0 (also for a release
//                   checkpoint, e.g. one made by import-hf, and for --pretrained-checkpoint's,
//                   loaded when --load has none)
//   --override-ckpt-iteration N  resume at iteration N, consumed samples N x global batch
//   --no-load-optim no optimizer, scheduler or loss-scaler state (master weights re-copied from
//                   the model weights); iteration and consumed samples are restored
//   --no-load-rng   dropout restarts from the seed (serial 0)
// --verify-integrity: saves also write the files' SHA-256 manifest (integrity.json), and a load
// first checks the files against it (checkpoint/checkpoint_io.h), refusing a changed one by name.
// With --non-persistent-ckpt-type global, a non-persistent checkpoint at least as new as --load's
// is loaded instead, as a resume (checkpoint_to_load); saves every --non-persistent-save-interval
// iterations go there (app/checkpoint_retention.h keeps only the newest).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "app/checkpoint_retention.h"
#include "app/progress_log.h"
#include "checkpoint/checkpoint_io.h"
#include "core/config.h"
#include "engine/gpt_model.h"
#include "engine/trainer.h"

namespace mt {

struct ParallelState;

// Where a run resumes, as read by TrainingCheckpoints::load().
struct ResumePoint {
  bool loaded = false;          // a checkpoint's weights are in the model
  std::string directory;        // the iteration directory loaded
  Trainer::Counters counters;   // zeros unless resuming (finetune/release: zeros)
  double flops_so_far = 0;      // num_floating_point_operations_so_far
  bool optimizer_state = false;  // the fields below were loaded
  std::optional<LrScheduleParams> schedule;  // with --use-checkpoint-opt-param-scheduler: the checkpoint's
  int64_t scheduler_num_steps = 0;
  int64_t optimizer_steps = 0;
  double loss_scale = 1.0;
  int64_t scaler_growth_tracker = 0;
  int scaler_hysteresis_tracker = 0;
};

// The ranks' agreement for a save (SaveGroup::all_ok): a logical AND over the world, done as a
// min all-reduce of one element of the model's scalar buffer (device memory for NCCL).
SaveGroup make_save_group(ParallelState& ps, GptModel& model);

class TrainingCheckpoints {
 public:
  // Plans the host staging buffers for --save up front (the size of this rank's parameters,
  // master weights and optimizer states), so that a save allocates no large buffers.
  TrainingCheckpoints(const Config& cfg, ParallelState& ps, std::vector<GptModel*> chunks);
  TrainingCheckpoints(const Config& cfg, ParallelState& ps, GptModel& model)
      : TrainingCheckpoints(cfg, ps, std::vector<GptModel*>{&model}) {}
  ~TrainingCheckpoints();
  TrainingCheckpoints(const TrainingCheckpoints&) = delete;
  TrainingCheckpoints& operator=(const TrainingCheckpoints&) = delete;

  // --load: fills the model's weights (and master weights and optimizer states when resuming).
  // Call before building the data streams: they start at counters.consumed_samples. Without
  // --load, or without a checkpoint there (and no --exit-on-missing-checkpoint), returns an
  // empty ResumePoint and the model keeps its initialization.
  ResumePoint load();
  // Applies the loaded progress, scheduler, optimizer step count and loss scaler to the trainer.
  void restore(const ResumePoint& r, Trainer& trainer);

  // FLOPs of one iteration, for num_floating_point_operations_so_far.
  // Model FLOPs of one sample (num_floating_point_operations is linear in the batch).
  void set_flops_per_sample(double f) { flops_per_sample_ = f; }

  // Saves the trainer's current iteration into --save (non_persistent: into the non-persistent
  // directory, where older ones are then deleted): synchronously, or with --async-save by copying
  // the shards into the staging buffers and writing them on a background thread.
  void save(Trainer& trainer, bool non_persistent = false);
  // Once per iteration with --async-save: commits a background save that has finished
  // (collective; a no-op otherwise).
  void poll();
  // Waits for and commits a pending background save (end of training, before exiting).
  void finish();
  std::optional<int64_t> last_saved_iteration() const { return last_saved_; }

 private:
  // Host staging of one chunk: params (compute dtype), master (accum dtype, when separate),
  // states 1 and 2 (sharded buffers with the distributed optimizer).
  struct Staging {
    // master: float32 (GptModel::master_to_host); master_raw: master_flat's own bytes when they are
    // not that (int16 remainders), master_ties: their tie bits (GptModel::master_tie_words).
    std::vector<unsigned char> params, master, master_raw, master_ties, state1, state2, fp8, fp8_extra;
    std::vector<float> fp8_experts, fp8_experts_out;  // the experts' FP8 state: packed, then per expert
    std::vector<float> expert_bias;  // the MoE layers' expert biases (aux-loss-free balancing)
    // FP8 parameters: this rank's master shards rounded to the compute dtype (their model weights).
    std::vector<unsigned char> fp8_model;
  };
  // Whether this rank writes the model replica of parameter p; the optimizer replica too unless
  // the optimizer state is sharded (then every DP rank writes its shards).
  bool owns(const ParamDesc& p) const;
  bool first_instance(const GradLayout& L, int bucket) const;
  // Commits a finished (wait: or waits for the) background save, naming its iteration.
  void commit_pending(bool wait);
  void committed(int64_t iteration, bool non_persistent, std::optional<int64_t> previous);
  std::unique_ptr<CheckpointWriter> stage(Trainer& trainer, const std::string& dir);
  void stage_chunk(CheckpointWriter& w, GptModel& m, Staging& h, bool optim);
  void load_chunk(CheckpointReader& reader, GptModel& m, bool load_optim);
  void load_expert_bias(CheckpointReader& reader, GptModel& m);
  void verify_integrity(const std::string& dir);
  void override_iteration(ResumePoint& r, const RunState& rs, const std::string& manifest) const;
  // FP8 parameters' model weights: the compute-dtype rounding of this rank's master shards.
  void stage_fp8_params(CheckpointWriter& w, GptModel& m, Staging& h);
  // Loading progress: tensors read of all to read, printed by rank 0 every few seconds.
  struct LoadProgress {
    std::string directory;
    int64_t done = 0, total = 0;
    double bytes = 0;
    std::chrono::steady_clock::time_point start, next_report;
  };
  LoadProgress load_progress_;
  void loaded_tensor(size_t bytes);
  // false: the checkpoint holds none (the state stays as it was).
  bool load_fp8_state(CheckpointReader& reader, GptModel& m);
  static void stage_fp8_state(CheckpointWriter& w, Backend& be, const Fp8State& f, std::vector<unsigned char>& staging,
                              const std::string& prefix);
  bool load_fp8_layers(CheckpointReader& reader, GptModel& m, Fp8State& f, const std::string& prefix);
  // The experts' FP8 state (GptModel::fp8_expert_state): per FP8 MoE layer, per expert (global
  // rows of a [E, ...] tensor, each rank its experts').
  void stage_fp8_experts(CheckpointWriter& w, GptModel& m, Staging& h);
  void load_fp8_experts(CheckpointReader& reader, GptModel& m);
  bool writes_expert_state() const;
  void read_flat(CheckpointReader& reader, GptModel& m, CheckpointKind kind, const std::string& suffix, Tensor dst,
                 bool from_model_fallback);
  void read_param(CheckpointReader& reader, GptModel& m, const ParamDesc& p, CheckpointKind kind,
                  const std::string& suffix, Tensor dst, bool from_model_fallback, std::vector<unsigned char>& host);
  // --dist-ckpt-strictness: compares what the run loads (every rank's tensors) with what the
  // checkpoint holds; reports, fails or fills absent_ as the value says.
  void check_strictness(const CheckpointReader& reader, bool load_optim);
  // Tensors the run loads that the checkpoint lacks, left as initialized (optimizer states: zero)
  // under the log_*, return_* and ignore_all strictness values. Keys: (model or optimizer, name);
  // model weights (and their main copies) are keyed as model.
  std::set<std::pair<int, std::string>> absent_;

  const Config& cfg_;
  ParallelState& ps_;
  std::vector<GptModel*> chunks_;
  GptModel& model_;  // chunk 0 (backend, scalars)
  SaveGroup group_;
  double flops_per_sample_ = 0;
  int64_t start_iteration_ = 0;
  double start_flops_ = 0;
  int64_t start_consumed_ = 0;
  std::optional<int64_t> last_saved_;
  int64_t pending_iteration_ = 0;  // of the background save in flight
  bool pending_non_persistent_ = false;
  std::optional<int64_t> pending_previous_;  // what the tracker named when that save began
  // num_floating_point_operations_so_far at `iteration` of this run.
  // (By the samples: --step-batch-size-schedule varies the batch per iteration.)
  double flops_so_far(int64_t consumed_samples) const {
    return start_flops_ + static_cast<double>(consumed_samples - start_consumed_) * flops_per_sample_;
  }
  ProgressLog progress_;           // --log-progress
  CheckpointRetention retention_;  // --save-retain-interval (after progress_: it logs there)
  std::string non_persistent_dir_;  // --non-persistent-ckpt-type global with --save ("" otherwise)
  NonPersistentCleanup non_persistent_cleanup_;

  std::vector<Staging> staging_;  // per chunk
  AsyncCheckpointSaver async_;
};

}  // namespace mt

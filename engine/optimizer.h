// Optimizer: Megatron's optimizer step on the flat buffers of this rank's model chunks.
//
// After the micro-batches' backward passes: gradient reductions (engine/dp_grad_sync.h), the
// global gradient norm (every
// parameter once: TP-duplicated ones on TP rank 0 only, the last stage's tied-embedding copy not
// at all), one host readback of [loss sum, tokens, grad sum of squares, zeros] (the iteration's
// only device->host sync), the overflow / NaN decision, clipping and the AdamW or SGD update, all
// in the gradients' original scale: loss scale, data-parallel averaging, per-token normalization
// and the clip coefficient fold into one grad_scale the update kernel applies.
//
// Parameter groups (Megatron's): weight decay or not (no decay on biases and 1-D parameters),
// and --decoupled-lr / --decoupled-min-lr for the word embeddings and the output layer.
//
// With --use-distributed-optimizer each DP rank updates its shard of every bucket and the
// parameters are then all-gathered (engine/distributed_optimizer.h); the gradient norm and the
// zero count are then summed over DP as well.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "core/config.h"
#include "engine/backend.h"
#include "engine/distributed_optimizer.h"
#include "engine/dp_grad_sync.h"
#include "engine/gpt_model.h"
#include "engine/loss_scaler.h"
#include "engine/lr_schedule.h"
#include "engine/muon.h"

namespace mt {

struct ParallelState;

struct StepOutcome {
  bool skipped = false;             // inf/NaN gradients under loss scaling: no update
  bool held = false;                // kept back by `validate` (a re-run or a stop): no update
  double loss_sum = 0, tokens = 0;  // over the global batch (all DP ranks)
  std::optional<double> grad_norm;  // before clipping; none when skipped
  std::optional<int64_t> num_zeros; // with --log-num-zeros-in-grad
  // MoE: Megatron's logged losses (coefficients removed) by name, in Megatron's order
  // (load_balancing_loss, seq_load_balancing_loss, global_load_balancing_loss, z_loss), each the sum
  // over micro-batches and MoE layers divided by both, averaged over DP (global_load_balancing_loss:
  // summed over DP, as Megatron reduces it). With --moe-per-layer-logging, also each global layer's
  // values (not divided by the MoE layers; zero for dense layers), Megatron's moe/<name>_layer_<i>.
  struct MoeLoss {
    std::string name;
    double value = 0;
    std::vector<double> layers;
  };
  std::vector<MoeLoss> moe_losses;
  // Knowledge distillation: Megatron's "total loss", "logits distillation loss" and "intermediate
  // distillation loss" (kDistillLossNames; each a masked sum over the global batch's tokens).
  std::vector<std::pair<std::string, double>> kd_losses;
  // Multi-token prediction: Megatron's mtp_<j> loss per depth (averaged over micro-batches and DP x CP).
  std::vector<double> mtp_losses;
  // ... and its acceptance counts {rows whose argmax was the label, rows counted}, summed over the
  // micro-batches and DP x CP (Megatron's mtp_<j>_acceptance_rate is their ratio in percent).
  std::vector<std::pair<double, double>> mtp_accept;
  double loss() const { return loss_sum / std::max(1.0, tokens); }
};

class Optimizer {
 public:
  enum Group { kDecay = kOptimDecay, kNoDecay = kOptimNoDecay, kDecoupledDecay = kOptimDecoupledDecay,
               kDecoupledNoDecay = kOptimDecoupledNoDecay, kMupHidden = kOptimMupHidden };

  // chunks: this rank's model chunks (one without an interleaved pipeline), in chunk order.
  Optimizer(const Config& cfg, std::vector<GptModel*> chunks, ParallelState& ps, LrSchedule& schedule,
            LossScaler& scaler);
  Optimizer(const Config& cfg, GptModel& model, ParallelState& ps, LrSchedule& schedule, LossScaler& scaler)
      : Optimizer(cfg, std::vector<GptModel*>{&model}, ps, schedule, scaler) {}
  ~Optimizer();

  // The data-parallel reductions (the trainer starts each step with grad_sync().start_step()).
  DpGradSync& grad_sync() { return *grad_sync_; }
  // Before reading parameters, master weights or optimizer states other than in the next step's
  // forward (checkpoints, evaluation, hashes): the compute stream waits for the distributed
  // optimizer's overlapped parameter gathers and for an update beside the forward (below).
  void wait_for_params();
  // Whether the update runs beside the next forward: on a backend with a side stream the AdamW or
  // SGD update is enqueued there, cut at the forward's parameter boundaries (each decoder layer,
  // the embedding, the head), and the next forward waits for each piece just before its layer; the
  // backward (which writes gradients the update read) waits for all of it. The same arithmetic as
  // one pass: each element is updated once, by the same kernel. Only with MEGATRAIN_OPTIMIZER_OVERLAP=1
  // (measured slower on one GPU: bench/RESULTS.md), and not where the distributed optimizer
  // all-gathers the parameters after the update (more than one rank in its group), nor with FP8,
  // Muon or sharded gradients.
  bool update_beside_forward() const { return !pieces_.empty(); }
  // Its pieces, in the order they are enqueued (piece k: side-stream mark k): the range (ranges()),
  // the first parameter whose forward waits for the piece, the segments (relative to the range's
  // start, as its update's).
  struct UpdatePiece {
    size_t range = 0;
    int first_param = 0;
    std::vector<OptimSegment> update;
  };
  const std::vector<UpdatePiece>& update_pieces() const { return pieces_; }

  // The iteration's end: reduce, check, clip, update, step the schedule (by the global batch
  // size, successful steps only). Throws mt::Error for NaN/Inf in the loss or the grad norm when
  // --check-for-nan-in-loss-and-grad is on (and no loss scaler handles overflow).
  // global_batch: the samples of this iteration (default the config's constant global batch).
  StepOutcome step(int64_t iteration, int64_t global_batch = 0);

  // Timers (engine/phase_timers.h): optimizer-clip-main-grad, optimizer-count-zeros,
  // optimizer-inner-step, params-all-gather. grad_sync() has its own hook.
  TimerHook timer;
  // The rerun state machine's checks (engine/rerun_state_machine.h), after the readback and before
  // anything is applied (loss scaler, schedule, update): the iteration's lm loss and gradient norm
  // (before clipping). Returns false to keep the update back (StepOutcome::held).
  std::function<bool(double loss, double grad_norm)> validate;

  // L2 norm of the parameters (--log-params-norm): one extra readback, only when asked.
  double params_norm();

  double learning_rate() const;             // the default group's, as logged
  std::optional<double> decoupled_learning_rate() const;
  double weight_decay() const { return schedule_.weight_decay(); }
  int64_t successful_steps() const { return steps_; }
  void set_successful_steps(int64_t n) { steps_ = n; }

  // What this rank updates (distributed_optimizer.h).
  const std::vector<OptimRange>& ranges() const { return ranges_; }
  // The first range's segments: the whole buffer of a single unsharded chunk (tests).
  const std::vector<OptimSegment>& segments() const { return ranges_.front().update; }
  const std::vector<OptimSegment>& norm_segments() const { return ranges_.front().norm; }

 private:
  OptimStepParams step_params(double grad_scale) const;
  // --optimizer muon: the update of Muon's parameters (engine/muon.h), after AdamW's of the others.
  struct MuonChunk {
    std::vector<MuonMatrix> matrices;
    std::vector<char> owned;      // per matrix: this rank orthogonalizes it
    std::vector<int> group;       // per parameter: its optimizer group (learning rate, weight decay)
    std::vector<MuonRange> pieces;
    MuonViews views;
    std::vector<int> buckets;     // distributed optimizer: the buckets holding Muon parameters
  };
  void plan_muon();
  void muon_step(const OptimStepParams& p);
  std::vector<MuonChunk> muon_;  // per chunk
  // FP8 parameters (--fp8-param-gather): this rank's shards cast from the master weights (a step
  // skipped by the loss scaler; an update casts them itself); false when no chunk has any.
  bool cast_fp8_params();
  // The FP8 parameters' amaxes after their cast: max over TP and DP.
  void reduce_fp8_param_amax();
  // Tensorwise FP8 parameters after the update: scales from the new weights' amaxes, then the cast
  // again with them (the update's own cast used the previous step's scales).
  void rescale_fp8_params();
  double read_scalars(double* host, int count);
  // The update beside the next forward (update_beside_forward): each range's update segments
  // cut at its chunk's forward_param_boundaries(), in forward order.
  std::vector<UpdatePiece> pieces_;
  std::vector<std::vector<size_t>> chunk_pieces_;  // per chunk: its pieces, by first_param
  std::vector<size_t> next_wait_;                  // per chunk: its first piece not yet waited for
  void plan_update_pieces();
  void await_update(int chunk, int end);  // the chunk's on_params_needed
  void join_update();
  void reduce_expert_statistics(Tensor sums);
  // --moe-per-layer-logging: the chunks' per-layer sums, reduced over DP and PP, on the host.
  void read_moe_layer_losses(StepOutcome& out, double micro_batches);
  std::vector<double> moe_layer_host_;
  std::vector<float> moe_layer_f32_;

  const Config& cfg_;
  std::vector<GptModel*> chunks_;
  GptModel* output_chunk_ = nullptr;  // the chunk with the loss (last pipeline stage), or null
  int mtp_depths_ = 0;                // --mtp-num-layers (every rank: the reductions are collective)
  ParallelState& ps_;
  LrSchedule& schedule_;
  LossScaler& scaler_;
  Backend& be_;
  std::vector<OptimRange> ranges_;
  bool sharded_ = false;
  std::unique_ptr<DpGradSync> grad_sync_;
  std::unique_ptr<ParamGather> param_gather_;
  double max_lr_[OptimStepParams::kMaxGroups] = {}, min_lr_[OptimStepParams::kMaxGroups] = {};
  double mup_hidden_eps_ = 0;  // --use-mup with Adam: the hidden matrices' eps (0: adam_eps)
  int64_t steps_ = 0;
  bool check_nan_ = true;
};

}  // namespace mt

// Optimizer: Megatron's optimizer step on the model's flat buffers.
//
// After the micro-batches' backward passes: gradient reductions, the global gradient norm (every
// parameter once: TP-duplicated ones on TP rank 0 only, the last stage's tied-embedding copy not
// at all), one host readback of [loss sum, tokens, grad sum of squares, zeros] (the iteration's
// only device->host sync), the overflow / NaN decision, clipping and the AdamW or SGD update, all
// in the gradients' original scale: loss scale, data-parallel averaging, per-token normalization
// and the clip coefficient fold into one grad_scale the update kernel applies.
//
// Parameter groups (Megatron's): weight decay or not (no decay on biases and 1-D parameters),
// and --decoupled-lr / --decoupled-min-lr for the word embeddings and the output layer.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/config.h"
#include "engine/backend.h"
#include "engine/gpt_model.h"
#include "engine/loss_scaler.h"
#include "engine/lr_schedule.h"

namespace mt {

struct ParallelState;

struct StepOutcome {
  bool skipped = false;             // inf/NaN gradients under loss scaling: no update
  double loss_sum = 0, tokens = 0;  // over the global batch (all DP ranks)
  std::optional<double> grad_norm;  // before clipping; none when skipped
  std::optional<int64_t> num_zeros; // with --log-num-zeros-in-grad
  double loss() const { return loss_sum / std::max(1.0, tokens); }
};

class Optimizer {
 public:
  enum Group { kDecay = 0, kNoDecay = 1, kDecoupledDecay = 2, kDecoupledNoDecay = 3 };

  Optimizer(const Config& cfg, GptModel& model, ParallelState& ps, LrSchedule& schedule, LossScaler& scaler);

  // The iteration's end: reduce, check, clip, update, step the schedule (by the global batch
  // size, successful steps only). Throws mt::Error for NaN/Inf in the loss or the grad norm when
  // --check-for-nan-in-loss-and-grad is on (and no loss scaler handles overflow).
  StepOutcome step(int64_t iteration);

  // L2 norm of the parameters (--log-params-norm): one extra readback, only when asked.
  double params_norm();

  double learning_rate() const;             // the default group's, as logged
  std::optional<double> decoupled_learning_rate() const;
  double weight_decay() const { return schedule_.weight_decay(); }
  int64_t successful_steps() const { return steps_; }
  void set_successful_steps(int64_t n) { steps_ = n; }

  const std::vector<OptimSegment>& segments() const { return segments_; }
  const std::vector<OptimSegment>& norm_segments() const { return norm_segments_; }

 private:
  OptimStepParams step_params(double grad_scale) const;

  const Config& cfg_;
  GptModel& model_;
  ParallelState& ps_;
  LrSchedule& schedule_;
  LossScaler& scaler_;
  Backend& be_;
  std::vector<OptimSegment> segments_, norm_segments_;
  double max_lr_[OptimStepParams::kMaxGroups] = {}, min_lr_[OptimStepParams::kMaxGroups] = {};
  int64_t steps_ = 0;
  bool check_nan_ = true;
};

}  // namespace mt

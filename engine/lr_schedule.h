// LrSchedule: Megatron's OptimizerParamScheduler. Steps are counted in samples (each successful
// iteration adds the global batch size); learning rate and weight decay are pure functions of the
// step count, so resuming only needs num_steps.
#pragma once

#include <cstdint>
#include <optional>

#include "core/config.h"

namespace mt {

struct LrScheduleParams {
  double init_lr = 0;          // --lr-warmup-init
  double max_lr = 0;           // --lr
  double min_lr = 0;           // --min-lr
  double warmup_steps = 0;     // samples (may be fractional with --lr-warmup-fraction)
  double decay_steps = 0;      // samples
  LrDecayStyle decay_style = LrDecayStyle::linear;
  std::optional<double> wsd_decay_steps;  // samples, WSD only
  WsdDecayStyle wsd_style = WsdDecayStyle::exponential;
  double start_wd = 0, end_wd = 0;
  double wd_incr_steps = 0;    // samples
  WeightDecayIncrStyle wd_incr_style = WeightDecayIncrStyle::constant;
};

class LrSchedule {
 public:
  // Validates as Megatron's constructor asserts do (mt::Error naming the flags).
  explicit LrSchedule(const LrScheduleParams& p);
  // From the run's flags, exactly as Megatron's get_optimizer_param_scheduler.
  static LrScheduleParams params_from_config(const Config& cfg);

  // Learning rate of a parameter group whose schedule runs between its own max and min.
  double lr(double max_lr, double min_lr) const;
  double lr() const { return lr(p_.max_lr, p_.min_lr); }
  double weight_decay() const;

  void step(int64_t increment) { num_steps_ += increment; }
  int64_t num_steps() const { return num_steps_; }
  void set_num_steps(int64_t n) { num_steps_ = n; }
  const LrScheduleParams& params() const { return p_; }

 private:
  LrScheduleParams p_;
  int64_t num_steps_ = 0;
};

}  // namespace mt

#include "engine/lr_schedule.h"

#include <cmath>

#include "core/error.h"

namespace mt {

LrSchedule::LrSchedule(const LrScheduleParams& p) : p_(p) {
  if (p_.min_lr < 0) fail("--min-lr must be >= 0 (got {})", p_.min_lr);
  if (p_.max_lr < p_.min_lr) fail("--lr ({}) must be >= --min-lr ({})", p_.max_lr, p_.min_lr);
  if (p_.init_lr > p_.max_lr) fail("--lr-warmup-init ({}) must be <= --lr ({})", p_.init_lr, p_.max_lr);
  if (p_.decay_steps <= 0)
    fail("the learning-rate decay horizon is {} samples; set --lr-decay-iters/--lr-decay-samples "
         "(or --train-iters/--train-samples) > 0", p_.decay_steps);
  if (p_.warmup_steps >= p_.decay_steps)
    fail("the warmup ({} samples) must be shorter than the decay horizon ({} samples): lower "
         "--lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction or raise --lr-decay-iters",
         p_.warmup_steps, p_.decay_steps);
  if (p_.decay_style == LrDecayStyle::wsd && !p_.wsd_decay_steps)
    fail("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)");
  if (p_.start_wd < 0) fail("--start-weight-decay must be >= 0 (got {})", p_.start_wd);
  if (p_.end_wd < p_.start_wd)
    fail("--end-weight-decay ({}) must be >= --start-weight-decay ({})", p_.end_wd, p_.start_wd);
}

LrScheduleParams LrSchedule::params_from_config(const Config& cfg) {
  const TrainConfig& t = cfg.train;
  LrScheduleParams p;
  p.init_lr = t.lr_warmup_init;
  if (!t.lr) fail("--lr is required for training");
  p.max_lr = *t.lr;
  p.min_lr = t.min_lr;
  p.decay_style = t.lr_decay_style;
  p.wsd_style = t.lr_wsd_decay_style;
  const double B = t.global_batch;
  if (t.train_iters) {
    const double decay_iters = static_cast<double>(t.lr_decay_iters.value_or(*t.train_iters));
    p.decay_steps = decay_iters * B;
    p.wd_incr_steps = static_cast<double>(*t.train_iters) * B;
    if (t.lr_wsd_decay_iters) p.wsd_decay_steps = static_cast<double>(*t.lr_wsd_decay_iters) * B;
    p.warmup_steps = t.lr_warmup_fraction ? *t.lr_warmup_fraction * p.decay_steps
                                          : static_cast<double>(t.lr_warmup_iters) * B;
  } else if (t.train_samples) {
    p.decay_steps = static_cast<double>(t.lr_decay_samples.value_or(*t.train_samples));
    p.wd_incr_steps = static_cast<double>(*t.train_samples);
    if (t.lr_wsd_decay_samples) p.wsd_decay_steps = static_cast<double>(*t.lr_wsd_decay_samples);
    p.warmup_steps = t.lr_warmup_fraction ? *t.lr_warmup_fraction * p.decay_steps
                                          : static_cast<double>(t.lr_warmup_samples);
  } else {
    fail("either --train-iters or --train-samples is required");
  }
  // Megatron: with the constant increment style both ends are --weight-decay.
  if (t.weight_decay_incr_style == WeightDecayIncrStyle::constant) {
    p.start_wd = p.end_wd = t.weight_decay;
  } else {
    if (!t.start_weight_decay || !t.end_weight_decay)
      fail("--weight-decay-incr-style linear/cosine needs --start-weight-decay and --end-weight-decay");
    p.start_wd = *t.start_weight_decay;
    p.end_wd = *t.end_weight_decay;
  }
  p.wd_incr_style = t.weight_decay_incr_style;
  return p;
}

double LrSchedule::weight_decay() const {
  const double n = static_cast<double>(num_steps_);
  if (n > p_.wd_incr_steps) return p_.end_wd;
  if (p_.wd_incr_style == WeightDecayIncrStyle::constant) return p_.end_wd;
  const double ratio = n / p_.wd_incr_steps;
  const double coeff = p_.wd_incr_style == WeightDecayIncrStyle::linear
                           ? ratio
                           : 0.5 * (std::cos(M_PI * (1.0 - ratio)) + 1.0);
  return p_.start_wd + coeff * (p_.end_wd - p_.start_wd);
}

double LrSchedule::lr(double max_lr, double min_lr) const {
  const double n = static_cast<double>(num_steps_);
  if (p_.warmup_steps > 0 && n <= p_.warmup_steps)
    return p_.init_lr + (max_lr - p_.init_lr) * n / p_.warmup_steps;
  if (p_.decay_style == LrDecayStyle::constant) return max_lr;
  if (n > p_.decay_steps) return min_lr;
  if (p_.decay_style == LrDecayStyle::inverse_square_root) {
    const double warmup = std::max(p_.warmup_steps, 1.0), steps = std::max(n, 1.0);
    return std::max(min_lr, max_lr * std::sqrt(warmup) / std::sqrt(steps));
  }
  const double ratio = (n - p_.warmup_steps) / (p_.decay_steps - p_.warmup_steps);
  double coeff = 0;
  switch (p_.decay_style) {
    case LrDecayStyle::linear: coeff = 1.0 - ratio; break;
    case LrDecayStyle::cosine: coeff = 0.5 * (std::cos(M_PI * ratio) + 1.0); break;
    case LrDecayStyle::wsd: {
      const double anneal_start = p_.decay_steps - *p_.wsd_decay_steps;
      if (n <= anneal_start) {
        coeff = 1.0;
      } else {
        const double r = (n - anneal_start) / *p_.wsd_decay_steps;
        switch (p_.wsd_style) {
          case WsdDecayStyle::linear: coeff = 1.0 - r; break;
          case WsdDecayStyle::cosine: coeff = 0.5 * (std::cos(M_PI * r) + 1.0); break;
          case WsdDecayStyle::exponential: coeff = 2.0 * std::pow(0.5, r) - 1.0; break;
          case WsdDecayStyle::minus_sqrt: coeff = 1.0 - std::sqrt(r); break;
        }
      }
      break;
    }
    default: break;
  }
  return min_lr + coeff * (max_lr - min_lr);
}

}  // namespace mt

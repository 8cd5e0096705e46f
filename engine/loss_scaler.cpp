#include "engine/loss_scaler.h"

#include <algorithm>

#include "core/error.h"

namespace mt {

LossScaler LossScaler::from_config(const Config& cfg) {
  const TrainConfig& t = cfg.train;
  const bool half = t.precision == Precision::fp16 || t.precision == Precision::bf16;
  if (t.loss_scale && *t.loss_scale != 0 && (half || cfg.parallel.use_distributed_optimizer))
    return constant(*t.loss_scale);
  if (t.precision == Precision::fp16)
    return dynamic(t.initial_loss_scale, t.min_loss_scale, t.loss_scale_window, t.hysteresis);
  return none();
}

LossScaler LossScaler::dynamic(double initial, double min_scale, double window, int hysteresis) {
  if (min_scale <= 0) fail("--min-loss-scale must be > 0 (got {})", min_scale);
  if (min_scale > initial)
    fail("--min-loss-scale ({}) must be <= --initial-loss-scale ({})", min_scale, initial);
  if (window <= 0) fail("--loss-scale-window must be > 0 (got {})", window);
  if (hysteresis <= 0) fail("--hysteresis must be > 0 (got {})", hysteresis);
  LossScaler s(Kind::dynamic, initial);
  s.min_scale_ = min_scale;
  s.window_ = window;
  s.hysteresis_ = hysteresis;
  s.hysteresis_tracker_ = hysteresis;
  return s;
}

void LossScaler::update(bool found_inf) {
  if (kind_ != Kind::dynamic) return;
  if (found_inf) {
    growth_tracker_ = 0;
    if (--hysteresis_tracker_ <= 0) scale_ = std::max(scale_ * 0.5, min_scale_);
  } else {
    ++growth_tracker_;
    if (static_cast<double>(growth_tracker_) == window_) {
      growth_tracker_ = 0;
      hysteresis_tracker_ = hysteresis_;
      scale_ *= 2.0;
    }
  }
}

}  // namespace mt

// LossScaler: Megatron's grad scalers. fp16 without --loss-scale: dynamic (halve after
// --hysteresis overflowing iterations, double after --loss-scale-window clean ones, never below
// --min-loss-scale). --loss-scale with fp16/bf16 (or the distributed optimizer): constant.
// Otherwise none (scale 1, no overflow check).
#pragma once

#include <cstdint>

#include "core/config.h"

namespace mt {

class LossScaler {
 public:
  enum class Kind { none, constant, dynamic };

  static LossScaler from_config(const Config& cfg);
  static LossScaler none() { return LossScaler(Kind::none, 1.0); }
  static LossScaler constant(double scale) { return LossScaler(Kind::constant, scale); }
  static LossScaler dynamic(double initial, double min_scale, double window, int hysteresis);

  Kind kind() const { return kind_; }
  // Whether gradients are checked for inf/NaN and overflowing steps skipped.
  bool checks_overflow() const { return kind_ != Kind::none; }
  double scale() const { return scale_; }
  // After each iteration's check: found_inf = some gradient was inf/NaN (the step is skipped).
  void update(bool found_inf);

  // State for checkpoints.
  int64_t growth_tracker() const { return growth_tracker_; }
  int hysteresis_tracker() const { return hysteresis_tracker_; }
  void set_state(double scale, int64_t growth_tracker, int hysteresis_tracker) {
    scale_ = scale;
    growth_tracker_ = growth_tracker;
    hysteresis_tracker_ = hysteresis_tracker;
  }

 private:
  LossScaler(Kind k, double scale) : kind_(k), scale_(scale) {}

  Kind kind_;
  double scale_;
  double min_scale_ = 1.0;
  double window_ = 1000;
  int hysteresis_ = 2;
  int64_t growth_tracker_ = 0;
  int hysteresis_tracker_ = 2;
};

}  // namespace mt

// LR and weight-decay schedule against hand-computed values (Megatron's OptimizerParamScheduler).
#include <catch2/catch.hpp>

#include <cmath>

#include "core/error.h"
#include "engine/lr_schedule.h"

using namespace mt;

namespace {

Config iteration_config(int64_t train_iters, int global_batch) {
  Config c;
  c.train.train_iters = train_iters;
  c.train.global_batch = global_batch;
  c.train.lr = 1e-3;
  c.train.min_lr = 1e-4;
  return c;
}

double lr_at(LrSchedule& s, int64_t samples) {
  s.set_num_steps(samples);
  return s.lr();
}

}  // namespace

TEST_CASE("lr schedule: linear warmup then linear decay, counted in samples", "[lr]") {
  Config c = iteration_config(100, 4);
  c.train.lr_warmup_iters = 10;
  c.train.lr_decay_iters = 60;
  LrSchedule s(LrSchedule::params_from_config(c));
  CHECK(s.params().warmup_steps == 40);
  CHECK(s.params().decay_steps == 240);
  CHECK(lr_at(s, 0) == 0.0);
  CHECK(lr_at(s, 20) == Approx(5e-4));
  CHECK(lr_at(s, 40) == Approx(1e-3));
  CHECK(lr_at(s, 140) == Approx(1e-4 + 0.5 * 9e-4));  // ratio (140-40)/200
  CHECK(lr_at(s, 240) == Approx(1e-4));
  CHECK(lr_at(s, 244) == Approx(1e-4));  // past the horizon: min
}

TEST_CASE("lr schedule: cosine, constant, inverse-square-root, warmup init and fraction", "[lr]") {
  Config c = iteration_config(100, 4);
  c.train.lr_warmup_iters = 10;
  c.train.lr_decay_iters = 60;
  c.train.lr_decay_style = LrDecayStyle::cosine;
  LrSchedule cosine(LrSchedule::params_from_config(c));
  CHECK(lr_at(cosine, 140) == Approx(1e-4 + 0.5 * 9e-4));
  CHECK(lr_at(cosine, 90) == Approx(1e-4 + 0.5 * (std::cos(M_PI * 0.25) + 1) * 9e-4));  // 0.853553 of the way

  c.train.lr_decay_style = LrDecayStyle::constant;
  LrSchedule constant(LrSchedule::params_from_config(c));
  CHECK(lr_at(constant, 20) == Approx(5e-4));
  CHECK(lr_at(constant, 100) == 1e-3);
  CHECK(lr_at(constant, 1000) == 1e-3);  // constant ignores the horizon

  c.train.lr_decay_style = LrDecayStyle::inverse_square_root;
  LrSchedule isr(LrSchedule::params_from_config(c));
  CHECK(lr_at(isr, 160) == Approx(1e-3 * 0.5));  // sqrt(40)/sqrt(160)
  CHECK(lr_at(isr, 1000) == Approx(1e-4));       // past the horizon

  c.train.lr_decay_style = LrDecayStyle::linear;
  c.train.lr_warmup_init = 2e-4;
  LrSchedule init(LrSchedule::params_from_config(c));
  CHECK(lr_at(init, 0) == Approx(2e-4));
  CHECK(lr_at(init, 10) == Approx(2e-4 + 8e-4 * 0.25));

  c.train.lr_warmup_init = 0;
  c.train.lr_warmup_fraction = 0.1;  // of the decay horizon: 24 samples
  LrSchedule frac(LrSchedule::params_from_config(c));
  CHECK(frac.params().warmup_steps == Approx(24));
  CHECK(lr_at(frac, 12) == Approx(5e-4));
}

TEST_CASE("lr schedule: WSD with each anneal style", "[lr]") {
  Config c = iteration_config(100, 4);
  c.train.lr_decay_iters = 60;  // 240 samples
  c.train.lr_decay_style = LrDecayStyle::wsd;
  c.train.lr_wsd_decay_iters = 20;  // anneal over the last 80 samples: from 160
  const double delta = 9e-4;
  struct Expect {
    WsdDecayStyle style;
    double coeff_at_half;
  };
  for (Expect e : {Expect{WsdDecayStyle::exponential, 2 * std::sqrt(0.5) - 1}, Expect{WsdDecayStyle::linear, 0.5},
                   Expect{WsdDecayStyle::cosine, 0.5}, Expect{WsdDecayStyle::minus_sqrt, 1 - std::sqrt(0.5)}}) {
    c.train.lr_wsd_decay_style = e.style;
    LrSchedule s(LrSchedule::params_from_config(c));
    CHECK(lr_at(s, 100) == Approx(1e-3));
    CHECK(lr_at(s, 160) == Approx(1e-3));
    CHECK(lr_at(s, 200) == Approx(1e-4 + e.coeff_at_half * delta));
    CHECK(lr_at(s, 240) == Approx(1e-4).margin(1e-12));
  }
  c.train.lr_wsd_decay_iters.reset();
  CHECK_THROWS_AS(LrSchedule(LrSchedule::params_from_config(c)), Error);
}

TEST_CASE("lr schedule: sample-based flags, decoupled group bounds", "[lr]") {
  Config c;
  c.train.train_samples = 1000;
  c.train.global_batch = 8;
  c.train.lr = 3e-4;
  c.train.min_lr = 3e-5;
  c.train.lr_warmup_samples = 100;
  c.train.lr_decay_samples = 900;
  LrSchedule s(LrSchedule::params_from_config(c));
  CHECK(s.params().warmup_steps == 100);
  CHECK(s.params().decay_steps == 900);
  CHECK(s.params().wd_incr_steps == 1000);
  s.set_num_steps(500);  // ratio 0.5
  CHECK(s.lr() == Approx(3e-5 + 0.5 * 2.7e-4));
  // A decoupled group (--decoupled-lr 1e-3 --decoupled-min-lr 1e-4) follows the same shape.
  CHECK(s.lr(1e-3, 1e-4) == Approx(1e-4 + 0.5 * 9e-4));
  s.set_num_steps(50);  // warmup from init 0 to the group's own max
  CHECK(s.lr(1e-3, 1e-4) == Approx(5e-4));
}

TEST_CASE("weight decay schedule: constant, linear, cosine", "[lr]") {
  Config c = iteration_config(100, 4);  // wd increment horizon: 400 samples
  c.train.weight_decay = 0.1;
  LrSchedule constant(LrSchedule::params_from_config(c));
  constant.set_num_steps(200);
  CHECK(constant.weight_decay() == 0.1);
  c.train.weight_decay_incr_style = WeightDecayIncrStyle::linear;
  CHECK_THROWS_AS(LrSchedule::params_from_config(c), Error);  // needs start/end
  c.train.start_weight_decay = 0.0;
  c.train.end_weight_decay = 0.1;
  LrSchedule linear(LrSchedule::params_from_config(c));
  linear.set_num_steps(100);
  CHECK(linear.weight_decay() == Approx(0.025));
  linear.set_num_steps(500);
  CHECK(linear.weight_decay() == Approx(0.1));
  c.train.weight_decay_incr_style = WeightDecayIncrStyle::cosine;
  LrSchedule cosine(LrSchedule::params_from_config(c));
  cosine.set_num_steps(100);  // ratio 0.25: 0.5 (cos(0.75 pi) + 1) = 0.1464466
  CHECK(cosine.weight_decay() == Approx(0.1 * 0.14644660940672627));
}

TEST_CASE("lr schedule: Megatron's validation rules", "[lr]") {
  Config c = iteration_config(10, 4);
  c.train.lr_warmup_iters = 10;  // warmup == decay horizon
  CHECK_THROWS_AS(LrSchedule(LrSchedule::params_from_config(c)), Error);
  c.train.lr_warmup_iters = 0;
  c.train.min_lr = 1e-2;  // > lr
  CHECK_THROWS_AS(LrSchedule(LrSchedule::params_from_config(c)), Error);
}

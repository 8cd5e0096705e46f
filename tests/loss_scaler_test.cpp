// Loss scaler: dynamic scaling with hysteresis and growth window, constant and none.
#include <catch2/catch.hpp>

#include "engine/loss_scaler.h"

using namespace mt;

TEST_CASE("dynamic loss scaler: hysteresis, backoff, growth window, floor", "[loss_scale]") {
  LossScaler s = LossScaler::dynamic(16.0, 2.0, 3, 2);
  CHECK(s.checks_overflow());
  s.update(true);  // first overflow: hysteresis 2 -> 1, scale kept
  CHECK(s.scale() == 16.0);
  s.update(true);  // second consecutive: halve
  CHECK(s.scale() == 8.0);
  s.update(true);  // tracker stays exhausted: every further overflow halves
  CHECK(s.scale() == 4.0);
  s.update(false);
  s.update(false);
  CHECK(s.scale() == 4.0);
  s.update(false);  // third clean iteration in a row: double, hysteresis restored
  CHECK(s.scale() == 8.0);
  s.update(true);  // hysteresis back at 2: one overflow does not halve
  CHECK(s.scale() == 8.0);
  s.update(false);
  s.update(false);
  s.update(true);  // growth tracker was reset by the overflow; hysteresis now exhausted
  CHECK(s.scale() == 4.0);
  s.update(true);
  CHECK(s.scale() == 2.0);
  s.update(true);  // never below --min-loss-scale
  CHECK(s.scale() == 2.0);
}

TEST_CASE("loss scaler from flags", "[loss_scale]") {
  Config c;
  CHECK(LossScaler::from_config(c).kind() == LossScaler::Kind::none);
  CHECK(LossScaler::from_config(c).scale() == 1.0);
  c.train.precision = Precision::fp16;
  LossScaler d = LossScaler::from_config(c);
  CHECK(d.kind() == LossScaler::Kind::dynamic);
  CHECK(d.scale() == 4294967296.0);
  c.train.loss_scale = 128.0;
  LossScaler k = LossScaler::from_config(c);
  CHECK(k.kind() == LossScaler::Kind::constant);
  k.update(true);
  CHECK(k.scale() == 128.0);
  c.train.precision = Precision::bf16;
  CHECK(LossScaler::from_config(c).kind() == LossScaler::Kind::constant);
  c.train.loss_scale.reset();
  CHECK(LossScaler::from_config(c).kind() == LossScaler::Kind::none);
}

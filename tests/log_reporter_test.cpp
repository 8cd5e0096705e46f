// Megatron's log line and validation line, character for character.
#include <catch2/catch.hpp>

#include "app/log_reporter.h"

using namespace mt;

TEST_CASE("Megatron iteration log line format", "[log]") {
  IterationStats s;
  s.iteration = 100;
  s.train_iters = 500000;
  s.consumed_samples = 12800;
  s.elapsed_ms_per_iteration = 1234.5;
  s.tflops_per_gpu = 456.7;
  s.learning_rate = 1.5e-4;
  s.global_batch_size = 128;
  s.losses["lm loss"] = 5.123456;
  s.loss_scale = 1.0;
  s.grad_norm = 1.234;
  CHECK(format_iteration_line(s, "[2026-08-22 15:22:22.123456]") ==
        " [2026-08-22 15:22:22.123456] iteration      100/  500000 | consumed samples:        12800 | elapsed time "
        "per iteration (ms): 1234.5 | throughput per GPU (TFLOP/s/GPU): 456.7 | learning rate: 1.500000E-04 | "
        "global batch size:   128 | lm loss: 5.123456E+00 | loss scale: 1.0 | grad norm: 1.234 | number of "
        "skipped iterations:   0 | number of nan iterations:   0 |");
  s.skipped_samples = 64;
  s.tflops_per_gpu.reset();
  s.grad_norm.reset();
  s.num_zeros = 17;
  s.params_norm = 321.5;
  s.loss_scale = 65536.0;
  s.skipped_iterations = 2;
  CHECK(format_iteration_line(s, "[t]") ==
        " [t] iteration      100/  500000 | consumed samples:        12800 | skipped samples:           64 | "
        "elapsed time per iteration (ms): 1234.5 | learning rate: 1.500000E-04 | global batch size:   128 | "
        "lm loss: 5.123456E+00 | loss scale: 65536.0 | num zeros: 17.0 | params norm: 321.500 | number of "
        "skipped iterations:   2 | number of nan iterations:   0 |");
}

TEST_CASE("Megatron validation line format", "[log]") {
  EvalStats e;
  e.iteration = 30;
  e.losses["lm loss"] = 2.0;
  CHECK(format_validation_line(e) ==
        " validation loss at iteration 30 | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 | ");
  e.after_training = true;
  e.losses["lm loss"] = 25.0;  // PPL capped at exp(20)
  CHECK(format_validation_line(e) ==
        " validation loss at iteration 30 on validation set | lm loss value: 2.500000E+01 | lm loss PPL: "
        "4.851652E+08 | ");
}

#include "app/log_reporter.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <ctime>

#include "core/log.h"

namespace mt {

namespace {

std::string now_timestamp() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() % 1000000;
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", &tm);
  return fmt::format("[{}.{:06d}]", buf, us);
}

class LogReporter final : public Reporter {
 public:
  void on_iteration(const IterationStats& s) override { log::info_last("{}", format_iteration_line(s, now_timestamp())); }
  void on_eval(const EvalStats& e) override {
    const std::string line = format_validation_line(e);
    const std::string dashes(line.size() + 1, '-');
    log::info_last("{}", dashes);
    log::info_last("{}", line);
    log::info_last("{}", dashes);
  }
};

}  // namespace

std::string format_iteration_line(const IterationStats& s, const std::string& timestamp) {
  std::string l = " " + timestamp;
  l += fmt::format(" iteration {:8d}/{:8d} |", s.iteration, s.train_iters);
  l += fmt::format(" consumed samples: {:12d} |", s.consumed_samples);
  if (s.skipped_samples > 0) l += fmt::format(" skipped samples: {:12d} |", s.skipped_samples);
  l += fmt::format(" elapsed time per iteration (ms): {:.1f} |", s.elapsed_ms_per_iteration);
  if (s.tflops_per_gpu) l += fmt::format(" throughput per GPU (TFLOP/s/GPU): {:.1f} |", *s.tflops_per_gpu);
  if (s.learning_rate) l += fmt::format(" learning rate: {:.6E} |", *s.learning_rate);
  l += fmt::format(" global batch size: {:5d} |", s.global_batch_size);
  for (const auto& [key, value] : s.losses)
    if (value >= 0.0) l += fmt::format(" {}: {:.6E} |", key, value);
  l += fmt::format(" loss scale: {:.1f} |", s.loss_scale);
  if (s.grad_norm) l += fmt::format(" grad norm: {:.3f} |", *s.grad_norm);
  if (s.num_zeros) l += fmt::format(" num zeros: {:.1f} |", static_cast<double>(*s.num_zeros));  // a Python float
  if (s.params_norm) l += fmt::format(" params norm: {:.3f} |", *s.params_norm);
  l += fmt::format(" number of skipped iterations: {:3d} |", s.skipped_iterations);
  l += fmt::format(" number of nan iterations: {:3d} |", s.nan_iterations);
  return l;
}

std::string format_validation_line(const EvalStats& e) {
  const std::string where = e.after_training
                                ? fmt::format("iteration {} on {} set", e.iteration, e.split)
                                : fmt::format("iteration {}", e.iteration);
  std::string l = fmt::format(" {} loss at {} | ", e.split, where);
  for (const auto& [key, value] : e.losses) {
    l += fmt::format("{} value: {:.6E} | ", key, value);
    l += fmt::format("{} PPL: {:.6E} | ", key, std::exp(std::min(20.0, value)));
  }
  return l;
}

std::unique_ptr<Reporter> make_log_reporter() { return std::make_unique<LogReporter>(); }

}  // namespace mt

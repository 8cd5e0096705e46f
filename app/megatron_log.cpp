#include "app/megatron_log.h"

#include <fmt/format.h>
#include <sys/time.h>

#include <algorithm>
#include <cmath>
#include <ctime>

#include "core/log.h"
#include "engine/phase_timers.h"

namespace mt {

std::string megatron_timestamp() {
  timeval tv;
  ::gettimeofday(&tv, nullptr);
  std::tm tm;
  ::localtime_r(&tv.tv_sec, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return fmt::format(" [{}.{:06d}]", buf, static_cast<long>(tv.tv_usec));
}

std::string format_iteration_line(const IterationStats& s, const std::string& timestamp) {
  std::string out = timestamp;
  out += fmt::format(" iteration {:8d}/{:8d} |", s.iteration, s.train_iters);
  out += fmt::format(" consumed samples: {:12d} |", s.consumed_samples);
  if (s.skipped_samples > 0) out += fmt::format(" skipped samples: {:12d} |", s.skipped_samples);
  out += fmt::format(" elapsed time per iteration (ms): {:.1f} |", s.elapsed_ms_per_iteration);
  if (s.tflops_per_gpu) out += fmt::format(" throughput per GPU (TFLOP/s/GPU): {:.1f} |", *s.tflops_per_gpu);
  if (s.energy_per_gpu_j) out += fmt::format(" energy per GPU (J/iter/GPU): {:.1f} |", *s.energy_per_gpu_j);
  if (s.power_per_gpu_w) out += fmt::format(" power per GPU (W/GPU): {:.1f} |", *s.power_per_gpu_w);
  if (s.learning_rate) out += fmt::format(" learning rate: {:.6E} |", *s.learning_rate);
  // Printed by Megatron <= core_v0.15 with --decoupled-lr (HEAD dropped the field).
  if (s.decoupled_learning_rate) out += fmt::format(" decoupled learning rate: {:.6E} |", *s.decoupled_learning_rate);
  out += fmt::format(" global batch size: {:5d} |", s.global_batch_size);
  for (const auto& [key, avg] : s.losses)
    if (avg >= 0.0) out += fmt::format(" {}: {:.6E} |", key, avg);  // Megatron skips negative (and NaN) averages
  out += fmt::format(" loss scale: {:.1f} |", s.loss_scale);
  if (s.grad_norm) out += fmt::format(" grad norm: {:.3f} |", *s.grad_norm);
  if (s.num_zeros) out += fmt::format(" num zeros: {} |", *s.num_zeros);
  if (s.params_norm) out += fmt::format(" params norm: {:.3f} |", *s.params_norm);
  out += fmt::format(" number of skipped iterations: {:3d} |", s.skipped_iterations);
  out += fmt::format(" number of nan iterations: {:3d} |", s.nan_iterations);
  return out;
}

std::string format_eval_block(const EvalStats& e) {
  std::string prefix = fmt::format("iteration {}", e.iteration);
  if (e.after_training || e.split == "test") prefix += e.split == "test" ? " on test set" : " on validation set";
  std::string text = fmt::format(" validation loss at {} | ", prefix);
  for (const auto& [key, value] : e.losses) {
    text += fmt::format("{} value: {:.6E} | ", key, value);
    // Python's min(20, x) returns 20 unless x < 20 (so NaN gives exp(20)); std::min agrees.
    text += fmt::format("{} PPL: {:.6E} | ", key, std::exp(std::min(20.0, value)));
  }
  const std::string dashes(text.size() + 1, '-');
  return dashes + "\n" + text + "\n" + dashes;
}

const std::vector<std::string>& megatron_timer_order() {
  static const std::vector<std::string> order = [] {
    std::vector<std::string> v;
    for (const TimerName& t : megatron_timers()) v.push_back(t.name);
    return v;
  }();
  return order;
}

namespace {

// The names present in `timers`, in Megatron's order, then the others alphabetically.
template <typename Map>
std::vector<std::string> ordered_timer_names(const Map& timers) {
  std::vector<std::string> names;
  for (const auto& n : megatron_timer_order())
    if (timers.count(n)) names.push_back(n);
  for (const auto& [n, v] : timers)
    if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
  return names;
}

std::string dotted(const std::string& name) {
  std::string s = name + " ";
  if (s.size() < 48) s.append(48 - s.size(), '.');  // Python's ljust(48, '.')
  return s;
}

}  // namespace

std::string format_timers(const IterationStats& s, const std::string& option) {
  if (option == "all") {
    std::string out = "times across ranks (ms):";
    bool any = false;
    for (const auto& name : ordered_timer_names(s.timers_all_ranks_ms)) {
      bool first = true;
      const auto& per_rank = s.timers_all_ranks_ms.at(name);
      for (size_t r = 0; r < per_rank.size(); ++r) {
        if (per_rank[r] <= 0) continue;
        any = true;
        if (first) out += fmt::format("\n  {}:", name);
        first = false;
        out += fmt::format("\n     rank {:2d}: {:.2f}", r, per_rank[r]);
      }
    }
    return any ? out : std::string();
  }
  const bool max_only = option == "max";
  std::string out = max_only ? "max time across ranks (ms):" : "(min, max) time across ranks (ms):";
  bool any = false;
  for (const auto& name : ordered_timer_names(s.timers_ms)) {
    const auto [mn, mx] = s.timers_ms.at(name);
    if (mx <= 0) continue;  // Megatron drops timers that did not run anywhere
    any = true;
    if (max_only) out += fmt::format("\n    {}: {:.2f}", dotted(name), mx);
    else out += fmt::format("\n    {}: ({:.2f}, {:.2f})", dotted(name), mn, mx);
  }
  return any ? out : std::string();
}

IterationStats with_logging_flags(const IterationStats& s, const LoggingConfig& cfg) {
  IterationStats out = s;
  if (!cfg.log_throughput) out.tflops_per_gpu.reset();
  if (!cfg.log_params_norm) out.params_norm.reset();
  if (!cfg.log_num_zeros_in_grad) out.num_zeros.reset();
  if (!cfg.log_energy) {
    out.energy_per_gpu_j.reset();
    out.power_per_gpu_w.reset();
  }
  return out;
}

MegatronLogReporter::MegatronLogReporter(const LoggingConfig& cfg, Sink sink, Clock timestamp)
    : cfg_(cfg), sink_(std::move(sink)), timestamp_(std::move(timestamp)) {
  if (!sink_) sink_ = [](const std::string& line) { log::write_stdout(line); };
  if (!timestamp_) timestamp_ = megatron_timestamp;
}

void MegatronLogReporter::on_iteration(const IterationStats& s) {
  if (!s.interval_end) return;
  sink_(format_iteration_line(with_logging_flags(s, cfg_), timestamp_()));
  if (cfg_.timing_log_level >= 1) {
    const std::string timers = format_timers(s, cfg_.timing_log_option);
    if (!timers.empty()) sink_(timers);
  }
}

void MegatronLogReporter::on_eval(const EvalStats& e) { sink_(format_eval_block(e)); }

}  // namespace mt

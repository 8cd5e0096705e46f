#include "app/metrics_jsonl.h"

#include <fmt/format.h>
#include <sys/time.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace mt {

using nlohmann::json;

namespace {

double now_seconds() {
  timeval tv;
  ::gettimeofday(&tv, nullptr);
  return static_cast<double>(tv.tv_sec) + static_cast<double>(tv.tv_usec) * 1e-6;
}

// JSON has no NaN or infinity: those become null (documented).
json number(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

}  // namespace

std::string metric_key(const std::string& loss_name) {
  std::string k = loss_name;
  std::replace(k.begin(), k.end(), ' ', '_');
  return k;
}

json iteration_record(const IterationStats& s, double time) {
  json r;
  r["type"] = "iteration";
  r["time"] = time;
  r["iteration"] = s.iteration;
  r["train_iters"] = s.train_iters;
  r["consumed_samples"] = s.consumed_samples;
  r["skipped_samples"] = s.skipped_samples;
  r["elapsed_ms_per_iteration"] = number(s.elapsed_ms_per_iteration);
  if (s.tflops_per_gpu) r["tflops_per_gpu"] = number(*s.tflops_per_gpu);
  if (s.energy_per_gpu_j) r["energy_per_gpu_j"] = number(*s.energy_per_gpu_j);
  if (s.power_per_gpu_w) r["power_per_gpu_w"] = number(*s.power_per_gpu_w);
  if (s.learning_rate) r["learning_rate"] = number(*s.learning_rate);
  if (s.decoupled_learning_rate) r["decoupled_learning_rate"] = number(*s.decoupled_learning_rate);
  r["global_batch_size"] = s.global_batch_size;
  for (const auto& [key, value] : s.losses) r[metric_key(key)] = number(value);
  // The MTP acceptance rates (the trackers' other scalars are the losses above, or per layer).
  for (const auto& [tag, value] : s.tracker_scalars)
    if (tag.find("acceptance_rate") != std::string::npos) r[tag] = number(value);
  r["loss_scale"] = number(s.loss_scale);
  if (s.grad_norm) r["grad_norm"] = number(*s.grad_norm);
  if (s.num_zeros) r["num_zeros"] = *s.num_zeros;
  if (s.params_norm) r["params_norm"] = number(*s.params_norm);
  r["skipped_iterations"] = s.skipped_iterations;
  r["nan_iterations"] = s.nan_iterations;
  r["weight_decay"] = number(s.weight_decay);
  r["tokens_per_second"] = number(s.tokens_per_second);
  r["world_size"] = s.world_size;
  if (s.memory_allocated_bytes) r["memory_allocated_bytes"] = number(*s.memory_allocated_bytes);
  if (s.memory_peak_bytes) r["memory_peak_bytes"] = number(*s.memory_peak_bytes);
  if (s.memory_reserved_bytes) r["memory_reserved_bytes"] = number(*s.memory_reserved_bytes);
  if (!s.timers_ms.empty()) {
    json t = json::object();
    for (const auto& [name, mm] : s.timers_ms) t[name] = {number(mm.first), number(mm.second)};
    r["timers_ms"] = t;
  }
  return r;
}

json eval_record(const EvalStats& e, double time) {
  json r;
  r["type"] = "evaluation";
  r["time"] = time;
  r["split"] = e.split;
  r["iteration"] = e.iteration;
  r["after_training"] = e.after_training;
  r["consumed_samples"] = e.consumed_train_samples;
  for (const auto& [key, value] : e.losses) {
    r[metric_key(key)] = number(value);
    r[metric_key(key) + "_ppl"] = number(std::exp(std::min(20.0, value)));
  }
  return r;
}

MetricsJsonlReporter::MetricsJsonlReporter(const std::string& path) : path_(path) {
  const std::filesystem::path p(path);
  if (p.has_parent_path()) {
    std::error_code ec;
    std::filesystem::create_directories(p.parent_path(), ec);
    if (ec) fail("--metrics-jsonl {}: cannot create its directory: {}", path, ec.message());
  }
  file_ = std::fopen(path.c_str(), "ab");
  if (!file_) fail("--metrics-jsonl {}: cannot open for appending: {}", path, std::strerror(errno));
}

MetricsJsonlReporter::~MetricsJsonlReporter() {
  if (file_) std::fclose(file_);
}

void MetricsJsonlReporter::write(const json& record) {
  const std::string line = record.dump() + "\n";
  // One line per record, flushed: a crash loses nothing already reported, `tail -f` works.
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0)
    fail("--metrics-jsonl {}: write failed: {}", path_, std::strerror(errno));
}

void MetricsJsonlReporter::on_iteration(const IterationStats& s) {
  if (s.interval_end) write(iteration_record(s, now_seconds()));
}

void MetricsJsonlReporter::on_eval(const EvalStats& e) { write(eval_record(e, now_seconds())); }

void MetricsJsonlReporter::flush() {
  if (std::fflush(file_) != 0) fail("--metrics-jsonl {}: flush failed: {}", path_, std::strerror(errno));
}

}  // namespace mt

// --metrics-jsonl PATH (megatrain's own flag): one JSON object per line for every logged iteration
// and every evaluation, for scripts and dashboards (format: docs/metrics-jsonl.md).
#pragma once

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/reporter.h"

namespace mt {

// The records (exposed for tests). `time` is the unix wall time of the record.
nlohmann::json iteration_record(const IterationStats& s, double time);
nlohmann::json eval_record(const EvalStats& e, double time);
// "lm loss" -> "lm_loss": loss keys as JSON-friendly field names.
std::string metric_key(const std::string& loss_name);

class MetricsJsonlReporter : public Reporter {
 public:
  // Appends to `path` (a resumed run continues the same file); creates parent directories.
  explicit MetricsJsonlReporter(const std::string& path);
  ~MetricsJsonlReporter() override;
  void on_iteration(const IterationStats& s) override;  // records iterations that end a log interval
  void on_eval(const EvalStats& e) override;
  void flush() override;

 private:
  void write(const nlohmann::json& record);

  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace mt

// The reporters a run writes to, chosen from the Config: Megatron's log line, TensorBoard event
// files (--tensorboard-dir) and JSON lines (--metrics-jsonl). As in Megatron, only the last rank
// (print_rank_last, the TensorBoard writer's rank) reports; other ranks get an empty fan-out.
#pragma once

#include <memory>
#include <vector>

#include "core/config.h"
#include "engine/reporter.h"

namespace mt {

class CompositeReporter : public Reporter {
 public:
  void add(std::unique_ptr<Reporter> r) { reporters_.push_back(std::move(r)); }
  size_t size() const { return reporters_.size(); }
  void on_iteration(const IterationStats& s) override;
  void on_eval(const EvalStats& e) override;
  void flush() override;

 private:
  std::vector<std::unique_ptr<Reporter>> reporters_;
};

std::unique_ptr<Reporter> make_reporters(const Config& cfg);

}  // namespace mt

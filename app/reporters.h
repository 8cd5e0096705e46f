// The reporters a run writes to, chosen from the Config: Megatron's log line, TensorBoard event
// files (--tensorboard-dir, or the W&B directory) and JSON lines (--metrics-jsonl). As in Megatron, only the last rank
// (print_rank_last, the TensorBoard writer's rank) reports; other ranks get an empty fan-out.
#pragma once

#include <memory>
#include <optional>
#include <string>
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

// Megatron's W&B flags without a W&B client: with a non-empty --wandb-project, the TensorBoard
// event files go to the W&B directory (--wandb-save-dir, else <save>/wandb, Megatron-LM's default in
// megatron/training/global_vars.py) unless --tensorboard-dir names a directory of its own.
// The directory the event files go to: --tensorboard-dir, else the W&B one, else none.
std::optional<std::string> tensorboard_events_dir(const Config& cfg);
// With a non-empty --wandb-project: the command that uploads those event files,
// `wandb sync --project P [--entity E] [--id NAME] DIR` (--id: --wandb-exp-name when it is letters,
// digits, '-' and '_', which any W&B run ID may hold), shell-quoted. make_reporters prints it once, on the last rank.
std::optional<std::string> wandb_sync_command(const Config& cfg);

}  // namespace mt

#include "app/reporters.h"

#include <filesystem>

#include "app/megatron_log.h"
#include "app/metrics_jsonl.h"
#include "app/tensorboard_writer.h"
#include "core/log.h"

namespace mt {

void CompositeReporter::on_iteration(const IterationStats& s) {
  for (auto& r : reporters_) r->on_iteration(s);
}

void CompositeReporter::on_eval(const EvalStats& e) {
  for (auto& r : reporters_) r->on_eval(e);
}

void CompositeReporter::flush() {
  for (auto& r : reporters_) r->flush();
}

namespace {

bool non_empty(const std::optional<std::string>& s) { return s && !s->empty(); }

// A word as the shell reads it: as is when it holds only safe characters, else single-quoted.
std::string shell_word(const std::string& s) {
  const bool safe = !s.empty() && s.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                                       "0123456789_-.,/:=+@%") == std::string::npos;
  if (safe) return s;
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

}  // namespace

std::optional<std::string> tensorboard_events_dir(const Config& cfg) {
  const LoggingConfig& l = cfg.logging;
  if (l.tensorboard_dir) return l.tensorboard_dir;
  if (!non_empty(l.wandb_project)) return std::nullopt;
  if (non_empty(l.wandb_save_dir)) return l.wandb_save_dir;
  // (validate_checkpoint_and_logging refuses --wandb-project without either.)
  if (!cfg.checkpoint.save) return std::nullopt;
  return (std::filesystem::path(*cfg.checkpoint.save) / "wandb").string();
}

std::optional<std::string> wandb_sync_command(const Config& cfg) {
  const LoggingConfig& l = cfg.logging;
  const std::optional<std::string> dir = tensorboard_events_dir(cfg);
  if (!non_empty(l.wandb_project) || !dir) return std::nullopt;
  std::string cmd = "wandb sync --project " + shell_word(*l.wandb_project);
  if (non_empty(l.wandb_entity)) cmd += " --entity " + shell_word(*l.wandb_entity);
  // --id only for names of letters, digits, '-' and '_', which any W&B run ID may hold; otherwise W&B
  // chooses the run's ID.
  const bool id_safe = non_empty(l.wandb_exp_name) &&
                       l.wandb_exp_name->find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                                           "0123456789_-") == std::string::npos;
  if (id_safe) cmd += " --id " + *l.wandb_exp_name;
  return cmd + " " + shell_word(*dir);
}

std::unique_ptr<Reporter> make_reporters(const Config& cfg) {
  auto all = std::make_unique<CompositeReporter>();
  const bool last_rank = cfg.parallel.rank == cfg.parallel.world_size - 1;
  if (!last_rank) return all;
  all->add(std::make_unique<MegatronLogReporter>(cfg.logging));
  if (const std::optional<std::string> dir = tensorboard_events_dir(cfg)) {
    LoggingConfig logging = cfg.logging;
    logging.tensorboard_dir = dir;
    all->add(std::make_unique<TensorBoardReporter>(logging, cfg.train.skip_train, cfg.parallel.world_size));
  }
  if (const std::optional<std::string> sync = wandb_sync_command(cfg))
    log::write_stdout(fmt::format("> W&B: megatrain has no W&B client; TensorBoard event files go to {}; upload them "
                                  "with: {}", *tensorboard_events_dir(cfg), *sync));
  if (cfg.logging.metrics_jsonl) all->add(std::make_unique<MetricsJsonlReporter>(*cfg.logging.metrics_jsonl));
  return all;
}

}  // namespace mt

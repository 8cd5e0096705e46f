#include "app/reporters.h"

#include "app/megatron_log.h"
#include "app/metrics_jsonl.h"
#include "app/tensorboard_writer.h"

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

std::unique_ptr<Reporter> make_reporters(const Config& cfg) {
  auto all = std::make_unique<CompositeReporter>();
  const bool last_rank = cfg.parallel.rank == cfg.parallel.world_size - 1;
  if (!last_rank) return all;
  all->add(std::make_unique<MegatronLogReporter>(cfg.logging));
  if (cfg.logging.tensorboard_dir)
    all->add(std::make_unique<TensorBoardReporter>(cfg.logging, cfg.train.skip_train, cfg.parallel.world_size));
  if (cfg.logging.metrics_jsonl) all->add(std::make_unique<MetricsJsonlReporter>(*cfg.logging.metrics_jsonl));
  return all;
}

}  // namespace mt

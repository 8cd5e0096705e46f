#include "app/training_data.h"

#include <fmt/format.h>

#include "core/error.h"
#include "data/batch_loader.h"
#include "data/dataset_builder.h"

namespace mt {

TrainingData build_training_data(const Config& cfg, int dp_rank, int dp_size, int64_t consumed_train_samples,
                                 int64_t consumed_valid_samples) {
  TokenizerFacts facts;
  facts.vocab_size = cfg.model.vocab_size;
  facts.eod = cfg.data.eod_id;
  const DatasetsConfig dc = datasets_config(cfg, facts);
  const std::array<int64_t, 3> n = samples_per_split(cfg);
  std::array<std::optional<int64_t>, 3> sizes;
  for (int i = 0; i < 3; ++i)
    if (n[i] > 0) sizes[i] = n[i];
  const BuiltDatasets built = build_datasets(dc, sizes);
  if (!built.splits[0]) fail("no training split was built: check --split (its first weight must be > 0)");

  TrainingData t;
  t.train = std::make_unique<BatchLoader>(built.splits[0],
                                          batch_loader_options(cfg, facts, dp_rank, dp_size, consumed_train_samples));
  if (built.splits[1] && cfg.train.eval_iters > 0)
    t.valid = std::make_unique<BatchLoader>(built.splits[1], batch_loader_options(cfg, facts, dp_rank, dp_size, consumed_valid_samples));
  const char* names[3] = {"train", "valid", "test"};
  for (int i = 0; i < 3; ++i)
    if (built.splits[i]) t.description += fmt::format(" > {} split: {}\n", names[i], built.splits[i]->describe());
  return t;
}

}  // namespace mt

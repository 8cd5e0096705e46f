// The micro-batch streams a training run consumes: the train/valid datasets built from the data
// flags (data/dataset_builder.h) behind the data code's BatchLoaders (Megatron's pretraining
// sampler with background staging). The tokenizer's facts (vocabulary size, EOD id) come from
// the Config, where the flag parser put them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/config.h"
#include "data/batch.h"

namespace mt {

struct TrainingData {
  std::unique_ptr<BatchSource> train, valid;
  std::string description;  // one line per split, for the start-up log
};

// consumed_train_samples: where a resumed run continues.
TrainingData build_training_data(const Config& cfg, int dp_rank, int dp_size, int64_t consumed_train_samples);

}  // namespace mt

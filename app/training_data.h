// The micro-batch streams a training run consumes: the tokenizer's facts, the train/valid
// datasets built from the data flags (data/dataset_builder.h), and Megatron's pretraining sampler
// over them (sequential, this data-parallel rank's slice of each global micro-batch). Glue until
// the data code's own batch loader (background staging) replaces DatasetBatchSource.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/config.h"
#include "data/batch.h"
#include "data/gpt_dataset.h"

namespace mt {

// Megatron's MegatronPretrainingSampler: global micro-batches of micro_batch x dp_size consecutive
// samples from `consumed`; rank r takes samples [r * b, (r + 1) * b) of each.
class DatasetBatchSource final : public BatchSource {
 public:
  DatasetBatchSource(std::shared_ptr<const SampleDataset> dataset, int micro_batch, int seq_length, int dp_rank,
                     int dp_size, const SampleMasking& masking, int64_t consumed_samples);
  bool next(MicroBatch& mb) override;
  int64_t consumed_samples() const { return consumed_; }

 private:
  std::shared_ptr<const SampleDataset> dataset_;
  int b_, s_, dp_rank_, dp_size_;
  SampleMasking masking_;
  int64_t consumed_;
  std::vector<int32_t> window_, segments_;
};

struct TrainingData {
  std::unique_ptr<BatchSource> train, valid;
  int64_t vocab_size = 0;  // the tokenizer's, before padding
  int32_t eod = -1;
  std::string description;  // one line per split, for the start-up log
};

// Builds the tokenizer and the datasets named by the flags. consumed_train_samples: where a
// resumed run continues.
TrainingData build_training_data(const Config& cfg, int dp_rank, int dp_size, int64_t consumed_train_samples);

}  // namespace mt

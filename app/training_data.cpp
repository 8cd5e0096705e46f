#include "app/training_data.h"

#include "core/error.h"
#include "data/dataset_builder.h"
#include "data/tokenizer.h"

namespace mt {

DatasetBatchSource::DatasetBatchSource(std::shared_ptr<const SampleDataset> dataset, int micro_batch, int seq_length,
                                       int dp_rank, int dp_size, const SampleMasking& masking,
                                       int64_t consumed_samples)
    : dataset_(std::move(dataset)),
      b_(micro_batch),
      s_(seq_length),
      dp_rank_(dp_rank),
      dp_size_(dp_size),
      masking_(masking),
      consumed_(consumed_samples) {
  if (dataset_->window_length() != s_ + 1)
    fail("dataset windows hold {} tokens, --seq-length {} needs {}", dataset_->window_length(), s_, s_ + 1);
  window_.resize(static_cast<size_t>(s_) + 1);
  segments_.resize(static_cast<size_t>(s_));
}

bool DatasetBatchSource::next(MicroBatch& mb) {
  const int64_t global = static_cast<int64_t>(b_) * dp_size_;
  if (consumed_ + global > dataset_->size()) return false;  // the sampler drops a last partial batch
  mb.resize(b_, s_);
  for (int i = 0; i < b_; ++i) {
    const int64_t idx = consumed_ + static_cast<int64_t>(dp_rank_) * b_ + i;
    dataset_->window(idx, window_.data());
    const size_t o = static_cast<size_t>(i) * s_;
    make_training_sample(window_, masking_, mb.tokens.data() + o, mb.labels.data() + o, mb.loss_mask.data() + o,
                         mb.positions.data() + o, segments_.data());
  }
  consumed_ += global;
  return true;
}

TrainingData build_training_data(const Config& cfg, int dp_rank, int dp_size, int64_t consumed_train_samples) {
  if (cfg.data.reset_attention_mask)
    throw Unsupported("--reset-attention-mask (attention blocked at document boundaries) is not supported yet");
  std::unique_ptr<Tokenizer> tokenizer = build_tokenizer(tokenizer_options(cfg.data));
  TokenizerFacts facts;
  facts.vocab_size = tokenizer->vocab_size();
  facts.eod = tokenizer->eod();
  facts.pad = -1;

  const DatasetsConfig dc = datasets_config(cfg, facts);
  const std::array<int64_t, 3> n = samples_per_split(cfg);
  std::array<std::optional<int64_t>, 3> sizes;
  for (int i = 0; i < 3; ++i)
    if (n[i] > 0) sizes[i] = n[i];
  const BuiltDatasets built = build_datasets(dc, sizes);
  if (!built.splits[0]) fail("no training split was built: check --split (its first weight must be > 0)");

  SampleMasking masking;
  masking.eod_token = facts.eod;
  masking.pad_token = static_cast<int32_t>(dc.tokenizer.pad);
  masking.reset_position_ids = cfg.data.reset_position_ids;
  masking.eod_mask_loss = cfg.data.eod_mask_loss;

  TrainingData t;
  t.vocab_size = facts.vocab_size;
  t.eod = facts.eod;
  const int b = cfg.train.micro_batch_size, s = cfg.model.seq_length;
  t.train = std::make_unique<DatasetBatchSource>(built.splits[0], b, s, dp_rank, dp_size, masking, consumed_train_samples);
  if (built.splits[1]) t.valid = std::make_unique<DatasetBatchSource>(built.splits[1], b, s, dp_rank, dp_size, masking, 0);
  for (int i = 0; i < 3; ++i)
    if (built.splits[i]) t.description += fmt::format(" > {} split: {}\n", i == 0 ? "train" : i == 1 ? "valid" : "test",
                                                      built.splits[i]->describe());
  return t;
}

}  // namespace mt

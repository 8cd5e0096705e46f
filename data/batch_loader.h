// BatchLoader: this data-parallel rank's micro-batches in the order of Megatron's dataloaders.
// `single` (MegatronPretrainingSampler): global sample ids consumed_samples, consumed_samples + 1,
// ... are cut into chunks of micro_batch x DP, and DP rank r takes ids [r*b, (r+1)*b) of each
// chunk; a last incomplete chunk is dropped. `cyclic` (MegatronPretrainingRandomSampler behind
// cyclic_iter): data/cyclic_order.h, endless. A background thread prepares the next few
// micro-batches (reading only this rank's samples) into buffers allocated at start-up; errors it
// meets are raised by next() once the batches before them are consumed.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "data/batch.h"
#include "data/cyclic_order.h"
#include "data/dataset_builder.h"
#include "data/gpt_dataset.h"

namespace mt {

struct Config;

struct BatchLoaderOptions {
  int micro_batch_size = 1;
  int data_parallel_rank = 0;
  int data_parallel_size = 1;
  int64_t consumed_samples = 0;  // global samples consumed before (resume)
  SampleMasking masking;
  int prefetch = 4;  // micro-batches prepared ahead
  // Megatron's DataLoader workers (--num-workers, at least 1): micro-batch k (counted from where
  // this loader starts) is read by worker k mod workers, each with its own copy of the datasets'
  // order-dependent state (SampleStreams: the FIM random streams).
  int workers = 1;
  bool cyclic = false;         // --dataloader-type cyclic
  bool data_sharding = true;   // cyclic only: --no-data-sharding clears it
};

// The options a run's flags give: --micro-batch-size, the EOD/pad ids and --reset-position-ids,
// --reset-attention-mask, --eod-mask-loss, --dataloader-type, --no-data-sharding. Throws
// mt::Unsupported for --dataloader-type external.
BatchLoaderOptions batch_loader_options(const Config& config, const TokenizerFacts& tokenizer, int data_parallel_rank,
                                        int data_parallel_size, int64_t consumed_samples);

class BatchLoader : public BatchSource {
 public:
  // Throws mt::Error when no full chunk is left after consumed_samples.
  BatchLoader(std::shared_ptr<const SampleDataset> dataset, BatchLoaderOptions options);
  ~BatchLoader() override;
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  // Swaps the next micro-batch into mb (mb's old buffers are recycled; after the first few calls
  // nothing is allocated). Returns false once the dataset holds no further full chunk.
  bool next(MicroBatch& mb) override;

  // Micro-batches this rank gets in total from where it started (INT64_MAX with cyclic).
  int64_t num_micro_batches() const { return num_micro_batches_; }
  // The dataset indices of this rank's k-th micro-batch, micro_batch_size of them. With cyclic, not
  // while the loader runs (its background thread walks the same order).
  std::vector<int64_t> samples_of(int64_t k);

 private:
  void produce();
  void fill(int64_t k, MicroBatch& slot, std::vector<int32_t>& window, std::vector<int64_t>& ids);
  void sample_ids(int64_t k, int64_t* out);
  std::vector<SampleStreams> streams_;  // one per worker

  std::shared_ptr<const SampleDataset> dataset_;
  BatchLoaderOptions options_;
  int seq_ = 0;
  int64_t num_micro_batches_ = 0;
  std::optional<CyclicOrder> cyclic_;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<MicroBatch> slots_;
  int64_t produced_ = 0;  // micro-batches filled
  int64_t handed_ = 0;    // micro-batches given to the consumer
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread worker_;
};

}  // namespace mt

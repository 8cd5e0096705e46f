#include "data/batch_loader.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <limits>

#include "core/config.h"
#include "core/error.h"
#include "core/log.h"

namespace mt {

BatchLoaderOptions batch_loader_options(const Config& config, const TokenizerFacts& tokenizer, int data_parallel_rank,
                                        int data_parallel_size, int64_t consumed_samples) {
  if (config.data.dataloader_type != "single" && config.data.dataloader_type != "cyclic") {
    throw Unsupported(fmt::format("--dataloader-type {} is not supported yet (megatrain reads in the order of "
                                  "Megatron's 'single' and 'cyclic' loaders)",
                                  config.data.dataloader_type));
  }
  BatchLoaderOptions o;
  o.micro_batch_size = config.train.micro_batch_size;
  o.data_parallel_rank = data_parallel_rank;
  o.data_parallel_size = data_parallel_size;
  o.consumed_samples = consumed_samples;
  o.masking.eod_token = static_cast<int32_t>(tokenizer.eod);
  // Megatron drops a pad id that collides with EOD (MegatronDataset.__init__), unless
  // --allow-ambiguous-pad-tokens.
  o.masking.pad_token = tokenizer.pad == tokenizer.eod && !config.data.allow_ambiguous_pad_tokens
                            ? -1
                            : static_cast<int32_t>(tokenizer.pad);
  o.masking.reset_position_ids = config.data.reset_position_ids;
  o.masking.reset_attention_mask = config.data.reset_attention_mask;
  o.masking.inter_document_masking = config.data.inter_document_masking;
  o.masking.eod_mask_loss = config.data.eod_mask_loss;
  o.workers = std::max(1, config.data.num_workers);
  o.cyclic = config.data.dataloader_type == "cyclic";
  o.data_sharding = config.data.data_sharding;
  return o;
}

BatchLoader::BatchLoader(std::shared_ptr<const SampleDataset> dataset, BatchLoaderOptions options)
    : dataset_(std::move(dataset)), options_(options) {
  MT_CHECK(dataset_ != nullptr, "no dataset");
  const auto& o = options_;
  if (o.micro_batch_size <= 0) fail("--micro-batch-size {} must be positive", o.micro_batch_size);
  if (o.data_parallel_size <= 0 || o.data_parallel_rank < 0 || o.data_parallel_rank >= o.data_parallel_size) {
    fail("data-parallel rank {} of {} is out of range", o.data_parallel_rank, o.data_parallel_size);
  }
  if (o.consumed_samples < 0) fail("consumed samples {} must not be negative", o.consumed_samples);
  if (o.prefetch < 1) fail("prefetch depth {} must be at least 1", o.prefetch);
  if (o.workers < 1) fail("loader workers {} must be at least 1", o.workers);
  streams_.resize(static_cast<size_t>(o.workers));
  const int64_t total = dataset_->size();
  if (total <= 0) fail("no sample to consume: {} is empty", dataset_->describe());
  const int64_t chunk = static_cast<int64_t>(o.micro_batch_size) * o.data_parallel_size;
  if (o.cyclic) {
    cyclic_.emplace(CyclicOrderOptions{total, o.micro_batch_size, o.data_parallel_rank, o.data_parallel_size,
                                       o.consumed_samples, o.data_sharding});
    num_micro_batches_ = std::numeric_limits<int64_t>::max();
  } else {
    if (o.consumed_samples >= total) {
      fail("no samples left to consume: {} samples were consumed and {} holds {}", o.consumed_samples,
           dataset_->describe(), total);
    }
    num_micro_batches_ = (total - o.consumed_samples) / chunk;
  }
  seq_ = dataset_->window_length() - 1;
  slots_.resize(static_cast<size_t>(o.prefetch));
  for (MicroBatch& s : slots_) s.resize(o.micro_batch_size, seq_);
  worker_ = std::thread([this] { produce(); });
}

BatchLoader::~BatchLoader() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void BatchLoader::sample_ids(int64_t k, int64_t* out) {
  if (cyclic_) return cyclic_->ids(k, out);
  const int64_t chunk = static_cast<int64_t>(options_.micro_batch_size) * options_.data_parallel_size;
  const int64_t first = options_.consumed_samples + k * chunk +
                        static_cast<int64_t>(options_.data_parallel_rank) * options_.micro_batch_size;
  for (int i = 0; i < options_.micro_batch_size; ++i) out[i] = first + i;
}

std::vector<int64_t> BatchLoader::samples_of(int64_t k) {
  std::vector<int64_t> ids(static_cast<size_t>(options_.micro_batch_size));
  sample_ids(k, ids.data());
  return ids;
}

void BatchLoader::fill(int64_t k, MicroBatch& slot, std::vector<int32_t>& window, std::vector<int64_t>& ids) {
  const int b = options_.micro_batch_size;
  if (slot.batch != b || slot.seq != seq_ || slot.tokens.size() != static_cast<size_t>(b) * seq_ ||
      slot.segments.size() != slot.tokens.size()) {
    slot.resize(b, seq_);  // only while the consumer's first buffers cycle in
  }
  sample_ids(k, ids.data());
  SampleStreams& streams = streams_[static_cast<size_t>(k % options_.workers)];
  std::vector<int32_t> parts;  // --dataloader-inter-document-masking: a window's document parts
  for (int i = 0; i < b; ++i) {
    dataset_->read_window(ids[static_cast<size_t>(i)], window.data(), streams);
    const size_t at = static_cast<size_t>(i) * seq_;
    make_training_sample(window, options_.masking, slot.tokens.data() + at, slot.labels.data() + at,
                         slot.loss_mask.data() + at, slot.positions.data() + at, slot.segments.data() + at);
    if (options_.masking.inter_document_masking) {
      dataset_->document_parts(ids[static_cast<size_t>(i)], parts);
      document_segments(parts, seq_, dataset_->window_length() > seq_, slot.positions.data() + at,
                        slot.segments.data() + at);
    }
  }
}

void BatchLoader::produce() {
  std::vector<int32_t> window(static_cast<size_t>(seq_) + 1);
  std::vector<int64_t> ids(static_cast<size_t>(options_.micro_batch_size));
  const int64_t depth = static_cast<int64_t>(slots_.size());
  for (int64_t k = 0; k < num_micro_batches_; ++k) {
    MicroBatch* slot;
    {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [&] { return stop_ || produced_ - handed_ < depth; });
      if (stop_) return;
      slot = &slots_[static_cast<size_t>(k % depth)];
    }
    try {
      fill(k, *slot, window, ids);
    } catch (...) {
      std::lock_guard lock(mutex_);
      error_ = std::current_exception();
      changed_.notify_all();
      return;
    }
    {
      std::lock_guard lock(mutex_);
      ++produced_;
    }
    changed_.notify_all();
  }
}

bool BatchLoader::next(MicroBatch& mb) {
  std::unique_lock lock(mutex_);
  if (handed_ >= num_micro_batches_) return false;
  // A step that waits on the loader says so every few seconds (slow storage, a huge sample).
  const auto ready = [&] { return handed_ < produced_ || error_; };
  const auto start = std::chrono::steady_clock::now();
  while (!changed_.wait_for(lock, log::wait_progress_interval(), ready))
    log::write_stderr(fmt::format("[rank {}] waiting for the batch loader: micro-batch {}{} not ready after {:.0f} s",
                                  log::rank(), handed_ + 1,
                                  cyclic_ ? std::string() : fmt::format(" of {}", num_micro_batches_),
                                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()));
  if (handed_ >= produced_) std::rethrow_exception(error_);
  MicroBatch& slot = slots_[static_cast<size_t>(handed_ % static_cast<int64_t>(slots_.size()))];
  std::swap(mb, slot);
  ++handed_;
  lock.unlock();
  changed_.notify_all();
  return true;
}

}  // namespace mt

// The token store a GPTDataset cuts samples from: an IndexedDataset (.bin/.idx) or the mock data.
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace mt {

class LowLevelDataset {
 public:
  virtual ~LowLevelDataset() = default;
  // Sequences (for GPT, the unit --split divides: Megatron's numel_low_level_dataset).
  virtual int64_t num_sequences() const = 0;
  virtual std::span<const int32_t> sequence_lengths() const = 0;
  // Tokens [offset, offset + count) of one sequence.
  virtual void read(int64_t seq, int64_t offset, int64_t count, int32_t* out) const = 0;
  // For messages: the data prefix, or "mock data".
  virtual std::string name() const = 0;
  // What the sample indices depend on, for the cache key (the sequence lengths, by content).
  virtual std::string cache_identity() const = 0;
};

}  // namespace mt

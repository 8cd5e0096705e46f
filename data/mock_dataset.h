// --mock-data: Megatron's MockGPTLowLevelDataset. 100000 documents whose lengths are
// numpy.random.default_rng(0).integers(1, 4096, 100000, dtype=int32); document i of length L holds
// (1, 2, ..., L-1) modulo the vocabulary size followed by the EOD token. A GPTDataset over it
// (MockGPTDataset) builds its indices exactly as over real data, so megatrain's mock stream equals
// Megatron's for the same seed, sequence length, sample counts and tokenizer (vocabulary size and
// EOD id). Megatron ignores --split for mock data and always splits it 1,1,1.
#pragma once

#include <vector>

#include "data/low_level_dataset.h"

namespace mt {

class MockLowLevelDataset : public LowLevelDataset {
 public:
  static constexpr int64_t kSize = 100000;
  static constexpr int32_t kMaxSequenceLength = 4096;
  static constexpr uint64_t kSeed = 0;

  // vocab_size: the tokenizer's (unpadded) vocabulary size; eod: its end-of-document id.
  MockLowLevelDataset(int64_t vocab_size, int64_t eod);

  int64_t num_sequences() const override { return kSize; }
  std::span<const int32_t> sequence_lengths() const override { return lengths_; }
  void read(int64_t seq, int64_t offset, int64_t count, int32_t* out) const override;
  std::string name() const override { return "mock data"; }
  std::string cache_identity() const override;

 private:
  int64_t vocab_size_;
  int64_t eod_;
  std::vector<int32_t> lengths_;
};

}  // namespace mt

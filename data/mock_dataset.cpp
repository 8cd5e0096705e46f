#include "data/mock_dataset.h"

#include "core/error.h"
#include "data/numpy_random.h"

namespace mt {

MockLowLevelDataset::MockLowLevelDataset(int64_t vocab_size, int64_t eod)
    : vocab_size_(vocab_size), eod_(eod), lengths_(kSize) {
  if (vocab_size <= 0) fail("--mock-data needs the tokenizer's vocabulary size (got {})", vocab_size);
  if (eod < 0 || eod > INT32_MAX) fail("--mock-data: the tokenizer's EOD id {} is not a valid token id", eod);
  numpy_random::Pcg64 gen(kSeed);
  numpy_random::integers_int32(gen, 1, kMaxSequenceLength, lengths_);
}

void MockLowLevelDataset::read(int64_t seq, int64_t offset, int64_t count, int32_t* out) const {
  MT_CHECK(seq >= 0 && seq < kSize && offset >= 0 && count >= 0 && offset + count <= lengths_[seq],
           "mock read(seq={}, offset={}, count={})", seq, offset, count);
  const int64_t last = lengths_[seq] - 1;  // the EOD position
  for (int64_t i = 0; i < count; ++i) {
    const int64_t pos = offset + i;
    out[i] = static_cast<int32_t>(pos == last ? eod_ : (pos + 1) % vocab_size_);
  }
}

std::string MockLowLevelDataset::cache_identity() const {
  return fmt::format("mock: default_rng({}).integers(1, {}, {})", kSeed, kMaxSequenceLength, kSize);
}

}  // namespace mt

// Bit-exact re-implementations of the numpy random streams Megatron's datasets consume:
//  - numpy.random.RandomState(seed) (legacy MT19937, init_genrand seeding) and its 1-D shuffle,
//    which order GPTDataset's document and shuffle indices;
//  - numpy.random.default_rng(seed) (PCG64 seeded through SeedSequence) and
//    Generator.integers(..., dtype=int32), which draw MockGPTLowLevelDataset's document lengths;
//  - numpy.sum over float64 (pairwise summation) and Megatron's normalize(), whose rounding decides
//    split boundaries and blend sizes.
// tests/numpy_random_test.cpp checks every stream against numpy itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace mt::numpy_random {

// numpy.random.RandomState(seed): MT19937 seeded with init_genrand(seed), which is exactly what
// std::mt19937(seed) does; next_uint32 is the standard tempered output.
class RandomState {
 public:
  explicit RandomState(uint32_t seed) : mt_(seed) {}

  uint32_t next_uint32() { return static_cast<uint32_t>(mt_()); }
  // numpy's mt19937_next64: the first 32-bit draw is the high half.
  uint64_t next_uint64() {
    const uint64_t hi = next_uint32();
    const uint64_t lo = next_uint32();
    return (hi << 32) | lo;
  }

  // numpy's random_interval(max): a uniform value in [0, max] by masked rejection; 32-bit draws
  // while max fits in 32 bits, 64-bit draws beyond.
  uint64_t random_interval(uint64_t max);

  // RandomState.random_sample(): a double in [0, 1) from two 32-bit draws (53 bits).
  double random_sample() {
    const uint32_t a = next_uint32() >> 5, b = next_uint32() >> 6;
    return (a * 67108864.0 + b) / 9007199254740992.0;
  }

  // RandomState.binomial(n, p) for scalar n and p (the legacy stream, which Megatron's FIM dataset
  // draws from): the inversion algorithm, which numpy uses while n * min(p, 1 - p) <= 30. Unlike
  // Generator.binomial it draws even for p == 0. Throws mt::Error for p outside [0, 1], n < 0,
  // or n * min(p, 1 - p) > 30 (numpy's BTPE branch, not needed by megatrain).
  int64_t binomial(int64_t n, double p);

  // RandomState.shuffle of a 1-D array: for i = n-1 down to 1, swap a[i] with a[random_interval(i)].
  // The permutation depends only on n and the stream, not on the element type.
  template <typename T>
  void shuffle(std::span<T> a);

 private:
  std::mt19937 mt_;
};

// numpy.random.default_rng(seed): a Generator over PCG64 (XSL-RR 128/64) whose 128-bit state and
// increment come from SeedSequence(seed).generate_state(4, uint64).
class Pcg64 {
 public:
  explicit Pcg64(uint64_t seed);
  uint64_t next_uint64();
  // Generator's 32-bit draws split one 64-bit output: low half first, high half buffered.
  uint32_t next_uint32();

 private:
  unsigned __int128 state_ = 0;
  unsigned __int128 inc_ = 0;
  bool has_uint32_ = false;
  uint32_t buffered_uint32_ = 0;
};

// Generator.integers(low, high, size=out.size(), dtype=numpy.int32) (endpoint=False): Lemire's
// bounded method on 32-bit draws.
void integers_int32(Pcg64& gen, int32_t low, int32_t high, std::span<int32_t> out);

// SeedSequence(entropy).generate_state(n_words, uint32) (no spawn key, pool size 4).
std::vector<uint32_t> seed_sequence_state(uint64_t entropy, size_t n_words);

// numpy.sum of a float64 array (pairwise summation with 8 accumulators, blocks of 128).
double pairwise_sum(std::span<const double> a);

// megatron.core.datasets.utils.normalize: w / numpy.sum(w) in float64.
std::vector<double> normalize(std::span<const double> w);

// ---- template implementation ----

template <typename T>
void RandomState::shuffle(std::span<T> a) {
  const size_t n = a.size();
  if (n < 2) return;
  // The stream of swap partners does not depend on the array, so draw a block of them first and
  // prefetch their targets a few swaps ahead: the swaps are random accesses into an array that can
  // be gigabytes long, and overlapping their cache misses is most of the speed. The order of the
  // swaps (and so the result) is numpy's.
  constexpr size_t kBlock = 4096;
  constexpr size_t kAhead = 16;
  uint64_t partner[kBlock];
  size_t i = n - 1;
  while (i >= 1) {
    const size_t count = i < kBlock ? i : kBlock;  // i, i-1, ..., i-count+1
    for (size_t k = 0; k < count; ++k) partner[k] = random_interval(i - k);
    for (size_t k = 0; k < count && k < kAhead; ++k) __builtin_prefetch(&a[partner[k]], 1);
    for (size_t k = 0; k < count; ++k) {
      if (k + kAhead < count) __builtin_prefetch(&a[partner[k + kAhead]], 1);
      const size_t pos = i - k;
      const T tmp = a[pos];
      a[pos] = a[partner[k]];
      a[partner[k]] = tmp;
    }
    i -= count;
  }
}

}  // namespace mt::numpy_random

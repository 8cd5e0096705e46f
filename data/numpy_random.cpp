#include "data/numpy_random.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace mt::numpy_random {

uint64_t RandomState::random_interval(uint64_t max) {
  if (max == 0) return 0;
  uint64_t mask = max;
  mask |= mask >> 1;
  mask |= mask >> 2;
  mask |= mask >> 4;
  mask |= mask >> 8;
  mask |= mask >> 16;
  mask |= mask >> 32;
  uint64_t value;
  if (max <= 0xffffffffULL) {
    while ((value = (next_uint32() & mask)) > max) {
    }
  } else {
    while ((value = (next_uint64() & mask)) > max) {
    }
  }
  return value;
}

// numpy/random/src/legacy/legacy-distributions.c: legacy_random_binomial (no shortcut for p == 0
// or n == 0) over distributions.c's random_binomial_inversion. Its cached constants (q, q^n, the
// bound) are recomputed here each call: the same values, so the same draws.
int64_t RandomState::binomial(int64_t n, double p) {
  if (!(p >= 0.0 && p <= 1.0)) fail("binomial: p = {} is outside [0, 1]", p);
  if (n < 0) fail("binomial: n = {} is negative", n);
  const bool flip = p > 0.5;
  const double pp = flip ? 1.0 - p : p;
  if (pp * static_cast<double>(n) > 30.0) fail("binomial: n * p = {} > 30 (numpy's BTPE branch) is not implemented", pp * n);
  const double q = 1.0 - pp;
  const double qn = std::exp(static_cast<double>(n) * std::log(q));
  const double np = static_cast<double>(n) * pp;
  const int64_t bound = static_cast<int64_t>(std::min(static_cast<double>(n), np + 10.0 * std::sqrt(np * q + 1)));
  int64_t x = 0;
  double px = qn;
  double u = random_sample();
  while (u > px) {
    ++x;
    if (x > bound) {
      x = 0;
      px = qn;
      u = random_sample();
    } else {
      u -= px;
      px = (static_cast<double>(n - x + 1) * pp * px) / (static_cast<double>(x) * q);
    }
  }
  return flip ? n - x : x;
}

// ---- SeedSequence (numpy/random/bit_generator.pyx) ----

namespace {

constexpr uint32_t kInitA = 0x43b0d7e5;
constexpr uint32_t kMultA = 0x931e8875;
constexpr uint32_t kInitB = 0x8b51f9dd;
constexpr uint32_t kMultB = 0x58f38ded;
constexpr uint32_t kMixMultL = 0xca01f9dd;
constexpr uint32_t kMixMultR = 0x4973f715;
constexpr int kXShift = 16;
constexpr size_t kPoolSize = 4;

uint32_t hashmix(uint32_t value, uint32_t& hash_const) {
  value ^= hash_const;
  hash_const *= kMultA;
  value *= hash_const;
  value ^= value >> kXShift;
  return value;
}

uint32_t mix(uint32_t x, uint32_t y) {
  uint32_t result = kMixMultL * x - kMixMultR * y;
  result ^= result >> kXShift;
  return result;
}

}  // namespace

std::vector<uint32_t> seed_sequence_state(uint64_t entropy, size_t n_words) {
  // An integer's entropy is its 32-bit words, least significant first (0 is one zero word).
  std::vector<uint32_t> words{static_cast<uint32_t>(entropy)};
  if (entropy >> 32) words.push_back(static_cast<uint32_t>(entropy >> 32));

  uint32_t pool[kPoolSize];
  uint32_t hash_const = kInitA;
  for (size_t i = 0; i < kPoolSize; ++i) {
    pool[i] = hashmix(i < words.size() ? words[i] : 0u, hash_const);
  }
  for (size_t src = 0; src < kPoolSize; ++src) {
    for (size_t dst = 0; dst < kPoolSize; ++dst) {
      if (src != dst) pool[dst] = mix(pool[dst], hashmix(pool[src], hash_const));
    }
  }
  for (size_t src = kPoolSize; src < words.size(); ++src) {
    for (size_t dst = 0; dst < kPoolSize; ++dst) pool[dst] = mix(pool[dst], hashmix(words[src], hash_const));
  }

  std::vector<uint32_t> state(n_words);
  uint32_t out_const = kInitB;
  for (size_t i = 0; i < n_words; ++i) {
    uint32_t v = pool[i % kPoolSize];
    v ^= out_const;
    out_const *= kMultB;
    v *= out_const;
    v ^= v >> kXShift;
    state[i] = v;
  }
  return state;
}

// ---- PCG64 (numpy/random/src/pcg64) ----

namespace {

constexpr unsigned __int128 kPcgMultiplier =
    (static_cast<unsigned __int128>(2549297995355413924ULL) << 64) | 4865540595714422341ULL;

}  // namespace

Pcg64::Pcg64(uint64_t seed) {
  // generate_state(4, uint64) = 8 uint32 words viewed as little-endian uint64 pairs.
  const std::vector<uint32_t> w = seed_sequence_state(seed, 8);
  uint64_t v[4];
  for (int i = 0; i < 4; ++i) v[i] = static_cast<uint64_t>(w[2 * i]) | (static_cast<uint64_t>(w[2 * i + 1]) << 32);
  const unsigned __int128 initstate = (static_cast<unsigned __int128>(v[0]) << 64) | v[1];
  const unsigned __int128 initseq = (static_cast<unsigned __int128>(v[2]) << 64) | v[3];
  // pcg_setseq_128_srandom_r
  state_ = 0;
  inc_ = (initseq << 1) | 1;
  state_ = state_ * kPcgMultiplier + inc_;
  state_ += initstate;
  state_ = state_ * kPcgMultiplier + inc_;
}

uint64_t Pcg64::next_uint64() {
  state_ = state_ * kPcgMultiplier + inc_;
  // XSL-RR output of the new state.
  const uint64_t xored = static_cast<uint64_t>(state_ >> 64) ^ static_cast<uint64_t>(state_);
  const unsigned rot = static_cast<unsigned>(state_ >> 122);
  return (xored >> rot) | (xored << ((64 - rot) & 63));
}

uint32_t Pcg64::next_uint32() {
  if (has_uint32_) {
    has_uint32_ = false;
    return buffered_uint32_;
  }
  const uint64_t next = next_uint64();
  has_uint32_ = true;
  buffered_uint32_ = static_cast<uint32_t>(next >> 32);
  return static_cast<uint32_t>(next & 0xffffffffULL);
}

void integers_int32(Pcg64& gen, int32_t low, int32_t high, std::span<int32_t> out) {
  if (high <= low) fail("integers_int32: empty range [{}, {})", low, high);
  const uint32_t rng = static_cast<uint32_t>(static_cast<int64_t>(high) - 1 - low);
  for (int32_t& x : out) {
    uint32_t drawn;
    if (rng == 0) {
      drawn = 0;
    } else if (rng == 0xffffffffu) {
      drawn = gen.next_uint32();
    } else {
      // Lemire's method (numpy's buffered_bounded_lemire_uint32).
      const uint32_t rng_excl = rng + 1;
      uint64_t m = static_cast<uint64_t>(gen.next_uint32()) * rng_excl;
      uint32_t leftover = static_cast<uint32_t>(m);
      if (leftover < rng_excl) {
        const uint32_t threshold = (0xffffffffu - rng) % rng_excl;
        while (leftover < threshold) {
          m = static_cast<uint64_t>(gen.next_uint32()) * rng_excl;
          leftover = static_cast<uint32_t>(m);
        }
      }
      drawn = static_cast<uint32_t>(m >> 32);
    }
    x = static_cast<int32_t>(static_cast<uint32_t>(low) + drawn);
  }
}

// ---- numpy.sum / normalize ----

double pairwise_sum(std::span<const double> a) {
  const size_t n = a.size();
  if (n < 8) {
    double res = 0.0;
    for (double x : a) res += x;
    return res;
  }
  if (n <= 128) {
    double r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    size_t i = 8;
    for (; i < n - (n % 8); i += 8) {
      for (int j = 0; j < 8; ++j) r[j] += a[i + j];
    }
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i];
    return res;
  }
  size_t n2 = n / 2;
  n2 -= n2 % 8;
  return pairwise_sum(a.subspan(0, n2)) + pairwise_sum(a.subspan(n2));
}

std::vector<double> normalize(std::span<const double> w) {
  const double sum = pairwise_sum(w);
  std::vector<double> out(w.size());
  for (size_t i = 0; i < w.size(); ++i) out[i] = w[i] / sum;
  return out;
}

}  // namespace mt::numpy_random

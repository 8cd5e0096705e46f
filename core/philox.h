// Counter-based random numbers (Philox4x32-10), identical on host and device.
//
// Why counter-based: every random value megatrain draws (weight init, dropout masks) is a pure
// function of (key, counter). A tensor shard computes its own elements from their *global* indices,
// so initialization does not depend on the parallel layout, and the reference and CUDA backends
// draw the very same dropout masks.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define MT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MT_HOST_DEVICE inline
#endif

namespace mt {

struct Philox4 {
  uint32_t v[4];
};

MT_HOST_DEVICE void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

// Philox4x32 with 10 rounds: counter (c0..c3) and key (k0, k1) -> four uniform 32-bit words.
MT_HOST_DEVICE Philox4 philox4x32(uint64_t counter_lo, uint64_t counter_hi, uint64_t key) {
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(0xD2511F53u, c0, hi0, lo0);
    philox_mulhilo(0xCD9E8D57u, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// Uniform in (0, 1]: never 0, so log() is safe.
MT_HOST_DEVICE float uniform_from_bits(uint32_t x) {
  return (static_cast<float>(x >> 8) + 1.0f) * (1.0f / 16777216.0f);
}
MT_HOST_DEVICE double uniform64_from_bits(uint32_t hi, uint32_t lo) {
  const uint64_t x = (static_cast<uint64_t>(hi) << 32) | lo;
  return (static_cast<double>(x >> 11) + 1.0) * (1.0 / 9007199254740992.0);
}

// Standard normal for element `index` of the stream `key` (Box-Muller in double precision, so the
// host and the device agree to the last bit after rounding to float).
MT_HOST_DEVICE float normal_at(uint64_t key, uint64_t index) {
  const Philox4 r = philox4x32(index, 0x6e6f726d616cULL /* "normal" */, key);
  const double u1 = uniform64_from_bits(r.v[0], r.v[1]);
  const double u2 = uniform64_from_bits(r.v[2], r.v[3]);
  // Qualified: inside namespace mt an unqualified log would find the mt::log namespace.
  return static_cast<float>(::sqrt(-2.0 * ::log(u1)) * ::cos(6.283185307179586 * u2));
}

// Uniform float in (0, 1] for element `index` of stream `key` (uniform init, the MoE router's jitter;
// dropout draws 16 bits per element instead, engine/dropout_mask.h).
MT_HOST_DEVICE float uniform_at(uint64_t key, uint64_t index) {
  const Philox4 r = philox4x32(index, 0x756e69666f726dULL /* "uniform" */, key);
  return uniform_from_bits(r.v[0]);
}

// 64-bit FNV-1a, to turn a parameter name into part of its stream key.
inline constexpr uint64_t fnv1a64(const char* s, uint64_t h = 0xcbf29ce484222325ULL) {
  while (*s) {
    h ^= static_cast<unsigned char>(*s++);
    h *= 0x100000001b3ULL;
  }
  return h;
}

inline constexpr uint64_t mix_key(uint64_t a, uint64_t b) {
  uint64_t x = a ^ (b + 0x9E3779B97F4A7C15ULL + (a << 6) + (a >> 2));
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return x;
}

}  // namespace mt

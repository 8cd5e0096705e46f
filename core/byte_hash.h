// A 64-bit hash of a buffer's bytes, identical on host and device (Backend::hash_bytes; the weight
// hash check of --check-weight-hash-across-dp-replicas-interval compares it across ranks).
//
// The buffer of n bytes is read as words w_j = bytes [8j, 8j + 8) little-endian (the last one
// zero-padded), and
//
//   H = fmix64(n) + sum_j fmix64(w_j + (j + 1) * K)   (mod 2^64),   K = 0x9E3779B97F4A7C15,
//
// fmix64 being MurmurHash3's 64-bit finalizer, a bijection of 64-bit words. Changing one word
// changes exactly one term, so H always changes; two or more changed words leave H equal with
// probability about 2^-64. Addition modulo 2^64 is associative and commutative, so a parallel
// reduction in any order gives the same bits.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MT_HASH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MT_HASH_HOST_DEVICE inline
#endif

namespace mt {

constexpr uint64_t kByteHashStride = 0x9E3779B97F4A7C15ull;

MT_HASH_HOST_DEVICE uint64_t hash_fmix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ull;
  k ^= k >> 33;
  return k;
}

// The term of word j.
MT_HASH_HOST_DEVICE uint64_t byte_hash_term(uint64_t word, uint64_t j) {
  return hash_fmix64(word + (j + 1) * kByteHashStride);
}

// The whole hash on the host (the reference backend; tests).
inline uint64_t byte_hash(const void* data, uint64_t n) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint64_t h = hash_fmix64(n);
  for (uint64_t j = 0; j * 8 < n; ++j) {
    uint64_t w = 0;
    for (uint64_t b = 0; b < 8 && j * 8 + b < n; ++b) w |= static_cast<uint64_t>(p[j * 8 + b]) << (8 * b);
    h += byte_hash_term(w, j);
  }
  return h;
}

}  // namespace mt

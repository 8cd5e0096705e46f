// A fast 64-bit content hash for cache keys (not cryptographic: it names cache files and fingerprints
// sequence-length arrays; the cache also compares the full key text before trusting a file).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace mt {

inline uint64_t mix64(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

inline uint64_t hash_bytes(const void* data, size_t n, uint64_t seed = 0) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = mix64(seed ^ (n * 0x9e3779b97f4a7c15ULL));
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ mix64(w + i)) * 0x9e3779b97f4a7c15ULL;
    h = (h << 31) | (h >> 33);
  }
  uint64_t tail = 0;
  if (i < n) std::memcpy(&tail, p + i, n - i);
  return mix64(h ^ mix64(tail ^ 0xa0761d6478bd642fULL));
}

inline std::string hash_hex(std::string_view text) { return fmt::format("{:016x}", hash_bytes(text.data(), text.size())); }

}  // namespace mt

// Small open-addressing hash tables for the tokenizers' hot paths (vocabulary lookups, BPE merge
// ranks, the per-word cache). std::unordered_map costs an allocation per entry and a pointer chase
// per probe; these keep everything in flat arrays.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace mt {

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 32;
  x *= 0xd6e8feb86659fd93ull;
  x ^= x >> 32;
  x *= 0xd6e8feb86659fd93ull;
  x ^= x >> 32;
  return x;
}

// A fast hash of a byte string (8 bytes per step).
inline uint64_t hash_bytes(const char* p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xff51afd7ed558ccdull);
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = (h ^ mix64(w)) * 0x9fb21c651e98df25ull;
    p += 8;
    n -= 8;
  }
  if (n > 0) {
    uint64_t w = 0;
    std::memcpy(&w, p, n);
    h = (h ^ mix64(w ^ (uint64_t{n} << 59))) * 0x9fb21c651e98df25ull;
  }
  return mix64(h);
}
inline uint64_t hash_bytes(std::string_view s) { return hash_bytes(s.data(), s.size()); }

// uint64 key -> uint64 value; keys are never ~0 (the empty marker). Insert overwrites.
class FlatU64Map {
 public:
  explicit FlatU64Map(size_t expected = 16) { rehash(expected); }

  void insert_or_assign(uint64_t key, uint64_t value) {
    if ((size_ + 1) * 2 > keys_.size()) rehash(keys_.size());
    size_t i = mix64(key) & mask_;
    while (keys_[i] != kEmpty && keys_[i] != key) i = (i + 1) & mask_;
    if (keys_[i] == kEmpty) ++size_;
    keys_[i] = key;
    values_[i] = value;
  }
  // Pointer to the value, or nullptr.
  const uint64_t* find(uint64_t key) const {
    size_t i = mix64(key) & mask_;
    while (true) {
      if (keys_[i] == key) return &values_[i];
      if (keys_[i] == kEmpty) return nullptr;
      i = (i + 1) & mask_;
    }
  }
  size_t size() const { return size_; }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  void rehash(size_t want) {
    size_t cap = 16;
    while (cap < want * 2) cap *= 2;
    std::vector<uint64_t> old_keys = std::move(keys_), old_values = std::move(values_);
    keys_.assign(cap, kEmpty);
    values_.assign(cap, 0);
    mask_ = cap - 1;
    size_ = 0;
    for (size_t i = 0; i < old_keys.size(); ++i)
      if (old_keys[i] != kEmpty) insert_or_assign(old_keys[i], old_values[i]);
  }
  std::vector<uint64_t> keys_, values_;
  size_t mask_ = 0, size_ = 0;
};

// byte string -> int32 (a vocabulary). Keys are copied into one arena. Insert overwrites.
class FlatStringMap {
 public:
  explicit FlatStringMap(size_t expected = 16) { rehash(expected); }

  void insert_or_assign(std::string_view key, int32_t value) {
    if ((size_ + 1) * 2 > slots_.size()) rehash(slots_.size());
    const uint64_t h = hash_bytes(key);
    size_t i = h & mask_;
    while (slots_[i].length >= 0) {
      if (slots_[i].hash == h && key_of(slots_[i]) == key) {
        slots_[i].value = value;
        return;
      }
      i = (i + 1) & mask_;
    }
    slots_[i] = Slot{h, static_cast<uint32_t>(arena_.size()), static_cast<int32_t>(key.size()), value};
    arena_.append(key);
    ++size_;
  }
  const int32_t* find(std::string_view key) const { return find(key, hash_bytes(key)); }
  const int32_t* find(std::string_view key, uint64_t h) const {
    size_t i = h & mask_;
    while (slots_[i].length >= 0) {
      if (slots_[i].hash == h && key_of(slots_[i]) == key) return &slots_[i].value;
      i = (i + 1) & mask_;
    }
    return nullptr;
  }
  size_t size() const { return size_; }

 private:
  struct Slot {
    uint64_t hash = 0;
    uint32_t offset = 0;
    int32_t length = -1;  // -1: empty
    int32_t value = 0;
  };
  std::string_view key_of(const Slot& s) const { return {arena_.data() + s.offset, static_cast<size_t>(s.length)}; }
  void rehash(size_t want) {
    size_t cap = 16;
    while (cap < want * 2) cap *= 2;
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
    for (const Slot& s : old) {
      if (s.length < 0) continue;
      size_t i = s.hash & mask_;
      while (slots_[i].length >= 0) i = (i + 1) & mask_;
      slots_[i] = s;
    }
  }
  std::vector<Slot> slots_;
  std::string arena_;
  size_t mask_ = 0, size_ = 0;
};

}  // namespace mt

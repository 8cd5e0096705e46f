// float32 master weights stored as a bf16 model weight plus 16 remainder bits (Transformer
// Engine's FusedAdam store_param_remainders, on by default in Megatron's precision-aware
// optimizer with bf16 parameters): the master weight costs 2 bytes beyond the model weight
// instead of 4, and is recovered exactly.
//
// Splitting a float32 x (bits hi:lo, 16 each): the bf16 weight is hi, plus one where lo's top bit
// is set (round to nearest on the bits, ties away from zero, instead of to even: only exact ties
// differ from an ordinary bf16 rounding), and the remainder is lo read as int16. Joining undoes it:
// a negative remainder says the weight was rounded up. Every bit pattern round-trips.
#pragma once

#include <cstdint>
#include <cstring>

namespace mt {

struct SplitMaster {
  uint16_t weight;     // bf16 bits
  int16_t remainder;
};

inline SplitMaster split_master_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint16_t lo = static_cast<uint16_t>(bits & 0xFFFFu);
  const uint16_t hi = static_cast<uint16_t>((bits >> 16) + ((lo & 0x8000u) ? 1u : 0u));
  return {hi, static_cast<int16_t>(lo)};
}

inline float join_master_bits(uint16_t weight, int16_t remainder) {
  const uint16_t hi = static_cast<uint16_t>(weight - (remainder < 0 ? 1u : 0u));
  const uint32_t bits = (static_cast<uint32_t>(hi) << 16) | static_cast<uint16_t>(remainder);
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

}  // namespace mt

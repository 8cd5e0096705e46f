// float32 master weights stored as a bf16 model weight plus 16 remainder bits (Transformer
// Engine's FusedAdam store_param_remainders, on by default in Megatron's precision-aware
// optimizer with bf16 parameters): the master weight costs 2 bytes beyond the model weight
// instead of 4, and is recovered exactly.
//
// Splitting a float32 x (bits hi:lo, 16 each): the bf16 weight is hi, plus one where lo's top bit
// is set (round to nearest on the bits, ties away from zero, instead of to even: only exact ties
// differ from an ordinary bf16 rounding), and the remainder is lo read as int16. Joining undoes it:
// a negative remainder says the weight was rounded up. Every bit pattern round-trips.
//
// Rounded to nearest even instead (ModelOptions::master_tie_bits, megatrain's default for bf16
// parameters): the weight is exactly what a cast of the float32 master weight gives
// (float_to_bf16_bits), as beside a separate master copy, and the remainder is lo again. Where
// (weight, remainder) cannot say whether the weight was rounded up, one more bit per element does
// (`up`, in a bit array: TieBits): at an exact tie (lo 0x8000: to even may go either way) and at an
// infinite or NaN weight (a finite x rounded up to infinity; a NaN whose quiet bit the cast set).
// Elsewhere the bit is 0. Every bit pattern round-trips; that 65,537 float32 values round to each
// even bf16 value is why 16 bits alone cannot do it.
#pragma once

#include <cstdint>
#include <cstring>

// The same code on the host (the reference backend, checkpoints) and in the CUDA kernels
// (cuda/optimizer_kernels.cu). (The same macro as core/philox.h's.)
#if defined(__CUDACC__)
#define MT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MT_HOST_DEVICE inline
#endif

namespace mt {

MT_HOST_DEVICE uint32_t master_float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

MT_HOST_DEVICE float master_bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

struct SplitMaster {
  uint16_t weight;     // bf16 bits
  int16_t remainder;
};

MT_HOST_DEVICE SplitMaster split_master_bits(float x) {
  const uint32_t bits = master_float_bits(x);
  const uint16_t lo = static_cast<uint16_t>(bits & 0xFFFFu);
  const uint16_t hi = static_cast<uint16_t>((bits >> 16) + ((lo & 0x8000u) ? 1u : 0u));
  return {hi, static_cast<int16_t>(lo)};
}

MT_HOST_DEVICE float join_master_bits(uint16_t weight, int16_t remainder) {
  const uint16_t hi = static_cast<uint16_t>(weight - (remainder < 0 ? 1u : 0u));
  return master_bits_float((static_cast<uint32_t>(hi) << 16) | static_cast<uint16_t>(remainder));
}

// Round to nearest even: whether (weight, remainder) needs the extra bit, the split, the join.
MT_HOST_DEVICE bool master_tie_ambiguous(uint16_t weight, int16_t remainder) {
  return static_cast<uint16_t>(remainder) == 0x8000u || (weight & 0x7F80u) == 0x7F80u;
}

struct SplitMasterEven {
  uint16_t weight;  // float_to_bf16_bits(x)
  int16_t remainder;
  bool up;          // the weight is not x's top 16 bits, where master_tie_ambiguous; else false
};

MT_HOST_DEVICE SplitMasterEven split_master_even(float x) {
  const uint32_t bits = master_float_bits(x);
  const uint16_t top = static_cast<uint16_t>(bits >> 16);
  // core/dtype.h's float_to_bf16_bits: a NaN made quiet, else rounded to nearest even.
  const uint16_t w = (bits & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(top | 0x40u)
                                                         : static_cast<uint16_t>((bits + 0x7FFFu + (top & 1u)) >> 16);
  const auto r = static_cast<int16_t>(static_cast<uint16_t>(bits & 0xFFFFu));
  return {w, r, master_tie_ambiguous(w, r) && w != top};
}

MT_HOST_DEVICE float join_master_even(uint16_t weight, int16_t remainder, bool up) {
  uint16_t top;
  if (!master_tie_ambiguous(weight, remainder)) {  // rounded up exactly when lo is above half
    top = static_cast<uint16_t>(weight - (static_cast<uint16_t>(remainder) > 0x8000u ? 1u : 0u));
  } else if ((weight & 0x7F80u) == 0x7F80u && (weight & 0x7Fu) != 0) {  // a NaN: up is the quiet bit the cast set
    top = static_cast<uint16_t>(up ? weight ^ 0x40u : weight);
  } else {
    top = static_cast<uint16_t>(weight - (up ? 1u : 0u));
  }
  return master_bits_float((static_cast<uint32_t>(top) << 16) | static_cast<uint16_t>(remainder));
}

// Bit i of a bit array of 32-bit words (TieBits: element i's `up`).
MT_HOST_DEVICE bool tie_bit(const uint32_t* words, int64_t i) { return ((words[i >> 5] >> (i & 31)) & 1u) != 0; }

}  // namespace mt

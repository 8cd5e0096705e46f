// Element types that tensors in megatrain can hold, with their sizes and names.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace mt {

// fp8_e4m3 is OCP/NVIDIA "E4M3FN" (bias 7, no infinities, one NaN pattern S.1111.111, max 448);
// fp8_e5m2 is IEEE-like (bias 15, infinities, max 57344). Both are 1 byte; FP8 training uses them.
// i16: the remainders of float32 master weights kept beside bf16 ones (core/master_remainder.h).
enum class DType : uint8_t { f32, f64, bf16, f16, i32, i64, u8, fp8_e4m3, fp8_e5m2, i16 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
    case DType::fp8_e4m3: return 1;
    case DType::fp8_e5m2: return 1;
    case DType::i16: return 2;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::u8: return "uint8";
    case DType::fp8_e4m3: return "float8_e4m3fn";
    case DType::fp8_e5m2: return "float8_e5m2";
    case DType::i16: return "int16";
  }
  return "?";
}

constexpr bool is_floating(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::f16 ||
         t == DType::fp8_e4m3 || t == DType::fp8_e5m2;
}

constexpr bool is_fp8(DType t) { return t == DType::fp8_e4m3 || t == DType::fp8_e5m2; }

// Largest finite value of an FP8 format (448 for e4m3, 57344 for e5m2); 0 for other types.
constexpr float fp8_max(DType t) {
  return t == DType::fp8_e4m3 ? 448.0f : t == DType::fp8_e5m2 ? 57344.0f : 0.0f;
}

// Host-side conversions for the 16-bit float formats (round to nearest even), used by the
// reference backend, tests and checkpoint code. The CUDA backend uses the hardware types.
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_bits_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_f16_bits(float f);
float f16_bits_to_float(uint16_t h);

// Host-side FP8 conversions (core/fp8.cpp), t is fp8_e4m3 or fp8_e5m2. float -> fp8 rounds to
// nearest even and SATURATES: anything beyond the largest finite value (infinities included)
// becomes +-max, as Transformer Engine's scaled casts do (CUDA's __NV_SATFINITE). NaN stays NaN
// (0x7f | sign for both formats). Values below half the smallest subnormal become signed zero.
// The reference backend uses these to emulate FP8 rounding; tests check them against bit patterns.
uint8_t float_to_fp8_bits(DType t, float f);
float fp8_bits_to_float(DType t, uint8_t b);
// The FP8 value nearest to f (float_to_fp8_bits then back): the emulated FP8 rounding.
inline float round_to_fp8(DType t, float f) { return fp8_bits_to_float(t, float_to_fp8_bits(t, f)); }

}  // namespace mt

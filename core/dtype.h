// Element types that tensors in megatrain can hold, with their sizes and names.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace mt {

enum class DType : uint8_t { f32, f64, bf16, f16, i32, i64, u8 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
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
  }
  return "?";
}

constexpr bool is_floating(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::f16;
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

}  // namespace mt

#include "core/tensor.h"

#include <cmath>
#include <cstring>

namespace mt {

std::string Tensor::shape_string() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "] " + std::string(dtype_name(dtype));
}

uint16_t float_to_f16_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t absx = x & 0x7fffffffu;
  if (absx > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf (RNE)
  if (absx < 0x38800000u) {  // subnormal half (or zero): round |f| * 2^24 to nearest even integer
    const float scaled = std::fabs(f) * 16777216.0f;
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
  }
  uint32_t mant = absx & 0x7fffffu;
  uint32_t exp = (absx >> 23) - 112;  // rebias 127 -> 15
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float f16_bits_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(mant), -24);
    if (sign) f = -f;
    return f;
  }
  uint32_t x;
  if (exp == 31) x = sign | 0x7f800000u | (mant << 13);
  else x = sign | ((exp + 112) << 23) | (mant << 13);
  std::memcpy(&f, &x, 4);
  return f;
}

}  // namespace mt

// Host FP8 conversions (E4M3FN and E5M2). Written from the format definitions: sign, exponent
// field, mantissa field, exponent bias 2^(e-1)-1; subnormals below the smallest normal exponent.
// The work is done in double, where every float and every product with a power of two is exact,
// so std::rint (round to nearest even in the default rounding mode) gives the one correct rounding.
#include <algorithm>
#include <cmath>

#include "core/dtype.h"
#include "core/error.h"

namespace mt {
namespace {

struct Fp8Format {
  int mant_bits;    // 3 (e4m3) or 2 (e5m2)
  int bias;         // 7 or 15
  int max_exp_field;  // largest exponent field of a finite number: 15 (e4m3: only mantissa 111 is NaN) or 30
  double max_finite;
};

Fp8Format format_of(DType t) {
  if (t == DType::fp8_e4m3) return {3, 7, 15, 448.0};
  if (t == DType::fp8_e5m2) return {2, 15, 30, 57344.0};
  fail("FP8 conversion asked for {}, which is not an FP8 type", dtype_name(t));
}

}  // namespace

uint8_t float_to_fp8_bits(DType t, float f) {
  const Fp8Format fm = format_of(t);
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  if (std::isnan(f)) return static_cast<uint8_t>(sign | 0x7f);
  double a = std::fabs(static_cast<double>(f));
  if (a > fm.max_finite) a = fm.max_finite;  // saturate (infinity included)
  if (a == 0.0) return sign;
  const int min_exp = 1 - fm.bias;  // exponent of the smallest normal number
  int e;
  std::frexp(a, &e);                // a = m * 2^e, m in [0.5, 1): unbiased exponent is e - 1
  int exp = std::max(e - 1, min_exp);
  // Quantize to the grid of this binade (or the subnormal grid), ties to even.
  double units = std::rint(std::ldexp(a, fm.mant_bits - exp));
  if (units == 0.0) return sign;
  if (units >= std::ldexp(1.0, fm.mant_bits + 1)) {  // rounded up into the next binade
    units /= 2;
    exp += 1;
  }
  const int m = static_cast<int>(units);
  if (m < (1 << fm.mant_bits)) return static_cast<uint8_t>(sign | m);  // subnormal: exponent field 0
  const int exp_field = exp + fm.bias;
  // Saturation above guarantees the result stays finite; check anyway (cheap, and a bug here
  // would silently corrupt every FP8 number).
  MT_CHECK(exp_field <= fm.max_exp_field, "FP8 rounding overflowed for {}", f);
  return static_cast<uint8_t>(sign | (exp_field << fm.mant_bits) | (m - (1 << fm.mant_bits)));
}

float fp8_bits_to_float(DType t, uint8_t b) {
  const Fp8Format fm = format_of(t);
  const bool neg = (b & 0x80) != 0;
  const int exp_field = (b & 0x7f) >> fm.mant_bits;
  const int mant = b & ((1 << fm.mant_bits) - 1);
  double v;
  if (t == DType::fp8_e4m3 && exp_field == 15 && mant == 7) {
    v = std::nan("");
  } else if (t == DType::fp8_e5m2 && exp_field == 31) {
    v = mant == 0 ? HUGE_VAL : std::nan("");
  } else if (exp_field == 0) {
    v = std::ldexp(static_cast<double>(mant), 1 - fm.bias - fm.mant_bits);
  } else {
    v = std::ldexp(static_cast<double>(mant + (1 << fm.mant_bits)), exp_field - fm.bias - fm.mant_bits);
  }
  return static_cast<float>(neg ? -v : v);
}

}  // namespace mt

// Host FP8 conversions against bit patterns derived from the format definitions:
//   e4m3 (E4M3FN): bias 7, 3 mantissa bits, S.1111.111 is NaN, no infinities, max 1.75 * 2^8 = 448.
//   e5m2: bias 15, 2 mantissa bits, IEEE-style infinities/NaNs, max 1.75 * 2^15 = 57344.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>

#include "core/dtype.h"
#include "tests/python_oracle.h"
#include "tests/skip.h"

using namespace mt;
namespace oracle = mt::oracle;

namespace {
constexpr DType E4 = DType::fp8_e4m3;
constexpr DType E5 = DType::fp8_e5m2;
}  // namespace

TEST_CASE("fp8 dtypes: size and names", "[fp8]") {
  CHECK(dtype_size(E4) == 1);
  CHECK(dtype_size(E5) == 1);
  CHECK(dtype_name(E4) == "float8_e4m3fn");
  CHECK(dtype_name(E5) == "float8_e5m2");
  CHECK(fp8_max(E4) == 448.0f);
  CHECK(fp8_max(E5) == 57344.0f);
}

TEST_CASE("fp8 e4m3: known bit patterns, rounding and saturation", "[fp8]") {
  CHECK(float_to_fp8_bits(E4, 1.0f) == 0x38);            // 0.0111.000
  CHECK(float_to_fp8_bits(E4, -2.0f) == 0xC0);           // 1.1000.000
  CHECK(float_to_fp8_bits(E4, 448.0f) == 0x7E);          // max finite 0.1111.110
  CHECK(float_to_fp8_bits(E4, std::ldexp(1.0f, -6)) == 0x08);   // smallest normal
  CHECK(float_to_fp8_bits(E4, std::ldexp(7.0f, -9)) == 0x07);   // largest subnormal
  CHECK(float_to_fp8_bits(E4, std::ldexp(1.0f, -9)) == 0x01);   // smallest subnormal
  CHECK(float_to_fp8_bits(E4, 0.0f) == 0x00);
  CHECK(float_to_fp8_bits(E4, -0.0f) == 0x80);
  // Ties to even: 1 + 1/16 lies halfway between 1 (mantissa 000) and 1.125 (001).
  CHECK(float_to_fp8_bits(E4, 1.0625f) == 0x38);
  // 1.1875 lies halfway between 1.125 (001) and 1.25 (010): to 010.
  CHECK(float_to_fp8_bits(E4, 1.1875f) == 0x3A);
  CHECK(float_to_fp8_bits(E4, 1.19f) == 0x3A);
  CHECK(float_to_fp8_bits(E4, 1.06f) == 0x38);
  // Subnormal ties: 2^-10 is halfway between 0 and 2^-9 (to 0); 3 * 2^-10 between 1 and 2 units (to 2).
  CHECK(float_to_fp8_bits(E4, std::ldexp(1.0f, -10)) == 0x00);
  CHECK(float_to_fp8_bits(E4, std::ldexp(3.0f, -10)) == 0x02);
  // Rounding up across a binade: 15.9 -> 16 = 0.1011.000.
  CHECK(float_to_fp8_bits(E4, 15.9f) == 0x58);
  // Saturation (TE's scaled casts: SATFINITE): beyond max and infinities become +-448.
  CHECK(float_to_fp8_bits(E4, 464.0f) == 0x7E);
  CHECK(float_to_fp8_bits(E4, 1e6f) == 0x7E);
  CHECK(float_to_fp8_bits(E4, -INFINITY) == 0xFE);
  CHECK(float_to_fp8_bits(E4, INFINITY) == 0x7E);
  CHECK(float_to_fp8_bits(E4, NAN) == 0x7F);
  CHECK(std::isnan(fp8_bits_to_float(E4, 0x7F)));
  CHECK(std::isnan(fp8_bits_to_float(E4, 0xFF)));
  CHECK(fp8_bits_to_float(E4, 0x7E) == 448.0f);
  CHECK(fp8_bits_to_float(E4, 0x78) == 256.0f);  // 0.1111.000 is a number in E4M3FN, not infinity
  CHECK(fp8_bits_to_float(E4, 0xB9) == -1.125f);
}

TEST_CASE("fp8 e5m2: known bit patterns, rounding and saturation", "[fp8]") {
  CHECK(float_to_fp8_bits(E5, 1.0f) == 0x3C);       // 0.01111.00
  CHECK(float_to_fp8_bits(E5, 57344.0f) == 0x7B);   // max finite 0.11110.11
  CHECK(float_to_fp8_bits(E5, std::ldexp(1.0f, -14)) == 0x04);  // smallest normal
  CHECK(float_to_fp8_bits(E5, std::ldexp(1.0f, -16)) == 0x01);  // smallest subnormal
  CHECK(float_to_fp8_bits(E5, 1.125f) == 0x3C);     // tie between 1 and 1.25: to even (1)
  CHECK(float_to_fp8_bits(E5, 1.375f) == 0x3E);     // tie between 1.25 and 1.5: to even (1.5)
  CHECK(float_to_fp8_bits(E5, -3.0f) == 0xC2);
  CHECK(float_to_fp8_bits(E5, 61440.0f) == 0x7B);   // halfway to the next (non-)value: saturates
  CHECK(float_to_fp8_bits(E5, INFINITY) == 0x7B);
  CHECK(float_to_fp8_bits(E5, -INFINITY) == 0xFB);
  CHECK(float_to_fp8_bits(E5, NAN) == 0x7F);
  CHECK(std::isinf(fp8_bits_to_float(E5, 0x7C)));
  CHECK(std::isnan(fp8_bits_to_float(E5, 0x7D)));
  CHECK(fp8_bits_to_float(E5, 0x7B) == 57344.0f);
}

TEST_CASE("fp8: every finite bit pattern round-trips, and rounding picks the nearest value", "[fp8]") {
  for (DType t : {E4, E5}) {
    for (int b = 0; b < 256; ++b) {
      const float v = fp8_bits_to_float(t, static_cast<uint8_t>(b));
      if (!std::isfinite(v)) continue;
      INFO(dtype_name(t) << " bits " << b << " value " << v);
      CHECK(float_to_fp8_bits(t, v) == b);
    }
    // Brute-force nearest check on a sweep of values: no finite FP8 value is strictly nearer.
    for (int i = -3000; i <= 3000; ++i) {
      const float x = std::ldexp(static_cast<float>(i) * 1.37f, t == E4 ? -6 : 2);
      const float r = round_to_fp8(t, x);
      if (std::fabs(x) > fp8_max(t)) {
        CHECK(r == std::copysign(fp8_max(t), x));
        continue;
      }
      float nearer = NAN;  // a finite FP8 value strictly nearer to x than r, if any
      for (int b = 0; b < 256; ++b) {
        const float v = fp8_bits_to_float(t, static_cast<uint8_t>(b));
        if (std::isfinite(v) && std::fabs(v - x) < std::fabs(r - x)) nearer = v;
      }
      INFO(dtype_name(t) << " x " << x << " rounded " << r << " nearer " << nearer);
      CHECK(std::isnan(nearer));
    }
  }
}

TEST_CASE("fp8: conversions agree with ml_dtypes (Python oracle)", "[fp8][oracle]") {
  auto python = oracle::python_or_skip("FP8 ml_dtypes oracle");
  if (!python) return;
  const std::string out = oracle::run_capture(oracle::shell_quote(*python) + " " +
                                              oracle::shell_quote(std::string(MEGATRAIN_SOURCE_DIR) +
                                                                  "/tests/oracles/fp8_ml_dtypes.py"));
  if (out.rfind("SKIP", 0) == 0) {
    MT_SKIP("FP8 ml_dtypes oracle: " << out);
  }
  std::istringstream lines(out);
  std::string line;
  int decoded = 0, encoded = 0;
  while (std::getline(lines, line)) {
    std::istringstream in(line);
    std::string fmt_name, what;
    in >> fmt_name >> what;
    const DType t = fmt_name == "e4m3" ? E4 : E5;
    if (what == "decode") {
      for (int b = 0; b < 256; ++b) {
        std::string v;
        in >> v;
        const float expect = std::stof(v);
        const float got = fp8_bits_to_float(t, static_cast<uint8_t>(b));
        INFO(fmt_name << " bits " << b);
        if (std::isnan(expect)) CHECK(std::isnan(got));
        else CHECK(got == expect);
        ++decoded;
      }
    } else {
      std::string pair;
      while (in >> pair) {
        const size_t colon = pair.find(':');
        const float x = std::stof(pair.substr(0, colon));
        const int bits = std::stoi(pair.substr(colon + 1));
        INFO(fmt_name << " x " << x);
        CHECK(float_to_fp8_bits(t, x) == bits);
        ++encoded;
      }
    }
  }
  CHECK(decoded == 512);
  CHECK(encoded > 1000);
}

// ReferenceBackend: one row's LayerNorm / RMSNorm statistics and output values (double math, one
// rounding to the row's dtype), shared by norm_forward (norm_ops.cpp) and the FP8 cast of a norm's
// output (fp8_ops.cpp), so that both give the same values.
#pragma once

#include <cmath>
#include <cstdint>

#include "engine/backend.h"

namespace mt::reference {

struct RowStats {
  double mean = 0, rstd = 0;
};

template <typename T>
RowStats norm_row_stats(const T* x, int64_t C, const NormParams& p) {
  RowStats s;
  if (p.kind == Normalization::layernorm) {
    double sum = 0;
    for (int64_t c = 0; c < C; ++c) sum += x[c];
    s.mean = sum / C;
    double var = 0;
    for (int64_t c = 0; c < C; ++c) var += (x[c] - s.mean) * (x[c] - s.mean);
    s.rstd = 1.0 / std::sqrt(var / C + p.eps);
  } else {
    double sq = 0;
    for (int64_t c = 0; c < C; ++c) sq += static_cast<double>(x[c]) * x[c];
    s.rstd = 1.0 / std::sqrt(sq / C + p.eps);
  }
  return s;
}

// Column c of the normalized row x: norm(x)[c] * w[c] (+ b[c]). Weights may be null (then 1 / 0).
template <typename T>
T norm_row_value(const T* x, int64_t c, const RowStats& s, const T* w, const T* b, const NormParams& p) {
  const double xhat = (x[c] - s.mean) * s.rstd;
  const double wc = (w ? static_cast<double>(w[c]) : 1.0) + (p.one_p ? 1.0 : 0.0);
  return static_cast<T>(xhat * wc + (b ? static_cast<double>(b[c]) : 0.0));
}

}  // namespace mt::reference

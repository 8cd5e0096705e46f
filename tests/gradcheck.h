// Helpers for the float64 finite-difference gradient checks of the reference backend.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mt::test {

// A host float64 (or int32) array with a Tensor view over it.
struct Buf {
  std::vector<double> d;
  std::vector<int32_t> i;
  std::vector<int64_t> shape;

  static Buf zeros(std::initializer_list<int64_t> dims) {
    Buf b;
    b.shape = dims;
    int64_t n = 1;
    for (auto s : dims) n *= s;
    b.d.assign(static_cast<size_t>(n), 0.0);
    return b;
  }
  static Buf randn(std::initializer_list<int64_t> dims, std::mt19937_64& rng, double scale = 1.0) {
    Buf b = zeros(dims);
    std::normal_distribution<double> n(0.0, scale);
    for (auto& v : b.d) v = n(rng);
    return b;
  }
  static Buf ints(std::initializer_list<int64_t> dims, std::vector<int32_t> values) {
    Buf b;
    b.shape = dims;
    b.i = std::move(values);
    return b;
  }
  Tensor t() {
    Tensor x;
    x.device = Device::cpu;
    x.ndim = static_cast<int>(shape.size());
    for (int k = 0; k < x.ndim; ++k) x.shape[k] = shape[k];
    if (!i.empty()) {
      x.dtype = DType::i32;
      x.data = i.data();
    } else {
      x.dtype = DType::f64;
      x.data = d.data();
    }
    return x;
  }
  // A float32 copy (for float32-vs-float64 comparisons).
  std::vector<float> as_f32() const { return std::vector<float>(d.begin(), d.end()); }
  size_t size() const { return i.empty() ? d.size() : i.size(); }
};

inline Tensor f32_view(std::vector<float>& v, std::initializer_list<int64_t> dims) {
  return Tensor(v.data(), DType::f32, Device::cpu, dims);
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t k = 0; k < a.size(); ++k) s += a[k] * b[k];
  return s;
}

// Central differences of loss() w.r.t. every element of x (or every `stride`-th one), compared
// with analytic: |a - n| <= atol + rtol * max(|a|, |n|).
inline void check_gradient(const std::string& what, std::vector<double>& x, const std::vector<double>& analytic,
                           const std::function<double()>& loss, double rtol = 1e-6, double atol = 1e-8,
                           double eps = 1e-5, size_t stride = 1) {
  REQUIRE(analytic.size() == x.size());
  double worst = 0;
  size_t checked = 0;
  for (size_t k = 0; k < x.size(); k += stride) {
    const double saved = x[k];
    x[k] = saved + eps;
    const double lp = loss();
    x[k] = saved - eps;
    const double lm = loss();
    x[k] = saved;
    const double numeric = (lp - lm) / (2 * eps);
    const double err = std::fabs(analytic[k] - numeric);
    const double bound = atol + rtol * std::max(std::fabs(analytic[k]), std::fabs(numeric));
    worst = std::max(worst, err / bound);
    if (err > bound) {
      INFO(what << "[" << k << "]: analytic " << analytic[k] << " numeric " << numeric);
      CHECK(err <= bound);
    }
    ++checked;
  }
  INFO(what << ": worst error/bound " << worst << " over " << checked << " elements");
  CHECK(checked > 0);
  CHECK(worst <= 1.0);
}

inline void require_close(const std::vector<double>& a, const std::vector<double>& b, double rtol, double atol,
                          const std::string& what) {
  REQUIRE(a.size() == b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    const double bound = atol + rtol * std::max(std::fabs(a[k]), std::fabs(b[k]));
    if (std::fabs(a[k] - b[k]) > bound) {
      INFO(what << "[" << k << "]: " << a[k] << " vs " << b[k]);
      REQUIRE(std::fabs(a[k] - b[k]) <= bound);
    }
  }
}

}  // namespace mt::test

// Helpers for the GPU op tests: every op runs on the CUDA backend and on the reference backend
// (float32) with the same input values, and the outputs are compared by relative L2 error
// ||cuda - ref|| / ||ref||.
//
// Inputs are fresh random numbers per run (std::mt19937_64, seed printed on failure; set
// MT_TEST_SEED to replay one). Values are rounded to the CUDA tensor's dtype first, so both
// backends see identical inputs and the comparison measures the kernels, not the input rounding.
// CUDA outputs are filled with NaN before each op, so an element the kernel fails to write fails
// the comparison.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "engine/backend.h"

namespace mt::gputest {

Backend& dev();       // one CudaBackend (device 0) for the whole test binary
Backend& ref();  // one reference backend

// A device or host buffer owned by a backend, freed on scope exit.
class Buf {
 public:
  Buf() = default;
  Buf(Backend& be, DType dt, std::initializer_list<int64_t> shape);
  Buf(Backend& be, DType dt, const std::vector<int64_t>& shape);
  ~Buf();
  Buf(Buf&& o) noexcept;
  Buf& operator=(Buf&& o) noexcept;
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  Tensor t;
  Backend* be = nullptr;
};

// Host-side conversion of float values into a dtype's bytes and back.
std::vector<uint8_t> encode(DType dt, const std::vector<double>& values);
std::vector<double> decode(DType dt, const uint8_t* bytes, int64_t n);
double round_to(DType dt, double v);  // the value a float stored as dt holds

void upload(Backend& be, const Tensor& t, const std::vector<double>& values);
std::vector<double> download(Backend& be, const Tensor& t);
// Raw bytes of a tensor (for bit-identity checks).
std::vector<uint8_t> download_bytes(Backend& be, const Tensor& t);

// A CUDA tensor and its reference twin (float32, or the same dtype for non-float data) holding the
// same values.
struct Twin {
  Buf cu, ref;
  Tensor c() const { return cu.t; }
  Tensor r() const { return ref.t; }
};
// dtype of the CUDA side; the reference side is float32 for float dtypes, else the same.
Twin twin(DType dt, const std::vector<int64_t>& shape, const std::vector<double>& values);
Twin twin_nan(DType dt, const std::vector<int64_t>& shape);  // outputs: NaN on both sides
// Both sides in dt (for ops the reference runs on any float dtype: cast, init, mixed axpby).
Twin twin_same(DType dt, const std::vector<int64_t>& shape, const std::vector<double>& values);
inline Twin absent() { return Twin{}; }

// Random values.
class Rng {
 public:
  Rng();
  uint64_t seed() const { return seed_; }
  std::vector<double> normal(int64_t n, double std = 1.0);
  std::vector<double> uniform(int64_t n, double lo, double hi);
  std::vector<double> ints(int64_t n, int64_t lo, int64_t hi);  // [lo, hi)
  std::mt19937_64& engine() { return gen_; }

 private:
  uint64_t seed_;
  std::mt19937_64 gen_;
};

// Number of elements (of elem_bytes each) whose bytes differ; a size mismatch counts as all.
// (Tests CHECK this count: Catch2 would print whole vectors compared with ==.)
int64_t differing(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, size_t elem_bytes);

double rel_err(const std::vector<double>& got, const std::vector<double>& want);
// Relative L2 error of the CUDA tensor against the reference tensor.
double rel_err(const Twin& x);
// Row sums of products (a dp of [rows, cols] terms): the rows whose got value is further from want
// than rel times the sum of the row's term magnitudes |term(r, c)| (plus 1e-30). A float32 sum of
// rounded terms errs by a fraction of those magnitudes, however much the terms cancel.
int64_t rows_beyond_term_bound(const std::vector<double>& got, const std::vector<double>& want, int64_t rows,
                               int64_t cols, double rel, const std::function<double(int64_t, int64_t)>& term);

// Tolerance on an output stored in dt (rounding of the result dominates for 16-bit types).
double tol_for(DType dt);

// bfloat16 parameter gradients (--grad-reduce-in-bf16): every element is round_bf16(old + the op's
// float32 contribution), and the backends' contributions differ only by summation order, so an
// element may land one bf16 step away where the two sums straddle a rounding boundary. Checks that
// every element of `got` is a bf16 value (no NaN), within 2^-7 relative (one bf16 step) plus
// 1e-4 * rms(want) absolute of `want`, and that the mean relative error (each element's error over
// max(|want|, 1e-3 * rms(want))) stays below 2^-11, a small fraction of a step: a missing
// accumulation or another rounding (truncation, a second rounding in bf16) fails it.
void check_bf16_grad_close(const std::vector<double>& got, const std::vector<double>& want, const std::string& what);
// The same on a Twin whose two sides are bf16 (twin_same(DType::bf16, ...)): CUDA against reference.
void check_bf16_grad(const Twin& g, const std::string& what);
// Host oracle of one accumulation into a bf16 gradient: round_bf16(float(old) + float(sum)).
double bf16_accumulate(double old, double sum);

// Shorthand for shapes.
using Shape = std::vector<int64_t>;
inline int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// max(start, max |x| as stored) over a tensor of `be`: what an op's amax slot (a tensorwise FP8
// cast's producer, Fp8TensorMeta::fresh) holding `start` must hold after the op wrote x.
inline float max_abs_of(Backend& be, const Tensor& x, float start) {
  float m = start;
  for (double e : download(be, x)) m = std::fmax(m, static_cast<float>(std::fabs(e)));
  return m;
}

// An FP8 cast's scaling state of three float32 [1] tensors (no amax slot, margin 0).
inline Fp8TensorMeta meta_of(Tensor scale, Tensor scale_inv, Tensor amax, Fp8Recipe recipe) {
  Fp8TensorMeta m;
  m.scale = scale, m.scale_inv = scale_inv, m.amax = amax, m.recipe = recipe;
  return m;
}

}  // namespace mt::gputest

// A fresh random generator whose seed is reported with any failure in the enclosing scope.
#define MT_RNG(var)            \
  ::mt::gputest::Rng var;      \
  INFO("random seed " << var.seed() << " (replay with MT_TEST_SEED=" << var.seed() << ")")

// Checks the relative error of a Twin's CUDA side against its reference side.
#define MT_CHECK_CLOSE(twin_, tol_)                                                         \
  do {                                                                                      \
    const double mt_err_ = ::mt::gputest::rel_err(twin_);                                   \
    INFO(#twin_ << ": relative L2 error " << mt_err_ << " (tolerance " << (tol_) << ")");   \
    CHECK(mt_err_ <= (tol_));                                                               \
  } while (0)

// Helpers shared by the reference backend's op files: dtype dispatch and element access.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>

#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "engine/backend.h"

namespace mt::reference {

// Calls f(T{}) with T = float or double, the element type of a data tensor.
template <typename F>
void dispatch_float(const Tensor& t, const char* op, F&& f) {
  switch (t.dtype) {
    case DType::f32: f(float{}); return;
    case DType::f64: f(double{}); return;
    default:
      throw Unsupported(fmt::format("reference backend: {} on {} tensors (float32 and float64 only)", op,
                                    dtype_name(t.dtype)));
  }
}

// Element access for the float32-or-float64 accumulators (statistics, gradients, losses) and for
// any float tensor where speed does not matter (bf16/f16 through the host conversions).
struct Floats {
  void* p = nullptr;
  DType t = DType::f32;

  Floats() = default;
  explicit Floats(const Tensor& x) : p(x.data), t(x.dtype) {}
  bool empty() const { return p == nullptr; }

  double get(int64_t i) const {
    switch (t) {
      case DType::f32: return static_cast<const float*>(p)[i];
      case DType::f64: return static_cast<const double*>(p)[i];
      case DType::bf16: return bf16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
      case DType::f16: return f16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
      case DType::i32: return static_cast<const int32_t*>(p)[i];
      case DType::i16: return static_cast<const int16_t*>(p)[i];
      case DType::fp8_e4m3:
      case DType::fp8_e5m2: return fp8_bits_to_float(t, static_cast<const uint8_t*>(p)[i]);
      default: return NAN;
    }
  }
  void set(int64_t i, double v) const {
    switch (t) {
      case DType::f32: static_cast<float*>(p)[i] = static_cast<float>(v); return;
      case DType::f64: static_cast<double*>(p)[i] = v; return;
      case DType::bf16: static_cast<uint16_t*>(p)[i] = float_to_bf16_bits(static_cast<float>(v)); return;
      case DType::f16: static_cast<uint16_t*>(p)[i] = float_to_f16_bits(static_cast<float>(v)); return;
      case DType::i32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); return;
      case DType::i16: static_cast<int16_t*>(p)[i] = static_cast<int16_t>(v); return;
      case DType::fp8_e4m3:
      case DType::fp8_e5m2: static_cast<uint8_t*>(p)[i] = float_to_fp8_bits(t, static_cast<float>(v)); return;
      default: return;
    }
  }
  // Accumulates in the storage type: float32 accumulators add like the CUDA backend's fp32 adds.
  void add(int64_t i, double v) const {
    if (t == DType::f32) static_cast<float*>(p)[i] += static_cast<float>(v);
    else set(i, get(i) + v);
  }
};

inline void check_float_accumulator(const Tensor& t, const char* op, const char* what) {
  if (t.empty()) return;
  if (t.dtype != DType::f32 && t.dtype != DType::f64)
    fail("reference backend: {}: {} must be float32 or float64, got {}", op, what, dtype_name(t.dtype));
}

// A parameter gradient: float32/float64, or bf16 (--grad-reduce-in-bf16, Megatron's bf16 main grads).
// Ops add their contribution, summed in double, to a bf16 gradient in one rounding (Floats::add),
// as the CUDA backend's float32 sums are rounded once into it.
inline void check_grad_accumulator(const Tensor& t, const char* op, const char* what) {
  if (t.empty()) return;
  if (t.dtype != DType::f32 && t.dtype != DType::f64 && t.dtype != DType::bf16)
    fail("reference backend: {}: gradient {} must be float32, float64 or bf16, got {}", op, what, dtype_name(t.dtype));
}

inline void check_same_dtype(const Tensor& a, const Tensor& b, const char* op) {
  if (!b.empty() && a.dtype != b.dtype)
    fail("reference backend: {}: mixed dtypes {} and {}", op, dtype_name(a.dtype), dtype_name(b.dtype));
}

inline void check_numel(const Tensor& t, int64_t n, const char* op, const char* what) {
  MT_CHECK(t.numel() == n, "{}: {} has {} elements, expected {}", op, what, t.numel(), n);
}

// *amax = max(*amax, max |x| as stored) (amax: optional, float32 [1]; NaN is not a maximum): the
// amax an op takes for the tensorwise FP8 cast of what it wrote (Fp8TensorMeta::fresh).
inline void max_abs_into(Tensor amax, const Tensor& x, const char* op) {
  if (amax.empty()) return;
  MT_CHECK(amax.dtype == DType::f32 && amax.numel() == 1, "{}: the amax must be a float32 [1] tensor, got {} {}", op,
           dtype_name(amax.dtype), amax.shape_string());
  const Floats f(x);
  float m = *amax.ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) m = std::fmax(m, std::fabs(static_cast<float>(f.get(i))));
  *amax.ptr<float>() = m;
}

// Elements selected by optimizer segments: all of x when segments is empty.
template <typename F>
void for_each_segment(const Tensor& x, std::span<const OptimSegment> segments, F&& f) {
  if (segments.empty()) {
    f(OptimSegment{0, x.numel(), 0});
    return;
  }
  for (const OptimSegment& s : segments) {
    MT_CHECK(s.offset >= 0 && s.offset + s.count <= x.numel(), "segment [{}, +{}) outside {} elements",
             s.offset, s.count, x.numel());
    f(s);
  }
}

}  // namespace mt::reference

// Activation functions and their derivatives (float32, host and device), and the dropout
// decision shared by every kernel that drops: the mask is a pure function of (key, flat index),
// so it equals the reference backend's and the backward pass redraws it instead of storing it.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/philox.h"
#include "engine/activation.h"
#include "engine/dropout_mask.h"

namespace mt::cuda {

constexpr float kSqrt1_2 = 0.70710678118654752440f;      // 1/sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;   // 1/sqrt(2*pi)
constexpr float kSqrt2OverPi = 0.79788456080286535588f;  // sqrt(2/pi)
constexpr float kGeluTanhCoeff = 0.044715f;

// erf GeLU: x * Phi(x), Phi(x) = erfc(-x/sqrt 2) / 2. The erfc form keeps full relative precision
// in the negative tail, where 1 + erf(x/sqrt 2) cancels (float32 gelu(-5) was ~10% off that way).
__device__ __forceinline__ float gelu_erf(float x) { return 0.5f * x * erfcf(-x * kSqrt1_2); }
__device__ __forceinline__ float gelu_erf_grad(float x) {
  return 0.5f * erfcf(-x * kSqrt1_2) + x * kInvSqrt2Pi * expf(-0.5f * x * x);
}
// 1 / (1 + e^-x) with the hardware exponential (ex2.approx) and an approximate division: a few
// instructions instead of ~20 for expf and an IEEE division, at a relative error of about
// |x| * 2^-24 (4e-6 at the largest |x| where the result is not 0 or 1). The FP8 casts that apply
// GeLU or SwiGLU on the fly are instruction-bound, and every GPU kernel shares this one form, so
// they agree bit for bit. For x -> -inf the exponential overflows to inf and the quotient is 0.
__device__ __forceinline__ float fast_sigmoid(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }

// tanh approximation (GPT-2's): 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), computed as
// x * s with s = (1 + tanh u) / 2 = sigmoid(2u): again no cancellation for u << 0.
__device__ __forceinline__ float gelu_tanh_gate(float x) {
  const float u = kSqrt2OverPi * (x + kGeluTanhCoeff * x * x * x);
  return fast_sigmoid(2.0f * u);
}
__device__ __forceinline__ float gelu_tanh_grad_from_gate(float x, float s) {
  return s + 2.0f * x * s * (1.0f - s) * kSqrt2OverPi * (1.0f + 3.0f * kGeluTanhCoeff * x * x);
}
__device__ __forceinline__ float gelu_tanh(float x) { return x * gelu_tanh_gate(x); }
__device__ __forceinline__ float gelu_tanh_grad(float x) { return gelu_tanh_grad_from_gate(x, gelu_tanh_gate(x)); }

// Squared ReLU (--squared-relu): relu(x)^2, derivative 2 relu(x). `x < 0 ? 0 : x` keeps a NaN
// input NaN (torch's relu does). For 16-bit inputs r * r and dy * 2r are exact in float32, so the
// results round once, as the reference backend's double math does.
__device__ __forceinline__ float relu(float x) { return x < 0.0f ? 0.0f : x; }
__device__ __forceinline__ float squared_relu(float x) { return relu(x) * relu(x); }
__device__ __forceinline__ float squared_relu_grad(float x) { return 2.0f * relu(x); }

// The ungated activations by Activation (never none). The kernels pass it at run time (one branch,
// the same for every thread) or as a template argument.
__device__ __forceinline__ float act_value(float x, Activation a) {
  switch (a) {
    case Activation::gelu_tanh: return gelu_tanh(x);
    case Activation::squared_relu: return squared_relu(x);
    default: return gelu_erf(x);
  }
}
__device__ __forceinline__ float act_grad(float x, Activation a) {
  switch (a) {
    case Activation::gelu_tanh: return gelu_tanh_grad(x);
    case Activation::squared_relu: return squared_relu_grad(x);
    default: return gelu_erf_grad(x);
  }
}

// act(x) and act'(x) from one erf (tanh) evaluation: the backward that recomputes the forward's
// activation. The same operations as act_value() and act_grad(), so the same bits.
__device__ __forceinline__ void act_and_grad(float x, Activation a, float& y, float& dy) {
  if (a == Activation::gelu_tanh) {
    const float s = gelu_tanh_gate(x);
    y = x * s;
    dy = gelu_tanh_grad_from_gate(x, s);
  } else if (a == Activation::squared_relu) {
    y = squared_relu(x);
    dy = squared_relu_grad(x);
  } else {
    const float c = erfcf(-x * kSqrt1_2);
    y = 0.5f * x * c;
    dy = 0.5f * c + x * kInvSqrt2Pi * expf(-0.5f * x * x);
  }
}

__device__ __forceinline__ float sigmoid(float x) { return fast_sigmoid(x); }

// SwiGLU of one (gate, up) pair: silu(gate) * up.
__device__ __forceinline__ float swiglu_value(float gate, float up) { return gate * sigmoid(gate) * up; }
// SwiGLU's backward for one (gate, up) pair and the output gradient dy.
__device__ __forceinline__ void swiglu_grad(float gate, float up, float dy, float& dgate, float& dup) {
  const float s = sigmoid(gate);
  const float silu = gate * s;
  dup = dy * silu;
  dgate = dy * up * s * (1.0f + gate * (1.0f - s));
}

// The gated unit of engine/activation.h's Glu: SwiGLU's exact expressions above when plain;
// otherwise the halves clamped, quick-GeLU (x sigmoid(1.702 x)) or SiLU on the gate, the linear
// half plus the offset; the gradients 0 where a half was clamped.
__device__ __forceinline__ float glu_value(const Glu& q, float gate, float up) {
  if (q.plain()) return swiglu_value(gate, up);
  const float g = q.clamp > 0.0f ? fminf(gate, q.clamp) : gate;
  const float u = q.clamp > 0.0f ? fminf(fmaxf(up, -q.clamp), q.clamp) : up;
  const float a = q.quick_gelu ? 1.702f : 1.0f;
  return g * sigmoid(a * g) * (u + q.offset);
}
__device__ __forceinline__ void glu_grad(const Glu& q, float gate, float up, float dy, float& dgate, float& dup) {
  if (q.plain()) return swiglu_grad(gate, up, dy, dgate, dup);
  const bool clamp = q.clamp > 0.0f;
  const float g = clamp ? fminf(gate, q.clamp) : gate;
  const float u = clamp ? fminf(fmaxf(up, -q.clamp), q.clamp) : up;
  const float a = q.quick_gelu ? 1.702f : 1.0f;
  const float s = sigmoid(a * g);
  const bool g_in = !clamp || gate <= q.clamp, u_in = !clamp || (up >= -q.clamp && up <= q.clamp);
  dup = u_in ? dy * g * s : 0.0f;
  dgate = g_in ? dy * (u + q.offset) * s * (1.0f + a * g * (1.0f - s)) : 0.0f;
}

// Dropout (engine/dropout_mask.h): element `index` is kept iff dropout_keep(key, index, p), then
// scaled by 1/(1-p); p == 0 draws nothing.
// The factors of elements [base, base + n) with base % n == 0 and n dividing 8: they share one
// draw (engine/dropout_mask.h), drawn here once; at(index) for an index of that range.
struct DropoutGroup {
  Philox4 r{};
  uint32_t threshold = 0;
  float keep_scale = 1.0f;
  bool on = false;
  __device__ __forceinline__ DropoutGroup(uint64_t key, uint64_t base, float p, float scale)
      : threshold(dropout_threshold(p)), keep_scale(scale), on(p > 0.0f) {
    if (on) r = dropout_words(key, base / 8);
  }
  __device__ __forceinline__ float at(uint64_t index) const {
    if (!on) return 1.0f;
    return dropout_bits(r, index) >= threshold ? keep_scale : 0.0f;
  }
};
// residual + v * factor as one explicit FMA: the fused bias-dropout-add + norm kernels and the
// separate bias_dropout_add must round the same way (the compiler may or may not contract
// `r + v * factor` through the select of the factor; bits then differed in ~1e-5 of elements).
__device__ __forceinline__ float dropout_add(float residual, float v, float factor) {
  return __fmaf_rn(v, factor, residual);
}
inline float dropout_keep_scale(float p) { return p < 1.0f ? 1.0f / (1.0f - p) : 0.0f; }

}  // namespace mt::cuda

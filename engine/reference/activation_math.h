// Scalar activation functions and their derivatives, in double (the reference's precision).
#pragma once

#include <algorithm>
#include <cmath>

#include "engine/backend.h"

namespace mt::reference {

constexpr double kSqrt2OverPi = 0.7978845608028654;  // sqrt(2/pi)
constexpr double kInvSqrt2 = 0.7071067811865476;
constexpr double kInvSqrt2Pi = 0.3989422804014327;   // 1/sqrt(2 pi)
constexpr double kGeluTanhCoeff = 0.044715;

// GeLU, erf form: x * Phi(x) with Phi(x) = erfc(-x/sqrt 2) / 2 (erfc: no cancellation in the
// negative tail, where 1 + erf(x/sqrt 2) loses all digits below x ~ -8 even in double).
inline double gelu_erf(double x) { return 0.5 * x * std::erfc(-x * kInvSqrt2); }
inline double gelu_erf_grad(double x) {
  return 0.5 * std::erfc(-x * kInvSqrt2) + x * kInvSqrt2Pi * std::exp(-0.5 * x * x);
}

// GeLU, tanh approximation (--openai-gelu): 0.5 x (1 + tanh(u)) = x * sigmoid(2u).
inline double gelu_tanh_gate(double x) {
  const double u = kSqrt2OverPi * (x + kGeluTanhCoeff * x * x * x);
  return 1.0 / (1.0 + std::exp(-2.0 * u));
}
inline double gelu_tanh(double x) { return x * gelu_tanh_gate(x); }
inline double gelu_tanh_grad(double x) {
  const double s = gelu_tanh_gate(x);
  return s + 2.0 * x * s * (1.0 - s) * kSqrt2OverPi * (1.0 + 3.0 * kGeluTanhCoeff * x * x);
}

// Squared ReLU (--squared-relu, Megatron's squared_relu: relu(x)^2). `x < 0 ? 0 : x` keeps a NaN
// input NaN, as torch's relu does.
inline double relu(double x) { return x < 0.0 ? 0.0 : x; }
inline double squared_relu(double x) { return relu(x) * relu(x); }
inline double squared_relu_grad(double x) { return 2.0 * relu(x); }

inline double activate(Activation act, double x) {
  switch (act) {
    case Activation::gelu: return gelu_erf(x);
    case Activation::gelu_tanh: return gelu_tanh(x);
    case Activation::squared_relu: return squared_relu(x);
    case Activation::none: break;
  }
  return x;
}
inline double activation_grad(Activation act, double x) {
  switch (act) {
    case Activation::gelu: return gelu_erf_grad(x);
    case Activation::gelu_tanh: return gelu_tanh_grad(x);
    case Activation::squared_relu: return squared_relu_grad(x);
    case Activation::none: break;
  }
  return 1.0;
}

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// The gated unit in double (engine/activation.h Glu): value y and the gradients of y w.r.t. the
// gate and up inputs; plain SwiGLU keeps its own expressions (swiglu_forward / _backward_rows).
struct GluEval {
  double y, dgate, dup;
};
inline GluEval glu_eval(const Glu& q, double gate, double up) {
  const bool clamp = q.clamp > 0;
  const double c = q.clamp;
  const double g = clamp ? std::min(gate, c) : gate, u = clamp ? std::clamp(up, -c, c) : up;
  const double a = q.quick_gelu ? 1.702 : 1.0, s = 1.0 / (1.0 + std::exp(-a * g)), lin = u + q.offset;
  const bool g_in = !clamp || gate <= c, u_in = !clamp || (up >= -c && up <= c);
  return {g * s * lin, g_in ? lin * s * (1.0 + a * g * (1.0 - s)) : 0.0, u_in ? g * s : 0.0};
}

}  // namespace mt::reference

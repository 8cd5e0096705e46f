// Scalar activation functions and their derivatives, in double (the reference's precision).
#pragma once

#include <cmath>

#include "engine/backend.h"

namespace mt::reference {

constexpr double kSqrt2OverPi = 0.7978845608028654;  // sqrt(2/pi)
constexpr double kInvSqrt2 = 0.7071067811865476;
constexpr double kInvSqrt2Pi = 0.3989422804014327;   // 1/sqrt(2 pi)
constexpr double kGeluTanhCoeff = 0.044715;

// GeLU, erf form: x * Phi(x).
inline double gelu_erf(double x) { return 0.5 * x * (1.0 + std::erf(x * kInvSqrt2)); }
inline double gelu_erf_grad(double x) {
  return 0.5 * (1.0 + std::erf(x * kInvSqrt2)) + x * kInvSqrt2Pi * std::exp(-0.5 * x * x);
}

// GeLU, tanh approximation (--openai-gelu).
inline double gelu_tanh(double x) {
  return 0.5 * x * (1.0 + std::tanh(kSqrt2OverPi * (x + kGeluTanhCoeff * x * x * x)));
}
inline double gelu_tanh_grad(double x) {
  const double t = std::tanh(kSqrt2OverPi * (x + kGeluTanhCoeff * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * kSqrt2OverPi * (1.0 + 3.0 * kGeluTanhCoeff * x * x);
}

inline double activate(Activation act, double x) {
  switch (act) {
    case Activation::gelu: return gelu_erf(x);
    case Activation::gelu_tanh: return gelu_tanh(x);
    case Activation::none: break;
  }
  return x;
}
inline double activation_grad(Activation act, double x) {
  switch (act) {
    case Activation::gelu: return gelu_erf_grad(x);
    case Activation::gelu_tanh: return gelu_tanh_grad(x);
    case Activation::none: break;
  }
  return 1.0;
}

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

}  // namespace mt::reference

// The activation kinds the backends apply: of a linear layer's output and between fc1 and fc2.
#pragma once

namespace mt {

// The activation of a linear layer's output (linear_forward's act) and of activation_forward:
// GeLU (erf), GeLU (tanh approximation) or squared ReLU (--squared-relu: relu(x)^2).
enum class Activation { none, gelu, gelu_tanh, squared_relu };
// The MLP activation between fc1 and fc2, as fp8_quantize_activation applies it to fc1's output:
// gelu / gelu_tanh / squared_relu as activation_forward, swiglu as swiglu_forward ([gate | up] per
// row).
enum class MlpActivation { gelu, gelu_tanh, swiglu, squared_relu };
// The elementwise Activation of an ungated MLP activation (not swiglu).
inline Activation ungated_activation(MlpActivation a) {
  switch (a) {
    case MlpActivation::gelu_tanh: return Activation::gelu_tanh;
    case MlpActivation::squared_relu: return Activation::squared_relu;
    default: return Activation::gelu;
  }
}

// The gated linear unit of a gated MLP (SwiGLU's place): out = act(g) * (u + offset) of each row's
// [g | u] halves, with act SiLU (--swiglu) or quick-GeLU x sigmoid(1.702 x) (--quick-geglu), and
// with clamp > 0 (--activation-func-clamp-value) g clamped to at most clamp and u to [-clamp, clamp]
// first (their gradients 0 where clamped), as Megatron-LM's GLU and its fused kernels compute it.
// The default is plain SwiGLU.
struct Glu {
  bool quick_gelu = false;
  float offset = 0;  // --glu-linear-offset
  float clamp = 0;   // --activation-func-clamp-value (0: none)
  constexpr bool plain() const { return !quick_gelu && offset == 0 && clamp == 0; }  // (device code too)
};

}  // namespace mt

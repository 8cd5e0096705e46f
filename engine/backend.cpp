#include "engine/backend.h"

#include "core/error.h"

namespace mt {

void Backend::qk_norm_forward(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, const RopeShape&,
                              const NormParams&) {
  throw Unsupported("--qk-layernorm is not implemented by the " + name() + " backend yet");
}

void Backend::qk_norm_backward(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                               Tensor, const RopeShape&, const NormParams&) {
  throw Unsupported("--qk-layernorm is not implemented by the " + name() + " backend yet");
}

}  // namespace mt

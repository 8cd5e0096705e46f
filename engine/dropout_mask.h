// Random draws shared by the reference and CUDA backends (host and device): dropout decisions and
// the MoE router's input jitter factors.
//
// Element `index` of a dropout site with key `key` is kept when uniform_at(key, index) > p, and a
// kept element is scaled by 1 / (1 - p): the rule of engine/attention_dropout.h and the CUDA kernels.
// Nothing is stored: backward passes redraw the same mask from the same key. The index of an
// element is documented by each op in engine/backend.h (flat index of the tensor for the
// elementwise ops; ((i*heads + h)*seq + q)*seq + k for attention).
#pragma once

#include <cstdint>

#include "core/philox.h"

namespace mt {

MT_HOST_DEVICE bool dropout_keep(uint64_t key, uint64_t index, float p) {
  return uniform_at(key, index) > p;
}

// Backend::moe_jitter's factor of element `index`: (1 - eps) + (2 eps) u, rounded step by step in
// float32 (no fused multiply-add on the device), so both backends draw the same factors.
MT_HOST_DEVICE float moe_jitter_factor(uint64_t key, uint64_t index, float eps) {
  const float u = uniform_at(key, index);
#if defined(__CUDA_ARCH__)
  return __fadd_rn(1.0f - eps, __fmul_rn(2.0f * eps, u));
#else
  return (1.0f - eps) + (2.0f * eps) * u;
#endif
}

}  // namespace mt

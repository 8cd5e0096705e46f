// Dropout decisions shared by the reference and CUDA backends (host and device).
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

}  // namespace mt

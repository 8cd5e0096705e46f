// GQA run as per-query-head attention (one of the layouts cuDNN's attention is timed in, see
// attention_cudnn.cpp): the per-query-head dK and dV summed back into their KV group's slots of the
// packed dqkv rows.
//
// A per-head buffer has the attention output's layout: [rows, heads * d], row = position * batch +
// sample (as the packed QKV rows), query head g * (heads / groups) + j of KV group g. 16-bit
// activations only (cuDNN's); d is a multiple of 8 (cuDNN's rule), so every access is 16 bytes.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "core/dtype.h"
#include "engine/backend.h"

namespace mt::cuda::kv_heads {

// Bytes of one per-head buffer (dK or dV) of this shape.
size_t buffer_bytes(const AttentionShape& a, DType dtype);

// dqkv's k / v slot of group g = the sum over the group's query heads of dk_heads / dv_heads
// (float32 sum, one rounding); dqkv's q slots are not touched.
void sum_grads(void* dqkv, const void* dk_heads, const void* dv_heads, const AttentionShape& a, DType dtype,
               cudaStream_t stream);

}  // namespace mt::cuda::kv_heads

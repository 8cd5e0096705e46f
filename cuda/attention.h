// Causal GQA attention on the GPU, flash-style: forward and backward on packed QKV rows (layout in
// engine/backend.h). Implemented in cuda/attention_*.cu; CudaBackend dispatches here according to
// --attention-backend (our own kernel, or cuDNN's fused attention).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "core/config.h"
#include "core/tensor.h"
#include "engine/backend.h"

namespace mt::cuda {

// Workspace in bytes that attention needs for this shape (allocated once, up front, by the caller).
size_t attention_workspace_bytes(const AttentionShape& a, AttentionBackend backend);

void attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a, AttentionBackend backend,
                       void* workspace, size_t workspace_bytes, cudaStream_t stream);
void attention_backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a,
                        AttentionBackend backend, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace mt::cuda

// The generic attention kernels: flash-style (tiled, online softmax, scores never in memory),
// CUDA cores only, float32 arithmetic throughout, for the shapes our tensor-core kernels do not
// compile: float32 activations (any head dim) and 16-bit activations with head dims other than 64
// and 128. Any head dim from 1 to 256, GQA, causal or not, megatrain's attention dropout; the
// backward is deterministic (two kernels, each gradient summed in a fixed order, no atomics).
//
// Precision: float32 storage and float32 sums, no TF32. Speed is secondary here (the fast paths
// are cuDNN and the mma.sync kernels): expect a few TFLOP/s.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "core/tensor.h"
#include "engine/backend.h"

namespace mt::cuda::generic {

constexpr int kMaxHeadDim = 256;

bool supports_head_dim(int head_dim);
// Backward workspace: delta = rowsum(dO * O) per query row, float32 [b, heads, s].
size_t backward_workspace_bytes(const AttentionShape& a);

// Same contracts as cuda/attention.h's entry points (qkv packed rows, out [N, heads*d], lse float32
// [b, heads, s]); activations float32, bfloat16 or float16.
void forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a, cudaStream_t stream);
void backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a, void* workspace,
              size_t workspace_bytes, cudaStream_t stream);

}  // namespace mt::cuda::generic

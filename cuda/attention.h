// Causal GQA attention on the GPU, flash-style: forward and backward on packed QKV rows (layout in
// engine/backend.h). CudaBackend dispatches here according to --attention-backend:
//   flash  our own kernels, GQA, dropout, deterministic backward: the tensor-core ones
//          (cuda/attention_flash*.cu) for head dims 64 and 128 in bf16/fp16, the generic CUDA-core
//          ones (cuda/attention_generic.cu) for float32 and every other head dim up to 256.
//   fused  cuDNN's fused attention (cuda/attention_cudnn.cpp): bf16/fp16, MHA and GQA, sliding
//          windows, dropout with cuDNN's own mask (not the reference backend's draws); no packed
//          documents.
//   auto   per head dim, whichever bench_attention measured faster (flash where fused cannot).
//   unfused, local: refused (megatrain has no materialized-scores attention).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/config.h"
#include "core/tensor.h"
#include "engine/backend.h"

namespace mt::cuda {

// The implementation `requested` means for this shape; throws mt::Unsupported (naming the flag)
// for what cannot run. May build cuDNN plans (set-up time).
AttentionBackend resolve_attention_backend(const AttentionShape& a, AttentionBackend requested, DType dtype);

// Whether cuDNN's fused attention handles this shape (builds and caches its plans on first call).
bool fused_attention_supported(const AttentionShape& a, DType dtype);

// Workspace in bytes that attention needs for this shape (allocated once, up front, by the caller;
// 256-byte aligned). Builds cuDNN plans when the fused path is selected.
size_t attention_workspace_bytes(const AttentionShape& a, AttentionBackend backend, DType dtype = DType::bf16);

// ", sliding window of N keys" for a windowed shape, "" otherwise (for the descriptions).
std::string window_text(const AttentionShape& a);

// Packed documents: the shape's doc_start as a device pointer for the kernels (checked: device
// int32 [b * s]), or null without documents. Causal: query t sees keys doc_start[t] .. t; not
// causal (a context-parallel block of earlier keys): keys doc_start[t] .. s - 1, possibly none.
const int32_t* document_starts(const AttentionShape& a);

// One line for the start-up log: which implementation runs this shape and how.
std::string describe_attention(const AttentionShape& a, AttentionBackend backend, DType dtype);

void attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a, AttentionBackend backend,
                       void* workspace, size_t workspace_bytes, cudaStream_t stream);
// Overwrites all of dqkv (q, k and v slots).
void attention_backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a,
                        AttentionBackend backend, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace mt::cuda

// cuDNN's fused attention (`--attention-backend fused`) through the raw backend Graph API.
//
// cuDNN 9.14 (the runtime we target) has a dedicated SDPA forward operation but no causal mask
// for it (that needs the 9.21 subgraph attribute) and no SDPA backward operation (9.17), so both
// passes are expressed as the composite graphs cuDNN's flash-attention engines recognize:
//   forward:  S = Q K^T * scale -> causal mask -> softmax with stats -> O = P V
//   backward: the FA2 chain (delta = rowsum(dO*O), P from stats, dV, dP, dS, dK, dQ).
// q/k/v are read straight from the packed rows through strides; GQA folds the KV group into the
// batch dimension, which makes every stride uniform (Dims in the .cpp), and sums dK/dV over the
// group's query heads with reductions in the backward graph.
// Plans are built once per shape (supported() / workspace_bytes() at set-up) and cached.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "core/tensor.h"
#include "engine/backend.h"

namespace mt::cuda::cudnn_attention {

// Builds (once) the forward and backward plans for this shape; false, with the reason in *why, if
// the shape is outside what this path handles or cuDNN has no engine for it.
bool supported(const AttentionShape& a, DType dtype, std::string* why = nullptr);
size_t workspace_bytes(const AttentionShape& a, DType dtype);
// One line for the start-up log: the version, the backward's dQ algorithm, the workspace.
std::string describe(const AttentionShape& a, DType dtype);
int runtime_version();  // cudnnGetVersion(), e.g. 91400

void forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a, void* workspace, size_t workspace_bytes,
             cudaStream_t stream);
void backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a,
              void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace mt::cuda::cudnn_attention

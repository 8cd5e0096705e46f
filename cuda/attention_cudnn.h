// cuDNN's fused attention (`--attention-backend fused`) through the raw backend Graph API.
//
// cuDNN 9.14 (the runtime we target) has a dedicated SDPA forward operation but no causal mask
// for it (that needs the 9.21 subgraph attribute) and no SDPA backward operation (9.17), so both
// passes are expressed as the composite graphs cuDNN's flash-attention engines recognize:
//   forward:  S = Q K^T * scale -> causal mask -> softmax with stats -> O = P V
//   backward: the FA2 chain (delta = rowsum(dO*O), P from stats, dV, dP, dS, dK, dQ).
// q/k/v are read straight from the packed rows through strides; GQA folds the KV group into the
// batch dimension, which makes every stride uniform (Dims in the .cpp). GQA's K/V then have two
// layouts: shared (cuDNN sums dK/dV over the group's query heads in the backward graph), or one
// K/V head per query head (a zero stride), with dK/dV per query head summed by our kernel
// (attention_kv_heads.h).
// Dropout: cuDNN draws its own keep mask (the RNG operation of cudnn-frontend's SDPA graphs:
// Philox seeded with the shape's dropout_key, offset 0) and redraws it in the backward; the mask is
// cuDNN's, not engine/attention_dropout.h's, so runs with dropout differ from the reference
// backend's and the flash kernels' draws (each a valid dropout of probability p), sliding windows
// included (cuDNN 9.10.2 and newer take the pair).
// Plans are built once per shape (supported() / workspace_bytes() at set-up) and cached: every
// layout and engine configuration that builds is a candidate, and the first call of each pass
// times them on its own buffers and keeps the fastest (not under --deterministic-mode: then the
// shared layout's smallest-workspace plan, untimed).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "engine/backend.h"

namespace mt::cuda::cudnn_attention {

// Builds (once) the forward and backward plans for this shape; false, with the reason in *why, if
// the shape is outside what this path handles or cuDNN has no engine for it.
bool supported(const AttentionShape& a, DType dtype, std::string* why = nullptr);
size_t workspace_bytes(const AttentionShape& a, DType dtype);
// One line for the start-up log: the version, how the candidates are chosen, the workspace.
std::string describe(const AttentionShape& a, DType dtype);
// The candidates chosen (with their times), or "not chosen yet", and the layouts cuDNN refused.
std::string chosen(const AttentionShape& a, DType dtype);

// For tests and benchmarks: each pass's candidates by name, and pinning one (-1: time them again
// at the next call).
std::vector<std::string> forward_candidates(const AttentionShape& a, DType dtype);
std::vector<std::string> backward_candidates(const AttentionShape& a, DType dtype);
void pin_candidates(const AttentionShape& a, DType dtype, int forward_index, int backward_index);
int runtime_version();  // cudnnGetVersion(), e.g. 91400

void forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a, void* workspace, size_t workspace_bytes,
             cudaStream_t stream);
void backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a,
              void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Writes dropout's Philox state for the graphs (int64 seed = key, int64 offset = 0) on the stream.
void write_philox_state(void* seed, void* offset, uint64_t key, cudaStream_t stream);

}  // namespace mt::cuda::cudnn_attention

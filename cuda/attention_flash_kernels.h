// Glue between the flash attention host code (attention_flash.cu) and the kernel files: each
// dispatch launches the compiled variant matching (d, config) and returns false if there is none.
#pragma once

#include <cuda_runtime.h>

#include "cuda/attention_flash.h"
#include "cuda/attention_flash_common.cuh"

namespace mt::cuda::flash {

template <typename Elem, bool DROPOUT>
bool forward_dispatch(const Params& p, int head_dim, const ForwardConfig& config, cudaStream_t stream);

// Runs the whole backward: delta = rowsum(dO * O), the turn counters' reset, the main kernel.
template <typename Elem, bool DROPOUT>
bool backward_dispatch(const Params& p, int head_dim, const BackwardConfig& config, cudaStream_t stream);

// Backward workspace layout; dq_accum rows are padded to kDqRowPad so that every block size fits.
constexpr int kDqRowPad = 128;
constexpr int kMinBlockM = 32;
constexpr int kMaxWarps = 8;  // backward: BN <= 128 keys per CTA, one warp per 16

}  // namespace mt::cuda::flash

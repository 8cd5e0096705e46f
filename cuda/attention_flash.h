// Our flash attention kernels (mma.sync, FA2-style), behind cuda/attention.h's `flash` backend.
// The tile configuration is a parameter so that bench_attention can measure the compiled
// alternatives; attention.h's entry points use default_*_config().
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "engine/backend.h"

namespace mt::cuda::flash {

struct ForwardConfig {
  int block_m = 0, block_n = 0, warps = 0;  // query rows per CTA, keys per step, warps per CTA
  std::string name() const;
};
struct BackwardConfig {
  int block_m = 0, block_n = 0;  // query rows per step, keys per CTA (one warp per 16 keys)
  // false: dq by float atomics in arrival order (FA2's way; not deterministic), compiled for the
  // 64x128 tiles of bf16 without dropout only, to measure what the deterministic order costs.
  bool deterministic = true;
  std::string name() const;
};

// Head dims with compiled kernels; every other d is refused with a clear error.
bool supports_head_dim(int head_dim);
ForwardConfig default_forward_config(int head_dim, bool dropout);
BackwardConfig default_backward_config(int head_dim, bool dropout);
// All compiled bf16 configurations (the defaults first; the backward's non-deterministic ones
// last), for benchmarks and tests; with dropout the ones compiled with it.
std::vector<ForwardConfig> forward_configs(int head_dim, bool dropout = false);
std::vector<BackwardConfig> backward_configs(int head_dim, bool dropout = false);

// Validates shape, dtypes and alignment; fails with a message naming what is wrong.
void check_shape(const AttentionShape& a, Tensor qkv, Tensor out, Tensor lse);

size_t backward_workspace_bytes(const AttentionShape& a);

void forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a, const ForwardConfig& config,
             cudaStream_t stream);
// Deterministic: dk/dv are summed in a fixed order inside one CTA, dq in a fixed order across CTAs.
void backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a,
              const BackwardConfig& config, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace mt::cuda::flash

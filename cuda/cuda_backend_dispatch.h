// What every CudaBackend op file (cuda_backend.cu, cuda_backend_fp8.cu) starts an op with: the op
// profiler's scope and the check that the tensors are device memory. Internal to those files.
#pragma once

#include <fmt/format.h>

#include "core/error.h"
#include "core/tensor.h"
#include "cuda/op_profiler.h"

// GPU time of this op under MEGATRAIN_PROFILE_OPS (cuda/op_profiler.h); the label is formatted
// only while profiling. Used inside CudaBackend members (profiler_).
#define MT_PROFILE_OP(...)                                                                            \
  const cuda::OpProfiler::Scope mt_profile_scope_ =                                                   \
      profiler_->active() ? profiler_->scope(fmt::format(__VA_ARGS__)) : cuda::OpProfiler::Scope()

namespace mt::cuda_dispatch {

template <typename... Ts>
void on_device(const char* what, const Ts&... ts) {
  for (const Tensor* t : {&ts...})
    if (!t->empty() && t->device != Device::cuda)
      fail("{}: tensor {} is host memory; the CUDA backend works on device tensors", what, t->shape_string());
}

}  // namespace mt::cuda_dispatch

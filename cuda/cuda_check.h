// Error checks for CUDA runtime, cuBLASLt and cuDNN calls: a failure becomes an mt::Error naming
// the call and the place (file:line), never an abort without a message.
#pragma once

#include <cuda_runtime.h>

#include "core/error.h"

#define MT_CUDA_CHECK(expr)                                                                         \
  do {                                                                                              \
    cudaError_t mt_err_ = (expr);                                                                   \
    if (mt_err_ != cudaSuccess)                                                                     \
      ::mt::fail("CUDA error {} ({}) in {} at {}:{}", static_cast<int>(mt_err_), cudaGetErrorString(mt_err_), \
                 #expr, __FILE__, __LINE__);                                                        \
  } while (0)

// After every kernel launch: catches bad launch configurations at the launch site.
#define MT_CUDA_CHECK_LAUNCH() MT_CUDA_CHECK(cudaGetLastError())

// The normalized value y = (x - mean) * rstd * w + b with one rounding order, shared by the norm
// kernels (forward, and the backward's recomputation of the output) and by the FP8 cast that
// quantizes a norm's output from its input and statistics (fp8_kernels.cu, NormInput): all of
// them give the same bits.
#pragma once

namespace mt::cuda {

__device__ __forceinline__ float norm_xhat(float x, float mean, float rstd) {
  return __fmul_rn(__fsub_rn(x, mean), rstd);
}
__device__ __forceinline__ float norm_apply(float xhat, float w) { return __fmul_rn(xhat, w); }
__device__ __forceinline__ float norm_apply(float xhat, float w, float b) { return __fmaf_rn(xhat, w, b); }

}  // namespace mt::cuda

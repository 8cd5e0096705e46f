// Layout-independent normal initialization: element i of a shard gets
// std * normal_at(key, global index of i), the very function the host (reference backend) uses,
// so a shard made on the GPU holds the same bits as the matching slice made on the CPU. The
// uniform init likewise (lo + (hi - lo) * uniform_at, rounded as the host rounds it; its log
// comes from logf, within one float32 step of the host's).
#include "core/philox.h"
#include "core/shard.h"
#include "cuda/cuda_check.h"
#include "cuda/device_utils.cuh"
#include "cuda/kernels.h"

namespace mt::cuda {
namespace {

template <typename T>
__global__ void init_normal_kernel(T* out, int64_t n, uint64_t key, float std, ShardIndex index) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = std * normal_at(key, static_cast<uint64_t>(shard_global_index(index, i)));
    out[i] = from_float<T>(v);
  }
}

// range = hi - lo (float32, as the host computes it); the product and the sum rounded separately
// (no fused multiply-add), as on the host.
template <typename T>
__global__ void init_uniform_kernel(T* out, int64_t n, uint64_t key, float lo, float range, bool log_of,
                                    ShardIndex index) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float u = uniform_at(key, static_cast<uint64_t>(shard_global_index(index, i)));
    const float v = __fadd_rn(lo, __fmul_rn(range, u));
    out[i] = from_float<T>(log_of ? ::logf(v) : v);
  }
}

}  // namespace

void init_normal(const KernelContext& ctx, Tensor t, uint64_t key, float std, const ShardIndex& index) {
  const int64_t n = t.numel();
  MT_CHECK(index.local_numel() == n, "init_normal: shard index covers {} elements, tensor {} has {}",
           index.local_numel(), t.shape_string(), n);
  if (n == 0) return;
  const unsigned grid = grid_for(n, 256, static_cast<int64_t>(ctx.num_sms) * 16);
  switch (t.dtype) {
    case DType::f32: init_normal_kernel<<<grid, 256, 0, ctx.stream>>>(t.ptr<float>(), n, key, std, index); break;
    case DType::f64: init_normal_kernel<<<grid, 256, 0, ctx.stream>>>(t.ptr<double>(), n, key, std, index); break;
    case DType::bf16: init_normal_kernel<<<grid, 256, 0, ctx.stream>>>(t.ptr<bf16>(), n, key, std, index); break;
    case DType::f16: init_normal_kernel<<<grid, 256, 0, ctx.stream>>>(t.ptr<f16>(), n, key, std, index); break;
    default: fail("init_normal: dtype {} is not a float type", dtype_name(t.dtype));
  }
  MT_CUDA_CHECK_LAUNCH();
}

void init_uniform(const KernelContext& ctx, Tensor t, uint64_t key, float lo, float hi, bool log_of,
                  const ShardIndex& index) {
  const int64_t n = t.numel();
  MT_CHECK(index.local_numel() == n, "init_uniform: shard index covers {} elements, tensor {} has {}",
           index.local_numel(), t.shape_string(), n);
  if (n == 0) return;
  const unsigned grid = grid_for(n, 256, static_cast<int64_t>(ctx.num_sms) * 16);
  const float range = hi - lo;
  switch (t.dtype) {
    case DType::f32:
      init_uniform_kernel<<<grid, 256, 0, ctx.stream>>>(t.ptr<float>(), n, key, lo, range, log_of, index);
      break;
    case DType::f64:
      init_uniform_kernel<<<grid, 256, 0, ctx.stream>>>(t.ptr<double>(), n, key, lo, range, log_of, index);
      break;
    case DType::bf16:
      init_uniform_kernel<<<grid, 256, 0, ctx.stream>>>(t.ptr<bf16>(), n, key, lo, range, log_of, index);
      break;
    case DType::f16:
      init_uniform_kernel<<<grid, 256, 0, ctx.stream>>>(t.ptr<f16>(), n, key, lo, range, log_of, index);
      break;
    default: fail("init_uniform: dtype {} is not a float type", dtype_name(t.dtype));
  }
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda

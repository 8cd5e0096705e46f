// Device-side helpers shared by the CUDA kernels: element types and their float conversions,
// 16-byte vector loads/stores, warp/block reductions, and the dtype dispatch used by launchers.
// Every kernel computes in float32 and converts at the load/store boundary.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/error.h"
#include "core/tensor.h"

namespace mt::cuda {

using bf16 = __nv_bfloat16;
using f16 = __half;

constexpr int kWarp = 32;

// ---- conversions ------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<double>(double v) { return static_cast<float>(v); }
template <>
__device__ __forceinline__ float to_float<bf16>(bf16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<f16>(f16 v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ double from_float<double>(float v) { return v; }
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ f16 from_float<f16>(float v) { return __float2half_rn(v); }

// A parameter gradient's element += v (engine/backend.h: gradients accumulate). float32: as is.
// bfloat16 (--grad-reduce-in-bf16): the stored value plus v in float32, rounded once to nearest even.
template <typename G>
__device__ __forceinline__ void grad_add(G* p, float v) {
  if constexpr (std::is_same_v<G, float>) *p += v;
  else *p = from_float<G>(to_float(*p) + v);
}

// ---- N-element vectors: one 16-byte access when N * sizeof(T) is a multiple of 16 -------------
// The caller guarantees 16-byte alignment of p + i when it takes the vector path (checked on the
// host: base pointers aligned and row widths multiples of N).
template <int N>
struct Floats {
  float v[N];
};

template <int N, typename T>
__device__ __forceinline__ Floats<N> load_vec(const T* p) {
  Floats<N> r;
  if constexpr ((N * sizeof(T)) % 16 == 0) {
    constexpr int kPer = 16 / sizeof(T);
#pragma unroll
    for (int c = 0; c < N / kPer; ++c) {
      const int4 raw = *reinterpret_cast<const int4*>(p + c * kPer);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < kPer; ++j) r.v[c * kPer + j] = to_float(e[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) r.v[j] = to_float(p[j]);
  }
  return r;
}

template <int N, typename T>
__device__ __forceinline__ void store_vec(T* p, const Floats<N>& x) {
  if constexpr ((N * sizeof(T)) % 16 == 0) {
    constexpr int kPer = 16 / sizeof(T);
#pragma unroll
    for (int c = 0; c < N / kPer; ++c) {
      int4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int j = 0; j < kPer; ++j) e[j] = from_float<T>(x.v[c * kPer + j]);
      *reinterpret_cast<int4*>(p + c * kPer) = raw;
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) p[j] = from_float<T>(x.v[j]);
  }
}

// Loads min(N, n) elements (the rest read as zero): the tail of a vectorized loop.
template <int N, typename T>
__device__ __forceinline__ Floats<N> load_partial(const T* p, int64_t n) {
  Floats<N> r;
#pragma unroll
  for (int j = 0; j < N; ++j) r.v[j] = j < n ? to_float(p[j]) : 0.0f;
  return r;
}
template <int N, typename T>
__device__ __forceinline__ void store_partial(T* p, const Floats<N>& x, int64_t n) {
#pragma unroll
  for (int j = 0; j < N; ++j)
    if (j < n) p[j] = from_float<T>(x.v[j]);
}

// ---- reductions ---------------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// |v| after rounding to T (what a kernel stores), for the amaxes tensorwise FP8 casts take from
// the kernels that write their sources.
template <typename T>
__device__ __forceinline__ float stored_abs(float v) {
  return fabsf(to_float(from_float<T>(v)));
}

// The block's max of non-negative values (blockDim.x a multiple of 32, at most 1024), maxed into
// *amax by one atomicMax of the float bits (for v >= 0 int order is float order). Every thread of
// the block calls it, and may call it again (the optimizer update, once per chunk of a segment).
// The FP8 casts', the FP8 optimizer update's and the norms' amaxes (for tensorwise casts).
__device__ __forceinline__ void block_amax_atomic(float* amax, float v) {
  __shared__ float partial[kWarp];
  v = warp_max(v);
  __syncthreads();  // partial[] may still be read by a previous call
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = warp_max(lane < warps ? partial[lane] : 0.0f);
    if (lane == 0) atomicMax(reinterpret_cast<int*>(amax), __float_as_int(v));
  }
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the
// result. The order is fixed by the launch shape, so the result is deterministic.
template <typename V>
__device__ V block_sum(V v) {
  __shared__ V partial[kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  v = warp_sum(v);
  __syncthreads();  // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  V s = lane < warps ? partial[lane] : V(0);
  return warp_sum(s);
}

// ---- host-side helpers --------------------------------------------------------------------------
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
inline bool aligned8(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7u) == 0; }

inline unsigned grid_for(int64_t work_items, int block, int64_t max_blocks = 65535LL * 16) {
  int64_t g = (work_items + block - 1) / block;
  if (g < 1) g = 1;
  if (g > max_blocks) g = max_blocks;
  return static_cast<unsigned>(g);
}

}  // namespace mt::cuda

// Runs the statement with `T` bound to the C++ type of a floating dtype the kernels support.
#define MT_DISPATCH_FLOAT(dtype, T, what, ...)                                                   \
  do {                                                                                           \
    switch (dtype) {                                                                             \
      case ::mt::DType::f32: { using T = float; __VA_ARGS__; } break;                            \
      case ::mt::DType::bf16: { using T = ::mt::cuda::bf16; __VA_ARGS__; } break;                \
      case ::mt::DType::f16: { using T = ::mt::cuda::f16; __VA_ARGS__; } break;                  \
      default:                                                                                   \
        ::mt::fail("{}: dtype {} is not supported by the CUDA backend (float32, bfloat16, float16)", \
                   what, ::mt::dtype_name(dtype));                                               \
    }                                                                                            \
  } while (0)

// Runs the statement with `G` bound to the C++ type of a parameter gradient's dtype: float32, or
// bfloat16 (--grad-reduce-in-bf16). `what` names the op and the tensor in the error.
#define MT_DISPATCH_GRAD(dtype, G, what, ...)                                                    \
  do {                                                                                           \
    switch (dtype) {                                                                             \
      case ::mt::DType::f32: { using G = float; __VA_ARGS__; } break;                            \
      case ::mt::DType::bf16: { using G = ::mt::cuda::bf16; __VA_ARGS__; } break;                \
      default:                                                                                   \
        ::mt::fail("{}: the gradient is {}; gradients must be float32 or bfloat16", what,       \
                   ::mt::dtype_name(dtype));                                                     \
    }                                                                                            \
  } while (0)

// Device helpers of the grouped GEMM kernels (cuda/grouped_gemm_mma.cu, cuda/grouped_gemm_tma.cu):
// shared-memory addresses and wgmma descriptors, the output stores, and how a CTA finds its
// expert from offsets in device memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace mt::cuda::grouped_detail {

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// A shared-memory matrix descriptor with the 128-byte swizzle (its atoms 1024-byte aligned).
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  const uint32_t a = smem_u32(p);
  return static_cast<uint64_t>((a & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo_bytes & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo_bytes & 0x3FFFF) >> 4) << 32) | (uint64_t{1} << 62);
}

template <typename TC>
__device__ __forceinline__ void store2(TC* p, float x, float y, bool accumulate) {
  if constexpr (std::is_same_v<TC, float>) {
    float2* q = reinterpret_cast<float2*>(p);
    if (accumulate) {
      const float2 o = *q;
      x += o.x;
      y += o.y;
    }
    *q = make_float2(x, y);
  } else if constexpr (std::is_same_v<TC, __nv_bfloat16>) {
    __nv_bfloat162* q = reinterpret_cast<__nv_bfloat162*>(p);
    if (accumulate) {
      const float2 o = __bfloat1622float2(*q);
      x += o.x;
      y += o.y;
    }
    *q = __floats2bfloat162_rn(x, y);
  } else {
    __half2* q = reinterpret_cast<__half2*>(p);
    if (accumulate) {
      const float2 o = __half22float2(*q);
      x += o.x;
      y += o.y;
    }
    *q = __floats2half2_rn(x, y);
  }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr bool kHaveWgmma = true;
#else
constexpr bool kHaveWgmma = false;
#endif

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Waits until at most one committed wgmma group of this warpgroup is in flight.
__device__ __forceinline__ void wgmma_wait_one() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }

// The experts' first m-tiles of bm rows: an exclusive scan of their tile counts over the CTA's
// kThreads threads (one expert each: groups <= kThreads), written to first_tile[groups] in shared
// memory (warp_total: kThreads / 32 ints of shared scratch). Returns the tiles of all experts.
// Every thread of the CTA calls it.
template <int kThreads>
__device__ __forceinline__ int grouped_first_tiles(const int* offsets, int groups, int bm, int* first_tile,
                                                   int* warp_total) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int count = tid < groups ? (offsets[tid + 1] - offsets[tid] + bm - 1) / bm : 0;
  int sum = count;  // inclusive within the warp
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, sum, d);
    if (lane >= d) sum += v;
  }
  if (lane == 31) warp_total[warp] = sum;
  __syncthreads();
  int before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) {
    before += w < warp ? warp_total[w] : 0;
    all += warp_total[w];
  }
  if (tid < groups) first_tile[tid] = before + sum - count;
  __syncthreads();
  return all;
}

// The expert that m-tile t (below the total) belongs to: the last whose first tile is <= t (an
// expert without rows shares its first tile with the next, so the last is one with rows).
__device__ __forceinline__ int grouped_tile_expert(const int* first_tile, int groups, int t) {
  int lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (first_tile[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

}  // namespace mt::cuda::grouped_detail

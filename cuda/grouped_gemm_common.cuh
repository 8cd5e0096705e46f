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

// Two values at p as float32 (p 4-byte aligned for 16-bit types, 8-byte for float).
template <typename TC>
__device__ __forceinline__ float2 load2(const TC* p) {
  if constexpr (std::is_same_v<TC, float>) return *reinterpret_cast<const float2*>(p);
  else if constexpr (std::is_same_v<TC, __nv_bfloat16>) return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
  else return __half22float2(*reinterpret_cast<const __half2*>(p));
}

// Two values to p (as load2's alignment), added to what p holds with accumulate.
template <typename TC>
__device__ __forceinline__ void store2(TC* p, float x, float y, bool accumulate) {
  if (accumulate) {
    const float2 o = load2<TC>(p);
    x += o.x;
    y += o.y;
  }
  if constexpr (std::is_same_v<TC, float>) *reinterpret_cast<float2*>(p) = make_float2(x, y);
  else if constexpr (std::is_same_v<TC, __nv_bfloat16>) *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
  else *reinterpret_cast<__half2*>(p) = __floats2half2_rn(x, y);
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

// D[64 x 128] += A[64 x 16] B[16 x 128] for one warpgroup, both operands in shared memory,
// reduction-contiguous or (kTransA / kTransB) output-contiguous.
#define MT_WGMMA_M64N128K16(TYPE) \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %68, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %66, %67;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
        : "l"(desc_a), "l"(desc_b), "n"(kTransA), "n"(kTransB), "r"(1));
template <int kTransA, int kTransB, typename T>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    MT_WGMMA_M64N128K16("bf16")
  else
    MT_WGMMA_M64N128K16("f16")
}
#undef MT_WGMMA_M64N128K16

// D[64 x 256] += A[64 x 16] B[16 x 256] for one warpgroup, both operands in shared memory,
// reduction-contiguous or (kTransA / kTransB) output-contiguous.
#define MT_WGMMA_M64N256K16(TYPE) \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %132, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " " \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, %130, %131;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
        : "l"(desc_a), "l"(desc_b), "n"(kTransA), "n"(kTransB), "r"(1));
template <int kTransA, int kTransB, typename T>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    MT_WGMMA_M64N256K16("bf16")
  else
    MT_WGMMA_M64N256K16("f16")
}
#undef MT_WGMMA_M64N256K16

inline constexpr int kStepK = 64;  // both kernels' k-step

// The shared-memory descriptors of k-slice kk of a k-step for the MMA on rows [64 half, 64 half +
// 64) of A and all of B's columns. Reduction-contiguous: rows of 128 bytes, 8-row groups 1024 bytes
// apart, the k-slice 32 bytes further. Output-contiguous: atoms of 8 k-rows, the 64-wide blocks
// 8 KB apart.
template <bool kARed, bool kBRed, typename T>
__device__ __forceinline__ void descriptors(const T* As, const T* Bs, int half, int kk, uint64_t& da, uint64_t& db) {
  da = kARed ? smem_desc(As + half * 64 * kStepK + kk * 16, 16, 1024)
             : smem_desc(As + half * kStepK * 64 + kk * 16 * 64, kStepK * 64 * 2, 1024);
  db = kBRed ? smem_desc(Bs + kk * 16, 16, 1024) : smem_desc(Bs + kk * 16 * 64, kStepK * 64 * 2, 1024);
}

// The accumulators zeroed; and held in place across asynchronous wgmma (the compiler may not move
// them while MMAs that write them are in flight).
template <int kRegs>
__device__ __forceinline__ void zero(float (&d)[kRegs]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) d[i] = 0.0f;
}
template <int kRegs>
__device__ __forceinline__ void fence_registers(float (&d)[kRegs]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

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

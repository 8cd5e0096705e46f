// Building blocks of the flash attention kernels (attention_flash_forward.cu, _backward.cu):
// tensor-core MMA (m16n8k16, bf16/fp16 in, fp32 accumulate), ldmatrix, cp.async and a swizzled
// shared-memory tile layout, plus the parameters both kernels read.
//
// Fragment layouts of mma.m16n8k16 (lane = thread index in the warp, r = lane/4, c = 2*(lane%4)):
//   A (16x16, row major): a0 = A[r][c..c+1], a1 = A[r+8][c..c+1], a2 = A[r][c+8..], a3 = A[r+8][c+8..]
//   B (16x8, "col"):      b0 = B[c..c+1][r],  b1 = B[c+8..c+9][r]
//   C (16x8, fp32):       c0,c1 = C[r][c..c+1],  c2,c3 = C[r+8][c..c+1]
// So the C fragments of two neighbouring 16x8 tiles, rounded to 16 bits, are exactly an A fragment:
// probabilities computed by one MMA feed the next without passing through shared memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace mt::cuda::flash {

// Everything the kernels need, by value. Token rows are sequence-major (row = t*b + i) and each qkv
// row holds, per KV group, [q: hpg*d][k: d][v: d] (engine/backend.h).
struct Params {
  const void* qkv = nullptr;
  void* out = nullptr;         // forward output [N, heads*d]
  float* lse = nullptr;        // [b, heads, s], natural log
  const void* dout = nullptr;  // backward: dO [N, heads*d]
  void* dqkv = nullptr;        // backward: gradient in the packed layout
  float* delta = nullptr;      // backward workspace: rowsum(dO * O) [b*heads, s]
  float* dq_accum = nullptr;   // backward workspace: fp32 dq partial sums [b*heads, q_blocks*BM, d]
  int* dq_turn = nullptr;      // backward workspace: [b*heads, q_blocks] whose turn it is to add to dq
  int batch = 0, seq = 0, heads = 0, groups = 0, hpg = 0;
  int64_t row_stride = 0;      // elements per qkv token row
  int64_t seq_stride = 0;      // qkv elements between positions t and t+1 of one sample (= b*row_stride)
  int64_t out_seq_stride = 0;  // out/dout elements between positions t and t+1 (= b*heads*d)
  float softmax_scale = 0, scale_log2 = 0;  // scale, and scale*log2(e) for exp2
  bool causal = true;
  int window = -1;             // sliding window: query q sees keys q - window ... q (-1: none)
  // Packed documents: doc_start[i * seq + q] is the first key query q of sample i sees (null: none).
  // Nondecreasing along a sample, so a block's first query has the lowest and its last the highest.
  const int32_t* doc_start = nullptr;
  float dropout_p = 0, dropout_scale = 1;   // scale = 1/(1-p)
  uint64_t dropout_key = 0;
};

constexpr float kLog2e = 1.4426950408889634f;

template <typename Elem>
struct Pack;
template <>
struct Pack<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t two(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t x) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&x));
  }
};
template <>
struct Pack<__half> {
  static __device__ __forceinline__ uint32_t two(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t x) {
    return __half22float2(*reinterpret_cast<__half2*>(&x));
  }
};

// C += A * B on tensor cores.
template <typename Elem>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<Elem, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 16-bit matrices; lanes 8j..8j+7 give the row addresses of matrix j.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 16-byte asynchronous copy global -> shared; valid == false writes zeros (and reads nothing).
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(src_bytes));
}
// 4-byte variant (through L1), for per-row scalars.
__device__ __forceinline__ void cp_async_4(uint32_t smem_addr, const void* gmem, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Shared-memory tiles are [rows][COLS] 16-bit elements, stored in 16-byte chunks whose index is
// XORed with the row: the 8 rows an ldmatrix reads (or a cp.async warp writes) hit 8 different
// bank groups. Returns the element offset of chunk `chunk` of row `row`.
template <int COLS>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  constexpr int kChunks = COLS / 8;
  constexpr int kMask = (kChunks < 8 ? kChunks : 8) - 1;
  return row * COLS + ((chunk ^ (row & kMask)) << 3);
}

// ldmatrix addresses into a swizzled tile, cheap inside unrolled loops: a lane reads row
// row0 + lane_row, chunk chunk0 + lane_chunk with row0 % 8 == 0, chunk0 even, lane_chunk in {0, 1}.
// Then the swizzle term depends on the lane only and chunk0 enters by one XOR:
//   address = tile + row0 * row_bytes + (lane_offset ^ (chunk0 * 16)).
template <int COLS>
struct Ldsm {
  static constexpr int kRowBytes = COLS * 2;
  static constexpr int kMask = (COLS / 8 < 8 ? COLS / 8 : 8) - 1;
  static __device__ __forceinline__ uint32_t lane_offset(int lane_row, int lane_chunk) {
    return lane_row * kRowBytes + ((lane_chunk ^ (lane_row & kMask)) << 4);
  }
  static __device__ __forceinline__ uint32_t at(uint32_t tile, uint32_t lane_off, int row0, int chunk0) {
    return tile + row0 * kRowBytes + (lane_off ^ (chunk0 << 4));
  }
};

// Copies rows [0, ROWS) x D of a strided global matrix into a swizzled tile; rows >= rows_valid
// become zeros (so padding keys contribute nothing and padding queries produce finite values).
template <int ROWS, int D, int NTHREADS, typename Elem>
__device__ __forceinline__ void load_tile(Elem* tile, const Elem* gmem, int64_t row_stride, int rows_valid,
                                          int tid) {
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int idx = tid; idx < ROWS * kChunks; idx += NTHREADS) {
    const int r = idx / kChunks, c = idx % kChunks;
    const bool valid = r < rows_valid;
    const Elem* src = valid ? gmem + r * row_stride + c * 8 : gmem;
    cp_async_16(smem_u32(tile + swizzle<D>(r, c)), src, valid);
  }
}

}  // namespace mt::cuda::flash

// cuda/grouped_gemm_mma.h. One kernel for the three ops, as C = A B per expert with
//   forward         C = y_e [rows, N]   A = x_e  [rows, K] (K contiguous)   B = w_e^T (w_e [N, K]: K contiguous)
//   backward input  C = dx_e [rows, K]  A = dy_e [rows, N] (N contiguous)   B = w_e   ([N, K]: output contiguous)
//   backward weight C = dw_e [N, K]     A = dy_e^T (dy_e [rows, N])         B = x_e   ([rows, K]: output contiguous)
// The first two group C's rows by expert (a CTA's tile lies inside one expert's rows), the third
// groups the reduction (a CTA reduces over its expert's rows).
//
// A CTA computes a 128 x 128 tile of C with 8 warps (2 x 4, 64 x 32 each) of mma.m16n8k16 over
// k-steps of 32, the operands staged in shared memory by cp.async in a 4-deep ring. Tiles are
// kept in shared memory as they lie in global memory (reduction-contiguous, or output-contiguous
// and read with ldmatrix.trans), their 16-byte chunks XOR-swizzled so that every ldmatrix phase
// touches 8 distinct bank groups. Rows past an expert's end and columns past the matrix read as
// zeros (cp.async's source size 0).
#include "cuda/grouped_gemm_mma.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <limits>

#include "core/error.h"
#include "cuda/cuda_check.h"

namespace mt::cuda {
namespace {

constexpr int BM = 128, BN = 128, BK = 32, STAGES = 4, THREADS = 256;
constexpr int kTile = BM * BK;  // elements of one operand's tile (BN * BK is the same)
static_assert(BM == BN, "the two operands' tiles share one layout scheme");
constexpr int kSmemBytes = STAGES * 2 * kTile * 2;

// The experts' row offsets and, for the row-grouped ops, the index of each expert's first
// m-tile (tile_start[groups] = all m-tiles).
struct GroupTable {
  int offsets[kGroupedMmaMaxGroups + 1];
  int tile_start[kGroupedMmaMaxGroups + 1];
  int groups;
};

struct Args {
  const void* a;
  const void* b;
  void* c;
  int lda, ldb, ldc;
  int M, N, K;          // row-grouped: M unused (each expert's rows); weight grouped: K unused
  long long b_stride;   // row-grouped: elements from one expert's weight to the next
  long long c_stride;   // weight-grouped: elements from one expert's gradient to the next
  int n_tiles;
  bool accumulate;
};

// A tile stored reduction-contiguous ([128 rows][32]): 4 chunks of 8 per row, chunk ^ (row/2 % 4).
__device__ __forceinline__ int swz_rows(int r, int k) { return r * BK + ((((k >> 3) ^ (r >> 1)) & 3) << 3) + (k & 7); }
// A tile stored output-contiguous ([32][128 cols]): 16 chunks per row, chunk ^ (row % 8).
__device__ __forceinline__ int swz_cols(int k, int m) { return k * BM + (((m >> 3) ^ (k & 7)) << 3) + (m & 7); }

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(size));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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

// Loads one operand's 128 x 32 tile into shared memory. kRed: the operand is stored
// reduction-contiguous (rows of the tile are `outer` indices, 0..127 from outer0, each row
// `ld` elements apart); else output-contiguous (rows are reduction indices from k0).
template <typename T, bool kRed>
__device__ __forceinline__ void load_tile(T* smem, const T* g, int ld, int outer0, int outer_end, int k0, int k_end,
                                          int tid) {
#pragma unroll
  for (int i = 0; i < (kTile / 8) / THREADS; ++i) {
    const int chunk = tid + i * THREADS;
    if constexpr (kRed) {
      const int r = chunk >> 2, kc = (chunk & 3) << 3;
      const bool valid = outer0 + r < outer_end && k0 + kc < k_end;
      const T* src = valid ? g + static_cast<long long>(outer0 + r) * ld + k0 + kc : g;
      cp_async16(smem + swz_rows(r, kc), src, valid);
    } else {
      const int kr = chunk >> 4, oc = (chunk & 15) << 3;
      const bool valid = k0 + kr < k_end && outer0 + oc < outer_end;
      const T* src = valid ? g + static_cast<long long>(k0 + kr) * ld + outer0 + oc : g;
      cp_async16(smem + swz_cols(kr, oc), src, valid);
    }
  }
}

// kARed / kBRed: A / B stored reduction-contiguous. kWeightGrouped: the reduction is grouped
// (backward weight); else C's rows are.
template <typename T, typename TC, bool kARed, bool kBRed, bool kWeightGrouped>
__global__ void __launch_bounds__(THREADS, 2) grouped_mma_kernel(const Args args, const __grid_constant__ GroupTable table) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* const smem = reinterpret_cast<T*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 2, wn = warp & 3;

  // This CTA's expert and tile.
  const int bid = blockIdx.x;
  const int mt = bid / args.n_tiles, nt = bid % args.n_tiles;
  int g, m0;
  if constexpr (kWeightGrouped) {
    g = blockIdx.y;
    m0 = mt * BM;
  } else {
    int lo = 0, hi = table.groups - 1;  // the last expert whose first tile is <= mt
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (table.tile_start[mid] <= mt) lo = mid;
      else hi = mid - 1;
    }
    g = lo;
    m0 = (mt - table.tile_start[g]) * BM;
  }
  const int n0 = nt * BN;
  const int row0 = table.offsets[g], rows = table.offsets[g + 1] - row0;
  const int M = kWeightGrouped ? args.M : rows, Kr = kWeightGrouped ? rows : args.K;
  const int nk = (Kr + BK - 1) / BK;
  if (kWeightGrouped && nk == 0 && args.accumulate) return;  // adds nothing

  const T* A = static_cast<const T*>(args.a) + static_cast<long long>(row0) * args.lda;
  const T* B = static_cast<const T*>(args.b) +
               (kWeightGrouped ? static_cast<long long>(row0) * args.ldb : static_cast<long long>(g) * args.b_stride);
  TC* C = static_cast<TC*>(args.c) +
          (kWeightGrouped ? static_cast<long long>(g) * args.c_stride : static_cast<long long>(row0) * args.ldc);

  auto load_stage = [&](int stage, int kt) {
    T* As = smem + stage * 2 * kTile;
    T* Bs = As + kTile;
    load_tile<T, kARed>(As, A, args.lda, m0, M, kt * BK, Kr, tid);
    load_tile<T, kBRed>(Bs, B, args.ldb, n0, args.N, kt * BK, Kr, tid);
  };

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.0f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load_stage(s, s);
    cp_async_commit();
  }

  for (int kt = 0; kt < nk; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    const int pre = kt + STAGES - 1;  // into the stage every warp finished reading last step
    if (pre < nk) load_stage(pre % STAGES, pre);
    cp_async_commit();

    const T* As = smem + (kt % STAGES) * 2 * kTile;
    const T* Bs = As + kTile;
#pragma unroll
    for (int ks = 0; ks < BK; ks += 16) {
      unsigned af[4][4], bf[2][4];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        const int mrow = wm * 64 + mi * 16;
        if constexpr (kARed) {
          ldmatrix_x4<false>(af[mi], As + swz_rows(mrow + (lane & 15), ks + ((lane >> 4) << 3)));
        } else {
          const int mat = lane >> 3;
          ldmatrix_x4<true>(af[mi], As + swz_cols(ks + ((mat >> 1) << 3) + (lane & 7), mrow + ((mat & 1) << 3)));
        }
      }
#pragma unroll
      for (int nj = 0; nj < 2; ++nj) {
        const int ncol = wn * 32 + nj * 16, mat = lane >> 3;
        if constexpr (kBRed)
          ldmatrix_x4<false>(bf[nj], Bs + swz_rows(ncol + ((mat >> 1) << 3) + (lane & 7), ks + ((mat & 1) << 3)));
        else
          ldmatrix_x4<true>(bf[nj], Bs + swz_cols(ks + ((mat & 1) << 3) + (lane & 7), ncol + ((mat >> 1) << 3)));
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma16816<T>(acc[mi][ni], af[mi], bf[ni >> 1][(ni & 1) * 2], bf[ni >> 1][(ni & 1) * 2 + 1]);
    }
  }
  cp_async_wait<0>();

  // Epilogue: each thread's pairs of columns, straight to global memory.
  const int gr = lane >> 2, gc = (lane & 3) << 1;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const int col = n0 + wn * 32 + ni * 8 + gc;
      if (col >= args.N) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + wm * 64 + mi * 16 + gr + h * 8;
        if (row < M)
          store2<TC>(C + static_cast<long long>(row) * args.ldc + col, acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1],
                     args.accumulate);
      }
    }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <typename T, typename TC, bool kARed, bool kBRed, bool kWeightGrouped>
void launch(const Args& args, const GroupTable& table, dim3 grid, cudaStream_t stream) {
  auto* kernel = grouped_mma_kernel<T, TC, kARed, kBRed, kWeightGrouped>;
  static const bool configured = [&] {
    MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    return true;
  }();
  (void)configured;
  kernel<<<grid, THREADS, kSmemBytes, stream>>>(args, table);
  MT_CUDA_CHECK_LAUNCH();
}

template <typename T>
void dispatch(GroupedOp op, DType c_dtype, const Args& args, const GroupTable& table, dim3 grid, cudaStream_t stream) {
  switch (op) {
    case GroupedOp::forward: return launch<T, T, true, true, false>(args, table, grid, stream);
    case GroupedOp::backward_input: return launch<T, T, true, false, false>(args, table, grid, stream);
    case GroupedOp::backward_weight:
      if (c_dtype == DType::f32) return launch<T, float, false, false, true>(args, table, grid, stream);
      return launch<T, T, false, false, true>(args, table, grid, stream);
  }
}

// w's rows per expert and its columns, for op's operands.
void feature_sizes(GroupedOp op, const Tensor& c, const Tensor& a, const Tensor& b, int64_t experts, int64_t& N,
                   int64_t& K) {
  switch (op) {
    case GroupedOp::forward: N = b.rows() / experts, K = b.cols(); break;
    case GroupedOp::backward_input: N = b.rows() / experts, K = b.cols(); break;
    case GroupedOp::backward_weight: N = c.rows() / experts, K = c.cols(); break;
  }
  (void)a;
}

}  // namespace

bool grouped_mma_takes(GroupedOp op, const Tensor& c, const Tensor& a, const Tensor& b, int64_t experts) {
  if (experts < 1 || experts > kGroupedMmaMaxGroups) return false;
  if (a.dtype != b.dtype || (a.dtype != DType::bf16 && a.dtype != DType::f16)) return false;
  if (c.dtype != a.dtype && !(op == GroupedOp::backward_weight && c.dtype == DType::f32)) return false;
  int64_t N = 0, K = 0;
  feature_sizes(op, c, a, b, experts, N, K);
  const int64_t big = std::numeric_limits<int>::max() / 2;
  if (N % 8 != 0 || K % 8 != 0 || N <= 0 || K <= 0 || N > big || K > big) return false;
  if (a.rows() > big || b.rows() > big || c.rows() > big) return false;
  return aligned16(a.data) && aligned16(b.data) && aligned16(c.data);
}

void grouped_mma_run(GroupedOp op, Tensor c, Tensor a, Tensor b, std::span<const int64_t> offsets, bool accumulate,
                     cudaStream_t stream) {
  const int64_t E = static_cast<int64_t>(offsets.size()) - 1;
  MT_CHECK(grouped_mma_takes(op, c, a, b, E), "grouped MMA GEMM: an op it does not take (c [{}] {}, a [{}] {})",
           c.shape_string(), dtype_name(c.dtype), a.shape_string(), dtype_name(a.dtype));
  int64_t N = 0, K = 0;
  feature_sizes(op, c, a, b, E, N, K);
  GroupTable table{};
  table.groups = static_cast<int>(E);
  int tiles = 0;
  for (int64_t e = 0; e <= E; ++e) {
    table.offsets[e] = static_cast<int>(offsets[static_cast<size_t>(e)]);
    table.tile_start[e] = tiles;
    if (e < E) tiles += static_cast<int>((offsets[static_cast<size_t>(e) + 1] - offsets[static_cast<size_t>(e)] + BM - 1) / BM);
  }
  Args args{};
  args.a = a.data;
  args.b = b.data;
  args.c = c.data;
  args.accumulate = accumulate;
  dim3 grid;
  switch (op) {
    case GroupedOp::forward:  // C = y [rows, N], A = x (ld K), B = w_e (ld K)
      args.lda = args.ldb = static_cast<int>(K);
      args.ldc = static_cast<int>(N);
      args.N = static_cast<int>(N);
      args.K = static_cast<int>(K);
      args.b_stride = N * K;
      break;
    case GroupedOp::backward_input:  // C = dx [rows, K], A = dy (ld N), B = w_e (ld K)
      args.lda = static_cast<int>(N);
      args.ldb = args.ldc = static_cast<int>(K);
      args.N = static_cast<int>(K);
      args.K = static_cast<int>(N);
      args.b_stride = N * K;
      break;
    case GroupedOp::backward_weight:  // C = dw_e [N, K], A = dy^T (ld N), B = x (ld K)
      args.lda = static_cast<int>(N);
      args.ldb = args.ldc = static_cast<int>(K);
      args.M = static_cast<int>(N);
      args.N = static_cast<int>(K);
      args.c_stride = N * K;
      break;
  }
  args.n_tiles = (args.N + BN - 1) / BN;
  if (op == GroupedOp::backward_weight) {
    grid = dim3(static_cast<unsigned>(((args.M + BM - 1) / BM) * args.n_tiles), static_cast<unsigned>(E));
  } else {
    if (tiles == 0) return;
    grid = dim3(static_cast<unsigned>(tiles * args.n_tiles));
  }
  if (a.dtype == DType::bf16) dispatch<__nv_bfloat16>(op, c.dtype, args, table, grid, stream);
  else dispatch<__half>(op, c.dtype, args, table, grid, stream);
}

}  // namespace mt::cuda

// cuda/grouped_gemm_mma.h. One kernel for the three ops, as C = A B per expert with
//   forward         C = y_e [rows, N]   A = x_e  [rows, K] (K contiguous)   B = w_e^T (w_e [N, K]: K contiguous)
//   backward input  C = dx_e [rows, K]  A = dy_e [rows, N] (N contiguous)   B = w_e   ([N, K]: output contiguous)
//   backward weight C = dw_e [N, K]     A = dy_e^T (dy_e [rows, N])         B = x_e   ([rows, K]: output contiguous)
// The first two group C's rows by expert (a CTA's tile lies inside one expert's rows), the third
// groups the reduction (a CTA reduces over its expert's rows).
//
// A CTA computes a 128 x 128 tile of C over k-steps of 64, the operands staged in shared memory by
// cp.async in a 3-deep ring (96 KB: two CTAs per SM). Two bodies share the loads and the tile
// scheduling:
// - wgmma (sm_90a, Hopper): each of the two warpgroups issues wgmma.m64n128k16 on its 64 rows,
//   both operands read from shared memory through descriptors in the 128-byte swizzled canonical
//   layouts: a reduction-contiguous tile as rows of 128 bytes (chunk ^ row % 8), an
//   output-contiguous one as 8 x 128-byte atoms (the two 64-wide halves 8 KB apart), read
//   transposed (wgmma's imm-trans).
// - mma.sync (any sm_90 build, and the reference for the first): 8 warps (2 x 4, 64 x 32 each) of
//   mma.m16n8k16 fed by ldmatrix (.trans for output-contiguous tiles), 16-byte chunks XOR-swizzled
//   so that every ldmatrix phase touches 8 distinct bank groups.
// Rows past an expert's end and columns past the matrix read as zeros (cp.async's source size 0).
#include "cuda/grouped_gemm_mma.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <limits>

#include "core/error.h"
#include "cuda/attention_flash_common.cuh"
#include "cuda/grouped_gemm_common.cuh"
#include "cuda/cuda_check.h"

namespace mt::cuda {
namespace {

constexpr int BM = 128, BN = 128, BK = 64, STAGES = 3, THREADS = 256;
static_assert(BK == grouped_detail::kStepK, "the shared descriptors' k-step");
constexpr int kTile = BM * BK;  // elements of one operand's tile (BN * BK is the same)
static_assert(BM == BN, "the two operands' tiles share one layout scheme");
constexpr int kSmemBytes = STAGES * 2 * kTile * 2 + 1024;  // + alignment room

struct Args {
  const int* offsets;   // [groups + 1], device
  int groups;
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

// A tile stored reduction-contiguous ([128 rows][64]): 8 chunks of 8 per row, chunk ^ (row % 8).
__device__ __forceinline__ int swz_rows(int r, int k) { return r * BK + ((((k >> 3) ^ r) & 7) << 3) + (k & 7); }
// A tile stored output-contiguous ([64][128 cols]): 16 chunks per row, chunk ^ (row % 8).
__device__ __forceinline__ int swz_cols(int k, int m) { return k * BM + (((m >> 3) ^ (k & 7)) << 3) + (m & 7); }
// The same tile for wgmma (MN-major, 128-byte swizzle): [2 halves of 64 cols][64 k rows][64],
// 1024-byte atoms of 8 rows, chunk ^ (row % 8) within a row.
__device__ __forceinline__ int swz_atoms(int k, int m) {
  return (m >> 6) * (BK * 64) + k * 64 + ((((m >> 3) & 7) ^ (k & 7)) << 3) + (m & 7);
}

// The cp.async, ldmatrix and mma.sync helpers are the flash kernels' (cuda/attention_flash_common.cuh).
using flash::cp_async_commit;
using flash::cp_async_wait;
using namespace grouped_detail;

// Loads one operand's 128 x 64 tile into shared memory. kRed: the operand is stored
// reduction-contiguous (rows of the tile are `outer` indices, 0..127 from outer0, each row
// `ld` elements apart); else output-contiguous (rows are reduction indices from k0).
template <typename T, bool kRed, bool kAtoms>
__device__ __forceinline__ void load_tile(T* smem, const T* g, int ld, int outer0, int outer_end, int k0, int k_end,
                                          int tid) {
#pragma unroll
  for (int i = 0; i < (kTile / 8) / THREADS; ++i) {
    const int chunk = tid + i * THREADS;
    if constexpr (kRed) {
      const int r = chunk >> 3, kc = (chunk & 7) << 3;
      const bool valid = outer0 + r < outer_end && k0 + kc < k_end;
      const T* src = valid ? g + static_cast<long long>(outer0 + r) * ld + k0 + kc : g;
      flash::cp_async_16(smem_u32(smem + swz_rows(r, kc)), src, valid);
    } else {
      const int kr = chunk >> 4, oc = (chunk & 15) << 3;
      const bool valid = k0 + kr < k_end && outer0 + oc < outer_end;
      const T* src = valid ? g + static_cast<long long>(k0 + kr) * ld + outer0 + oc : g;
      flash::cp_async_16(smem_u32(smem + (kAtoms ? swz_atoms(kr, oc) : swz_cols(kr, oc))), src, valid);
    }
  }
}

// kARed / kBRed: A / B stored reduction-contiguous. kWeightGrouped: the reduction is grouped
// (backward weight); else C's rows are. kWgmma: the wgmma body where the build has it (sm_90a),
// else mma.sync.
template <typename T, typename TC, bool kARed, bool kBRed, bool kWeightGrouped, bool kWgmma>
__global__ void __launch_bounds__(THREADS, 2) grouped_mma_kernel(const __grid_constant__ Args args) {
  constexpr bool kUseWgmma = kWgmma && kHaveWgmma;
  extern __shared__ unsigned char smem_raw[];
  // wgmma's swizzle atoms start on 1024-byte boundaries (kSmemBytes has the room).
  T* const smem = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // This CTA's expert and tile.
  const int bid = blockIdx.x;
  const int mt = bid / args.n_tiles, nt = bid % args.n_tiles;
  int g, m0;
  if constexpr (kWeightGrouped) {
    g = blockIdx.y;
    m0 = mt * BM;
  } else {
    // CTAs past the last tile (the grid covers the most the rows can make) leave.
    __shared__ int first_tile[kGroupedMmaMaxGroups];
    __shared__ int warp_total[THREADS / 32];
    static_assert(THREADS >= kGroupedMmaMaxGroups, "one thread per expert");
    const int all = grouped_first_tiles<THREADS>(args.offsets, args.groups, BM, first_tile, warp_total);
    if (mt >= all) return;
    g = grouped_tile_expert(first_tile, args.groups, mt);
    m0 = (mt - first_tile[g]) * BM;
  }
  const int n0 = nt * BN;
  const int row0 = args.offsets[g], rows = args.offsets[g + 1] - row0;
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
    load_tile<T, kARed, kUseWgmma>(As, A, args.lda, m0, M, kt * BK, Kr, tid);
    load_tile<T, kBRed, kUseWgmma>(Bs, B, args.ldb, n0, args.N, kt * BK, Kr, tid);
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load_stage(s, s);
    cp_async_commit();
  }

  if constexpr (kUseWgmma) {
    // Warpgroup wg computes rows [64 wg, 64 wg + 64) of the tile, all 128 columns.
    const int wg = tid >> 7;
    float d[64];
    zero(d);
    for (int kt = 0; kt < nk; ++kt) {
      cp_async_wait<STAGES - 2>();
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async's writes, seen by wgmma
      __syncthreads();
      const T* As = smem + (kt % STAGES) * 2 * kTile;
      const T* Bs = As + kTile;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        uint64_t da, db;
        descriptors<kARed, kBRed>(As, Bs, wg, kk, da, db);
        wgmma_m64n128k16<kARed ? 0 : 1, kBRed ? 0 : 1, T>(d, da, db);
      }
      wgmma_commit();
      const int pre = kt + STAGES - 1;  // into the stage both warpgroups' MMAs finished reading
      if (pre < nk) load_stage(pre % STAGES, pre);
      cp_async_commit();
      wgmma_wait_all();
      fence_registers(d);
    }
    cp_async_wait<0>();
    // Epilogue: warp w of the warpgroup holds rows 16 w + lane / 4 (+ 8), column pairs.
    const int r = m0 + wg * 64 + ((warp & 3) << 4) + (lane >> 2);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int col = n0 + j * 8 + ((lane & 3) << 1);
      if (col >= args.N) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (r + 8 * h < M)
          store2<TC>(C + static_cast<long long>(r + 8 * h) * args.ldc + col, d[4 * j + 2 * h], d[4 * j + 2 * h + 1],
                     args.accumulate);
    }
  } else {
    const int wm = warp >> 2, wn = warp & 3;
    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.0f;

    for (int kt = 0; kt < nk; ++kt) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();
      const int pre = kt + STAGES - 1;  // into the stage every warp finished reading last step
      if (pre < nk) load_stage(pre % STAGES, pre);
      cp_async_commit();

      const T* As = smem + (kt % STAGES) * 2 * kTile;
      const T* Bs = As + kTile;
#pragma unroll 1
      for (int ks = 0; ks < BK; ks += 16) {
        uint32_t af[4][4], bf[2][4];
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
          const int mrow = wm * 64 + mi * 16;
          if constexpr (kARed) {
            flash::ldmatrix_x4(af[mi], smem_u32(As + swz_rows(mrow + (lane & 15), ks + ((lane >> 4) << 3))));
          } else {
            const int mat = lane >> 3;
            flash::ldmatrix_x4_trans(af[mi], smem_u32(As + swz_cols(ks + ((mat >> 1) << 3) + (lane & 7), mrow + ((mat & 1) << 3))));
          }
        }
#pragma unroll
        for (int nj = 0; nj < 2; ++nj) {
          const int ncol = wn * 32 + nj * 16, mat = lane >> 3;
          if constexpr (kBRed)
            flash::ldmatrix_x4(bf[nj], smem_u32(Bs + swz_rows(ncol + ((mat >> 1) << 3) + (lane & 7), ks + ((mat & 1) << 3))));
          else
            flash::ldmatrix_x4_trans(bf[nj], smem_u32(Bs + swz_cols(ks + ((mat & 1) << 3) + (lane & 7), ncol + ((mat >> 1) << 3))));
        }
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
          for (int ni = 0; ni < 4; ++ni)
            flash::mma_16816<T>(acc[mi][ni], af[mi], bf[ni >> 1][(ni & 1) * 2], bf[ni >> 1][(ni & 1) * 2 + 1]);
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
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <typename T, typename TC, bool kARed, bool kBRed, bool kWeightGrouped, bool kWgmma>
void launch(const Args& args, dim3 grid, cudaStream_t stream) {
  auto* kernel = grouped_mma_kernel<T, TC, kARed, kBRed, kWeightGrouped, kWgmma>;
  static const bool configured = [&] {
    MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    return true;
  }();
  (void)configured;
  kernel<<<grid, THREADS, kSmemBytes, stream>>>(args);
  MT_CUDA_CHECK_LAUNCH();
}

template <typename T, bool kWgmma>
void dispatch(GroupedOp op, DType c_dtype, const Args& args, dim3 grid, cudaStream_t stream) {
  switch (op) {
    case GroupedOp::forward: return launch<T, T, true, true, false, kWgmma>(args, grid, stream);
    case GroupedOp::backward_input: return launch<T, T, true, false, false, kWgmma>(args, grid, stream);
    case GroupedOp::backward_weight:
      if (c_dtype == DType::f32) return launch<T, float, false, false, true, kWgmma>(args, grid, stream);
      return launch<T, T, false, false, true, kWgmma>(args, grid, stream);
  }
}

// Whether this process's GPU runs the wgmma body (compute capability 9.0: the sm_90a build).
bool device_has_wgmma() {
  static const bool yes = [] {
    int dev = 0, major = 0, minor = 0;
    MT_CUDA_CHECK(cudaGetDevice(&dev));
    MT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    MT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    return major == 9 && minor == 0;
  }();
  return yes;
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

bool grouped_mma_run(GroupedOp op, Tensor c, Tensor a, Tensor b, const int32_t* offsets, int64_t experts,
                     bool accumulate, cudaStream_t stream, GroupedKernel kernel, const GroupedSumSquares& sq) {
  const bool wgmma = kernel != GroupedKernel::mma_sync && device_has_wgmma();
  if (wgmma && kernel == GroupedKernel::best && grouped_tma_takes(op, c, a, b, experts)) {
    const bool take_sq = sq.out != nullptr && op == GroupedOp::backward_weight && !accumulate;
    grouped_tma_run(op, c, a, b, offsets, experts, accumulate, stream, take_sq ? sq : GroupedSumSquares{});
    return take_sq;
  }
  const int64_t E = experts;
  MT_CHECK(grouped_mma_takes(op, c, a, b, E), "grouped MMA GEMM: an op it does not take (c [{}] {}, a [{}] {})",
           c.shape_string(), dtype_name(c.dtype), a.shape_string(), dtype_name(a.dtype));
  int64_t N = 0, K = 0;
  feature_sizes(op, c, a, b, E, N, K);
  Args args{};
  args.offsets = offsets;
  args.groups = static_cast<int>(E);
  args.a = a.data;
  args.b = b.data;
  args.c = c.data;
  args.accumulate = accumulate;
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
  dim3 grid;
  if (op == GroupedOp::backward_weight) {
    grid = dim3(static_cast<unsigned>(((args.M + BM - 1) / BM) * args.n_tiles), static_cast<unsigned>(E));
  } else {
    // The most m-tiles the rows can make: sum_e ceil(rows_e / BM) <= (rows + E (BM - 1)) / BM.
    const int64_t rows = a.rows();
    if (rows == 0) return false;
    grid = dim3(static_cast<unsigned>((rows + E * (BM - 1)) / BM * args.n_tiles));
  }
  if (a.dtype == DType::bf16) {
    if (wgmma) dispatch<__nv_bfloat16, true>(op, c.dtype, args, grid, stream);
    else dispatch<__nv_bfloat16, false>(op, c.dtype, args, grid, stream);
  } else {
    if (wgmma) dispatch<__half, true>(op, c.dtype, args, grid, stream);
    else dispatch<__half, false>(op, c.dtype, args, grid, stream);
  }
  return false;
}

}  // namespace mt::cuda

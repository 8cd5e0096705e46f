// cuda/grouped_gemm_mma.h's three ops on Hopper as one warp-specialized, persistent kernel: one
// warpgroup's thread issues TMA loads of A's 128 x 64 and B's 256 x 64 tiles into a 4-deep ring of
// shared memory (mbarriers full/empty per stage), two consumer warpgroups each run
// wgmma.m64n256k16 on 64 of the tile's 128 rows, keeping one k-step's MMAs in flight. A CTA stays
// on the GPU for every tile its blockIdx.x strides over (the grid is at most one CTA per SM), so
// the next tile's loads run during this one's stores. (A ping-pong schedule, each consumer on its
// own 128 x 128 tile, measured slower: bench/RESULTS.md.)
//
// The epilogue: each consumer writes its 64 x 256 fragment to shared memory in 64-row boxes of 128
// bytes (64 16-bit or 32 float32 columns, the 128-byte swizzle), two 8 KB buffers per consumer, and
// its first thread hands each box to a TMA store (a TMA reduce-add for a float32 weight gradient with
// accumulate: old + new in float32, as the register path computes it), then goes on to the next tile
// while the stores drain. A row-grouped fragment whose 64 rows pass its expert's end (the next
// expert's rows, which another CTA writes) and C without a tensor map (see c_map_for) take the
// register stores of store_fragment instead.
//
// Row-grouped ops (forward, input gradient): tiles go expert by expert, the m-tiles of one n-tile
// next to each other, so the CTAs in flight share a few 256-row slabs of the expert's weight and
// its rows (both stay in L2). Rows of A past an expert's end are loaded (they are the next
// expert's, or zeros past the tensor) but their outputs are never stored: an output row depends on
// its own A row only. Reduction columns past the feature size are zeros in A (TMA's out-of-bounds
// fill), so whatever B holds there (the next expert's weight rows, for the input gradient) adds
// nothing; B's rows past the expert's N (forward) only make output columns that are not stored.
//
// With Args::sumsq (a weight gradient written, not accumulated: the gradient norm's share of the
// experts, Backend::grouped_linear_backward_weight), each consumer thread also sums the squares of
// its fragment as stored (in float: four chains per tile, then the thread's running sum, kept in
// shared memory), the warpgroup's sum (in double) goes to sumsq[2 blockIdx.x + cw], and a one-warp
// kernel adds those in index order to the output: the same bits from run to run (a CTA's tiles are
// fixed by the grid), not sum_squares' order. Elements past M, N or the expert's rows are zeros in
// the accumulators (zero operands), so they add nothing.
//
// Weight gradient (the reduction over each expert's rows): tiles go expert by expert, the n-tiles
// of one m-tile next to each other (the expert's x stays in L2, each 128-column slab of dy is read
// by the CTAs next to each other). Both operands are output-contiguous: 64-column boxes of dy
// (A, read transposed) and x (B). At an expert's last, partial k-step the consumers zero the rows
// past its end in shared memory (they hold the next expert's rows) before the MMAs read them.
#include <cuda.h>  // CUtensorMap and cuTensorMapEncodeTiled's types (the function comes from the runtime)

#include <algorithm>

#include "core/error.h"
#include "cuda/bench_choice.h"
#include "cuda/cuda_check.h"
#include "cuda/grouped_gemm_common.cuh"
#include "cuda/grouped_gemm_mma.h"

namespace mt::cuda {
namespace {

using namespace grouped_detail;

constexpr int BM = 128, BN = 256, BK = 64, STAGES = 4;
static_assert(BK == kStepK, "the shared descriptors' k-step");
constexpr int THREADS = 384;  // the producer's warpgroup and two consumers
constexpr int kAElems = BM * BK, kBElems = BN * BK;
constexpr int kStageBytes = (kAElems + kBElems) * 2;
// The epilogue's boxes: two 8 KB buffers per consumer warpgroup, after the ring.
constexpr int kBoxBytes = 64 * 128, kEpilogueBytes = 2 * 2 * kBoxBytes;
constexpr int kSmemBytes = STAGES * kStageBytes + kEpilogueBytes + 1024;  // + room to align the 1024-byte swizzle atoms

struct Args {
  const int* offsets;  // [groups + 1], device
  int groups;
  void* c;
  int ldc;
  int M;       // weight gradient: C's rows per expert
  int N;       // C's columns
  int K;       // row-grouped: the reduction
  int b_rows;  // row-grouped: rows of B's tensor per expert (forward: N; input gradient: the reduction)
  long long c_stride;  // weight gradient: elements from one expert's gradient to the next
  int m_tiles;         // weight gradient: per expert
  int n_tiles;
  bool accumulate;
  bool c_tma;  // the epilogue stores through map_c (see c_map_for)
  double* sumsq;  // weight gradient: [2 gridDim.x] partial sums of squares of C (see the header), or null
};

// (Unused in the sm_90 pass, which compiles the kernel's body out: the sm_90a pass uses them.)
[[maybe_unused]] __device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
[[maybe_unused]] __device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
[[maybe_unused]] __device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
[[maybe_unused]] __device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@done bra DONE;\nbra WAIT;\nDONE:\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
// A 2-D box of the tensor map at (x = column, y = row) into shared memory, counted on bar.
[[maybe_unused]] __device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, int x, int y, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_u32(bar))
      : "memory");
}

// The shared-memory box at src to the tensor map's box at (x, y[, z]): a TMA store (or a reduce-add
// into what the global box holds), in this thread's bulk group.
template <int kDims, bool kAdd>
[[maybe_unused]] __device__ __forceinline__ void tma_store(const CUtensorMap* map, const void* src, int x, int y, int z) {
  const uint64_t m = reinterpret_cast<uint64_t>(map);
  const uint32_t a = smem_u32(src);
  if constexpr (kDims == 2 && !kAdd)
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(m), "r"(x),
                 "r"(y), "r"(a)
                 : "memory");
  else if constexpr (kDims == 3 && !kAdd)
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(m),
                 "r"(x), "r"(y), "r"(z), "r"(a)
                 : "memory");
  else
    asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(m),
                 "r"(x), "r"(y), "r"(z), "r"(a)
                 : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Until at most kPending of this thread's bulk groups still read shared memory.
template <int kPending>
[[maybe_unused]] __device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// Until this thread's bulk groups are complete (their writes done).
[[maybe_unused]] __device__ __forceinline__ void tma_store_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
// Named barrier `id` over one consumer warpgroup (ids 2 and 3; 1 is both consumers', 0 the CTA's).
[[maybe_unused]] __device__ __forceinline__ void warpgroup_sync(int id) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
}

// A tile: its expert g, its first row m0 of C (row-grouped: within the expert's rows) and first
// column n0; row0 and rows: the expert's rows; nk: its k-steps.
struct Tile {
  int g, m0, n0, row0, rows, nk;
};

// Tile t of a launch. Row-grouped: expert by expert, the m-tiles of one n-tile next to each other
// (first_tile: the experts' first m-tiles). Weight gradient: expert by expert, the n-tiles of one
// m-tile next to each other.
template <bool kWeight>
__device__ __forceinline__ Tile tile_at(const Args& args, const int* first_tile, int t) {
  Tile x;
  if constexpr (kWeight) {
    const int per_expert = args.m_tiles * args.n_tiles, local = t % per_expert;
    x.g = t / per_expert;
    x.m0 = (local / args.n_tiles) * BM;
    x.n0 = (local % args.n_tiles) * BN;
  } else {
    x.g = grouped_tile_expert(first_tile, args.groups, t / args.n_tiles);
    const int count = (args.offsets[x.g + 1] - args.offsets[x.g] + BM - 1) / BM;
    const int local = t - first_tile[x.g] * args.n_tiles;
    x.m0 = (local % count) * BM;
    x.n0 = (local / count) * BN;
  }
  x.row0 = args.offsets[x.g];
  x.rows = args.offsets[x.g + 1] - x.row0;
  x.nk = ((kWeight ? x.rows : args.K) + BK - 1) / BK;
  return x;
}

// The producer's thread: every k-step of the CTA's tiles, in order, into the ring.
template <typename T, GroupedOp kOp>
__device__ __forceinline__ void produce(const CUtensorMap* map_a, const CUtensorMap* map_b, const Args& args,
                                        const int* first_tile, int tiles, T* smem, uint64_t* full, uint64_t* empty) {
  constexpr bool kWeight = kOp == GroupedOp::backward_weight;
  int it = 0;  // k-steps loaded by this CTA over all its tiles
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const Tile x = tile_at<kWeight>(args, first_tile, t);
    for (int kt = 0; kt < x.nk; ++kt, ++it) {
      const int s = it % STAGES;
      if (it >= STAGES) mbar_wait(&empty[s], ((it / STAGES) - 1) & 1);
      T* As = smem + s * (kAElems + kBElems);
      T* Bs = As + kAElems;
      mbar_expect_tx(&full[s], kStageBytes);
      if constexpr (kWeight) {
#pragma unroll
        for (int q = 0; q < BM / 64; ++q) tma_load(As + q * BK * 64, map_a, x.m0 + q * 64, x.row0 + kt * BK, &full[s]);
#pragma unroll
        for (int q = 0; q < BN / 64; ++q) tma_load(Bs + q * BK * 64, map_b, x.n0 + q * 64, x.row0 + kt * BK, &full[s]);
      } else {
        tma_load(As, map_a, kt * BK, x.row0 + x.m0, &full[s]);
        if constexpr (kOp == GroupedOp::forward) {
          tma_load(Bs, map_b, kt * BK, x.g * args.b_rows + x.n0, &full[s]);
        } else {
#pragma unroll
          for (int q = 0; q < BN / 64; ++q)
            tma_load(Bs + q * BK * 64, map_b, x.n0 + q * 64, x.g * args.b_rows + kt * BK, &full[s]);
        }
      }
    }
  }
}

// Weight gradient, an expert's last k-step of `valid` < 64 rows: rows [valid, 64) of the stage's
// 64-row boxes (A's two, B's four; 128 bytes a row whatever the swizzle) hold the next expert's
// rows. The two consumer warpgroups zero them, then (named barrier 1) the MMAs may read them.
template <typename T>
__device__ __forceinline__ void zero_tail(T* As, T* Bs, int valid) {
  constexpr int kBoxes = BM / 64 + BN / 64, kThreads = 2 * 128;
  const int chunks = (BK - valid) * 8;  // 16-byte chunks per box
  for (int i = static_cast<int>(threadIdx.x) - 128; i < kBoxes * chunks; i += kThreads) {
    const int box = i / chunks, c = i % chunks;
    T* base = box < BM / 64 ? As + box * BK * 64 : Bs + (box - BM / 64) * BK * 64;
    *reinterpret_cast<int4*>(reinterpret_cast<char*>(base) + valid * 128 + c * 16) = make_int4(0, 0, 0, 0);
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  asm volatile("bar.sync 1, %0;\n" ::"n"(kThreads) : "memory");
}

// A warpgroup's 64 x 256 fragment: d[4 j + 2 h + {0, 1}] is row r + 8 h (r: warp w of the
// warpgroup's 16 w + lane / 4), columns col0 + 8 j + 2 (lane % 4) + {0, 1}; rows up to row_end
// and columns up to n_end are stored (added to C with accumulate). With accumulate, C's old values
// are read four column groups at a time before any is written, so their latencies overlap.
template <typename TC>
__device__ __forceinline__ void store_fragment(TC* C, long long ldc, const float (&d)[128], int r, int row_end,
                                               int col0, int n_end, bool accumulate) {
  constexpr int kGroup = 4;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j0 = 0; j0 < 32; j0 += kGroup) {
    float2 old[kGroup][2];
#pragma unroll
    for (int jj = 0; jj < kGroup; ++jj)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = col0 + (j0 + jj) * 8 + ((lane & 3) << 1);
        old[jj][h] = accumulate && col < n_end && r + 8 * h < row_end
                         ? load2<TC>(C + static_cast<long long>(r + 8 * h) * ldc + col)
                         : make_float2(0.0f, 0.0f);
      }
#pragma unroll
    for (int jj = 0; jj < kGroup; ++jj) {
      const int j = j0 + jj, col = col0 + j * 8 + ((lane & 3) << 1);
      if (col >= n_end) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (r + 8 * h < row_end)
          store2<TC>(C + static_cast<long long>(r + 8 * h) * ldc + col, d[4 * j + 2 * h] + old[jj][h].x,
                     d[4 * j + 2 * h + 1] + old[jj][h].y, false);
    }
  }
}

// The TMA epilogue of a warpgroup's 64 x 256 fragment (see the header): boxes of 128-byte rows, box
// b's columns [b w, b w + w) of the fragment (w = 64 16-bit or 32 float32 values), written to the
// warpgroup's two buffers in turn with the 128-byte swizzle (16-byte chunk c of row r at chunk
// c ^ (r % 8)), each stored from (x0 + b w, y0[, z]) by the warpgroup's first thread. `boxes`
// counts the warpgroup's boxes so far (the buffer in turn, and when one must wait for its store).
template <typename TC, bool kWeight>
__device__ __forceinline__ void store_fragment_tma(const CUtensorMap* map, unsigned char* bufs, const float (&d)[128],
                                                   int x0, int y0, int z, bool add, int bar_id, int& boxes) {
  constexpr bool kF32 = std::is_same_v<TC, float>;
  constexpr int kBoxes = kF32 ? 8 : 4, kJ = 32 / kBoxes;  // boxes per fragment, fragment columns of 8 per box
  constexpr int kW = kF32 ? 32 : 64;
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const bool leader = (threadIdx.x & 127) == 0;
#pragma unroll
  for (int b = 0; b < kBoxes; ++b, ++boxes) {
    unsigned char* buf = bufs + (boxes & 1) * kBoxBytes;
    if (boxes >= 2) {
      if (leader) tma_store_wait_read<1>();  // the store of this buffer's last box has read it
      warpgroup_sync(bar_id);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = (warp << 4) + (lane >> 2) + 8 * h;
      unsigned char* row = buf + r * 128;
#pragma unroll
      for (int jj = 0; jj < kJ; ++jj) {
        const int j = b * kJ + jj;
        const float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
        if constexpr (kF32) {
          const int chunk = 2 * jj + ((lane & 3) >> 1);
          *reinterpret_cast<float2*>(row + ((chunk ^ (r & 7)) << 4) + ((lane & 1) << 3)) = make_float2(v0, v1);
        } else {
          uint32_t packed;
          if constexpr (std::is_same_v<TC, __nv_bfloat16>) {
            const __nv_bfloat162 t = __floats2bfloat162_rn(v0, v1);
            packed = *reinterpret_cast<const uint32_t*>(&t);
          } else {
            const __half2 t = __floats2half2_rn(v0, v1);
            packed = *reinterpret_cast<const uint32_t*>(&t);
          }
          *reinterpret_cast<uint32_t*>(row + ((jj ^ (r & 7)) << 4) + ((lane & 3) << 2)) = packed;
        }
      }
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the writes, seen by the TMA unit
    warpgroup_sync(bar_id);
    if (leader) {
      if constexpr (kWeight) {
        if (add) tma_store<3, true>(map, buf, x0 + b * kW, y0, z);
        else tma_store<3, false>(map, buf, x0 + b * kW, y0, z);
      } else {
        tma_store<2, false>(map, buf, x0 + b * kW, y0, 0);
      }
    }
  }
}

// The sum of squares of a fragment's 128 values as C stores them (16-bit C: rounded first), in
// float, in order.
template <typename TC>
[[maybe_unused]] __device__ __forceinline__ float sum_squares_as_stored(const float (&d)[128]) {
  float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // (four chains: the FMAs' latency overlaps)
#pragma unroll
  for (int i = 0; i < 128; ++i) {
    float v = d[i];
    if constexpr (std::is_same_v<TC, __nv_bfloat16>) v = __bfloat162float(__float2bfloat16_rn(v));
    else if constexpr (std::is_same_v<TC, __half>) v = __half2float(__float2half_rn(v));
    s[i % 4] = __fmaf_rn(v, v, s[i % 4]);
  }
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// kOp: forward (A = x, B = w_e [N, K] reduction-contiguous), backward_input (A = dy, B = w_e
// [reduction, K] output-contiguous: its columns as 64-wide boxes 8 KB apart), backward_weight
// (A = dy [rows, N] and B = x [rows, K], both output-contiguous). TC: C's dtype.
template <typename T, typename TC, GroupedOp kOp>
__global__ void __launch_bounds__(THREADS, 1)
    grouped_tma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                       const __grid_constant__ CUtensorMap map_c, const __grid_constant__ Args args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kWeight = kOp == GroupedOp::backward_weight;
  constexpr bool kARed = !kWeight, kBRed = kOp == GroupedOp::forward;
  extern __shared__ unsigned char smem_raw[];
  T* const smem = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  __shared__ alignas(8) uint64_t full[STAGES], empty[STAGES];
  __shared__ int first_tile[kWeight ? 1 : kGroupedMmaMaxGroups];
  __shared__ int warp_total[THREADS / 32];
  static_assert(THREADS >= kGroupedMmaMaxGroups, "one thread per expert");
  const int tid = threadIdx.x;
  const int tiles = kWeight ? args.groups * args.m_tiles * args.n_tiles
                            : grouped_first_tiles<THREADS>(args.offsets, args.groups, BM, first_tile, warp_total) *
                                  args.n_tiles;
  if (static_cast<int>(blockIdx.x) >= tiles) return;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 2 * 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (tid < 128) {  // the producer: one thread
    if (tid == 0) produce<T, kOp>(&map_a, &map_b, args, first_tile, tiles, smem, full, empty);
    return;
  }
  const int cw = (tid >> 7) - 1, warp = (tid >> 5) & 3;
  const int r_in = (warp << 4) + ((tid & 31) >> 2);  // this thread's first row in a 64-row fragment
  int it = 0;  // the CTA's k-steps before the tile at hand (both consumers')
  unsigned char* const c_bufs = reinterpret_cast<unsigned char*>(smem + STAGES * (kAElems + kBElems)) + cw * 2 * kBoxBytes;
  int boxes = 0;  // this warpgroup's epilogue boxes so far
  // Args::sumsq: this thread's sum of squares over its tiles, in shared memory (a register held
  // across the main loop spills there).
  __shared__ float thread_sq[kWeight ? 2 * 128 : 1];
  float* const my_sq = &thread_sq[tid - 128];
  if constexpr (kWeight) *my_sq = 0.0f;
  // Consumer cw computes rows [64 cw, 64 cw + 64) of every tile, all 256 columns.
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const Tile x = tile_at<kWeight>(args, first_tile, t);
    if (kWeight && x.nk == 0 && args.accumulate) continue;  // an expert without rows adds nothing
    float d[128];
    zero(d);
    for (int kt = 0; kt < x.nk; ++kt, ++it) {
      const int s = it % STAGES;
      mbar_wait(&full[s], (it / STAGES) & 1);
      T* As = smem + s * (kAElems + kBElems);
      T* Bs = As + kAElems;
      if (kWeight && x.rows - kt * BK < BK) zero_tail(As, Bs, x.rows - kt * BK);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        uint64_t da, db;
        descriptors<kARed, kBRed>(As, Bs, cw, kk, da, db);
        wgmma_m64n256k16<kARed ? 0 : 1, kBRed ? 0 : 1, T>(d, da, db);
      }
      wgmma_commit();
      wgmma_wait_one();  // the previous k-step's MMAs are done: its stage goes back to the producer
      if (kt > 0) mbar_arrive(&empty[(it - 1) % STAGES]);
    }
    wgmma_wait_all();
    if (x.nk > 0) mbar_arrive(&empty[(it - 1) % STAGES]);
    fence_registers(d);
    if constexpr (kWeight) {
      if (args.sumsq != nullptr) *my_sq += sum_squares_as_stored<TC>(d);
    }
    // The TMA epilogue: a weight gradient's boxes are clipped at its expert's M rows by the 3-D map;
    // a row-grouped fragment only when its 64 rows are all the expert's.
    if (args.c_tma && (kWeight || x.m0 + cw * 64 + 64 <= x.rows)) {
      store_fragment_tma<TC, kWeight>(&map_c, c_bufs, d, x.n0, kWeight ? x.m0 + cw * 64 : x.row0 + x.m0 + cw * 64, x.g,
                                      args.accumulate, 2 + cw, boxes);
      continue;
    }
    TC* Cp = static_cast<TC*>(args.c) + (kWeight ? x.g * args.c_stride : static_cast<long long>(x.row0) * args.ldc);
    store_fragment<TC>(Cp, args.ldc, d, x.m0 + cw * 64 + r_in, kWeight ? args.M : x.rows, x.n0, args.N,
                       args.accumulate);
  }
  if constexpr (kWeight) {
    if (args.sumsq != nullptr) {
      __shared__ double warp_sq[8];
      double sq = *my_sq;
#pragma unroll
      for (int o = 16; o > 0; o /= 2) sq += __shfl_xor_sync(0xffffffffu, sq, o);
      if ((tid & 31) == 0) warp_sq[cw * 4 + warp] = sq;
      warpgroup_sync(2 + cw);
      if ((tid & 127) == 0)
        args.sumsq[2 * blockIdx.x + cw] = ((warp_sq[cw * 4] + warp_sq[cw * 4 + 1]) + warp_sq[cw * 4 + 2]) +
                                          warp_sq[cw * 4 + 3];
    }
  }
  // The bulk stores read this CTA's shared memory and must finish before it goes.
  if (boxes > 0 && (tid & 127) == 0) tma_store_wait_all();
#endif
}

// out[0] += the n partial sums in index order (one warp: lane l sums l, l + 32, ..., then a fixed
// butterfly), out's old value added in double.
__global__ void sumsq_finish_kernel(float* out, const double* partials, int n) {
  double s = 0.0;
  for (int i = static_cast<int>(threadIdx.x); i < n; i += 32) s += partials[i];
#pragma unroll
  for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (threadIdx.x == 0) out[0] = static_cast<float>(static_cast<double>(out[0]) + s);
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    MT_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found));
    MT_CHECK(found == cudaDriverEntryPointSuccess && p != nullptr,
             "grouped GEMM: the CUDA driver has no cuTensorMapEncodeTiled (a driver for CUDA 12 or newer is needed)");
    return reinterpret_cast<EncodeTiled>(p);
  }();
  return fn;
}

// A tensor map of a row-major 16-bit matrix [rows, cols] (ld elements per row), boxes of
// box_rows x 64 columns (128 bytes) in the 128-byte swizzle; out-of-bounds elements read as zeros.
CUtensorMap tensor_map(const void* base, DType dt, int64_t rows, int64_t cols, int64_t ld, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 2};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode_tiled()(
      &map, dt == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
      const_cast<void*>(base), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MT_CHECK(r == CUDA_SUCCESS, "grouped GEMM: cuTensorMapEncodeTiled failed ({}) for [{}, {}] ld {}", static_cast<int>(r),
           rows, cols, ld);
  return map;
}

// The epilogue's map of C (Args::c_tma), or false where the register stores take C: a row-grouped op's C
// [rows, N] 16-bit in boxes of 64 rows x 64 columns; a weight gradient's [E, M, N] (16-bit or float32)
// as a 3-D map in boxes of 64 rows x 128 bytes, so that a box stops at its expert's M rows. TMA
// needs C 16-byte aligned with 16-byte row strides; the register stores take a 16-bit C with
// accumulate (their rounding of old + new is the one of store2).
bool c_map_for(GroupedOp op, const Tensor& c, const Args& args, CUtensorMap& map) {
  const int64_t elem = c.dtype == DType::f32 ? 4 : 2;
  if (reinterpret_cast<uintptr_t>(c.data) % 16 != 0 || (args.ldc * elem) % 16 != 0) return false;
  if (args.accumulate && (op != GroupedOp::backward_weight || c.dtype != DType::f32)) return false;
  CUtensorMapDataType type = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  if (c.dtype == DType::bf16) type = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  else if (c.dtype == DType::f16) type = CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  else if (c.dtype != DType::f32) return false;
  const cuuint32_t box_cols = static_cast<cuuint32_t>(128 / elem);
  const cuuint32_t element_strides[3] = {1, 1, 1};
  CUresult r;
  if (op == GroupedOp::backward_weight) {
    if ((args.c_stride * elem) % 16 != 0) return false;
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(args.N), static_cast<cuuint64_t>(args.M),
                                static_cast<cuuint64_t>(args.groups)};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(args.ldc * elem),
                                   static_cast<cuuint64_t>(args.c_stride * elem)};
    const cuuint32_t box[3] = {box_cols, 64, 1};
    r = encode_tiled()(&map, type, 3, c.data, dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                       CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  } else {
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(args.N), static_cast<cuuint64_t>(c.rows())};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(args.ldc * elem)};
    const cuuint32_t box[2] = {box_cols, 64};
    r = encode_tiled()(&map, type, 2, c.data, dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                       CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  }
  return r == CUDA_SUCCESS;
}

template <typename T, typename TC, GroupedOp kOp>
void launch(const CUtensorMap& a, const CUtensorMap& b, const CUtensorMap& c, const Args& args, int grid,
            cudaStream_t stream) {
  auto* kernel = grouped_tma_kernel<T, TC, kOp>;
  static const bool configured = [&] {
    MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    return true;
  }();
  (void)configured;
  kernel<<<grid, THREADS, kSmemBytes, stream>>>(a, b, c, args);
  MT_CUDA_CHECK_LAUNCH();
}

int sm_count() {
  static const int n = [] {
    int dev = 0, count = 0;
    MT_CUDA_CHECK(cudaGetDevice(&dev));
    MT_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev));
    return count;
  }();
  return n;
}

template <typename T>
void dispatch(GroupedOp op, DType c_dtype, const CUtensorMap& a, const CUtensorMap& b, const CUtensorMap& c,
              const Args& args, int grid, cudaStream_t stream) {
  switch (op) {
    case GroupedOp::forward: return launch<T, T, GroupedOp::forward>(a, b, c, args, grid, stream);
    case GroupedOp::backward_input: return launch<T, T, GroupedOp::backward_input>(a, b, c, args, grid, stream);
    case GroupedOp::backward_weight:
      if (c_dtype == DType::f32) return launch<T, float, GroupedOp::backward_weight>(a, b, c, args, grid, stream);
      return launch<T, T, GroupedOp::backward_weight>(a, b, c, args, grid, stream);
  }
}

}  // namespace

bool grouped_tma_takes(GroupedOp op, const Tensor& c, const Tensor& a, const Tensor& b, int64_t experts) {
  if (!grouped_mma_takes(op, c, a, b, experts)) return false;
  // Every tensor at least one box wide and long (the maps' boxes are 64 columns wide; A's 128 rows
  // long for the row-grouped ops, B's up to 256 for the forward, the rest 64).
  if (a.cols() < 64 || b.cols() < 64) return false;
  switch (op) {
    case GroupedOp::forward: return c.dtype == a.dtype && a.rows() >= BM && b.rows() >= BN;
    case GroupedOp::backward_input: return c.dtype == a.dtype && a.rows() >= BM && b.rows() >= BK;
    case GroupedOp::backward_weight: return a.rows() >= BK && b.rows() >= BK;
  }
  return false;
}

int64_t grouped_sumsq_partials() { return 2LL * sm_count(); }

void grouped_tma_run(GroupedOp op, Tensor c, Tensor a, Tensor b, const int32_t* offsets, int64_t experts,
                     bool accumulate, cudaStream_t stream, const GroupedSumSquares& sq) {
  MT_CHECK(sq.out == nullptr || (op == GroupedOp::backward_weight && !accumulate && sq.partials != nullptr),
           "grouped TMA GEMM: a sum of squares of a weight gradient written, with its partials' room, only");
  MT_CHECK(grouped_tma_takes(op, c, a, b, experts), "grouped TMA GEMM: an op it does not take (c [{}] {}, a [{}] {})",
           c.shape_string(), dtype_name(c.dtype), a.shape_string(), dtype_name(a.dtype));
  const int64_t E = experts, rows = a.rows();
  Args args{};
  args.offsets = offsets;
  args.groups = static_cast<int>(E);
  args.c = c.data;
  args.ldc = static_cast<int>(c.cols());
  args.N = static_cast<int>(c.cols());
  args.accumulate = accumulate;
  args.n_tiles = (args.N + BN - 1) / BN;
  int64_t most = 0;  // tiles, or the most the rows can make
  CUtensorMap map_a, map_b;
  if (op == GroupedOp::backward_weight) {
    // C = dw [E N, K]; A = dy [rows, N], B = x [rows, K]: boxes of 64 rows (the reduction) by 64 columns.
    args.M = static_cast<int>(c.rows() / E);
    args.c_stride = static_cast<long long>(args.M) * args.N;
    args.m_tiles = (args.M + BM - 1) / BM;
    map_a = tensor_map(a.data, a.dtype, rows, a.cols(), a.cols(), BK);
    map_b = tensor_map(b.data, b.dtype, b.rows(), b.cols(), b.cols(), BK);
    most = E * args.m_tiles * args.n_tiles;
  } else {
    args.K = static_cast<int>(a.cols());
    args.b_rows = static_cast<int>(b.rows() / E);
    // A: x [rows, K] (forward) or dy [rows, N] (input gradient), the reduction contiguous.
    map_a = tensor_map(a.data, a.dtype, rows, a.cols(), a.cols(), BM);
    // B: w [E N, K]; the forward's boxes are BN of its rows, the input gradient's 64 (reduction)
    // rows of 64 output columns.
    map_b = tensor_map(b.data, b.dtype, b.rows(), b.cols(), b.cols(), op == GroupedOp::forward ? BN : BK);
    // sum_e ceil(rows_e / BM) <= (rows + E (BM - 1)) / BM m-tiles.
    most = (rows + E * (BM - 1)) / BM * args.n_tiles;
  }
  if (most == 0) return;
  CUtensorMap map_c{};
  args.c_tma = !bench_choice::grouped_register_epilogue && c_map_for(op, c, args, map_c);
  const int grid = static_cast<int>(std::min<int64_t>(most, sm_count()));
  args.sumsq = sq.partials;
  if (a.dtype == DType::bf16) dispatch<__nv_bfloat16>(op, c.dtype, map_a, map_b, map_c, args, grid, stream);
  else dispatch<__half>(op, c.dtype, map_a, map_b, map_c, args, grid, stream);
  if (sq.out != nullptr) {
    sumsq_finish_kernel<<<1, 32, 0, stream>>>(sq.out, sq.partials, 2 * grid);
    MT_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace mt::cuda

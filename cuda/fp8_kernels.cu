// FP8 element kernels; see fp8_kernels.h.
//
// All casts are bandwidth-bound. The vector paths move 16 input bytes (8 bf16 / 2x4 float) per
// thread and write 8 fp8 bytes; the grids are capped at a few blocks per SM and stride over the
// work, so amax costs one atomicMax per block, not per tile.
#include "cuda/bench_choice.h"
#include "cuda/fp8_kernels.h"

#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "cuda/cuda_check.h"
#include "cuda/activations.cuh"
#include "cuda/device_utils.cuh"
#include "cuda/gemm_cublaslt.h"  // column_partials_accumulate
#include "cuda/norm_math.cuh"

namespace mt::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;

template <Fp8Format F>
__device__ __forceinline__ uint8_t to_fp8(float v) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, F == Fp8Format::e4m3 ? __NV_E4M3 : __NV_E5M2);
}

// Two values in one cvt (low byte = a).
template <Fp8Format F>
__device__ __forceinline__ uint16_t to_fp8x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, F == Fp8Format::e4m3 ? __NV_E4M3 : __NV_E5M2);
}

template <Fp8Format F>
__device__ __forceinline__ float from_fp8(uint8_t v) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(v, F == Fp8Format::e4m3 ? __NV_E4M3 : __NV_E5M2);
  return __half2float(__half(h));
}

// 8 fp8 bytes of 8 scaled floats, packed little-endian (element j in byte j).
template <Fp8Format F>
__device__ __forceinline__ uint2 pack8(const Floats<8>& v, float scale) {
  uint2 r;
  r.x = static_cast<uint32_t>(to_fp8x2<F>(v.v[0] * scale, v.v[1] * scale)) |
        (static_cast<uint32_t>(to_fp8x2<F>(v.v[2] * scale, v.v[3] * scale)) << 16);
  r.y = static_cast<uint32_t>(to_fp8x2<F>(v.v[4] * scale, v.v[5] * scale)) |
        (static_cast<uint32_t>(to_fp8x2<F>(v.v[6] * scale, v.v[7] * scale)) << 16);
  return r;
}

// ---- flat cast ----------------------------------------------------------------------------------
template <typename T, Fp8Format F, int VEC>
__global__ void cast_kernel(uint8_t* __restrict__ out, const T* __restrict__ in, int64_t n, const float* scale_p,
                            float* amax) {
  const float scale = *scale_p;
  float m = 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if constexpr (VEC == 8) {
    const int64_t nv = n / 8;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nv; i += stride) {
      const Floats<8> v = load_vec<8>(in + i * 8);
#pragma unroll
      for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(v.v[j]));
      reinterpret_cast<uint2*>(out)[i] = pack8<F>(v, scale);
    }
  } else {
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
      const float v = to_float(in[i]);
      m = fmaxf(m, fabsf(v));
      out[i] = to_fp8<F>(v * scale);
    }
  }
  if (amax) block_amax_atomic(amax, m);
}

// ---- cast + transpose -----------------------------------------------------------------------------
// Tiles of 64 x 64 elements. Phase 1 reads the tile row by row (VEC elements per access), writes
// the row-major fp8 output and keeps the bytes in shared memory; phase 2 writes the transposed
// tile, VEC bytes of one output row per access. VEC = 8 needs R and C multiples of 8.
// Shared-memory rows are 66 bytes: phase 2's threads read one byte from each of 8 rows 8 apart,
// and 8 * 66 bytes = 132 words puts those rows in different banks (a 64- or 72-byte row would
// put every second one in the same bank). Phase 1 therefore stores 2-byte pieces (66 is even).
constexpr int kTile = 64;
constexpr int kTileStride = kTile + 2;

// The raw bytes of 8 consecutive elements of T (one 16-byte load per 8 bf16, two per float),
// fetched apart from their conversion so that a thread can have several rows' loads in flight
// before it computes anything (cast_transpose_blocks_kernel) at 4 registers per 16 bytes.
template <typename T>
struct Raw8 {
  int4 q[(8 * sizeof(T) + 15) / 16];
};

template <typename T>
__device__ __forceinline__ Raw8<T> fetch8(const T* p) {
  Raw8<T> r;
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(r.q) / sizeof(int4)); ++i) r.q[i] = reinterpret_cast<const int4*>(p)[i];
  return r;
}

template <typename T>
__device__ __forceinline__ Floats<8> floats8(const Raw8<T>& r) {
  return load_vec<8>(reinterpret_cast<const T*>(r.q));
}

// What a cast reads: element (r, c) of the [R, C] tensor it quantizes, as a float. PlainInput is
// the tensor itself; the activation readers compute it from fc1's output exactly as activation_forward /
// swiglu_forward would store it (the activation in float32, rounded to T), so the bytes equal
// those of the activation op followed by the plain cast.
// Each reader: ptrs(r, c) gives the addresses of the kStreams tensors' 8 elements behind the 8
// values at (r, c), compute(raw, r, c, v) turns their raw bytes into the values of its kHalves
// halves; load1 is the one-element path.
template <typename T>
struct PlainInput {
  static constexpr int kHalves = 1;  // see SwigluGradInput
  static constexpr bool kTileKernel = false;
  using Elem = T;
  const T* __restrict__ in;
  int64_t C;
  static constexpr int kStreams = 1;
  __device__ __forceinline__ void ptrs(int64_t r, int64_t c, const T* (&p)[1]) const { p[0] = in + r * C + c; }
  __device__ __forceinline__ void compute(const Raw8<T> (&raw)[1], int64_t, int64_t, Floats<8> (&v)[1]) const {
    v[0] = floats8(raw[0]);
  }
  __device__ __forceinline__ float load1(int64_t r, int64_t c) const { return to_float(in[r * C + c]); }
};

template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

template <typename T, Activation A>
struct ActivationInput {
  static constexpr int kHalves = 1;
  static constexpr bool kTileKernel = false;
  using Elem = T;
  const T* __restrict__ pre;
  int64_t C;
  static constexpr int kStreams = 1;
  __device__ __forceinline__ void ptrs(int64_t r, int64_t c, const T* (&p)[1]) const { p[0] = pre + r * C + c; }
  __device__ __forceinline__ void compute(const Raw8<T> (&raw)[1], int64_t, int64_t, Floats<8> (&v)[1]) const {
    v[0] = floats8(raw[0]);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[0].v[j] = round_to<T>(act_value(v[0].v[j], A));
  }
  __device__ __forceinline__ float load1(int64_t r, int64_t c) const {
    return round_to<T>(act_value(to_float(pre[r * C + c]), A));
  }
};

// pre [R, 2C] = [gate | up] per row.
template <typename T>
struct SwigluInput {
  static constexpr int kHalves = 1;
  static constexpr bool kTileKernel = true;  // see launch_cast_transpose
  using Elem = T;
  const T* __restrict__ pre;
  int64_t C;
  Glu glu;  // (plain: SwiGLU's own expressions, glu_value)
  static constexpr int kStreams = 2;  // gate, up
  __device__ __forceinline__ void ptrs(int64_t r, int64_t c, const T* (&p)[2]) const {
    p[0] = pre + r * 2 * C + c;
    p[1] = p[0] + C;
  }
  __device__ __forceinline__ void compute(const Raw8<T> (&raw)[2], int64_t, int64_t, Floats<8> (&v)[1]) const {
    const Floats<8> gate = floats8(raw[0]), up = floats8(raw[1]);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[0].v[j] = round_to<T>(glu_value(glu, gate.v[j], up.v[j]));
  }
  __device__ __forceinline__ float load1(int64_t r, int64_t c) const {
    const T* row = pre + r * 2 * C;
    return round_to<T>(glu_value(glu, to_float(row[c]), to_float(row[C + c])));
  }
};

// dout * act'(pre), both [R, C].
template <typename T, Activation A>
struct ActivationGradInput {
  static constexpr int kHalves = 1;
  static constexpr bool kTileKernel = false;
  using Elem = T;
  const T* __restrict__ dout;
  const T* __restrict__ pre;
  int64_t C;
  static constexpr int kStreams = 2;  // dout, pre
  __device__ __forceinline__ void ptrs(int64_t r, int64_t c, const T* (&p)[2]) const {
    p[0] = dout + r * C + c;
    p[1] = pre + r * C + c;
  }
  __device__ __forceinline__ void compute(const Raw8<T> (&raw)[2], int64_t, int64_t, Floats<8> (&v)[1]) const {
    v[0] = floats8(raw[0]);
    const Floats<8> x = floats8(raw[1]);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[0].v[j] = round_to<T>(v[0].v[j] * act_grad(x.v[j], A));
  }
  __device__ __forceinline__ float load1(int64_t r, int64_t c) const {
    return round_to<T>(to_float(dout[r * C + c]) * act_grad(to_float(pre[r * C + c]), A));
  }
};

// SwiGLU's input gradient [R, 2F] = [dgate | dup] from dout [R, F] and pre [R, 2F] = [gate | up].
// Both halves come from the same gate, up and dout elements, so this reader gives them together
// (kHalves = 2): the kernel tiles the [R, F] half and writes element (r, j) to columns j and F + j.
template <typename T>
struct SwigluGradInput {
  static constexpr int kHalves = 2;
  static constexpr bool kTileKernel = true;  // see launch_cast_transpose
  using Elem = T;
  const T* __restrict__ dout;
  const T* __restrict__ pre;
  int64_t F;
  Glu glu;
  static constexpr int kStreams = 3;  // gate, up, dout
  __device__ __forceinline__ void ptrs(int64_t r, int64_t j0, const T* (&p)[3]) const {
    p[0] = pre + r * 2 * F + j0;
    p[1] = p[0] + F;
    p[2] = dout + r * F + j0;
  }
  __device__ __forceinline__ void compute(const Raw8<T> (&raw)[3], int64_t, int64_t, Floats<8> (&v)[2]) const {
    const Floats<8> gate = floats8(raw[0]), up = floats8(raw[1]), dy = floats8(raw[2]);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float dg, du;
      glu_grad(glu, gate.v[j], up.v[j], dy.v[j], dg, du);
      v[0].v[j] = round_to<T>(dg);
      v[1].v[j] = round_to<T>(du);
    }
  }
  __device__ __forceinline__ void load1(int64_t r, int64_t j, float (&v)[2]) const {
    const T* row = pre + r * 2 * F;
    float dg, du;
    glu_grad(glu, to_float(row[j]), to_float(row[F + j]), to_float(dout[r * F + j]), dg, du);
    v[0] = round_to<T>(dg);
    v[1] = round_to<T>(du);
  }
};

// y = norm(x) from x and the statistics the norm's forward stored, in that kernel's rounding order
// (cuda/norm_math.cuh) and rounded to T as it stores y: the bytes of norm_forward then the plain
// cast. mean may be null (RMSNorm: 0), bias too.
template <typename T>
struct NormInput {
  static constexpr int kHalves = 1;
  static constexpr bool kTileKernel = false;
  using Elem = T;
  const T* __restrict__ x;
  const float* __restrict__ mean;
  const float* __restrict__ rstd;
  const T* __restrict__ w;
  const T* __restrict__ b;
  int64_t C;
  float w_shift;  // 1 with --apply-layernorm-1p
  static constexpr int kStreams = 1;
  __device__ __forceinline__ float value(float xv, float m, float rs, float wv, const T* bp) const {
    const float xhat = norm_xhat(xv, m, rs);
    return round_to<T>(bp ? norm_apply(xhat, wv + w_shift, to_float(*bp)) : norm_apply(xhat, wv + w_shift));
  }
  __device__ __forceinline__ void ptrs(int64_t r, int64_t c, const T* (&p)[1]) const { p[0] = x + r * C + c; }
  __device__ __forceinline__ void compute(const Raw8<T> (&raw)[1], int64_t r, int64_t c, Floats<8> (&v)[1]) const {
    v[0] = floats8(raw[0]);
    const Floats<8> wv = load_vec<8>(w + c);
    const float m = mean ? mean[r] : 0.0f, rs = rstd[r];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[0].v[j] = value(v[0].v[j], m, rs, wv.v[j], b ? b + c + j : nullptr);
  }
  __device__ __forceinline__ float load1(int64_t r, int64_t c) const {
    return value(to_float(x[r * C + c]), mean ? mean[r] : 0.0f, rstd[r], to_float(w[c]), b ? b + c : nullptr);
  }
};

// The raw bytes behind one reader vector: 8 elements of each of its streams.
template <typename Input>
struct RawVecs {
  Raw8<typename Input::Elem> s[Input::kStreams];
};

template <typename Input>
__device__ __forceinline__ void fetch_raw(const Input& in, int64_t r, int64_t c, RawVecs<Input>& raw) {
  const typename Input::Elem* p[Input::kStreams];
  in.ptrs(r, c, p);
#pragma unroll
  for (int k = 0; k < Input::kStreams; ++k) raw.s[k] = fetch8(p[k]);
}

// One reader call: the element vector(s) at (r, c) of each half (kHalves == 1: the tensor's own).
template <typename Input, int VEC>
__device__ __forceinline__ void read_halves(const Input& in, int64_t r, int64_t c, Floats<VEC> (&v)[Input::kHalves]) {
  if constexpr (VEC == 8) {
    RawVecs<Input> raw;
    fetch_raw(in, r, c, raw);
    in.compute(raw.s, r, c, v);
  } else if constexpr (Input::kHalves == 2) {
    float f[2];
    in.load1(r, c, f);
    v[0].v[0] = f[0], v[1].v[0] = f[1];
  } else {
    v[0].v[0] = in.load1(r, c);
  }
}

// out and out_t may both be null: then only the amax is taken (tensorwise scaling's first pass).
// DBIAS: also the column sums of the input (the bias gradient of an output gradient). A block then
// takes `group` row tiles of one column tile in turn (a work item), each thread adding its columns
// over its rows, and writes the item's sums to col_partial[item row group][C] in a fixed order, so
// the sums are deterministic; column_partials_accumulate adds the row groups up.
// A reader with two halves (Input::kHalves == 2) is tiled over [R, C/2]: each tile then writes two
// output tiles, columns c and C/2 + c.
template <typename Input, Fp8Format F, int VEC, bool DBIAS>
__global__ void cast_transpose_kernel(uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, const Input in,
                                      int64_t R, int64_t C, const float* scale_p, float* amax, int group,
                                      float* __restrict__ col_partial) {
  constexpr int H = Input::kHalves;
  constexpr int kPerRow = kTile / VEC, kRowsPerPass = kThreads / kPerRow;
  __shared__ __align__(16) uint8_t tile[H][kTile][kTileStride];
  __shared__ float col_sums[DBIAS ? H : 1][DBIAS ? kRowsPerPass : 1][DBIAS ? kTile : 1];
  const float scale = *scale_p;
  const int64_t Cs = C / H;  // the tiled width
  float m = 0.0f;
  const int64_t tiles_c = (Cs + kTile - 1) / kTile, tiles_r = (R + kTile - 1) / kTile;
  const int64_t groups_r = (tiles_r + group - 1) / group, items = tiles_c * groups_r;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t group_r = item / tiles_c, col0 = (item % tiles_c) * kTile;
    float sums[H][VEC];  // this thread's columns (the same in every tile), over its rows
#pragma unroll
    for (int h = 0; h < H; ++h)
#pragma unroll
      for (int j = 0; j < VEC; ++j) sums[h][j] = 0.0f;
    const int64_t tr_end = (group_r + 1) * group < tiles_r ? (group_r + 1) * group : tiles_r;
    for (int64_t tr = group_r * group; tr < tr_end; ++tr) {
      const int64_t row0 = tr * kTile;
      for (int idx = threadIdx.x; idx < kTile * kPerRow; idx += kThreads) {
        const int r = idx / kPerRow, c = (idx % kPerRow) * VEC;
        const int64_t gr = row0 + r, gc = col0 + c;
        if (gr >= R || gc >= Cs) continue;
        Floats<VEC> v[H];
        read_halves<Input, VEC>(in, gr, gc, v);
#pragma unroll
        for (int h = 0; h < H; ++h) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) m = fmaxf(m, fabsf(v[h].v[j]));
          if constexpr (DBIAS) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) sums[h][j] += v[h].v[j];
          }
          const int64_t at = gr * C + h * Cs + gc;
          if constexpr (VEC == 8) {
            const uint2 q = pack8<F>(v[h], scale);
            if (out) *reinterpret_cast<uint2*>(out + at) = q;
            uint16_t* t16 = reinterpret_cast<uint16_t*>(&tile[h][r][c]);
            t16[0] = static_cast<uint16_t>(q.x);
            t16[1] = static_cast<uint16_t>(q.x >> 16);
            t16[2] = static_cast<uint16_t>(q.y);
            t16[3] = static_cast<uint16_t>(q.y >> 16);
          } else {
            const uint8_t q = to_fp8<F>(v[h].v[0] * scale);
            if (out) out[at] = q;
            tile[h][r][c] = q;
          }
        }
      }
      __syncthreads();
      if (out_t) {
        for (int idx = threadIdx.x; idx < kTile * kPerRow; idx += kThreads) {
          const int c = idx / kPerRow, r = (idx % kPerRow) * VEC;  // output row c (input column), columns r..
          const int64_t gr = row0 + r, gc = col0 + c;
          if (gr >= R || gc >= Cs) continue;
#pragma unroll
          for (int h = 0; h < H; ++h) {
            const auto& t = tile[h];
            uint8_t* dst = out_t + (h * Cs + gc) * R + gr;
            if constexpr (VEC == 8) {
              uint2 q;
              q.x = t[r][c] | (t[r + 1][c] << 8) | (t[r + 2][c] << 16) | (static_cast<uint32_t>(t[r + 3][c]) << 24);
              q.y = t[r + 4][c] | (t[r + 5][c] << 8) | (t[r + 6][c] << 16) |
                    (static_cast<uint32_t>(t[r + 7][c]) << 24);
              *reinterpret_cast<uint2*>(dst) = q;
            } else {
              *dst = t[r][c];
            }
          }
        }
      }
      __syncthreads();  // the tile is rewritten by the next iteration
    }
    if constexpr (DBIAS) {
      // Thread idx (first pass) owns row lane idx / kPerRow and columns (idx % kPerRow) * VEC..;
      // the lanes are then added in order, one thread per column.
      const int lane = threadIdx.x / kPerRow, c = (threadIdx.x % kPerRow) * VEC;
#pragma unroll
      for (int h = 0; h < H; ++h)
#pragma unroll
        for (int j = 0; j < VEC; ++j) col_sums[h][lane][c + j] = sums[h][j];
      __syncthreads();
      if (threadIdx.x < kTile && col0 + threadIdx.x < Cs) {
#pragma unroll
        for (int h = 0; h < H; ++h) {
          float t = 0.0f;
          for (int l = 0; l < kRowsPerPass; ++l) t += col_sums[h][l][threadIdx.x];
          col_partial[group_r * C + h * Cs + col0 + threadIdx.x] = t;
        }
      }
      __syncthreads();
    }
  }
  if (amax) block_amax_atomic(amax, m);
}

// ---- cast + transpose in registers ---------------------------------------------------------------
// The vector path (R and the tiled width multiples of 8). Each thread casts an 8 x 8 block: 8 rows of
// 8 consecutive elements, read, computed and packed to 8 fp8 words-pairs in registers, stored
// row-major, then transposed in registers (byte permutes, 4 x 4 at a time) and stored as 8 rows of
// the transposed copy. No shared memory and no barrier between a thread's reads and writes, and
// about a third of the instructions per element of the tile kernel above (whose exchange through
// shared memory and 64-bit index arithmetic made the activation and norm casts instruction-bound).
// A warp covers 64 rows x 32 columns: lane = 4 * row block + column block, so a load instruction
// reads 64 contiguous bytes of 8 rows, a row-major store writes 32 contiguous bytes of 8 rows and
// a transposed store 64 contiguous bytes of 4 rows: whole 32-byte sectors throughout. A block's 8
// warps stack in rows: 512 rows x 32 columns, one block per tile.
constexpr int kBlockRows = 8 * (kThreads / kWarp) * 8;  // 512
constexpr int kBlockCols = 32;

// col[j] = bytes j of a0..a3 (byte k of col[j] = byte j of ak), j = 0..3: a 4 x 4 byte transpose.
__device__ __forceinline__ void transpose4x4(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t* col) {
  const uint32_t t0 = __byte_perm(a0, a1, 0x5140), t1 = __byte_perm(a0, a1, 0x7362);
  const uint32_t t2 = __byte_perm(a2, a3, 0x5140), t3 = __byte_perm(a2, a3, 0x7362);
  col[0] = __byte_perm(t0, t2, 0x5410);
  col[1] = __byte_perm(t0, t2, 0x7632);
  col[2] = __byte_perm(t1, t3, 0x5410);
  col[3] = __byte_perm(t1, t3, 0x7632);
}

// DBIAS: the column sums go, per tile row (512 input rows), to col_partial[tile row][C] in a fixed
// order (a thread's 8 rows in turn, then the warp's row blocks by a fixed shuffle tree, then the
// block's warps in order): the same bits for any grid.
// The block's work: tile `block` (row tile block / tiles_c, column tile block % tiles_c).
template <typename Input, Fp8Format F, bool DBIAS>
__device__ __forceinline__ void cast_transpose_block(uint8_t* __restrict__ out, uint8_t* __restrict__ out_t,
                                                     const Input& in, int64_t R, int64_t C, const float* scale_p,
                                                     float* amax, float* __restrict__ col_partial, int64_t block) {
  constexpr int H = Input::kHalves;
  const float scale = *scale_p;
  const int64_t Cs = C / H;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t tiles_c = (Cs + kBlockCols - 1) / kBlockCols;
  const int64_t tile_r = block / tiles_c, col0 = (block % tiles_c) * kBlockCols;
  const int64_t r0 = tile_r * kBlockRows + warp * 64 + (lane / 4) * 8;
  const int64_t c0 = col0 + (lane % 4) * 8;
  const bool mine = r0 < R && c0 < Cs;  // R and Cs are multiples of 8: a block is all in or all out
  float m = 0.0f;
  float sums[DBIAS ? H : 1][8] = {};
  if (mine) {
    uint2 q[H][8];
    // Rows in groups whose loads are all issued before any of them is used: 8 rows' worth of
    // 16-byte loads in flight per group for one input stream, about as many bytes for two or three.
    constexpr int kGroup = Input::kStreams == 1 ? 8 : Input::kStreams == 2 ? 4 : 2;
#pragma unroll
    for (int k0 = 0; k0 < 8; k0 += kGroup) {
      RawVecs<Input> raw[kGroup];
#pragma unroll
      for (int i = 0; i < kGroup; ++i) fetch_raw(in, r0 + k0 + i, c0, raw[i]);
#pragma unroll
      for (int i = 0; i < kGroup; ++i) {
        const int k = k0 + i;
        Floats<8> v[H];
        in.compute(raw[i].s, r0 + k, c0, v);
#pragma unroll
        for (int h = 0; h < H; ++h) {
#pragma unroll
          for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(v[h].v[j]));
          if constexpr (DBIAS) {
#pragma unroll
            for (int j = 0; j < 8; ++j) sums[h][j] += v[h].v[j];
          }
          q[h][k] = pack8<F>(v[h], scale);
        }
      }
    }
#pragma unroll
    for (int h = 0; h < H; ++h) {
      if (out) {
#pragma unroll
        for (int k = 0; k < 8; ++k) *reinterpret_cast<uint2*>(out + (r0 + k) * C + h * Cs + c0) = q[h][k];
      }
      if (out_t) {
        uint32_t lo[8], hi[8];  // column j: rows 0-3 (lo[j]) and 4-7 (hi[j])
        transpose4x4(q[h][0].x, q[h][1].x, q[h][2].x, q[h][3].x, lo);
        transpose4x4(q[h][4].x, q[h][5].x, q[h][6].x, q[h][7].x, hi);
        transpose4x4(q[h][0].y, q[h][1].y, q[h][2].y, q[h][3].y, lo + 4);
        transpose4x4(q[h][4].y, q[h][5].y, q[h][6].y, q[h][7].y, hi + 4);
        uint8_t* dst = out_t + (h * Cs + c0) * R + r0;
#pragma unroll
        for (int j = 0; j < 8; ++j) *reinterpret_cast<uint2*>(dst + j * R) = make_uint2(lo[j], hi[j]);
      }
    }
  }
  if constexpr (DBIAS) {
    __shared__ float warp_sums[kThreads / kWarp][H][kBlockCols];
#pragma unroll
    for (int h = 0; h < H; ++h)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float t = sums[h][j];
        t += __shfl_xor_sync(0xffffffffu, t, 4);
        t += __shfl_xor_sync(0xffffffffu, t, 8);
        t += __shfl_xor_sync(0xffffffffu, t, 16);
        if (lane < 4) warp_sums[warp][h][lane * 8 + j] = t;
      }
    __syncthreads();
    for (int i = threadIdx.x; i < H * kBlockCols; i += kThreads) {
      const int h = i / kBlockCols, c = i % kBlockCols;
      if (col0 + c >= Cs) continue;
      float t = 0.0f;
      for (int w = 0; w < kThreads / kWarp; ++w) t += warp_sums[w][h][c];
      col_partial[tile_r * C + h * Cs + col0 + c] = t;
    }
  }
  if (amax) block_amax_atomic(amax, m);
}

template <typename Input, Fp8Format F, bool DBIAS>
__global__ void __launch_bounds__(kThreads) cast_transpose_blocks_kernel(uint8_t* __restrict__ out,
                                                                          uint8_t* __restrict__ out_t, const Input in,
                                                                          int64_t R, int64_t C, const float* scale_p,
                                                                          float* amax, float* __restrict__ col_partial) {
  cast_transpose_block<Input, F, DBIAS>(out, out_t, in, R, C, scale_p, amax, col_partial, blockIdx.x);
}

// Groups of rows, each cast with its own scale (fp8_quantize_groups): group g is rows
// [row0[g], row0[g + 1]) of the [R, C] input, its transposed copy the [C, M_g] block at element
// row0[g] * C of out_t; its tiles are blocks [block0[g], block0[g + 1]) of the grid. Every group's
// rows a multiple of 8 (the register-block tiles), C too.
struct CastGroupArg {
  int n = 0;
  int64_t row0[kMaxCastGroups + 1];
  int64_t block0[kMaxCastGroups + 1];
  const float* scale[kMaxCastGroups];
  float* amax[kMaxCastGroups];
};

template <typename T, Fp8Format F>
__global__ void __launch_bounds__(kThreads) cast_transpose_groups_kernel(uint8_t* __restrict__ out,
                                                                          uint8_t* __restrict__ out_t,
                                                                          const T* __restrict__ x, int64_t C,
                                                                          const __grid_constant__ CastGroupArg g) {
  // The group whose blocks hold this one: the last with block0 <= blockIdx.x (empty groups own none).
  int lo = 0, hi = g.n;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (g.block0[mid] <= static_cast<int64_t>(blockIdx.x)) lo = mid;
    else hi = mid;
  }
  const int64_t r0 = g.row0[lo], R = g.row0[lo + 1] - r0;
  cast_transpose_block<PlainInput<T>, F, false>(out ? out + r0 * C : nullptr, out_t ? out_t + r0 * C : nullptr,
                                                PlainInput<T>{x + r0 * C, C}, R, C, g.scale[lo], g.amax[lo], nullptr,
                                                blockIdx.x - g.block0[lo]);
}

// ---- byte transpose (fp8_transpose) -------------------------------------------------------------
// out_t [C, R] = in [R, C], bytes as they are: FP8 weights' transposed copy. A block moves one
// 64 x 64-byte tile through shared memory: it reads tile rows and writes tile columns, both as
// runs of 64 contiguous bytes (whole 32-byte sectors). One tile per block, no striding: the copy
// is a single load phase and a single store phase, and several resident blocks per SM overlap
// them. Two kernels: 4-byte words where R and C are multiples of 4 (the model's weights), single
// bytes otherwise.
constexpr int kXTile = 64;              // bytes per side of a transpose tile
constexpr int kXWords = kXTile / 4;     // 4-byte words per tile row
constexpr int kXThreads = 256;          // four words per thread each way
static_assert(kXThreads * 4 == kXTile * kXWords, "a transpose tile is 4 words per thread");

// The shared-memory slot of word w (bytes 4w..4w+3) of tile row r, in a [64][16]-word tile. Rows
// of 16 words fill half of the 32 banks, so the plain layout gives 2- to 16-way conflicts when the
// store phase reads one word column of rows 4i + k. Flipping the row's low bit by w's (r ^ (w & 1))
// puts the warp's two word columns in different bank halves, and XOR-ing the word with the row's
// 4-row group (w ^ (r >> 2)) spreads the 16 groups over the 16 banks of a half: both phases
// conflict-free (one bijection: r >> 2 survives the first flip, so w and then r can be recovered).
__device__ __forceinline__ int xtile_slot(int r, int w) {
  return (r ^ (w & 1)) * kXWords + (w ^ ((r >> 2) & (kXWords - 1)));
}

// R and C multiples of 4, in and out_t 4-byte aligned. Load phase: thread t reads word t % 16 of
// tile rows t / 16 + 16m (m = 0..3), all four loads in flight before any is stored; a warp reads 2
// rows x 64 bytes per load. Store phase: thread t takes the 4 x 4-byte block of tile rows
// 4i..4i+3 (i = t % 16) and word j = t / 16, transposes it in registers (byte permutes) and writes
// one word to each of the 4 output rows 4j..4j+3; a warp writes 2 output rows x 64 bytes per store.
__global__ void __launch_bounds__(kXThreads) transpose_words_kernel(uint32_t* __restrict__ out_t,
                                                                    const uint32_t* __restrict__ in, int64_t R,
                                                                    int64_t C) {
  __shared__ uint32_t tile[kXTile * kXWords];
  const int64_t tiles_c = (C + kXTile - 1) / kXTile;
  const int64_t row0 = blockIdx.x / tiles_c * kXTile, col0 = blockIdx.x % tiles_c * kXTile;
  const int64_t Cw = C / 4, Rw = R / 4;  // row lengths in words
  const int t = threadIdx.x;
  {
    const int w = t % kXWords, r = t / kXWords;
    const bool col_in = col0 + 4 * w < C;  // C % 4 == 0: a word is all in or all out
    uint32_t v[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int64_t gr = row0 + r + 16 * m;
      v[m] = col_in && gr < R ? in[gr * Cw + col0 / 4 + w] : 0u;
    }
#pragma unroll
    for (int m = 0; m < 4; ++m) tile[xtile_slot(r + 16 * m, w)] = v[m];
  }
  __syncthreads();
  const int i = t % kXWords, j = t / kXWords;
  if (row0 + 4 * i >= R) return;
  uint32_t col[4];
  transpose4x4(tile[xtile_slot(4 * i, j)], tile[xtile_slot(4 * i + 1, j)], tile[xtile_slot(4 * i + 2, j)],
               tile[xtile_slot(4 * i + 3, j)], col);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t oc = col0 + 4 * j + k;  // the output row: input column
    if (oc < C) out_t[oc * Rw + row0 / 4 + i] = col[k];
  }
}

// Any R and C, one byte per access (shapes that are not multiples of 4, unaligned views). Tile
// rows of 68 bytes (17 words, odd): the store phase's 32 lanes read one byte column of 32
// consecutive rows, 17 words apart, one bank each.
constexpr int kXByteStride = kXTile + 4;

__global__ void __launch_bounds__(kXThreads) transpose_bytes_kernel(uint8_t* __restrict__ out_t,
                                                                    const uint8_t* __restrict__ in, int64_t R,
                                                                    int64_t C) {
  __shared__ uint8_t tile[kXTile][kXByteStride];
  constexpr int kPer = kXTile * kXTile / kXThreads;  // 16 bytes per thread each way
  const int64_t tiles_c = (C + kXTile - 1) / kXTile;
  const int64_t row0 = blockIdx.x / tiles_c * kXTile, col0 = blockIdx.x % tiles_c * kXTile;
  uint8_t v[kPer];
#pragma unroll
  for (int m = 0; m < kPer; ++m) {  // a warp reads 32 consecutive bytes of one row
    const int idx = threadIdx.x + m * kXThreads, r = idx / kXTile, c = idx % kXTile;
    v[m] = row0 + r < R && col0 + c < C ? in[(row0 + r) * C + col0 + c] : uint8_t{0};
  }
#pragma unroll
  for (int m = 0; m < kPer; ++m) {
    const int idx = threadIdx.x + m * kXThreads;
    tile[idx / kXTile][idx % kXTile] = v[m];
  }
  __syncthreads();
#pragma unroll
  for (int m = 0; m < kPer; ++m) {  // a warp writes 32 consecutive bytes of one output row
    const int idx = threadIdx.x + m * kXThreads, c = idx / kXTile, r = idx % kXTile;
    if (row0 + r < R && col0 + c < C) out_t[(col0 + c) * R + row0 + r] = tile[r][c];
  }
}

// ---- amax only ------------------------------------------------------------------------------------
template <typename T, int VEC>
__global__ void amax_kernel(float* amax, const T* __restrict__ in, int64_t n) {
  float m = 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t nv = n / VEC;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nv; i += stride) {
    const Floats<VEC> v = load_vec<VEC>(in + i * VEC);
#pragma unroll
    for (int j = 0; j < VEC; ++j) m = fmaxf(m, fabsf(v.v[j]));
  }
  block_amax_atomic(amax, m);
}

// ---- dequantize -----------------------------------------------------------------------------------
// The values of 8 fp8 codes packed little-endian (element j in byte j), two per cvt to half2:
// exact, as every e4m3 and e5m2 value (NaN and the e5m2 infinities too) is a half.
template <Fp8Format F>
__device__ __forceinline__ Floats<8> unpack8(uint2 q) {
  Floats<8> r;
  const uint32_t w[2] = {q.x, q.y};
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const auto pair = static_cast<__nv_fp8x2_storage_t>(w[p / 2] >> (16 * (p % 2)));
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, F == Fp8Format::e4m3 ? __NV_E4M3 : __NV_E5M2);
    const float2 f = __half22float2(__half2(h));
    r.v[2 * p] = f.x;
    r.v[2 * p + 1] = f.y;
  }
  return r;
}

// out[i] = T(value(in[i]) * s): the float32 product rounded once to T. VEC = 8: 8 codes (one 8-byte
// load) and one or two 16-byte stores per thread (n a multiple of 8, in 8- and out 16-byte aligned).
template <typename T, Fp8Format F, int VEC>
__global__ void dequant_kernel(T* __restrict__ out, const uint8_t* __restrict__ in, int64_t n, const float* scale_inv_p) {
  const float s = *scale_inv_p;  // read here: earlier kernels on the stream write it
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if constexpr (VEC == 8) {
    for (int64_t i = first; i < n / 8; i += stride) {
      Floats<8> v = unpack8<F>(reinterpret_cast<const uint2*>(in)[i]);
#pragma unroll
      for (int j = 0; j < 8; ++j) v.v[j] *= s;
      store_vec<8>(out + i * 8, v);
    }
  } else {
    for (int64_t i = first; i < n; i += stride) out[i] = from_float<T>(from_fp8<F>(in[i]) * s);
  }
}

// ---- delayed-scaling update ---------------------------------------------------------------------
__global__ void update_scales_kernel(float* hist, int H, int count, float* scale, float* scale_inv, int stride,
                                     float fp8_max, const float* fp8_max_per, float margin_factor, bool use_max) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= count) return;
  const float first = hist[t];
  float amax = first;
  if (use_max)
    for (int h = 1; h < H; ++h) amax = fmaxf(amax, hist[static_cast<int64_t>(h) * count + t]);
  for (int h = 0; h + 1 < H; ++h) hist[static_cast<int64_t>(h) * count + t] = hist[static_cast<int64_t>(h + 1) * count + t];
  hist[static_cast<int64_t>(H - 1) * count + t] = first;
  hist[t] = 0.0f;
  if (amax > 0.0f && isfinite(amax)) {
    const float m = fp8_max_per ? fp8_max_per[t] : fp8_max;
    float s = (m / amax) / margin_factor;
    if (isinf(s)) s = FLT_MAX;  // a tiny amax, as Transformer Engine does
    scale[static_cast<int64_t>(t) * stride] = s;
    scale_inv[static_cast<int64_t>(t) * stride] = 1.0f / s;
  }
}

__global__ void copy_scale_pair_kernel(float* dst, const float* a, const float* b) {
  dst[0] = *a;
  dst[4] = *b;
}

// Tensorwise (current) scaling of one operand from the fresh amax of this call's tensor.
__global__ void tensorwise_scale_kernel(float* fresh_amax, float* amax, float* scale, float* scale_inv,
                                        float fp8_max, float margin_factor, bool reset_fresh, float* scale_inv_copy) {
  const float a = *fresh_amax;
  if (reset_fresh) *fresh_amax = 0.0f;
  if (a > 0.0f && isfinite(a)) {
    float s = (fp8_max / a) / margin_factor;
    if (isinf(s)) s = FLT_MAX;
    *scale = s;
    *scale_inv = 1.0f / s;
  }
  if (amax) *amax = fmaxf(*amax, a);
  if (scale_inv_copy) *scale_inv_copy = *scale_inv;
}

unsigned capped_grid(const KernelContext& ctx, int64_t work) {
  return grid_for(work, kThreads, static_cast<int64_t>(std::max(ctx.num_sms, 1)) * kBlocksPerSm);
}

// Runs `body` with F bound to the format as a compile-time constant.
template <typename Body>
void with_format(Fp8Format f, Body&& body) {
  if (f == Fp8Format::e4m3)
    body(std::integral_constant<Fp8Format, Fp8Format::e4m3>{});
  else
    body(std::integral_constant<Fp8Format, Fp8Format::e5m2>{});
}

void check_input(const Tensor& in, const char* what) {
  MT_CHECK(in.dtype == DType::f32 || in.dtype == DType::bf16, "{}: input must be float32 or bfloat16, got {}", what,
           dtype_name(in.dtype));
  MT_CHECK(in.device == Device::cuda, "{}: input is not on the GPU", what);
}

}  // namespace

void cast_to_fp8(const KernelContext& ctx, void* out, Fp8Format format, Tensor in, const float* scale, float* amax) {
  check_input(in, "cast_to_fp8");
  const int64_t n = in.numel();
  if (n == 0) return;
  const bool vec = n % 8 == 0 && aligned16(in.data) && (reinterpret_cast<uintptr_t>(out) & 7u) == 0;
  MT_DISPATCH_FLOAT(in.dtype, T, "cast_to_fp8", {
    with_format(format, [&](auto fc) {
      constexpr Fp8Format F = decltype(fc)::value;
      if (vec)
        cast_kernel<T, F, 8><<<capped_grid(ctx, n / 8), kThreads, 0, ctx.stream>>>(static_cast<uint8_t*>(out),
                                                                                  in.ptr<const T>(), n, scale, amax);
      else
        cast_kernel<T, F, 1><<<capped_grid(ctx, n), kThreads, 0, ctx.stream>>>(static_cast<uint8_t*>(out),
                                                                              in.ptr<const T>(), n, scale, amax);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

namespace {

// Which kernel takes the vector path. By default the register-block kernel, except for the SwiGLU
// readers (Input::kTileKernel) without a bias gradient: with two or three input streams per thread
// it held fewer loads in flight and measured slower than the tile kernel (bench_fp8_cast,
// bench/RESULTS.md). With a bias gradient every reader takes the register-block kernel,
// so that a fused cast sums each column in the same order as the plain cast of the same values
// (the same bits). bench_fp8_cast forces one kernel for every reader (bench_choice::fp8_cast_kernel)
// to compare them.
template <typename Input>
bool use_tile_kernel(bool dbias) {
  using bench_choice::Fp8CastKernel;
  const Fp8CastKernel forced = bench_choice::fp8_cast_kernel;
  return forced == Fp8CastKernel::by_reader ? Input::kTileKernel && !dbias : forced == Fp8CastKernel::tiles;
}

// Launches cast_transpose_blocks_kernel (vec) or cast_transpose_kernel over an [R, C] input read
// by `in`; vec: R and C multiples of 8 and the input 16-byte aligned (the caller's check). dbias
// (float32 or bfloat16 [C], may be null) += the input's column sums.
template <typename Input>
void launch_cast_transpose(const KernelContext& ctx, void* out, void* out_t, Fp8Format format, const Input& in,
                           int64_t R, int64_t C, bool vec, const float* scale, float* amax, GradOut dbias = GradOut()) {
  const int64_t Cs = C / Input::kHalves;  // the tiled width
  vec = vec && R % 8 == 0 && Cs % 8 == 0 && aligned8(out) && aligned8(out_t);
  auto* o = static_cast<uint8_t*>(out);
  auto* ot = static_cast<uint8_t*>(out_t);
  if (vec && !use_tile_kernel<Input>(static_cast<bool>(dbias))) {
    const int64_t tiles_r = (R + kBlockRows - 1) / kBlockRows, tiles_c = (Cs + kBlockCols - 1) / kBlockCols;
    MT_CHECK(tiles_r * tiles_c < (int64_t{1} << 31), "cast_transpose_to_fp8: [{}, {}] is too large for one grid", R, C);
    float* partial = dbias ? ctx.scratch->take_array<float>(tiles_r * C, "FP8 cast bias-gradient partial sums") : nullptr;
    const auto grid = static_cast<unsigned>(tiles_r * tiles_c);
    with_format(format, [&](auto fc) {
      constexpr Fp8Format F = decltype(fc)::value;
      if (dbias) cast_transpose_blocks_kernel<Input, F, true><<<grid, kThreads, 0, ctx.stream>>>(o, ot, in, R, C, scale, amax, partial);
      else cast_transpose_blocks_kernel<Input, F, false><<<grid, kThreads, 0, ctx.stream>>>(o, ot, in, R, C, scale, amax, partial);
    });
    MT_CUDA_CHECK_LAUNCH();
    if (dbias) column_partials_accumulate(ctx, dbias, partial, tiles_r, C);
    return;
  }
  const int64_t tiles_c = (Cs + kTile - 1) / kTile, tiles_r = (R + kTile - 1) / kTile;
  const int64_t max_blocks = static_cast<int64_t>(std::max(ctx.num_sms, 1)) * kBlocksPerSm;
  // With dbias, row tiles go in groups so that there are about two work items per block: few
  // partial rows to add up, every block busy. (A function of the shape and the GPU only, counted
  // over the whole width: a column's sum then runs in the same order whether or not the reader
  // pairs halves, so a fused cast's bias gradient equals the plain cast's bit for bit.)
  const int64_t tiles_c_full = (C + kTile - 1) / kTile;
  const int group = dbias ? static_cast<int>(std::max<int64_t>(1, tiles_r * tiles_c_full / (2 * max_blocks))) : 1;
  const int64_t groups_r = (tiles_r + group - 1) / group;
  // The grid: one block per work item (with the blocks' load and store phases interleaved by the
  // scheduler, the fused SwiGLU-gradient cast took 180 us per llama-1b layer against 212 us with 8
  // blocks per SM striding over the items, bench/RESULTS.md 2026-11-22; the plain casts the same).
  const unsigned grid = static_cast<unsigned>(groups_r * tiles_c);
  float* partial = dbias ? ctx.scratch->take_array<float>(groups_r * C, "FP8 cast bias-gradient partial sums") : nullptr;
  with_format(format, [&](auto fc) {
    constexpr Fp8Format F = decltype(fc)::value;
    auto launch = [&](auto kernel) {
      kernel<<<grid, kThreads, 0, ctx.stream>>>(o, ot, in, R, C, scale, amax, group, partial);
    };
    if (vec) {
      if (dbias) launch(cast_transpose_kernel<Input, F, 8, true>);
      else launch(cast_transpose_kernel<Input, F, 8, false>);
    } else {
      if (dbias) launch(cast_transpose_kernel<Input, F, 1, true>);
      else launch(cast_transpose_kernel<Input, F, 1, false>);
    }
  });
  MT_CUDA_CHECK_LAUNCH();
  if (dbias) column_partials_accumulate(ctx, dbias, partial, groups_r, C);
}

}  // namespace

void cast_transpose_to_fp8(const KernelContext& ctx, void* out, void* out_t, Fp8Format format, Tensor in,
                           const float* scale, float* amax, GradOut dbias) {
  cast_transpose_to_fp8(ctx, out, out_t, format, CastSource{CastSource::Kind::plain, in, Tensor()}, scale, amax, dbias);
}

bool cast_transpose_groups_to_fp8(const KernelContext& ctx, void* out, void* out_t, Fp8Format format, Tensor in,
                                  std::span<const int64_t> row0, std::span<const float* const> scale,
                                  std::span<float* const> amax) {
  check_input(in, "cast_transpose_groups_to_fp8");
  const int n = static_cast<int>(row0.size()) - 1;
  const int64_t C = in.cols();
  MT_CHECK(n >= 0 && scale.size() == static_cast<size_t>(n) && amax.size() == static_cast<size_t>(n),
           "cast_transpose_groups_to_fp8: {} offsets for {} scales and {} amax slots", row0.size(), scale.size(),
           amax.size());
  bool vec = n <= kMaxCastGroups && C % 8 == 0 && aligned16(in.data) && aligned8(out) && aligned8(out_t) &&
             row0[0] == 0;
  for (int g = 0; vec && g < n; ++g) vec = row0[g + 1] >= row0[g] && (row0[g + 1] - row0[g]) % 8 == 0;
  if (!vec) return false;
  MT_CHECK(row0[n] <= in.rows(), "cast_transpose_groups_to_fp8: groups end at row {} of {}", row0[n], in.rows());
  CastGroupArg g;
  g.n = n;
  const int64_t tiles_c = (C + kBlockCols - 1) / kBlockCols;
  g.block0[0] = 0;
  for (int i = 0; i < n; ++i) {
    const int64_t rows = row0[i + 1] - row0[i];
    g.row0[i] = row0[i];
    g.block0[i + 1] = g.block0[i] + (rows + kBlockRows - 1) / kBlockRows * tiles_c;
    g.scale[i] = scale[i];
    g.amax[i] = amax[i];
  }
  g.row0[n] = row0[n];
  const int64_t blocks = g.block0[n];
  if (blocks == 0) return true;
  MT_CHECK(blocks < (int64_t{1} << 31), "cast_transpose_groups_to_fp8: [{}, {}] is too large for one grid", row0[n], C);
  MT_DISPATCH_FLOAT(in.dtype, T, "cast_transpose_groups_to_fp8", {
    with_format(format, [&](auto fc) {
      constexpr Fp8Format F = decltype(fc)::value;
      cast_transpose_groups_kernel<T, F><<<static_cast<unsigned>(blocks), kThreads, 0, ctx.stream>>>(
          static_cast<uint8_t*>(out), static_cast<uint8_t*>(out_t), in.ptr<const T>(), C, g);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
  return true;
}

void cast_transpose_to_fp8(const KernelContext& ctx, void* out, void* out_t, Fp8Format format, const CastSource& src,
                           const float* scale, float* amax, GradOut dbias) {
  const char* what = "cast_transpose_to_fp8";
  check_input(src.x, what);
  if (dbias && dbias.dtype != DType::f32 && dbias.dtype != DType::bf16)
    fail("{}: the bias gradient is {}; it must be float32 or bfloat16", what, dtype_name(dbias.dtype));
  const int64_t R = src.rows(), C = src.cols();
  using Kind = CastSource::Kind;
  const bool swiglu = src.kind == Kind::activation && src.act == MlpActivation::swiglu;
  MT_CHECK(!swiglu || src.x.cols() % 2 == 0, "{}: odd SwiGLU width {}", what, src.x.cols());
  const bool gated_grad = src.kind == Kind::activation_grad && src.act == MlpActivation::swiglu;
  if (src.kind == Kind::norm) {
    MT_CHECK(src.rstd.numel() == R && src.rstd.dtype == DType::f32 &&
                 (src.mean.empty() || (src.mean.numel() == R && src.mean.dtype == DType::f32)),
             "{}: norm statistics mean {} / rstd {} for {} rows", what, src.mean.shape_string(),
             src.rstd.shape_string(), R);
    MT_CHECK(src.weight.numel() == C && src.weight.dtype == src.x.dtype &&
                 (src.bias.empty() || (src.bias.numel() == C && src.bias.dtype == src.x.dtype)),
             "{}: norm weight {} / bias {} for rows of {}", what, src.weight.shape_string(), src.bias.shape_string(), C);
  }
  if (src.kind == Kind::activation_grad) {
    check_input(src.pre, what);
    MT_CHECK(src.pre.dtype == src.x.dtype && src.pre.numel() == (gated_grad ? 2 : 1) * src.x.numel(),
             "{}: the activation gradient's input {} for {}", what, src.pre.shape_string(), src.x.shape_string());
  }
  if (R == 0 || C == 0) return;
  const bool vec = aligned16(src.x.data) && (src.pre.empty() || aligned16(src.pre.data)) &&
                   (!gated_grad || src.x.cols() % 8 == 0) &&
                   (src.kind != Kind::norm || aligned16(src.weight.data));
  MT_DISPATCH_FLOAT(src.x.dtype, T, what, {
    const T* x = src.x.ptr<const T>();
    const auto go = [&](const auto& input) {
      launch_cast_transpose(ctx, out, out_t, format, input, R, C, vec, scale, amax, dbias);
    };
    const Activation ungated = ungated_activation(src.act);
    switch (src.kind) {
      case Kind::plain: go(PlainInput<T>{x, C}); break;
      case Kind::activation:
        if (swiglu) go(SwigluInput<T>{x, C, src.glu});
        else if (ungated == Activation::gelu_tanh) go(ActivationInput<T, Activation::gelu_tanh>{x, C});
        else if (ungated == Activation::squared_relu) go(ActivationInput<T, Activation::squared_relu>{x, C});
        else go(ActivationInput<T, Activation::gelu>{x, C});
        break;
      case Kind::activation_grad: {
        const T* pre = src.pre.ptr<const T>();
        if (gated_grad) go(SwigluGradInput<T>{x, pre, src.x.cols(), src.glu});
        else if (ungated == Activation::gelu_tanh) go(ActivationGradInput<T, Activation::gelu_tanh>{x, pre, C});
        else if (ungated == Activation::squared_relu) go(ActivationGradInput<T, Activation::squared_relu>{x, pre, C});
        else go(ActivationGradInput<T, Activation::gelu>{x, pre, C});
        break;
      }
      case Kind::norm:
        go(NormInput<T>{x, src.mean.empty() ? nullptr : src.mean.ptr<const float>(), src.rstd.ptr<const float>(),
                        src.weight.ptr<const T>(), src.bias.empty() ? nullptr : src.bias.ptr<const T>(), C,
                        src.one_p ? 1.0f : 0.0f});
        break;
    }
  });
}

void fp8_amax(const KernelContext& ctx, float* amax, Tensor in) {
  check_input(in, "fp8_amax");
  const int64_t n = in.numel();
  if (n == 0) return;
  MT_DISPATCH_FLOAT(in.dtype, T, "fp8_amax", {
    if (n % 8 == 0 && aligned16(in.data))
      amax_kernel<T, 8><<<capped_grid(ctx, n / 8), kThreads, 0, ctx.stream>>>(amax, in.ptr<const T>(), n);
    else
      amax_kernel<T, 1><<<capped_grid(ctx, n), kThreads, 0, ctx.stream>>>(amax, in.ptr<const T>(), n);
  });
  MT_CUDA_CHECK_LAUNCH();
}

void cast_from_fp8(const KernelContext& ctx, Tensor out, const void* in, Fp8Format format, const float* scale_inv) {
  MT_CHECK(out.device == Device::cuda, "cast_from_fp8: output is not on the GPU");
  const int64_t n = out.numel();
  if (n == 0) return;
  const bool vec = n % 8 == 0 && aligned16(out.data) && (reinterpret_cast<uintptr_t>(in) & 7u) == 0;
  const auto* q = static_cast<const uint8_t*>(in);
  MT_DISPATCH_FLOAT(out.dtype, T, "cast_from_fp8", {
    with_format(format, [&](auto fc) {
      constexpr Fp8Format F = decltype(fc)::value;
      if (vec)
        dequant_kernel<T, F, 8><<<capped_grid(ctx, n / 8), kThreads, 0, ctx.stream>>>(out.ptr<T>(), q, n, scale_inv);
      else
        dequant_kernel<T, F, 1><<<capped_grid(ctx, n), kThreads, 0, ctx.stream>>>(out.ptr<T>(), q, n, scale_inv);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

void fp8_transpose(const KernelContext& ctx, void* out_t, const void* in, int64_t R, int64_t C) {
  if (R == 0 || C == 0) return;
  const int64_t tiles = ((R + kXTile - 1) / kXTile) * ((C + kXTile - 1) / kXTile);
  MT_CHECK(tiles < (int64_t{1} << 31), "fp8_transpose: [{}, {}] is too large for one grid", R, C);
  const auto a4 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 3u) == 0; };
  const auto grid = static_cast<unsigned>(tiles);
  if (R % 4 == 0 && C % 4 == 0 && a4(in) && a4(out_t))
    transpose_words_kernel<<<grid, kXThreads, 0, ctx.stream>>>(static_cast<uint32_t*>(out_t),
                                                              static_cast<const uint32_t*>(in), R, C);
  else
    transpose_bytes_kernel<<<grid, kXThreads, 0, ctx.stream>>>(static_cast<uint8_t*>(out_t),
                                                              static_cast<const uint8_t*>(in), R, C);
  MT_CUDA_CHECK_LAUNCH();
}

void fp8_update_scales(const KernelContext& ctx, float* amax_history, int history_len, int count, float* scale,
                       float* scale_inv, float fp8_max, int margin, Fp8AmaxAlgo algo, int scale_stride,
                       const float* fp8_max_per_tensor) {
  MT_CHECK(history_len >= 1, "fp8_update_scales: amax history length must be at least 1, got {}", history_len);
  MT_CHECK(scale_stride >= 1, "fp8_update_scales: scale stride must be at least 1");
  if (count <= 0) return;
  const float margin_factor = std::ldexp(1.0f, margin);
  update_scales_kernel<<<(count + 127) / 128, 128, 0, ctx.stream>>>(amax_history, history_len, count, scale, scale_inv,
                                                                    scale_stride, fp8_max, fp8_max_per_tensor,
                                                                    margin_factor, algo == Fp8AmaxAlgo::max);
  MT_CUDA_CHECK_LAUNCH();
}

void fp8_tensorwise_scale(const KernelContext& ctx, float* fresh_amax, float* amax, float* scale, float* scale_inv,
                          float fp8_max, int margin, bool reset_fresh, float* scale_inv_copy) {
  tensorwise_scale_kernel<<<1, 1, 0, ctx.stream>>>(fresh_amax, amax, scale, scale_inv, fp8_max,
                                                   std::ldexp(1.0f, margin), reset_fresh, scale_inv_copy);
  MT_CUDA_CHECK_LAUNCH();
}

void fp8_copy_scale_pair(const KernelContext& ctx, float* dst, const float* a, const float* b) {
  copy_scale_pair_kernel<<<1, 1, 0, ctx.stream>>>(dst, a, b);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda

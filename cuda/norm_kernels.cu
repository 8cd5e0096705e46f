// LayerNorm and RMSNorm: forward (optionally fused with the residual add and dropout before it)
// and backward (dx, plus dweight/dbias accumulation into float32 or bfloat16 gradients).
//
// Work split: a "team" of TPR threads (a power of two, 32..1024) owns one row; each thread keeps
// up to ITERS vectors of VEC elements of the row in registers, so the row is read from memory
// once and all statistics are exact two-pass ones (mean first, then the centred variance). TPR
// is chosen per call so that every thread holds at most ITERS vectors: 768 bf16 columns take one
// warp, 8192 take 256 threads. VEC = 16 bytes of elements when rows and pointers are 16-byte
// aligned, else 1 (odd widths). Teams reduce with warp shuffles and, past one warp, shared memory.
//
// Backward: dweight/dbias are accumulated without float atomics, so the result is bit-identical
// from run to run: each block sums its rows' contributions in registers, writes one partial row
// to scratch, and a second kernel adds the partials in block order. The block count depends only
// on (rows, width, dtype, device). A bfloat16 gradient (--grad-reduce-in-bf16) gets the same float32
// sum, added to its old value in float32 and rounded once.
//
// --qk-layernorm reuses the same kernels over "virtual rows": every q and k head of the packed
// QKV rows is one row of head_dim values (QkHeads maps a virtual row to its address and tells q
// from k, which have their own weights); v is copied through. Its weight gradients come from a
// separate deterministic column reduction (qk_param_partial_kernel).
#include <algorithm>
#include <cstdlib>
#include <type_traits>

#include "cuda/bench_choice.h"
#include "cuda/activations.cuh"
#include "cuda/cuda_check.h"
#include "cuda/device_utils.cuh"
#include "cuda/gemm_cublaslt.h"
#include "cuda/kernels.h"
#include "cuda/norm_math.cuh"

namespace mt::cuda {
namespace {

// Sum over the TPR threads of this thread's team (every thread gets it). Block-uniform tpr.
template <int K>
__device__ __forceinline__ void team_sum(float (&v)[K], int tpr, float (*red)[32]) {
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum(v[k]);
  if (tpr <= kWarp) return;
  const int warp = threadIdx.x / kWarp;
  __syncthreads();  // red[] may still be read from the previous reduction
  if (threadIdx.x % kWarp == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) red[k][warp] = v[k];
  }
  __syncthreads();
  const int first = (threadIdx.x / tpr) * (tpr / kWarp);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float s = 0.0f;
    for (int i = 0; i < tpr / kWarp; ++i) s += red[k][first + i];
    v[k] = s;
  }
}

// Row r of an ordinary [rows, h] tensor.
struct PlainRows {
  int64_t h;
  __device__ __forceinline__ int64_t offset(int64_t r) const { return r * h; }
  __device__ __forceinline__ bool second(int64_t) const { return false; }
};
// Virtual row v = row * heads + j: head j (q heads of each group, then its k) of packed QKV row `row`.
struct QkHeads {
  int64_t heads, q_per_group, d, row_width;
  __device__ __forceinline__ int64_t offset(int64_t v) const {
    const int64_t row = v / heads, j = v % heads;
    const int64_t g = j / (q_per_group + 1), k = j % (q_per_group + 1);
    return row * row_width + (g * (q_per_group + 2) + k) * d;
  }
  __device__ __forceinline__ bool second(int64_t v) const { return (v % heads) % (q_per_group + 1) == q_per_group; }
};

template <typename T>
struct NormForwardArgs {
  T* out;
  T* sum;           // fused add: a + dropout(b) is written here
  float* mean;      // may be null
  float* rstd;      // may be null
  const T* a;       // the input (or the residual stream of the fused add)
  const T* b;       // fused add's other operand (null: plain norm)
  const T* weight;
  const T* bias;    // may be null
  const T* weight2; // the layout's second kind of row (k heads)
  const T* bias2;
  int64_t rows;
  int h;
  float eps;
  float dropout_p, keep_scale;
  uint64_t dropout_key;
  bool rms, one_p;
  const T* b_bias = nullptr;  // fused add: added to b before the dropout (bias_dropout_add's order)
  float* out_amax = nullptr;  // max |out| as stored (written or not), one atomicMax per block
};

// Teams are at most kMaxTeam threads: the launch bound caps registers at 128 per thread, so every
// instance launches with a block that large (the backward instances would need more otherwise).
constexpr int kMaxTeam = 512;

template <typename T, int VEC, int ITERS, bool ADD, typename Layout>
__global__ void __launch_bounds__(kMaxTeam) norm_forward_kernel(NormForwardArgs<T> args, Layout layout, int tpr) {
  __shared__ float red[2][32];
  const int teams = blockDim.x / tpr, team = threadIdx.x / tpr, lane = threadIdx.x % tpr;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * teams + team;
  const bool valid = row < args.rows;
  const int h = args.h;
  const int64_t row_base = valid ? layout.offset(row) : 0;
  const bool second = valid && layout.second(row);
  const T* weight = second ? args.weight2 : args.weight;
  const T* bias = second ? args.bias2 : args.bias;

  float x[ITERS][VEC];
  float s[1] = {0.0f};
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (lane + it * tpr) * VEC;
    if (valid && c < h) {
      const Floats<VEC> av = load_vec<VEC>(args.a + row_base + c);
      if constexpr (ADD) {
        Floats<VEC> bv = load_vec<VEC>(args.b + row_base + c);
        if (args.b_bias) {
          const Floats<VEC> bb = load_vec<VEC>(args.b_bias + c);
#pragma unroll
          for (int j = 0; j < VEC; ++j) bv.v[j] += bb.v[j];
        }
        Floats<VEC> sv;
        // (row_base + c is a multiple of VEC, which divides 8: one draw.)
        const DropoutGroup drop(args.dropout_key, row_base + c, args.dropout_p, args.keep_scale);
#pragma unroll
        for (int j = 0; j < VEC; ++j) sv.v[j] = dropout_add(av.v[j], bv.v[j], drop.at(row_base + c + j));
        store_vec<VEC>(args.sum + row_base + c, sv);
        // Normalize the stored (rounded) sum, as a separate add followed by the norm would.
#pragma unroll
        for (int j = 0; j < VEC; ++j) x[it][j] = to_float(from_float<T>(sv.v[j]));
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) x[it][j] = av.v[j];
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) s[0] += x[it][j];
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) x[it][j] = 0.0f;
    }
  }
  float mean = 0.0f;
  if (!args.rms) {
    team_sum(s, tpr, red);
    mean = s[0] / h;
  }
  float q[1] = {0.0f};
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (lane + it * tpr) * VEC;
    if (valid && c < h) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = x[it][j] - mean;
        q[0] += d * d;
      }
    }
  }
  team_sum(q, tpr, red);
  const float rstd = 1.0f / sqrtf(q[0] / h + args.eps);
  if (valid && lane == 0) {
    if (args.mean) args.mean[row] = mean;  // 0 for RMSNorm, as the reference writes
    if (args.rstd) args.rstd[row] = rstd;
  }
  if (!args.out && !args.out_amax) return;  // statistics only (an FP8 cast takes the output from x and them)
  const float w_shift = args.one_p ? 1.0f : 0.0f;
  float m = 0.0f;  // max |y| as stored
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (lane + it * tpr) * VEC;
    if (valid && c < h) {
      const Floats<VEC> w = load_vec<VEC>(weight + c);
      Floats<VEC> y;
      if (bias) {
        const Floats<VEC> b = load_vec<VEC>(bias + c);
#pragma unroll
        for (int j = 0; j < VEC; ++j) y.v[j] = norm_apply(norm_xhat(x[it][j], mean, rstd), w.v[j] + w_shift, b.v[j]);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) y.v[j] = norm_apply(norm_xhat(x[it][j], mean, rstd), w.v[j] + w_shift);
      }
      if (args.out) store_vec<VEC>(args.out + row_base + c, y);
      if (args.out_amax)
#pragma unroll
        for (int j = 0; j < VEC; ++j) m = fmaxf(m, stored_abs<T>(y.v[j]));
    }
  }
  if (args.out_amax) block_amax_atomic(args.out_amax, m);
}

template <typename T>
struct NormBackwardArgs {
  T* dx;
  const T* dresidual;  // may be null (may alias dx)
  const T* dout;       // may alias dx
  const T* x;
  const float* mean;   // unused by RMSNorm
  const float* rstd;
  const T* weight;
  const T* weight2;    // the layout's second kind of row (k heads)
  float* partial_dw;   // [gridDim.x, h] or null
  float* partial_db;   // [gridDim.x, h] or null
  int64_t rows;
  int h;
  bool rms, one_p;
  T* out = nullptr;          // if given: the forward's output recomputed (plain rows only)
  const T* bias = nullptr;   // its bias (may be null)
  float* partial_ds = nullptr;  // [gridDim.x, h]: column sums of dx as stored (16-bit fast path only)
  float* dx_amax = nullptr;     // max |dx| as stored, one atomicMax per block
};

template <typename T, int VEC, int ITERS, typename Layout>
__global__ void __launch_bounds__(kMaxTeam) norm_backward_kernel(NormBackwardArgs<T> args, Layout layout, int tpr) {
  __shared__ float red[2][32];
  extern __shared__ float combine[];  // [2][h] when several teams share a block
  const int teams = blockDim.x / tpr, team = threadIdx.x / tpr, lane = threadIdx.x % tpr;
  const int h = args.h;
  const float w_shift = args.one_p ? 1.0f : 0.0f;

  float dw[ITERS][VEC], db[ITERS][VEC];
#pragma unroll
  for (int it = 0; it < ITERS; ++it)
#pragma unroll
    for (int j = 0; j < VEC; ++j) dw[it][j] = db[it][j] = 0.0f;
  float m = 0.0f;  // max |dx| as stored (args.dx_amax)

  for (int64_t row0 = static_cast<int64_t>(blockIdx.x) * teams; row0 < args.rows;
       row0 += static_cast<int64_t>(gridDim.x) * teams) {
    const int64_t row = row0 + team;
    const bool valid = row < args.rows;
    const int64_t row_base = valid ? layout.offset(row) : 0;
    const T* weight = (valid && layout.second(row)) ? args.weight2 : args.weight;
    const float mean = (valid && !args.rms) ? args.mean[row] : 0.0f;
    const float rstd = valid ? args.rstd[row] : 0.0f;
    float xhat[ITERS][VEC], g[ITERS][VEC];
    float sums[2] = {0.0f, 0.0f};  // sum(g * xhat), sum(g)
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (lane + it * tpr) * VEC;
      if (valid && c < h) {
        const Floats<VEC> xv = load_vec<VEC>(args.x + row_base + c);
        const Floats<VEC> dy = load_vec<VEC>(args.dout + row_base + c);
        const Floats<VEC> w = load_vec<VEC>(weight + c);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          xhat[it][j] = norm_xhat(xv.v[j], mean, rstd);
          g[it][j] = dy.v[j] * (w.v[j] + w_shift);
          sums[0] += g[it][j] * xhat[it][j];
          sums[1] += g[it][j];
          dw[it][j] += dy.v[j] * xhat[it][j];
          db[it][j] += dy.v[j];
        }
        if (args.out) {
          Floats<VEC> y;
          if (args.bias) {
            const Floats<VEC> b = load_vec<VEC>(args.bias + c);
#pragma unroll
            for (int j = 0; j < VEC; ++j) y.v[j] = norm_apply(xhat[it][j], w.v[j] + w_shift, b.v[j]);
          } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) y.v[j] = norm_apply(xhat[it][j], w.v[j] + w_shift);
          }
          store_vec<VEC>(args.out + row_base + c, y);
        }
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) xhat[it][j] = g[it][j] = 0.0f;
      }
    }
    team_sum(sums, tpr, red);
    const float c1 = sums[0] / h, c2 = args.rms ? 0.0f : sums[1] / h;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (lane + it * tpr) * VEC;
      if (valid && c < h) {
        Floats<VEC> d;
#pragma unroll
        for (int j = 0; j < VEC; ++j) d.v[j] = rstd * (g[it][j] - c2 - xhat[it][j] * c1);
        if (args.dresidual) {
          const Floats<VEC> r = load_vec<VEC>(args.dresidual + row_base + c);
#pragma unroll
          for (int j = 0; j < VEC; ++j) d.v[j] += r.v[j];
        }
        store_vec<VEC>(args.dx + row_base + c, d);
        if (args.dx_amax)
#pragma unroll
          for (int j = 0; j < VEC; ++j) m = fmaxf(m, stored_abs<T>(d.v[j]));
      }
    }
  }
  if (args.dx_amax) block_amax_atomic(args.dx_amax, m);

  if (!args.partial_dw && !args.partial_db) return;
  // Combine the teams of this block in team order, then write this block's partial row.
  if (teams > 1) {
    for (int t = 0; t < teams; ++t) {
      if (team == t) {
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
          const int c = (lane + it * tpr) * VEC;
          if (c < h) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
              if (t == 0) {
                combine[c + j] = dw[it][j];
                combine[h + c + j] = db[it][j];
              } else {
                combine[c + j] += dw[it][j];
                combine[h + c + j] += db[it][j];
              }
            }
          }
        }
      }
      __syncthreads();
    }
    for (int c = threadIdx.x; c < h; c += blockDim.x) {
      if (args.partial_dw) args.partial_dw[static_cast<int64_t>(blockIdx.x) * h + c] = combine[c];
      if (args.partial_db) args.partial_db[static_cast<int64_t>(blockIdx.x) * h + c] = combine[h + c];
    }
  } else {
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (lane + it * tpr) * VEC;
      if (c < h) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          if (args.partial_dw) args.partial_dw[static_cast<int64_t>(blockIdx.x) * h + c + j] = dw[it][j];
          if (args.partial_db) args.partial_db[static_cast<int64_t>(blockIdx.x) * h + c + j] = db[it][j];
        }
      }
    }
  }
}

// ---- 16-bit rows of at most 2048 elements: the backward the training step runs --------------------
// The general kernel above holds float copies of every loaded vector (xhat and g: 32 floats per
// thread on top of the dweight/dbias accumulators), loads dresidual only after the row's
// reduction and synchronises the block twice per row: it reached ~1.4-1.8 TB/s at h 768-2048.
// This one keeps each row's loads as raw 16-byte words (4 registers per 8 elements), issues all
// of a row's loads (x, dout, dresidual, mean, rstd) at once, and recomputes xhat and g from the raw
// words where needed. Teams of one warp (h <= 512) reduce with shuffles only; wider teams reduce
// through double-buffered shared memory with one block barrier per row and load the next row
// before reducing the current one. The rounding of every output element is the general
// kernel's (the recomputed norm output bit-identical to the forward's).
struct RowWords {
  uint4 x, dy, dr;
};

template <typename T, int ITERS, int TPR>
__device__ __forceinline__ void load_row_words(const NormBackwardArgs<T>& args, int64_t row, int lane, RowWords (&w)[ITERS],
                                               float& mean, float& rstd) {
  const bool valid = row < args.rows;
  mean = (valid && !args.rms) ? args.mean[row] : 0.0f;
  rstd = valid ? args.rstd[row] : 0.0f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (lane + it * TPR) * 8;
    if (valid && c < args.h) {
      const int64_t o = row * args.h + c;
      w[it].x = *reinterpret_cast<const uint4*>(args.x + o);
      w[it].dy = *reinterpret_cast<const uint4*>(args.dout + o);
      if (args.dresidual) w[it].dr = *reinterpret_cast<const uint4*>(args.dresidual + o);
    }
  }
}

template <typename T>
__device__ __forceinline__ float word_elem(const uint4& u, int j) {
  return to_float(reinterpret_cast<const T*>(&u)[j]);
}

// SUM_DX: also the column sums of dx as stored (args.partial_ds), accumulated in shared memory
// (in registers they pushed the prefetching variants past their register budget into spills).
template <typename T, int ITERS, int TPR, bool SUM_DX>
__global__ void __launch_bounds__(256, (TPR > kWarp ? 3 : 2)) norm_backward_rows16_kernel(NormBackwardArgs<T> args) {
  static_assert(sizeof(T) == 2, "16-bit element types only");
  constexpr bool kPrefetch = TPR > kWarp;
  constexpr int kWarpsPerTeam = TPR / kWarp;
  __shared__ float red[2][2][256 / kWarp];  // [buffer][sum][warp of the block]
  extern __shared__ float combine[];        // [h] when several teams share a block
  const int teams = blockDim.x / TPR, team = threadIdx.x / TPR, lane = threadIdx.x % TPR;
  const int warp = threadIdx.x / kWarp;
  const int h = args.h;
  const float w_shift = args.one_p ? 1.0f : 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * teams;

  float dw[ITERS][8], db[ITERS][8];
#pragma unroll
  for (int it = 0; it < ITERS; ++it)
#pragma unroll
    for (int j = 0; j < 8; ++j) dw[it][j] = db[it][j] = 0.0f;
  __shared__ float ds_acc[SUM_DX ? ITERS * 8 : 1][256];  // [element of the thread][thread]: no bank conflicts
  if constexpr (SUM_DX) {
#pragma unroll
    for (int k = 0; k < ITERS * 8; ++k) ds_acc[k][threadIdx.x] = 0.0f;
  }

  RowWords cur[ITERS];
  float mean = 0.0f, rstd = 0.0f;
  float m = 0.0f;  // max |dx| as stored (args.dx_amax)
  int64_t row = static_cast<int64_t>(blockIdx.x) * teams + team;
  if constexpr (kPrefetch) load_row_words<T, ITERS, TPR>(args, row, lane, cur, mean, rstd);
  int buf = 0;
  // The loop bound is uniform over the block (row0), so every thread reaches every barrier.
  for (int64_t row0 = static_cast<int64_t>(blockIdx.x) * teams; row0 < args.rows; row0 += stride, row += stride) {
    const bool valid = row < args.rows;
    RowWords next[ITERS];
    float next_mean = 0.0f, next_rstd = 0.0f;
    if constexpr (kPrefetch) load_row_words<T, ITERS, TPR>(args, row + stride, lane, next, next_mean, next_rstd);
    else load_row_words<T, ITERS, TPR>(args, row, lane, cur, mean, rstd);

    float s_gx = 0.0f, s_g = 0.0f;  // sum(g * xhat), sum(g)
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (lane + it * TPR) * 8;
      if (valid && c < h) {
        const uint4 wr = *reinterpret_cast<const uint4*>(args.weight + c);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float xhat = norm_xhat(word_elem<T>(cur[it].x, j), mean, rstd);
          const float g = word_elem<T>(cur[it].dy, j) * (word_elem<T>(wr, j) + w_shift);
          s_gx += g * xhat;
          s_g += g;
        }
      }
    }
    s_gx = warp_sum(s_gx);
    s_g = warp_sum(s_g);
    if constexpr (kWarpsPerTeam > 1) {
      if (threadIdx.x % kWarp == 0) {
        red[buf][0][warp] = s_gx;
        red[buf][1][warp] = s_g;
      }
      __syncthreads();  // one barrier per row: the other buffer is written next time
      s_gx = s_g = 0.0f;
#pragma unroll
      for (int i = 0; i < kWarpsPerTeam; ++i) {
        s_gx += red[buf][0][team * kWarpsPerTeam + i];
        s_g += red[buf][1][team * kWarpsPerTeam + i];
      }
      buf ^= 1;
    }
    const float c1 = s_gx / h, c2 = args.rms ? 0.0f : s_g / h;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (lane + it * TPR) * 8;
      if (valid && c < h) {
        const int64_t o = row * h + c;
        const uint4 wr = *reinterpret_cast<const uint4*>(args.weight + c);
        uint4 br = make_uint4(0u, 0u, 0u, 0u);
        if (args.bias) br = *reinterpret_cast<const uint4*>(args.bias + c);
        Floats<8> d, y;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float dyv = word_elem<T>(cur[it].dy, j), wv = word_elem<T>(wr, j) + w_shift;
          const float xhat = norm_xhat(word_elem<T>(cur[it].x, j), mean, rstd);
          const float g = dyv * wv;
          d.v[j] = rstd * (g - c2 - xhat * c1);
          if (args.dresidual) d.v[j] += word_elem<T>(cur[it].dr, j);
          dw[it][j] += dyv * xhat;
          db[it][j] += dyv;
          if constexpr (SUM_DX) ds_acc[it * 8 + j][threadIdx.x] += to_float(from_float<T>(d.v[j]));  // as stored
          if (args.dx_amax) m = fmaxf(m, stored_abs<T>(d.v[j]));
          y.v[j] = args.bias ? norm_apply(xhat, wv, word_elem<T>(br, j)) : norm_apply(xhat, wv);
        }
        store_vec<8>(args.dx + o, d);
        if (args.out) store_vec<8>(args.out + o, y);
      }
    }
    if constexpr (kPrefetch) {
#pragma unroll
      for (int it = 0; it < ITERS; ++it) cur[it] = next[it];
      mean = next_mean;
      rstd = next_rstd;
    }
  }

  if (args.dx_amax) block_amax_atomic(args.dx_amax, m);

  // Combine the teams of this block in team order, then write this block's partial row; one
  // accumulator at a time through combine[0, h).
  auto write_partial = [&](float (&acc)[ITERS][8], float* partial) {
    if (!partial) return;
    if (teams > 1) {
      for (int t = 0; t < teams; ++t) {
        if (team == t) {
#pragma unroll
          for (int it = 0; it < ITERS; ++it) {
            const int c = (lane + it * TPR) * 8;
            if (c < h) {
#pragma unroll
              for (int j = 0; j < 8; ++j) combine[c + j] = t == 0 ? acc[it][j] : combine[c + j] + acc[it][j];
            }
          }
        }
        __syncthreads();
      }
      for (int c = threadIdx.x; c < h; c += blockDim.x) partial[static_cast<int64_t>(blockIdx.x) * h + c] = combine[c];
      __syncthreads();  // combine is reused by the next accumulator
    } else {
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        const int c = (lane + it * TPR) * 8;
        if (c < h) {
#pragma unroll
          for (int j = 0; j < 8; ++j) partial[static_cast<int64_t>(blockIdx.x) * h + c + j] = acc[it][j];
        }
      }
    }
  };
  write_partial(dw, args.partial_dw);
  write_partial(db, args.partial_db);
  if constexpr (SUM_DX) {
    float ds[ITERS][8];  // (each thread reads only its own entries: no barrier needed)
#pragma unroll
    for (int it = 0; it < ITERS; ++it)
#pragma unroll
      for (int j = 0; j < 8; ++j) ds[it][j] = ds_acc[it * 8 + j][threadIdx.x];
    write_partial(ds, args.partial_ds);
  }
}

// ---- 16-bit rows of at most 2048 elements: the forward (plain and fused add) ----------------------
// Same layout as the fast backward: raw 16-byte words, the next row's loads issued before the
// current row's reductions, teams of 32-256 threads with one barrier per reduction.
template <int TPR>
__device__ __forceinline__ float team_sum_one_barrier(float v, float (*red)[256 / kWarp], int& buf, int team) {
  v = warp_sum(v);
  if constexpr (TPR > kWarp) {
    constexpr int kW = TPR / kWarp;
    if (threadIdx.x % kWarp == 0) red[buf][threadIdx.x / kWarp] = v;
    __syncthreads();  // double-buffered: the next reduction writes the other half
    v = 0.0f;
#pragma unroll
    for (int i = 0; i < kW; ++i) v += red[buf][team * kW + i];
    buf ^= 1;
  }
  return v;
}

template <typename T, int ITERS, int TPR, bool ADD>
__global__ void __launch_bounds__(256) norm_forward_rows16_kernel(NormForwardArgs<T> args) {
  static_assert(sizeof(T) == 2, "16-bit element types only");
  __shared__ float red[2][256 / kWarp];
  const int teams = blockDim.x / TPR, team = threadIdx.x / TPR, lane = threadIdx.x % TPR;
  const int h = args.h;
  const float w_shift = args.one_p ? 1.0f : 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * teams;
  auto load = [&](int64_t r, uint4 (&wa)[ITERS], uint4 (&wb)[ITERS]) {
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (lane + it * TPR) * 8;
      if (r < args.rows && c < h) {
        wa[it] = *reinterpret_cast<const uint4*>(args.a + r * h + c);
        if constexpr (ADD) wb[it] = *reinterpret_cast<const uint4*>(args.b + r * h + c);
      }
    }
  };
  uint4 ca[ITERS], cb[ITERS];
  int64_t row = static_cast<int64_t>(blockIdx.x) * teams + team;
  load(row, ca, cb);
  int buf = 0;
  float m = 0.0f;  // max |y| as stored (args.out_amax)
  // The weight and bias of this thread's columns, the same in every row: loaded once.
  uint4 wr[ITERS], br[ITERS];
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int c = (lane + it * TPR) * 8;
    wr[it] = br[it] = make_uint4(0u, 0u, 0u, 0u);
    if ((args.out || args.out_amax) && c < h) {
      wr[it] = *reinterpret_cast<const uint4*>(args.weight + c);
      if (args.bias) br[it] = *reinterpret_cast<const uint4*>(args.bias + c);
    }
  }
  for (int64_t row0 = static_cast<int64_t>(blockIdx.x) * teams; row0 < args.rows; row0 += stride, row += stride) {
    const bool valid = row < args.rows;
    uint4 na[ITERS], nb[ITERS];
    load(row + stride, na, nb);
    uint4 xw[ITERS];  // the row to normalize: a, or the stored (rounded) sum
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (lane + it * TPR) * 8;
      if constexpr (ADD) {
        if (valid && c < h) {
          const int64_t o = row * h + c;
          uint4 bb = make_uint4(0u, 0u, 0u, 0u);
          if (args.b_bias) bb = *reinterpret_cast<const uint4*>(args.b_bias + c);
          T* e = reinterpret_cast<T*>(&xw[it]);
          const DropoutGroup drop(args.dropout_key, o, args.dropout_p, args.keep_scale);  // (o % 8 == 0)
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            float bv = word_elem<T>(cb[it], j);
            if (args.b_bias) bv += word_elem<T>(bb, j);
            e[j] = from_float<T>(dropout_add(word_elem<T>(ca[it], j), bv, drop.at(o + j)));
          }
          *reinterpret_cast<uint4*>(args.sum + o) = xw[it];
        }
      } else {
        xw[it] = ca[it];
      }
    }
    float mean = 0.0f;
    if (!args.rms) {
      float s = 0.0f;
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        const int c = (lane + it * TPR) * 8;
        if (valid && c < h)
#pragma unroll
          for (int j = 0; j < 8; ++j) s += word_elem<T>(xw[it], j);
      }
      mean = team_sum_one_barrier<TPR>(s, red, buf, team) / h;
    }
    float q = 0.0f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (lane + it * TPR) * 8;
      if (valid && c < h)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float d = word_elem<T>(xw[it], j) - mean;
          q += d * d;
        }
    }
    const float rstd = 1.0f / sqrtf(team_sum_one_barrier<TPR>(q, red, buf, team) / h + args.eps);
    if (valid && lane == 0) {
      if (args.mean) args.mean[row] = mean;  // 0 for RMSNorm, as the reference writes
      if (args.rstd) args.rstd[row] = rstd;
    }
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = (lane + it * TPR) * 8;
      if ((args.out || args.out_amax) && valid && c < h) {  // (neither: statistics only)
        Floats<8> y;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float xhat = norm_xhat(word_elem<T>(xw[it], j), mean, rstd), wv = word_elem<T>(wr[it], j) + w_shift;
          y.v[j] = args.bias ? norm_apply(xhat, wv, word_elem<T>(br[it], j)) : norm_apply(xhat, wv);
          if (args.out_amax) m = fmaxf(m, stored_abs<T>(y.v[j]));
        }
        if (args.out) store_vec<8>(args.out + row * h + c, y);
      }
    }
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      ca[it] = na[it];
      cb[it] = nb[it];
    }
  }
  if (args.out_amax) block_amax_atomic(args.out_amax, m);
}

// out[c] += sum over g of partial[g, c] for each of up to three outputs (blockIdx.y: dweight, dbias,
// the column sums of dx; those given, in that order). A block sums 32 columns: its 8 warps each add
// every 8th partial row in order, then the 8 warp sums are added in warp order, so the result is
// fixed by (blocks, h). (One thread per column
// walking all the partials serially left the GPU nearly idle: h/256 blocks of dependent loads.)
// ANY_BF16: some outputs are bfloat16 gradients (out_bf16), each added to in float32 and rounded once.
constexpr int kReduceWarps = 8;
struct PartialSums {
  void* out[3];
  const float* partial[3];
  bool out_bf16[3];
};
template <bool ANY_BF16>
__global__ void __launch_bounds__(kWarp * kReduceWarps) reduce_partials_kernel(PartialSums sums, int blocks, int h) {
  __shared__ float part[kReduceWarps][kWarp + 1];
  void* out = sums.out[blockIdx.y];
  const float* partial = sums.partial[blockIdx.y];
  const int c = blockIdx.x * kWarp + threadIdx.x;
  float s = 0.0f;
  if (c < h)
    for (int g = threadIdx.y; g < blocks; g += kReduceWarps) s += partial[static_cast<int64_t>(g) * h + c];
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < h) {
    float t = 0.0f;
#pragma unroll
    for (int i = 0; i < kReduceWarps; ++i) t += part[i][threadIdx.x];
    if constexpr (ANY_BF16) {
      if (sums.out_bf16[blockIdx.y]) {
        grad_add(static_cast<bf16*>(out) + c, t);
        return;
      }
    }
    static_cast<float*>(out)[c] += t;
  }
}

// bench_choice::norm_general sends every norm (forward and backward) to the general kernels, so
// that bench_ops can compare the two paths in one binary.
bool fast_norm_disabled() { return bench_choice::norm_general; }

struct TeamShape {
  int vec, iters, tpr, block;
};

// Chooses VEC, ITERS and the team size for rows of width h (see the header comment).
// vec_iters: vectors per thread on the 16-byte path (4 forward; 2 backward, whose threads hold
// four arrays of them and would otherwise run at low occupancy).
template <typename T>
TeamShape team_shape(int64_t h, bool aligned, const char* what, int vec_iters = 4) {
  const int vec = aligned ? static_cast<int>(16 / sizeof(T)) : 1;
  const int64_t vectors = (h + vec - 1) / vec;
  int iters = vec == 1 ? (vectors > int64_t{kMaxTeam} * 4 ? 16 : 4) : vec_iters;
  if (vec > 1 && iters < 4 && vectors > int64_t{kMaxTeam} * iters) iters = 4;  // wide rows: more per thread
  int64_t tpr = kWarp;
  while (tpr * iters < vectors) tpr *= 2;
  if (tpr > kMaxTeam)
    throw Unsupported(fmt::format("{}: rows of {} elements are wider than this kernel supports ({} for this dtype "
                                  "and alignment)", what, h, int64_t{kMaxTeam} * iters * vec));
  return {vec, iters, static_cast<int>(tpr), static_cast<int>(std::max<int64_t>(tpr, 128))};
}

template <typename F>
void dispatch_vec_iters(const TeamShape& s, int elem_vec, F&& f) {
  if (s.vec == 1 && s.iters == 16) f.template operator()<1, 16>();
  else if (s.vec == 1) f.template operator()<1, 4>();
  else if (elem_vec == 8 && s.iters == 2) f.template operator()<8, 2>();
  else if (elem_vec == 8) f.template operator()<8, 4>();
  else if (s.iters == 2) f.template operator()<4, 2>();
  else f.template operator()<4, 4>();
}

bool aligned_rows(int64_t h, size_t elem, std::initializer_list<const void*> ptrs) {
  if ((h * static_cast<int64_t>(elem)) % 16 != 0) return false;
  for (const void* p : ptrs)
    if (p && !aligned16(p)) return false;
  return true;
}


// The 16-bit fast forward for aligned plain rows of at most 2048 elements (team shapes as the
// fast backward's). Returns false where it does not apply.
template <typename T>
bool launch_norm_forward_rows16(const KernelContext& ctx, const NormForwardArgs<T>& args, bool add) {
  const int64_t vectors = args.h / 8;
  auto run = [&](auto plain_kernel, auto add_kernel, int tpr) {
    const int teams = std::max(1, 256 / tpr), block = teams * tpr;
    int per_sm = 0;
    if (add) MT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, add_kernel, block, 0));
    else MT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, plain_kernel, block, 0));
    const auto blocks = static_cast<unsigned>(
        std::min<int64_t>((args.rows + teams - 1) / teams, static_cast<int64_t>(ctx.num_sms) * std::max(per_sm, 1)));
    if (add) add_kernel<<<blocks, block, 0, ctx.stream>>>(args);
    else plain_kernel<<<blocks, block, 0, ctx.stream>>>(args);
    MT_CUDA_CHECK_LAUNCH();
    return true;
  };
  if (vectors <= 32) return run(norm_forward_rows16_kernel<T, 1, 32, false>, norm_forward_rows16_kernel<T, 1, 32, true>, 32);
  if (vectors <= 64) return run(norm_forward_rows16_kernel<T, 2, 32, false>, norm_forward_rows16_kernel<T, 2, 32, true>, 32);
  if (vectors <= 96) return run(norm_forward_rows16_kernel<T, 1, 96, false>, norm_forward_rows16_kernel<T, 1, 96, true>, 96);
  if (vectors <= 128)
    return run(norm_forward_rows16_kernel<T, 1, 128, false>, norm_forward_rows16_kernel<T, 1, 128, true>, 128);
  if (vectors <= 256)
    return run(norm_forward_rows16_kernel<T, 1, 256, false>, norm_forward_rows16_kernel<T, 1, 256, true>, 256);
  return false;
}

template <typename T, typename Layout>
void launch_norm_forward(const KernelContext& ctx, const NormForwardArgs<T>& args, const Layout& layout, bool add,
                         bool aligned, const char* what) {
  if constexpr (sizeof(T) == 2 && std::is_same_v<Layout, PlainRows>) {
    if (aligned && args.h % 8 == 0 && args.h <= 2048 && !fast_norm_disabled())
      if (launch_norm_forward_rows16(ctx, args, add)) return;
  }
  const TeamShape s = team_shape<T>(args.h, aligned, what);
  const int teams = s.block / s.tpr;
  const unsigned grid = static_cast<unsigned>((args.rows + teams - 1) / teams);
  dispatch_vec_iters(s, 16 / sizeof(T), [&]<int V, int I>() {
    if constexpr (V == 1 || V * sizeof(T) == 16) {
      if (add) norm_forward_kernel<T, V, I, true><<<grid, s.block, 0, ctx.stream>>>(args, layout, s.tpr);
      else norm_forward_kernel<T, V, I, false><<<grid, s.block, 0, ctx.stream>>>(args, layout, s.tpr);
    }
  });
  MT_CUDA_CHECK_LAUNCH();
}

// Scratch for the per-block partial rows of dweight, dbias and dx's column sums (those given);
// returns the block count (at most `blocks`).
template <typename T>
int64_t take_partials(const KernelContext& ctx, NormBackwardArgs<T>& args, int64_t blocks, GradOut dweight,
                      GradOut dbias, GradOut dx_colsum = GradOut()) {
  const int sums = static_cast<int>(static_cast<bool>(dweight)) + static_cast<int>(static_cast<bool>(dbias)) +
                   static_cast<int>(static_cast<bool>(dx_colsum));
  if (sums == 0) return blocks;
  const int64_t h = args.h;
  const int64_t per_block = h * sums * static_cast<int64_t>(sizeof(float));
  blocks = std::max<int64_t>(1, std::min<int64_t>(blocks, static_cast<int64_t>(ctx.scratch->remaining()) / per_block));
  if (dweight) args.partial_dw = ctx.scratch->take_array<float>(blocks * h, "norm_backward partial dweight");
  if (dbias) args.partial_db = ctx.scratch->take_array<float>(blocks * h, "norm_backward partial dbias");
  if (dx_colsum) args.partial_ds = ctx.scratch->take_array<float>(blocks * h, "norm_backward partial dx sums");
  return blocks;
}

// dweight (+)= column sums of the partials, dbias and dx's column sums likewise, in one launch.
template <typename T>
void reduce_partials(const KernelContext& ctx, const NormBackwardArgs<T>& args, int64_t blocks, GradOut dweight,
                     GradOut dbias, GradOut dx_colsum = GradOut()) {
  PartialSums sums{};
  unsigned n = 0;
  bool any_bf16 = false;
  const GradOut outs[3] = {dweight, dbias, dx_colsum};
  const float* const partials[3] = {args.partial_dw, args.partial_db, args.partial_ds};
  for (int i = 0; i < 3; ++i) {
    if (!outs[i]) continue;
    sums.out[n] = outs[i].data;
    sums.partial[n] = partials[i];
    sums.out_bf16[n] = outs[i].is_bf16();
    any_bf16 = any_bf16 || outs[i].is_bf16();
    ++n;
  }
  if (n == 0) return;
  const dim3 grid(static_cast<unsigned>((args.h + kWarp - 1) / kWarp), n);
  if (any_bf16)
    reduce_partials_kernel<true><<<grid, dim3(kWarp, kReduceWarps), 0, ctx.stream>>>(sums, static_cast<int>(blocks), args.h);
  else
    reduce_partials_kernel<false><<<grid, dim3(kWarp, kReduceWarps), 0, ctx.stream>>>(sums, static_cast<int>(blocks), args.h);
  MT_CUDA_CHECK_LAUNCH();
}

// The 16-bit fast path (norm_backward_rows16_kernel) for aligned plain rows of at most 2048
// elements: team size and vectors per thread by width (one-warp teams up to 512 elements, then one
// vector per thread, 96-256 threads a row).
// dx_colsum (may be null) += the column sums of dx as stored, in the same pass.
template <typename T>
bool launch_norm_backward_rows16(const KernelContext& ctx, NormBackwardArgs<T> args, GradOut dweight, GradOut dbias,
                                 GradOut dx_colsum) {
  const int64_t vectors = args.h / 8;
  auto launch = [&](auto kernel, int tpr) {
    const int teams = std::max(1, 256 / tpr), kBlock = teams * tpr;
    const size_t smem = teams > 1 ? static_cast<size_t>(args.h) * sizeof(float) : 0;
    int per_sm = 0;
    MT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlock, smem));
    int64_t blocks =
        std::min<int64_t>((args.rows + teams - 1) / teams, static_cast<int64_t>(ctx.num_sms) * std::max(per_sm, 1));
    blocks = take_partials(ctx, args, blocks, dweight, dbias, dx_colsum);
    kernel<<<static_cast<unsigned>(blocks), kBlock, smem, ctx.stream>>>(args);
    MT_CUDA_CHECK_LAUNCH();
    reduce_partials(ctx, args, blocks, dweight, dbias, dx_colsum);
    return true;
  };
  auto run = [&]<int ITERS, int TPR>() {
    return static_cast<bool>(dx_colsum) ? launch(norm_backward_rows16_kernel<T, ITERS, TPR, true>, TPR)
                     : launch(norm_backward_rows16_kernel<T, ITERS, TPR, false>, TPR);
  };
  if (vectors <= 32) return run.template operator()<1, 32>();
  if (vectors <= 64) return run.template operator()<2, 32>();
  if (vectors <= 96) return run.template operator()<1, 96>();
  if (vectors <= 128) return run.template operator()<1, 128>();
  if (vectors <= 256) return run.template operator()<1, 256>();
  return false;
}

// dx for every row; with dweight/dbias given (plain rows only) also their deterministic accumulation.
template <typename T, typename Layout>
void launch_norm_backward(const KernelContext& ctx, NormBackwardArgs<T> args, const Layout& layout, bool aligned,
                          GradOut dweight, GradOut dbias) {
  const int64_t h = args.h;
  if constexpr (sizeof(T) == 2 && std::is_same_v<Layout, PlainRows>) {
    if (aligned && h % 8 == 0 && h <= 2048 && !fast_norm_disabled()) {
      if (launch_norm_backward_rows16(ctx, args, dweight, dbias, GradOut())) return;
    }
  }
  const TeamShape s = team_shape<T>(h, aligned, "norm_backward", 2);
  const int teams = s.block / s.tpr;
  const size_t smem = teams > 1 ? 2 * h * sizeof(float) : 0;
  dispatch_vec_iters(s, 16 / sizeof(T), [&]<int V, int I>() {
    if constexpr (V == 1 || V * sizeof(T) == 16) {
      auto kernel = norm_backward_kernel<T, V, I, Layout>;
      int per_sm = 0;
      MT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, s.block, smem));
      int64_t blocks =
          std::min<int64_t>((args.rows + teams - 1) / teams, static_cast<int64_t>(ctx.num_sms) * std::max(per_sm, 1));
      blocks = take_partials(ctx, args, blocks, dweight, dbias);
      kernel<<<static_cast<unsigned>(blocks), s.block, smem, ctx.stream>>>(args, layout, s.tpr);
      MT_CUDA_CHECK_LAUNCH();
      reduce_partials(ctx, args, blocks, dweight, dbias);
    }
  });
}

// ---- --qk-layernorm pieces ------------------------------------------------------------------------
// dst's v parts = src's v parts.
template <typename T>
__global__ void copy_v_kernel(T* dst, const T* src, int64_t rows, int groups, int q_per_group, int d,
                              int64_t row_width) {
  const int64_t total = rows * groups * d;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / (static_cast<int64_t>(groups) * d);
    const int rem = static_cast<int>(i % (static_cast<int64_t>(groups) * d));
    const int g = rem / d, c = rem % d;
    const int64_t o = row * row_width + (static_cast<int64_t>(g) * (q_per_group + 2) + q_per_group + 1) * d + c;
    dst[o] = src[o];
  }
}

// Per block: sums over its packed rows of dout * xhat and dout, for q heads and k heads
// separately, one column per thread: partial[block][4][d] = (dq_w, dq_b, dk_w, dk_b).
template <typename T>
__global__ void qk_param_partial_kernel(float* partial, const T* qkv, const T* dout, const float* mean,
                                        const float* rstd, int64_t rows, int64_t rows_per_block, QkHeads L, bool rms) {
  const int c = threadIdx.x;
  const int d = static_cast<int>(L.d);
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const int64_t r_begin = blockIdx.x * rows_per_block, r_end = min(rows, r_begin + rows_per_block);
  if (c < d) {
    for (int64_t row = r_begin; row < r_end; ++row) {
      for (int64_t j = 0; j < L.heads; ++j) {
        const int64_t v = row * L.heads + j;
        const int64_t o = L.offset(v) + c;
        const float xhat = (to_float(qkv[o]) - (rms ? 0.0f : mean[v])) * rstd[v];
        const float dy = to_float(dout[o]);
        const int k = L.second(v) ? 2 : 0;
        acc[k] += dy * xhat;
        acc[k + 1] += dy;
      }
    }
    for (int q = 0; q < 4; ++q) partial[(static_cast<int64_t>(blockIdx.x) * 4 + q) * d + c] = acc[q];
  }
}

// The four gradients (dq_w, dq_b, dk_w, dk_b; null: not wanted) += the sums of the partials. ANY_BF16:
// some are bfloat16 (bf16[i]), added to in float32 and rounded once.
struct QkParamGrads {
  void* g[4];
  bool bf16[4];
};
template <bool ANY_BF16>
__global__ void qk_param_finish_kernel(QkParamGrads out, const float* partial, int blocks, int d) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= d) return;
  float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int b = 0; b < blocks; ++b)
    for (int q = 0; q < 4; ++q) s[q] += partial[(static_cast<int64_t>(b) * 4 + q) * d + c];
  for (int q = 0; q < 4; ++q) {
    if (!out.g[q]) continue;
    if (ANY_BF16 && out.bf16[q]) grad_add(static_cast<bf16*>(out.g[q]) + c, s[q]);
    else static_cast<float*>(out.g[q])[c] += s[q];
  }
}

QkHeads qk_layout(const Tensor& qkv, const RopeShape& r, const char* what) {
  MT_CHECK(r.groups > 0 && r.heads % r.groups == 0, "{}: heads {} not a multiple of groups {}", what, r.heads, r.groups);
  const int64_t hpg = r.heads / r.groups;
  QkHeads L{r.groups * (hpg + 1), hpg, r.head_dim, r.groups * (hpg + 2) * r.head_dim};
  MT_CHECK(qkv.cols() == L.row_width, "{}: packed qkv {} must have {} columns", what, qkv.shape_string(), L.row_width);
  return L;
}

}  // namespace

void norm_forward(const KernelContext& ctx, Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor a, Tensor b,
                  float dropout_p, uint64_t dropout_key, Tensor weight, Tensor bias, const NormParams& p,
                  Tensor b_bias, Tensor out_amax) {
  const int64_t h = a.cols(), rows = a.rows();
  const bool add = !b.empty();
  const char* what = add ? "add_norm_forward" : "norm_forward";
  MT_CHECK(out.empty() || (out.numel() == a.numel() && out.dtype == a.dtype), "{}: out {} vs input {}", what,
           out.shape_string(), a.shape_string());
  MT_CHECK(!out.empty() || !rstd.empty(), "{}: neither out nor rstd given", what);
  MT_CHECK(weight.numel() == h && weight.dtype == a.dtype, "{}: weight {} for rows of {} ({})", what,
           weight.shape_string(), h, dtype_name(a.dtype));
  MT_CHECK(bias.empty() || (bias.numel() == h && bias.dtype == a.dtype), "{}: bias {}", what, bias.shape_string());
  MT_CHECK(mean.empty() || (mean.numel() == rows && mean.dtype == DType::f32), "{}: mean must be float32 [{}]", what, rows);
  MT_CHECK(rstd.empty() || (rstd.numel() == rows && rstd.dtype == DType::f32), "{}: rstd must be float32 [{}]", what, rows);
  if (add)
    MT_CHECK(b.numel() == a.numel() && b.dtype == a.dtype && sum.numel() == a.numel() && sum.dtype == a.dtype,
             "{}: a {}, b {}, sum {} must match", what, a.shape_string(), b.shape_string(), sum.shape_string());
  MT_CHECK(b_bias.empty() || (add && b_bias.numel() == h && b_bias.dtype == a.dtype), "{}: bias of b {} for rows of {}",
           what, b_bias.shape_string(), h);
  check_amax_slot(out_amax, what, "out_amax");
  if (rows == 0 || h == 0) return;
  MT_DISPATCH_FLOAT(a.dtype, T, what, {
    const bool aligned =
        aligned_rows(h, sizeof(T), {out.data, a.data, b.data, sum.data, weight.data, bias.data, b_bias.data});
    NormForwardArgs<T> args{out.ptr<T>(), sum.ptr<T>(), mean.ptr<float>(), rstd.ptr<float>(), a.ptr<const T>(),
                            b.ptr<const T>(), weight.ptr<const T>(), bias.ptr<const T>(), nullptr, nullptr, rows,
                            static_cast<int>(h), p.eps, dropout_p, dropout_keep_scale(dropout_p), dropout_key,
                            p.kind == Normalization::rmsnorm, p.one_p};
    args.b_bias = b_bias.ptr<const T>();
    args.out_amax = out_amax.ptr<float>();
    launch_norm_forward(ctx, args, PlainRows{h}, add, aligned, what);
  });
}

void norm_backward(const KernelContext& ctx, Tensor dx, Tensor dweight, Tensor dbias, Tensor dout, Tensor x,
                   Tensor mean, Tensor rstd, Tensor weight, Tensor dresidual, const NormParams& p, Tensor out,
                   Tensor bias, Tensor dx_colsum, Tensor dx_amax) {
  const int64_t h = x.cols(), rows = x.rows();
  const bool rms = p.kind == Normalization::rmsnorm;
  MT_CHECK(dx.numel() == x.numel() && dout.numel() == x.numel() && dx.dtype == x.dtype && dout.dtype == x.dtype,
           "norm_backward: dx {}, dout {}, x {} must match", dx.shape_string(), dout.shape_string(), x.shape_string());
  MT_CHECK(weight.numel() == h && weight.dtype == x.dtype, "norm_backward: weight {}", weight.shape_string());
  MT_CHECK(rstd.numel() == rows && rstd.dtype == DType::f32, "norm_backward: rstd must be float32 [{}]", rows);
  MT_CHECK(rms || (mean.numel() == rows && mean.dtype == DType::f32), "norm_backward: mean must be float32 [{}]", rows);
  check_grad(dweight, h, "norm_backward", "dweight");
  check_grad(dbias, h, "norm_backward", "dbias");
  MT_CHECK(dresidual.empty() || (dresidual.numel() == x.numel() && dresidual.dtype == x.dtype),
           "norm_backward: dresidual {}", dresidual.shape_string());
  MT_CHECK(out.empty() || (out.numel() == x.numel() && out.dtype == x.dtype && out.data != x.data &&
                           out.data != dx.data && out.data != dout.data && out.data != dresidual.data),
           "norm_backward: recomputed output {} must match x {} and alias nothing", out.shape_string(),
           x.shape_string());
  MT_CHECK(bias.empty() || (bias.numel() == h && bias.dtype == x.dtype), "norm_backward: bias {}", bias.shape_string());
  check_grad(dx_colsum, h, "norm_backward", "dx_colsum");
  check_amax_slot(dx_amax, "norm_backward", "dx_amax");
  if (rows == 0 || h == 0) return;
  MT_DISPATCH_FLOAT(x.dtype, T, "norm_backward", {
    const bool aligned = aligned_rows(h, sizeof(T), {dx.data, dout.data, x.data, weight.data, dresidual.data,
                                                     out.data, bias.data});
    NormBackwardArgs<T> args{dx.ptr<T>(), dresidual.ptr<const T>(), dout.ptr<const T>(), x.ptr<const T>(),
                             mean.ptr<const float>(), rstd.ptr<const float>(), weight.ptr<const T>(), nullptr,
                             nullptr, nullptr, rows, static_cast<int>(h), rms, p.one_p};
    args.out = out.ptr<T>();
    args.bias = bias.ptr<const T>();
    args.dx_amax = dx_amax.ptr<float>();
    bool summed = false;  // dx's column sums taken in the same pass (the 16-bit fast path)
    if constexpr (sizeof(T) == 2) {
      if (!dx_colsum.empty() && aligned && h % 8 == 0 && h <= 2048 && !fast_norm_disabled())
        summed = launch_norm_backward_rows16(ctx, args, GradOut(dweight), GradOut(dbias), GradOut(dx_colsum));
    }
    if (!summed) {
      launch_norm_backward(ctx, args, PlainRows{h}, aligned, GradOut(dweight), GradOut(dbias));
      if (!dx_colsum.empty()) column_sum_accumulate(ctx, dx_colsum, dx.view({rows, h}));
    }
  });
}

void qk_norm_forward(const KernelContext& ctx, Tensor out, Tensor mean, Tensor rstd, Tensor qkv, Tensor q_weight,
                     Tensor q_bias, Tensor k_weight, Tensor k_bias, const RopeShape& r, const NormParams& p) {
  const char* what = "qk_norm_forward";
  const QkHeads L = qk_layout(qkv, r, what);
  const int64_t rows = qkv.rows(), vrows = rows * L.heads;
  MT_CHECK(out.data != qkv.data, "{}: out must not alias qkv", what);
  MT_CHECK(out.numel() == qkv.numel() && out.dtype == qkv.dtype, "{}: out {} vs qkv {}", what, out.shape_string(),
           qkv.shape_string());
  MT_CHECK(rstd.numel() == vrows && rstd.dtype == DType::f32, "{}: rstd must be float32 [{}, {}]", what, rows, L.heads);
  MT_CHECK(mean.empty() || (mean.numel() == vrows && mean.dtype == DType::f32), "{}: mean must be float32 [{}, {}]",
           what, rows, L.heads);
  for (const Tensor* t : {&q_weight, &k_weight})
    MT_CHECK(t->numel() == L.d && t->dtype == qkv.dtype, "{}: weights must be [{}] {}", what, L.d, dtype_name(qkv.dtype));
  for (const Tensor* t : {&q_bias, &k_bias})
    MT_CHECK(t->empty() || (t->numel() == L.d && t->dtype == qkv.dtype), "{}: biases must be [{}]", what, L.d);
  MT_CHECK(q_bias.empty() == k_bias.empty(), "{}: give both q and k biases or neither", what);
  if (rows == 0) return;
  MT_DISPATCH_FLOAT(qkv.dtype, T, what, {
    const bool aligned = aligned_rows(L.d, sizeof(T), {out.data, qkv.data, q_weight.data, k_weight.data, q_bias.data,
                                                       k_bias.data});
    NormForwardArgs<T> args{out.ptr<T>(), nullptr, mean.ptr<float>(), rstd.ptr<float>(), qkv.ptr<const T>(), nullptr,
                            q_weight.ptr<const T>(), q_bias.ptr<const T>(), k_weight.ptr<const T>(),
                            k_bias.ptr<const T>(), vrows, static_cast<int>(L.d), p.eps, 0.0f, 1.0f, 0,
                            p.kind == Normalization::rmsnorm, p.one_p};
    launch_norm_forward(ctx, args, L, false, aligned, what);
    copy_v_kernel<T><<<grid_for(rows * r.groups * L.d, 256, ctx.num_sms * 8LL), 256, 0, ctx.stream>>>(
        out.ptr<T>(), qkv.ptr<const T>(), rows, r.groups, static_cast<int>(L.q_per_group), static_cast<int>(L.d),
        L.row_width);
    MT_CUDA_CHECK_LAUNCH();
  });
}

void qk_norm_backward(const KernelContext& ctx, Tensor dqkv, Tensor dq_weight, Tensor dq_bias, Tensor dk_weight,
                      Tensor dk_bias, Tensor dout, Tensor qkv, Tensor mean, Tensor rstd, Tensor q_weight,
                      Tensor k_weight, const RopeShape& r, const NormParams& p) {
  const char* what = "qk_norm_backward";
  const QkHeads L = qk_layout(qkv, r, what);
  const int64_t rows = qkv.rows(), vrows = rows * L.heads;
  const bool rms = p.kind == Normalization::rmsnorm;
  MT_CHECK(dqkv.numel() == qkv.numel() && dout.numel() == qkv.numel() && dqkv.dtype == qkv.dtype &&
               dout.dtype == qkv.dtype,
           "{}: dqkv {}, dout {}, qkv {} must match", what, dqkv.shape_string(), dout.shape_string(), qkv.shape_string());
  MT_CHECK(rstd.numel() == vrows && rstd.dtype == DType::f32, "{}: rstd must be float32 [{}, {}]", what, rows, L.heads);
  MT_CHECK(rms || (mean.numel() == vrows && mean.dtype == DType::f32), "{}: mean must be float32 [{}, {}]", what, rows,
           L.heads);
  for (const Tensor* t : {&q_weight, &k_weight})
    MT_CHECK(t->numel() == L.d && t->dtype == qkv.dtype, "{}: weights must be [{}] {}", what, L.d, dtype_name(qkv.dtype));
  check_grad(dq_weight, L.d, what, "dq_weight");
  check_grad(dq_bias, L.d, what, "dq_bias");
  check_grad(dk_weight, L.d, what, "dk_weight");
  check_grad(dk_bias, L.d, what, "dk_bias");
  MT_CHECK(L.d <= 1024, "{}: head_dim {} above 1024", what, L.d);
  if (rows == 0) return;
  MT_DISPATCH_FLOAT(qkv.dtype, T, what, {
    // Parameter gradients first: dqkv may overwrite dout.
    if (!dq_weight.empty() || !dq_bias.empty() || !dk_weight.empty() || !dk_bias.empty()) {
      const int64_t blocks = std::min<int64_t>(rows, ctx.num_sms * 4LL);
      const int64_t rows_per_block = (rows + blocks - 1) / blocks;
      const int64_t used = (rows + rows_per_block - 1) / rows_per_block;
      float* partial = ctx.scratch->take_array<float>(used * 4 * L.d, what);
      const int threads = static_cast<int>((L.d + 31) / 32 * 32);
      qk_param_partial_kernel<T><<<static_cast<unsigned>(used), threads, 0, ctx.stream>>>(
          partial, qkv.ptr<const T>(), dout.ptr<const T>(), mean.ptr<const float>(), rstd.ptr<const float>(), rows,
          rows_per_block, L, rms);
      MT_CUDA_CHECK_LAUNCH();
      QkParamGrads grads{};
      bool any_bf16 = false;
      const Tensor* const outs[4] = {&dq_weight, &dq_bias, &dk_weight, &dk_bias};
      for (int q = 0; q < 4; ++q) {
        grads.g[q] = outs[q]->data;
        grads.bf16[q] = !outs[q]->empty() && outs[q]->dtype == DType::bf16;
        any_bf16 = any_bf16 || grads.bf16[q];
      }
      const auto finish_grid = static_cast<unsigned>((L.d + 127) / 128);
      if (any_bf16)
        qk_param_finish_kernel<true><<<finish_grid, 128, 0, ctx.stream>>>(grads, partial, static_cast<int>(used),
                                                                           static_cast<int>(L.d));
      else
        qk_param_finish_kernel<false><<<finish_grid, 128, 0, ctx.stream>>>(grads, partial, static_cast<int>(used),
                                                                            static_cast<int>(L.d));
      MT_CUDA_CHECK_LAUNCH();
    }
    const bool aligned = aligned_rows(L.d, sizeof(T), {dqkv.data, dout.data, qkv.data, q_weight.data, k_weight.data});
    NormBackwardArgs<T> args{dqkv.ptr<T>(), nullptr, dout.ptr<const T>(), qkv.ptr<const T>(), mean.ptr<const float>(),
                             rstd.ptr<const float>(), q_weight.ptr<const T>(), k_weight.ptr<const T>(), nullptr,
                             nullptr, vrows, static_cast<int>(L.d), rms, p.one_p};
    launch_norm_backward(ctx, args, L, aligned, nullptr, nullptr);
    if (dqkv.data != dout.data) {
      copy_v_kernel<T><<<grid_for(rows * r.groups * L.d, 256, ctx.num_sms * 8LL), 256, 0, ctx.stream>>>(
          dqkv.ptr<T>(), dout.ptr<const T>(), rows, r.groups, static_cast<int>(L.q_per_group), static_cast<int>(L.d),
          L.row_width);
      MT_CUDA_CHECK_LAUNCH();
    }
  });
}

}  // namespace mt::cuda

// Gated DeltaNet's ops on the GPU (engine/backend.h, GdnShape; engine/reference/gdn_ops.cpp is the
// float64 spec): the causal convolution, the gated delta rule forward and backward, the output
// gate. Math in float32 (float64 for float64 data), each output rounded once; no atomics, no
// scratch: every sum has a fixed order, so the results repeat bit for bit.
//
// Convolution: one thread per (row, channel) with its K taps; the weight gradient one block per
// 32 channels, 16 row lanes each summing every 16th row, the lanes added in order.
//
// The recurrence keeps S [dk, dv] per (sample, value head); its columns are independent (column j
// only needs q, k, beta, the decay and u_j). A thread holds kRows rows x kCols columns of S in
// registers: a column group of rs lanes (rs a power of two, dkp = 8 rs >= dk rows, padded rows
// zero) covers kCols columns, lane l rows l + rs m; dot products over dk are a sum over m, then
// xor shuffles among the group's lanes.
//
// Forward: one block per (column tile, value head, sample); 32 positions at a time are staged in
// shared memory (q and k normalized, u, beta, decay), then stepped through with no block barrier;
// outputs go through shared memory to coalesced stores; S before every 64th position is saved.
//
// Backward: one thread-block cluster per (sample, key head) holds the rep value heads x their
// column tiles (cluster <= 8 blocks, 16 where the hardware allows it). Per chunk of 64 positions,
// last to first: pass 1 steps forward from the saved state, keeping S at every sub-chunk start
// (nsl slices in shared memory) and w = u - S^T k per position; then sub-chunks last to first,
// positions last to first: S before the position is recomputed from its slice (the same float
// operations as the forward, so the same bits), and the gradient flows through the position with
// dS carried in registers. Everything column-local (dS, the values' gradient) stays in the block;
// the sums over columns (q's and k's gradients before their norms, dbeta, d decay) are summed over
// the block's column groups in order into a per-position row, and every 8 positions the cluster
// adds its blocks' rows in rank order through distributed shared memory and writes dq, dk (the
// l2 norms' backward applied once to the sum over the group's value heads), dbeta and dalpha.
// d a_log and d dt_bias: one block per value head sums dproj's alpha column as stored (dalpha,
// and dalpha * softplus(x) / sigmoid(x) = d gl * gl) over all rows in order.
#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "cuda/cuda_backend.h"
#include "cuda/cuda_backend_dispatch.h"
#include "cuda/cuda_check.h"
#include "cuda/device_utils.cuh"
#include "engine/gdn_shape_check.h"

namespace mt::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr unsigned kFull = 0xffffffffu;
constexpr int kRows = 8;                  // state rows per thread
constexpr int kCols = 4;                  // state columns per thread
constexpr int kChunk = GdnShape::kChunk;  // positions between saved states
constexpr int kStage = 32;                // positions the forward stages at a time
constexpr int kGroup = 8;                 // positions whose column sums the backward's cluster adds at a time
constexpr int kMaxDk = 256;               // dkp = 8 rs, rs <= 32
constexpr int kMaxConv = 8;               // the convolution's weight gradient keeps K sums per thread
constexpr int kForwardThreads = 128;
constexpr int kBackwardMaxThreads = 256;  // up to 255 registers a thread
constexpr int kDwChannels = 32, kDwLanes = 16;  // the weight gradient's block: channels x row lanes

// Accumulation type: float32, float64 for float64 data.
template <typename T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename A, typename T>
__device__ __forceinline__ A ld(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, double>) return static_cast<A>(p[i]);
  else return static_cast<A>(to_float(p[i]));
}
template <typename T, typename A>
__device__ __forceinline__ void st(T* p, int64_t i, A v) {
  if constexpr (std::is_same_v<T, double>) p[i] = static_cast<double>(v);
  else p[i] = from_float<T>(static_cast<float>(v));
}

// Parameters (a_log, dt_bias, the conv weight) and their gradients in any float dtype, by code.
enum FloatCode : int { kCodeF32 = 0, kCodeBF16 = 1, kCodeF16 = 2, kCodeF64 = 3 };

int float_code(DType t, const char* op, const char* what) {
  switch (t) {
    case DType::f32: return kCodeF32;
    case DType::bf16: return kCodeBF16;
    case DType::f16: return kCodeF16;
    case DType::f64: return kCodeF64;
    default: fail("{}: {} is {}; it must be a float type", op, what, dtype_name(t));
  }
}

template <typename A>
__device__ __forceinline__ A ld_code(const void* p, int code, int64_t i) {
  switch (code) {
    case kCodeF64: return static_cast<A>(static_cast<const double*>(p)[i]);
    case kCodeBF16: return static_cast<A>(to_float(static_cast<const bf16*>(p)[i]));
    case kCodeF16: return static_cast<A>(to_float(static_cast<const f16*>(p)[i]));
    default: return static_cast<A>(static_cast<const float*>(p)[i]);
  }
}

// A parameter gradient's element (+)= v: the old value plus v in float32 (float64 for a float64
// gradient), rounded once.
template <typename A>
__device__ __forceinline__ void grad_out(void* p, int code, int64_t i, A v, bool accumulate) {
  switch (code) {
    case kCodeF64: {
      double* q = static_cast<double*>(p);
      q[i] = (accumulate ? q[i] : 0.0) + static_cast<double>(v);
      break;
    }
    case kCodeBF16: {
      bf16* q = static_cast<bf16*>(p);
      q[i] = from_float<bf16>((accumulate ? to_float(q[i]) : 0.0f) + static_cast<float>(v));
      break;
    }
    case kCodeF16: {
      f16* q = static_cast<f16*>(p);
      q[i] = from_float<f16>((accumulate ? to_float(q[i]) : 0.0f) + static_cast<float>(v));
      break;
    }
    default: {
      float* q = static_cast<float*>(p);
      q[i] = (accumulate ? q[i] : 0.0f) + static_cast<float>(v);
    }
  }
}

// Math in the accumulation type (qualified: mt has a log namespace).
__device__ __forceinline__ float gexp(float x) { return ::expf(x); }
__device__ __forceinline__ double gexp(double x) { return ::exp(x); }
__device__ __forceinline__ float glog1p(float x) { return ::log1pf(x); }
__device__ __forceinline__ double glog1p(double x) { return ::log1p(x); }
__device__ __forceinline__ float gsqrt(float x) { return ::sqrtf(x); }
__device__ __forceinline__ double gsqrt(double x) { return ::sqrt(x); }
// Explicit roundings where two kernels must agree to the bit (the recurrence's state).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fma_rn(double a, double b, double c) { return __fma_rn(a, b, c); }

template <typename A>
__device__ __forceinline__ A gdn_sigmoid(A x) { return A(1) / (A(1) + gexp(-x)); }
template <typename A>
__device__ __forceinline__ A gdn_softplus(A x) { return x > A(20) ? x : glog1p(gexp(x)); }
template <typename A>
__device__ __forceinline__ A gdn_silu(A x) { return x * gdn_sigmoid(x); }
template <typename A>
__device__ __forceinline__ A gdn_silu_grad(A x) {
  const A s = gdn_sigmoid(x);
  return s * (A(1) + x * (A(1) - s));
}
// softplus(x) / sigmoid(x) = softplus(x) (1 + e^-x), which tends to 1 as x -> -inf.
template <typename A>
__device__ __forceinline__ A softplus_over_sigmoid(A x) {
  return x < A(-20) ? A(1) : gdn_softplus(x) * (A(1) + gexp(-x));
}

// GdnShape's layouts for the device.
struct Dims {
  int batch, seq, key_heads, value_heads, dk, dv, conv_k, rep, chunks;
  float scale, eps;
  int64_t P, C, CG, GW, VW;  // proj width, conv width, conv group width, group width, value width
  __host__ __device__ int64_t conv_col(int64_t c) const { return c / CG * GW + c % CG; }
  __host__ __device__ int64_t z_col(int v) const { return int64_t{v / rep} * GW + CG + int64_t{v % rep} * dv; }
  __host__ __device__ int64_t beta_col(int v) const {
    return int64_t{v / rep} * GW + CG + int64_t{rep} * dv + v % rep;
  }
  __host__ __device__ int64_t alpha_col(int v) const { return beta_col(v) + rep; }
  __host__ __device__ int64_t q_col(int g) const { return int64_t{g} * CG; }
  __host__ __device__ int64_t k_col(int g) const { return q_col(g) + dk; }
  __host__ __device__ int64_t v_col(int v) const {
    return int64_t{v / rep} * CG + 2 * int64_t{dk} + int64_t{v % rep} * dv;
  }
  __host__ __device__ int64_t rows() const { return int64_t{batch} * seq; }
};

Dims dims_of(const GdnShape& s) {
  Dims d{};
  d.batch = s.batch, d.seq = s.seq, d.key_heads = s.key_heads, d.value_heads = s.value_heads;
  d.dk = s.dk, d.dv = s.dv, d.conv_k = s.conv_k, d.rep = s.rep(), d.chunks = static_cast<int>(s.chunks());
  d.scale = s.scale, d.eps = s.l2_eps;
  d.P = s.proj_width(), d.C = s.conv_width(), d.CG = s.conv_group_width(), d.GW = s.group_width();
  d.VW = s.value_width();
  return d;
}

// ---- causal convolution ---------------------------------------------------------------------------

template <typename T>
__global__ void gdn_conv_forward_kernel(T* xc, const T* proj, const void* w, int wcode, Dims d) {
  using A = Acc<T>;
  const int64_t n = d.rows() * d.C, K = d.conv_k;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / d.C, c = idx % d.C, t = r / d.batch, i = r % d.batch, col = d.conv_col(c);
    A acc = 0;
    for (int64_t j = 0; j < K; ++j) {
      const int64_t tt = t - (K - 1) + j;
      if (tt >= 0) acc += ld_code<A>(w, wcode, c * K + j) * ld<A>(proj, (tt * d.batch + i) * d.P + col);
    }
    st(xc, idx, gdn_silu(acc));
  }
}

// The pre-activation of channel c at position t of sample i (w: the channel's K taps).
template <typename A, typename T>
__device__ __forceinline__ A conv_pre(const T* proj, const A (&w)[kMaxConv], const Dims& d, int64_t t, int64_t i,
                                      int64_t col) {
  A acc = 0;
#pragma unroll
  for (int j = 0; j < kMaxConv; ++j) {
    const int64_t tt = t - (d.conv_k - 1) + j;
    if (j < d.conv_k && tt >= 0) acc += w[j] * ld<A>(proj, (tt * d.batch + i) * d.P + col);
  }
  return acc;
}

// dproj's q, k, v columns: input position t feeds outputs t + K - 1 - j.
template <typename T>
__global__ void gdn_conv_input_grad_kernel(T* dproj, const T* dxc, const T* proj, const void* w, int wcode, Dims d) {
  using A = Acc<T>;
  const int64_t n = d.rows() * d.C, K = d.conv_k;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / d.C, c = idx % d.C, t = r / d.batch, i = r % d.batch, col = d.conv_col(c);
    A wv[kMaxConv];
#pragma unroll
    for (int j = 0; j < kMaxConv; ++j) wv[j] = j < K ? ld_code<A>(w, wcode, c * K + j) : A(0);
    A acc = 0;
#pragma unroll
    for (int j = 0; j < kMaxConv; ++j) {
      const int64_t to = t + (K - 1) - j;
      if (j < K && to < d.seq) {
        const A dpre = ld<A>(dxc, (to * d.batch + i) * d.C + c) * gdn_silu_grad(conv_pre(proj, wv, d, to, i, col));
        acc += wv[j] * dpre;
      }
    }
    st(dproj, r * d.P + col, acc);
  }
}

// dw[c, j] (+)= sum over rows of dpre * x[t - (K - 1) + j]: lane y of the block sums rows y,
// y + 16, ... of its channel; the lanes' sums are added in lane order.
template <typename T>
__global__ void __launch_bounds__(kDwChannels* kDwLanes)
    gdn_conv_weight_grad_kernel(void* dw, int gcode, const T* dxc, const T* proj, const void* w, int wcode, Dims d,
                                bool accumulate) {
  using A = Acc<T>;
  __shared__ A red[kDwLanes][kDwChannels][kMaxConv];
  const int tx = static_cast<int>(threadIdx.x) % kDwChannels, ty = static_cast<int>(threadIdx.x) / kDwChannels;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kDwChannels + tx, K = d.conv_k;
  const bool active = c < d.C;
  A wv[kMaxConv], acc[kMaxConv];
#pragma unroll
  for (int j = 0; j < kMaxConv; ++j) {
    wv[j] = active && j < K ? ld_code<A>(w, wcode, c * K + j) : A(0);
    acc[j] = 0;
  }
  if (active) {
    const int64_t col = d.conv_col(c), n = d.rows();
    for (int64_t r = ty; r < n; r += kDwLanes) {
      const int64_t t = r / d.batch, i = r % d.batch;
      A x[kMaxConv], pre = 0;
#pragma unroll
      for (int j = 0; j < kMaxConv; ++j) {
        const int64_t tt = t - (K - 1) + j;
        x[j] = j < K && tt >= 0 ? ld<A>(proj, (tt * d.batch + i) * d.P + col) : A(0);
        if (j < K && tt >= 0) pre += wv[j] * x[j];
      }
      const A dpre = ld<A>(dxc, r * d.C + c) * gdn_silu_grad(pre);
#pragma unroll
      for (int j = 0; j < kMaxConv; ++j) acc[j] += dpre * x[j];
    }
  }
#pragma unroll
  for (int j = 0; j < kMaxConv; ++j) red[ty][tx][j] = acc[j];
  __syncthreads();
  if (ty == 0 && active)
    for (int j = 0; j < K; ++j) {
      A s = 0;
      for (int y = 0; y < kDwLanes; ++y) s += red[y][tx][j];
      grad_out(dw, gcode, c * K + j, s, accumulate);
    }
}

// ---- output gate --------------------------------------------------------------------------------

template <typename T>
__global__ void gdn_gate_forward_kernel(T* y, const T* n, const T* proj, Dims d) {
  using A = Acc<T>;
  const int64_t total = d.rows() * d.VW;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / d.VW, col = idx % d.VW;
    const int v = static_cast<int>(col / d.dv);
    const A z = ld<A>(proj, r * d.P + d.z_col(v) + col % d.dv);
    st(y, idx, ld<A>(n, idx) * gdn_silu(z));
  }
}

// dn may alias dy: each element's inputs are read before its outputs are written.
template <typename T>
__global__ void gdn_gate_backward_kernel(T* dn, T* dproj, const T* dy, const T* n, const T* proj, Dims d) {
  using A = Acc<T>;
  const int64_t total = d.rows() * d.VW;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / d.VW, col = idx % d.VW;
    const int v = static_cast<int>(col / d.dv);
    const int64_t zat = r * d.P + d.z_col(v) + col % d.dv;
    const A g = ld<A>(dy, idx), z = ld<A>(proj, zat), x = ld<A>(n, idx);
    st(dproj, zat, g * x * gdn_silu_grad(z));
    st(dn, idx, g * gdn_silu(z));
  }
}

// ---- the recurrence: shared pieces --------------------------------------------------------------

// Every lane of a column group gets the group's sum of each value (xor shuffles: all lanes of the
// warp take part).
template <typename A, int N>
__device__ __forceinline__ void group_sums(A (&v)[N], int rs) {
  for (int o = rs >> 1; o > 0; o >>= 1)
#pragma unroll
    for (int c = 0; c < N; ++c) v[c] += __shfl_xor_sync(kFull, v[c], o);
}
template <typename A>
__device__ __forceinline__ A group_sum(A v, int rs) {
  for (int o = rs >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// One position on the thread's part of S: S = a S, p = S^T k, w = u - p, S += k (b w)^T. The
// forward and the backward's recomputation use exactly these operations, so the backward's states
// are the forward's bit for bit.
template <typename A>
__device__ __forceinline__ void recur_step(A (&S)[kCols][kRows], const A (&k)[kRows], A a, A b, const A* u,
                                           A (&w)[kCols], int rs) {
  A p[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    p[c] = A(0);
#pragma unroll
    for (int m = 0; m < kRows; ++m) {
      S[c][m] = mul_rn(S[c][m], a);
      p[c] = fma_rn(S[c][m], k[m], p[c]);
    }
  }
  group_sums(p, rs);
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    w[c] = u[c] - p[c];
    const A un = mul_rn(b, w[c]);
#pragma unroll
    for (int m = 0; m < kRows; ++m) S[c][m] = fma_rn(k[m], un, S[c][m]);
  }
}

// The saved state `slot` ([batch, value_heads, chunks] flattened) <-> the thread's part of S
// (rows l + rs m < dk, columns j0 + c < dv; the rest is zero): f(c, m, at) for each of the thread's
// elements, at its offset in `states` or -1 where it is padding.
template <typename F>
__device__ __forceinline__ void for_state_elements(int64_t slot, const Dims& d, int l, int rs, int j0, F&& f) {
  const int64_t base = slot * d.dk * d.dv;
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    const int e = l + rs * m;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int j = j0 + c;
      f(c, m, e < d.dk && j < d.dv ? base + int64_t{e} * d.dv + j : int64_t{-1});
    }
  }
}
template <typename A>
__device__ void save_state(void* states, bool f64, int64_t slot, const A (&S)[kCols][kRows], const Dims& d, int l,
                           int rs, int j0) {
  for_state_elements(slot, d, l, rs, j0, [&](int c, int m, int64_t at) {
    if (at < 0) return;
    if (f64) static_cast<double*>(states)[at] = static_cast<double>(S[c][m]);
    else static_cast<float*>(states)[at] = static_cast<float>(S[c][m]);
  });
}
template <typename A>
__device__ void load_state(A (&S)[kCols][kRows], const void* states, bool f64, int64_t slot, const Dims& d, int l,
                           int rs, int j0) {
  for_state_elements(slot, d, l, rs, j0, [&](int c, int m, int64_t at) {
    S[c][m] = at < 0 ? A(0)
              : f64  ? static_cast<A>(static_cast<const double*>(states)[at])
                     : static_cast<A>(static_cast<const float*>(states)[at]);
  });
}

// hat[p * dkp + e] = x_e / sqrt(|x|^2 + eps) (times mult when scaled) for the n positions from t0
// of sample i, x the dk values at column col of xc's row; zero for dk <= e < dkp. rnorm[p] (if
// given) = 1 / sqrt(|x|^2 + eps). One warp per position.
template <typename T, typename A>
__device__ void stage_norm(A* hat, A* rnorm, const T* xc, const Dims& d, int i, int t0, int n, int64_t col, int dkp,
                           bool scaled, A mult) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  const int warps = static_cast<int>(blockDim.x) / kWarp;
  for (int p = warp; p < n; p += warps) {
    const int64_t base = (int64_t{t0 + p} * d.batch + i) * d.C + col;
    A sq = 0;
    for (int e = lane; e < dkp; e += kWarp) {
      const A x = e < d.dk ? ld<A>(xc, base + e) : A(0);
      hat[p * dkp + e] = x;
      sq = fma_rn(x, x, sq);
    }
    sq = warp_sum(sq);
    const A r = A(1) / gsqrt(sq + static_cast<A>(d.eps));
    for (int e = lane; e < dkp; e += kWarp) {
      A h = mul_rn(hat[p * dkp + e], r);
      if (scaled) h = mul_rn(h, mult);
      hat[p * dkp + e] = h;
    }
    if (rnorm && lane == 0) rnorm[p] = r;
  }
}

// vec[p * nc + jj] = src[row of position t0 + p, col + col0 + jj] (zero where col0 + jj >= dv).
template <typename T, typename A>
__device__ void stage_cols(A* vec, const T* src, int64_t width, int64_t col, const Dims& d, int i, int t0, int n,
                           int col0, int nc) {
  for (int idx = static_cast<int>(threadIdx.x); idx < n * nc; idx += static_cast<int>(blockDim.x)) {
    const int p = idx / nc, j = col0 + idx % nc;
    vec[idx] = j < d.dv ? ld<A>(src, (int64_t{t0 + p} * d.batch + i) * width + col + j) : A(0);
  }
}

// beta = sigmoid(proj[beta_col]), x = proj[alpha_col] + dt_bias, decay = exp(-exp(a_log) softplus(x))
// for the n positions from t0 (x_out optional).
template <typename T, typename A>
__device__ void stage_gates(A* beta, A* decay, A* x_out, const T* proj, const Dims& d, int i, int v, int t0, int n,
                            A a_exp, A dt_bias) {
  for (int p = static_cast<int>(threadIdx.x); p < n; p += static_cast<int>(blockDim.x)) {
    const int64_t prow = (int64_t{t0 + p} * d.batch + i) * d.P;
    beta[p] = gdn_sigmoid(ld<A>(proj, prow + d.beta_col(v)));
    const A x = ld<A>(proj, prow + d.alpha_col(v)) + dt_bias;
    decay[p] = gexp(-a_exp * gdn_softplus(x));
    if (x_out) x_out[p] = x;
  }
}

// ---- the recurrence: forward ----------------------------------------------------------------------

// Block: (column tile, value head, sample); blockDim = (columns / kCols) groups x rs lanes.
// Shared: q, k [kStage][dkp], u, out [kStage][nc], beta, decay [kStage].
template <typename T>
__global__ void __launch_bounds__(kForwardThreads)
    gdn_forward_kernel(T* out, void* states, bool states64, const T* xc, const T* proj, const void* a_log,
                       const void* dt_bias, int pcode, Dims d, int rs) {
  using A = Acc<T>;
  extern __shared__ __align__(16) unsigned char gdn_smem[];
  const int nt = static_cast<int>(blockDim.x), tid = static_cast<int>(threadIdx.x), dkp = kRows * rs;
  const int nc = nt / rs * kCols, l = tid % rs, jl = tid / rs * kCols;
  const int col0 = static_cast<int>(blockIdx.x) * nc;
  const int v = static_cast<int>(blockIdx.y), i = static_cast<int>(blockIdx.z), g = v / d.rep;
  A* qs = reinterpret_cast<A*>(gdn_smem);
  A* ks = qs + kStage * dkp;
  A* us = ks + kStage * dkp;
  A* os = us + kStage * nc;
  A* bs = os + kStage * nc;
  A* as = bs + kStage;
  const A a_exp = gexp(ld_code<A>(a_log, pcode, v)), dtb = ld_code<A>(dt_bias, pcode, v);
  const int64_t slot0 = (int64_t{i} * d.value_heads + v) * d.chunks;
  A S[kCols][kRows];
#pragma unroll
  for (int c = 0; c < kCols; ++c)
#pragma unroll
    for (int m = 0; m < kRows; ++m) S[c][m] = 0;

  for (int ts = 0; ts < d.seq; ts += kStage) {
    const int n = min(kStage, d.seq - ts);
    __syncthreads();  // the previous stage's buffers are read
    stage_norm(qs, static_cast<A*>(nullptr), xc, d, i, ts, n, d.q_col(g), dkp, true, static_cast<A>(d.scale));
    stage_norm(ks, static_cast<A*>(nullptr), xc, d, i, ts, n, d.k_col(g), dkp, false, A(1));
    stage_cols(us, xc, d.C, d.v_col(v), d, i, ts, n, col0, nc);
    stage_gates(bs, as, static_cast<A*>(nullptr), proj, d, i, v, ts, n, a_exp, dtb);
    __syncthreads();
    for (int p = 0; p < n; ++p) {
      const int t = ts + p;
      if (t % kChunk == 0) save_state(states, states64, slot0 + t / kChunk, S, d, l, rs, col0 + jl);
      A k[kRows], q[kRows], w[kCols], o[kCols];
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
        k[m] = ks[p * dkp + l + rs * m];
        q[m] = qs[p * dkp + l + rs * m];
      }
      recur_step(S, k, as[p], bs[p], us + p * nc + jl, w, rs);
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        o[c] = 0;
#pragma unroll
        for (int m = 0; m < kRows; ++m) o[c] = fma_rn(S[c][m], q[m], o[c]);
      }
      group_sums(o, rs);
      if (l == 0)
#pragma unroll
        for (int c = 0; c < kCols; ++c) os[p * nc + jl + c] = o[c];
    }
    __syncthreads();
    for (int idx = tid; idx < n * nc; idx += nt) {
      const int p = idx / nc, j = col0 + idx % nc;
      if (j < d.dv) st(out, (int64_t{ts + p} * d.batch + i) * d.VW + int64_t{v} * d.dv + j, os[idx]);
    }
  }
}

// ---- the recurrence: backward ---------------------------------------------------------------------

// Shared memory of the backward (in accumulation-type elements), in this order.
struct BackwardLayout {
  int dkp, nc, ncg, rs, nsl, sub, rst, pw;
  __host__ __device__ BackwardLayout(int dkp_, int nc_, int rs_, int nsl_)
      : dkp(dkp_), nc(nc_), ncg(nc_ / kCols), rs(rs_), nsl(nsl_), sub(kChunk / nsl_),
        rst(2 * dkp_ + (rs_ > 2 ? rs_ : 2)), pw(2 * dkp_ + 2) {}
  __host__ __device__ int64_t slices() const { return 0; }                                // [nsl][dkp * nc]
  __host__ __device__ int64_t w() const { return slices() + int64_t{nsl} * dkp * nc; }    // [kChunk][nc]
  __host__ __device__ int64_t kh() const { return w() + int64_t{kChunk} * nc; }           // [sub][dkp]
  __host__ __device__ int64_t qh() const { return kh() + int64_t{sub} * dkp; }            // [sub][dkp]
  __host__ __device__ int64_t vec() const { return qh() + int64_t{sub} * dkp; }           // [sub][nc]
  __host__ __device__ int64_t scal() const { return vec() + int64_t{sub} * nc; }          // beta decay x rq rk [sub]
  __host__ __device__ int64_t red() const { return scal() + 5 * int64_t{sub}; }           // [ncg][rst]
  __host__ __device__ int64_t part() const { return red() + int64_t{ncg} * rst; }         // [kGroup][pw]
  __host__ __device__ int64_t total() const { return part() + int64_t{kGroup} * pw; }
};

// Cluster (rep value heads x tiles column tiles) per (key head g, sample i): grid (key_heads *
// rep * tiles, batch). Block rank vl * tiles + tile: value head g * rep + vl, columns from
// tile * nc. A per-position row of the column sums holds q's gradient before the norm and the
// scale ([dkp]), k's before the norm ([dkp]), d decay, dbeta.
template <typename T>
__global__ void __launch_bounds__(kBackwardMaxThreads, 1)
    gdn_backward_kernel(T* dxc, T* dproj, const T* dout, const T* xc, const T* proj, const void* a_log,
                        const void* dt_bias, int pcode, const void* states, bool states64, Dims d, int rs, int tiles,
                        int nsl) {
  using A = Acc<T>;
  extern __shared__ __align__(16) unsigned char gdn_smem[];
  cg::cluster_group cluster = cg::this_cluster();
  const int cs = d.rep * tiles, rank = static_cast<int>(cluster.block_rank());
  const int g = static_cast<int>(blockIdx.x) / cs, i = static_cast<int>(blockIdx.y);
  const int vl = rank / tiles, tile = rank % tiles, v = g * d.rep + vl;
  const int nt = static_cast<int>(blockDim.x), tid = static_cast<int>(threadIdx.x), dkp = kRows * rs;
  const int nc = nt / rs * kCols, l = tid % rs, cgi = tid / rs, jl = cgi * kCols, col0 = tile * nc;
  const BackwardLayout L(dkp, nc, rs, nsl);
  A* base = reinterpret_cast<A*>(gdn_smem);
  A* slices = base + L.slices();
  A* wst = base + L.w();
  A* kh = base + L.kh();
  A* qh = base + L.qh();
  A* vec = base + L.vec();
  A* sbeta = base + L.scal();
  A* sdecay = sbeta + L.sub;
  A* sx = sdecay + L.sub;
  A* srq = sx + L.sub;
  A* srk = srq + L.sub;
  A* red = base + L.red();
  A* part = base + L.part();
  const A a_exp = gexp(ld_code<A>(a_log, pcode, v)), dtb = ld_code<A>(dt_bias, pcode, v);
  const A scale = static_cast<A>(d.scale);
  const int64_t slot0 = (int64_t{i} * d.value_heads + v) * d.chunks;
  const int slice_elems = dkp * nc;
  const int lane = tid % kWarp, warp = tid / kWarp, warps = nt / kWarp;

  A dS[kCols][kRows];  // d loss / d S after the position being processed
#pragma unroll
  for (int c = 0; c < kCols; ++c)
#pragma unroll
    for (int m = 0; m < kRows; ++m) dS[c][m] = 0;

  for (int chunk = d.chunks - 1; chunk >= 0; --chunk) {
    const int t0 = chunk * kChunk, tend = min(d.seq, t0 + kChunk);
    const int nreg = (tend - t0 + L.sub - 1) / L.sub;
    // Pass 1: the states at the sub-chunk starts, and w = u - S^T k per position.
    {
      A S[kCols][kRows];
      load_state(S, states, states64, slot0 + chunk, d, l, rs, col0 + jl);
      for (int r = 0; r < nreg; ++r) {
        const int rb = t0 + r * L.sub, n = min(L.sub, tend - rb);
        A* slice = slices + r * slice_elems;
#pragma unroll
        for (int m = 0; m < kRows; ++m)
#pragma unroll
          for (int c = 0; c < kCols; ++c) slice[(m * kCols + c) * nt + tid] = S[c][m];
        __syncthreads();  // the staging buffers are free
        stage_norm(kh, srk, xc, d, i, rb, n, d.k_col(g), dkp, false, A(1));
        stage_cols(vec, xc, d.C, d.v_col(v), d, i, rb, n, col0, nc);
        stage_gates(sbeta, sdecay, sx, proj, d, i, v, rb, n, a_exp, dtb);
        __syncthreads();
        for (int p = 0; p < n; ++p) {
          A k[kRows], w[kCols];
#pragma unroll
          for (int m = 0; m < kRows; ++m) k[m] = kh[p * dkp + l + rs * m];
          recur_step(S, k, sdecay[p], sbeta[p], vec + p * nc + jl, w, rs);
          if (l == 0)
#pragma unroll
            for (int c = 0; c < kCols; ++c) wst[(rb - t0 + p) * nc + jl + c] = w[c];
        }
      }
    }
    // Backward through the sub-chunks, last to first.
    for (int r = nreg - 1; r >= 0; --r) {
      const int rb = t0 + r * L.sub, n = min(L.sub, tend - rb);
      const A* slice = slices + r * slice_elems;
      __syncthreads();  // the staging buffers are free (and pass 1's w is visible)
      stage_norm(kh, srk, xc, d, i, rb, n, d.k_col(g), dkp, false, A(1));
      stage_norm(qh, srq, xc, d, i, rb, n, d.q_col(g), dkp, false, A(1));
      stage_cols(vec, dout, d.VW, int64_t{v} * d.dv, d, i, rb, n, col0, nc);
      stage_gates(sbeta, sdecay, sx, proj, d, i, v, rb, n, a_exp, dtb);
      __syncthreads();
      for (int p = n - 1; p >= 0; --p) {
        const int t = rb + p;
        const int64_t row = int64_t{t} * d.batch + i;
        // Sp: S before position t, from the sub-chunk's slice.
        A Sp[kCols][kRows];
#pragma unroll
        for (int m = 0; m < kRows; ++m)
#pragma unroll
          for (int c = 0; c < kCols; ++c) Sp[c][m] = slice[(m * kCols + c) * nt + tid];
        for (int s = 0; s < p; ++s) {
          const A as = sdecay[s], bs = sbeta[s];
          A ks[kRows];
#pragma unroll
          for (int m = 0; m < kRows; ++m) ks[m] = kh[s * dkp + l + rs * m];
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
            const A un = mul_rn(bs, wst[(rb - t0 + s) * nc + jl + c]);
#pragma unroll
            for (int m = 0; m < kRows; ++m) Sp[c][m] = fma_rn(ks[m], un, mul_rn(Sp[c][m], as));
          }
        }
        const A at = sdecay[p], bt = sbeta[p];
        A k[kRows], w[kCols], un[kCols], dov[kCols];
#pragma unroll
        for (int m = 0; m < kRows; ++m) k[m] = kh[p * dkp + l + rs * m];
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          w[c] = wst[(t - t0) * nc + jl + c];
          un[c] = mul_rn(bt, w[c]);
          dov[c] = vec[p * nc + jl + c];
        }
        // The block's column sums of position t go to red in column-group order (row cgi).
        A* mine = red + cgi * L.rst;
        // out = S^T q with S = a Sp + k un^T (after t): q's gradient S do; dS += q do^T.
#pragma unroll
        for (int m = 0; m < kRows; ++m) {
          const A qm = mul_rn(qh[p * dkp + l + rs * m], scale);
          A cq = 0;
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
            cq += fma_rn(k[m], un[c], mul_rn(Sp[c][m], at)) * dov[c];
            dS[c][m] += qm * dov[c];
          }
          mine[l + rs * m] = cq;
        }
        // S = S' + k un^T, un = beta (u - p), p = S'^T k, S' = a Sp.
        A du[kCols];
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          du[c] = 0;
#pragma unroll
          for (int m = 0; m < kRows; ++m) du[c] += dS[c][m] * k[m];
        }
        group_sums(du, rs);
        A dbeta = 0, dp[kCols];
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          dbeta += du[c] * w[c];
          dp[c] = -bt * du[c];
          const int j = col0 + jl + c;
          if (l == 0 && j < d.dv) st(dxc, row * d.C + d.v_col(v) + j, bt * du[c]);
        }
        // k's gradient: dS un + S' dp; then dS' = dS + k dp^T, d decay = <dS', Sp>, dSp = a dS'.
        A da = 0;
#pragma unroll
        for (int m = 0; m < kRows; ++m) {
          A ck = 0;
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
            ck += dS[c][m] * un[c] + at * Sp[c][m] * dp[c];
            const A x = dS[c][m] + k[m] * dp[c];
            da += x * Sp[c][m];
            dS[c][m] = at * x;
          }
          mine[dkp + l + rs * m] = ck;
        }
        da = group_sum(da, rs);
        if (l == 0) {
          mine[2 * dkp] = da;
          mine[2 * dkp + 1] = dbeta;
        }
        __syncthreads();
        A* prow = part + (t % kGroup) * L.pw;
        for (int o = tid; o < L.pw; o += nt) {
          A s = 0;
          for (int y = 0; y < L.ncg; ++y) s += red[y * L.rst + o];
          prow[o] = s;
        }
        __syncthreads();
        if (t % kGroup != 0) continue;
        // Positions [t, t + gn): the cluster adds its blocks' rows in rank order.
        const int gn = min(kGroup, rb + n - t);
        cluster.sync();
        for (int it = rank * warps + warp; it < 2 * gn; it += cs * warps) {
          const int pi = it / 2, which = it % 2, si = t - rb + pi;
          const A* hat = (which ? kh : qh) + si * dkp;
          const A rn = which ? srk[si] : srq[si], f = which ? A(1) : scale;
          A val[kMaxDk / kWarp], dot = 0;
#pragma unroll
          for (int nn = 0; nn < kMaxDk / kWarp; ++nn) {
            const int e = lane + kWarp * nn;
            val[nn] = 0;
            if (e < d.dk) {
              A s = 0;
              for (int rr = 0; rr < cs; ++rr) s += cluster.map_shared_rank(part, rr)[pi * L.pw + which * dkp + e];
              val[nn] = s * f;
              dot += hat[e] * val[nn];
            }
          }
          dot = warp_sum(dot);
          const int64_t at_row = (int64_t{t + pi} * d.batch + i) * d.C + (which ? d.k_col(g) : d.q_col(g));
#pragma unroll
          for (int nn = 0; nn < kMaxDk / kWarp; ++nn) {
            const int e = lane + kWarp * nn;
            if (e < d.dk) st(dxc, at_row + e, rn * (val[nn] - hat[e] * dot));
          }
        }
        if (tile == 0)
          for (int pi = tid; pi < gn; pi += nt) {
            const int si = t - rb + pi;
            A dbeta_sum = 0, da_sum = 0;
            for (int tt = 0; tt < tiles; ++tt) {
              const A* pr = cluster.map_shared_rank(part, vl * tiles + tt) + pi * L.pw;
              da_sum += pr[2 * dkp];
              dbeta_sum += pr[2 * dkp + 1];
            }
            const A b = sbeta[si];
            const int64_t prow_at = (int64_t{t + pi} * d.batch + i) * d.P;
            st(dproj, prow_at + d.beta_col(v), dbeta_sum * b * (A(1) - b));
            st(dproj, prow_at + d.alpha_col(v), da_sum * sdecay[si] * -a_exp * gdn_sigmoid(sx[si]));
          }
        cluster.sync();  // the rows are read; the next positions may overwrite them
      }
    }
  }
}

// d a_log[v], d dt_bias[v] (+)= the sums over all rows of d gl * gl = dalpha softplus(x) / sigmoid(x)
// and dalpha, dalpha read from dproj's alpha column as stored. One block per value head.
template <typename T>
__global__ void __launch_bounds__(256)
    gdn_decay_param_grad_kernel(void* da_log, void* ddt_bias, int gcode, const T* dproj, const T* proj,
                                const void* dt_bias, int pcode, Dims d, bool accumulate) {
  using A = Acc<T>;
  const int v = static_cast<int>(blockIdx.x);
  const A dtb = ld_code<A>(dt_bias, pcode, v);
  const int64_t n = d.rows(), col = d.alpha_col(v);
  A s_log = 0, s_dt = 0;
  for (int64_t r = threadIdx.x; r < n; r += blockDim.x) {
    const A dalpha = ld<A>(dproj, r * d.P + col);
    s_dt += dalpha;
    s_log += dalpha * softplus_over_sigmoid(ld<A>(proj, r * d.P + col) + dtb);
  }
  s_log = block_sum(s_log);
  s_dt = block_sum(s_dt);
  if (threadIdx.x == 0) {
    grad_out(da_log, gcode, v, s_log, accumulate);
    grad_out(ddt_bias, gcode, v, s_dt, accumulate);
  }
}

// ---- host side -----------------------------------------------------------------------------------

// Runs the statement with T bound to the data dtype (float32, bfloat16, float16, float64).
#define GDN_DISPATCH(dtype, T, what, ...)                                                          \
  do {                                                                                             \
    switch (dtype) {                                                                               \
      case DType::f32: { using T = float; __VA_ARGS__; } break;                                    \
      case DType::bf16: { using T = bf16; __VA_ARGS__; } break;                                    \
      case DType::f16: { using T = f16; __VA_ARGS__; } break;                                      \
      case DType::f64: { using T = double; __VA_ARGS__; } break;                                   \
      default: fail("{}: dtype {} is not supported (float32, bfloat16, float16, float64)", what,  \
                    dtype_name(dtype));                                                            \
    }                                                                                              \
  } while (0)

void check_shape(const GdnShape& s, const char* op) { check_gdn_shape(s, op); }

void check_2d(const Tensor& t, int64_t rows, int64_t cols, const char* op, const char* what) {
  MT_CHECK(t.numel() == rows * cols, "{}: {} is {}, expected [{}, {}]", op, what, t.shape_string(), rows, cols);
}

void check_data(const Tensor& t, DType dt, const char* op, const char* what) {
  MT_CHECK(t.dtype == dt, "{}: {} is {}, the other data tensors {}", op, what, dtype_name(t.dtype), dtype_name(dt));
}

bool states_f64(const Tensor& states, const char* op) {
  if (states.dtype != DType::f32 && states.dtype != DType::f64)
    fail("{}: states are {}; they must be float32 (or float64)", op, dtype_name(states.dtype));
  return states.dtype == DType::f64;
}

// rs: lanes per column group, the power of two with 8 rs >= dk.
int row_split(const GdnShape& s, const char* op) {
  if (s.dk > kMaxDk)
    fail("{}: key head dim {} is not supported; the CUDA backend's Gated DeltaNet takes at most {}", op, s.dk,
         kMaxDk);
  int rs = 1;
  while (kRows * rs < s.dk) rs *= 2;
  return rs;
}

int max_dynamic_smem() {
  int device = 0, bytes = 0;
  MT_CUDA_CHECK(cudaGetDevice(&device));
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return bytes;
}

unsigned flat_grid(const KernelContext& ctx, int64_t n) {
  return grid_for(n, 256, static_cast<int64_t>(ctx.num_sms) * 16);
}

template <typename K>
void allow_smem(K kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

void launch_conv_forward(const KernelContext& ctx, Tensor xc, Tensor proj, Tensor w, const GdnShape& s) {
  const char* op = "gdn_conv_forward";
  check_shape(s, op);
  const int64_t N = s.tokens();
  check_2d(xc, N, s.conv_width(), op, "xc");
  check_2d(proj, N, s.proj_width(), op, "proj");
  check_2d(w, s.conv_width(), s.conv_k, op, "w");
  check_data(xc, proj.dtype, op, "xc");
  const int wcode = float_code(w.dtype, op, "w");
  const Dims d = dims_of(s);
  GDN_DISPATCH(proj.dtype, T, op, {
    gdn_conv_forward_kernel<T><<<flat_grid(ctx, N * d.C), 256, 0, ctx.stream>>>(xc.ptr<T>(), proj.ptr<const T>(),
                                                                                w.data, wcode, d);
  });
  MT_CUDA_CHECK_LAUNCH();
}

void launch_conv_backward(const KernelContext& ctx, Tensor dproj, Tensor dw, Tensor dxc, Tensor proj, Tensor w,
                          const GdnShape& s, bool accumulate) {
  const char* op = "gdn_conv_backward";
  check_shape(s, op);
  if (s.conv_k > kMaxConv)
    fail("{}: convolution width {} is not supported; the CUDA backend takes at most {}", op, s.conv_k, kMaxConv);
  const int64_t N = s.tokens();
  check_2d(dproj, N, s.proj_width(), op, "dproj");
  check_2d(proj, N, s.proj_width(), op, "proj");
  check_2d(dxc, N, s.conv_width(), op, "dxc");
  check_2d(w, s.conv_width(), s.conv_k, op, "w");
  check_2d(dw, s.conv_width(), s.conv_k, op, "dw");
  check_data(dproj, proj.dtype, op, "dproj");
  check_data(dxc, proj.dtype, op, "dxc");
  const int wcode = float_code(w.dtype, op, "w"), gcode = float_code(dw.dtype, op, "dw");
  const Dims d = dims_of(s);
  GDN_DISPATCH(proj.dtype, T, op, {
    gdn_conv_input_grad_kernel<T><<<flat_grid(ctx, N * d.C), 256, 0, ctx.stream>>>(
        dproj.ptr<T>(), dxc.ptr<const T>(), proj.ptr<const T>(), w.data, wcode, d);
    MT_CUDA_CHECK_LAUNCH();
    const unsigned blocks = static_cast<unsigned>((d.C + kDwChannels - 1) / kDwChannels);
    gdn_conv_weight_grad_kernel<T><<<blocks, kDwChannels * kDwLanes, 0, ctx.stream>>>(
        dw.data, gcode, dxc.ptr<const T>(), proj.ptr<const T>(), w.data, wcode, d, accumulate);
  });
  MT_CUDA_CHECK_LAUNCH();
}

void launch_forward(const KernelContext& ctx, Tensor out, Tensor states, Tensor xc, Tensor proj, Tensor a_log,
                    Tensor dt_bias, const GdnShape& s) {
  const char* op = "gdn_forward";
  check_shape(s, op);
  const int64_t N = s.tokens();
  check_2d(out, N, s.value_width(), op, "out");
  check_2d(xc, N, s.conv_width(), op, "xc");
  check_2d(proj, N, s.proj_width(), op, "proj");
  MT_CHECK(states.numel() == s.states_numel(), "{}: states has {} elements, expected {}", op, states.numel(),
           s.states_numel());
  MT_CHECK(a_log.numel() == s.value_heads && dt_bias.numel() == s.value_heads, "{}: a_log and dt_bias need {} values",
           op, s.value_heads);
  check_data(out, xc.dtype, op, "out");
  check_data(proj, xc.dtype, op, "proj");
  const bool st64 = states_f64(states, op);
  const int pcode = float_code(a_log.dtype, op, "a_log");
  MT_CHECK(dt_bias.dtype == a_log.dtype, "{}: a_log is {}, dt_bias {}", op, dtype_name(a_log.dtype),
           dtype_name(dt_bias.dtype));
  const int rs = row_split(s, op), dkp = kRows * rs, per_warp = kWarp / rs;
  // Up to 4 warps of column groups, no more than the value head's columns need.
  const int groups_needed = (s.dv + kCols - 1) / kCols;
  const int warps = std::clamp((groups_needed + per_warp - 1) / per_warp, 1, kForwardThreads / kWarp);
  const int nt = warps * kWarp, nc = nt / rs * kCols;
  const unsigned tiles = static_cast<unsigned>((s.dv + nc - 1) / nc);
  const Dims d = dims_of(s);
  GDN_DISPATCH(xc.dtype, T, op, {
    using A = Acc<T>;
    const size_t smem = (2 * size_t{kStage} * dkp + 2 * size_t{kStage} * nc + 2 * size_t{kStage}) * sizeof(A);
    MT_CHECK(smem <= static_cast<size_t>(max_dynamic_smem()), "{}: needs {} bytes of shared memory", op, smem);
    allow_smem(gdn_forward_kernel<T>, smem);
    const dim3 grid(tiles, static_cast<unsigned>(s.value_heads), static_cast<unsigned>(s.batch));
    gdn_forward_kernel<T><<<grid, nt, smem, ctx.stream>>>(out.ptr<T>(), states.data, st64, xc.ptr<const T>(),
                                                          proj.ptr<const T>(), a_log.data, dt_bias.data, pcode, d, rs);
  });
  MT_CUDA_CHECK_LAUNCH();
}

// The backward's launch shape: column groups per block (ncg; nc = kCols ncg columns), column tiles
// per value head, state slices per chunk, and the cluster size rep * tiles.
struct BackwardConfig {
  int rs = 0, ncg = 0, tiles = 0, nsl = 0, nt = 0;
  size_t smem = 0;
};

// The most column tiles the cluster takes (more blocks, less shared memory each), then the most
// state slices that fit (fewer states recomputed per position); with more blocks than fit on the
// GPU at once, half the slices where that fits more blocks per SM. per_sm(threads, bytes): the
// kernel's resident blocks per SM at that shape.
template <typename PerSm>
bool backward_config(const GdnShape& s, int rs, size_t elem, int max_cluster, int num_sms, PerSm per_sm,
                     BackwardConfig& out) {
  const int rep = s.rep(), per_warp = kWarp / rs, dkp = kRows * rs;
  if (rep > max_cluster) return false;
  const size_t limit = static_cast<size_t>(max_dynamic_smem());
  const int groups_needed = (s.dv + kCols - 1) / kCols;
  for (int tiles = std::min(max_cluster / rep, (groups_needed + per_warp - 1) / per_warp); tiles >= 1; --tiles) {
    const int per_tile = (groups_needed + tiles - 1) / tiles;
    const int ncg = (per_tile + per_warp - 1) / per_warp * per_warp, nt = ncg * rs;
    if (nt > kBackwardMaxThreads) break;  // fewer tiles only widen the blocks
    const int real_tiles = (s.dv + ncg * kCols - 1) / (ncg * kCols);
    auto bytes = [&](int nsl) { return static_cast<size_t>(BackwardLayout(dkp, ncg * kCols, rs, nsl).total()) * elem; };
    for (int nsl = 8; nsl >= 1; nsl /= 2) {
      if (bytes(nsl) > limit) continue;
      const int64_t blocks = int64_t{s.batch} * s.key_heads * rep * real_tiles;
      // Half the slices where that fits more blocks on an SM and more are needed (fewer slices
      // stage longer sub-chunks, so their bytes may grow: checked against the limit first).
      if (nsl > 1 && bytes(nsl / 2) <= limit) {
        const int here = per_sm(nt, bytes(nsl));
        if (blocks > int64_t{num_sms} * here && per_sm(nt, bytes(nsl / 2)) > here) nsl /= 2;
      }
      out = BackwardConfig{rs, ncg, real_tiles, nsl, nt, bytes(nsl)};
      return true;
    }
  }
  return false;
}

void launch_backward(const KernelContext& ctx, Tensor dxc, Tensor dproj, Tensor da_log, Tensor ddt_bias, Tensor dout,
                     Tensor xc, Tensor proj, Tensor a_log, Tensor dt_bias, Tensor states, const GdnShape& s,
                     bool accumulate) {
  const char* op = "gdn_backward";
  check_shape(s, op);
  const int64_t N = s.tokens();
  check_2d(dxc, N, s.conv_width(), op, "dxc");
  check_2d(xc, N, s.conv_width(), op, "xc");
  check_2d(dproj, N, s.proj_width(), op, "dproj");
  check_2d(proj, N, s.proj_width(), op, "proj");
  check_2d(dout, N, s.value_width(), op, "dout");
  MT_CHECK(states.numel() == s.states_numel(), "{}: states has {} elements, expected {}", op, states.numel(),
           s.states_numel());
  MT_CHECK(a_log.numel() == s.value_heads && dt_bias.numel() == s.value_heads && da_log.numel() == s.value_heads &&
               ddt_bias.numel() == s.value_heads,
           "{}: a_log, dt_bias and their gradients need {} values", op, s.value_heads);
  for (const Tensor* t : {&dxc, &dproj, &dout, &proj}) check_data(*t, xc.dtype, op, "a data tensor");
  const bool st64 = states_f64(states, op);
  const int pcode = float_code(a_log.dtype, op, "a_log"), gcode = float_code(da_log.dtype, op, "da_log");
  MT_CHECK(dt_bias.dtype == a_log.dtype && ddt_bias.dtype == da_log.dtype,
           "{}: dt_bias ({}) and ddt_bias ({}) must have a_log's and da_log's dtypes ({}, {})", op,
           dtype_name(dt_bias.dtype), dtype_name(ddt_bias.dtype), dtype_name(a_log.dtype), dtype_name(da_log.dtype));
  const int rs = row_split(s, op);
  const Dims d = dims_of(s);
  GDN_DISPATCH(xc.dtype, T, op, {
    using A = Acc<T>;
    auto kernel = gdn_backward_kernel<T>;
    auto per_sm = [&](int threads, size_t bytes) {
      allow_smem(kernel, bytes);
      int blocks = 0;
      MT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, bytes));
      return blocks;
    };
    BackwardConfig cfg;
    bool ok = backward_config(s, rs, sizeof(A), 8, ctx.num_sms, per_sm, cfg);
    if (!ok && backward_config(s, rs, sizeof(A), 16, ctx.num_sms, per_sm, cfg)) {
      MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
      ok = true;
    }
    if (!ok)
      fail("{}: dk {}, dv {} with {} value heads per key head do not fit the CUDA kernel (a cluster of at most 16 "
           "blocks per key head, shared memory for the column tiles' states); fewer value heads per key head or "
           "smaller heads are supported",
           op, s.dk, s.dv, s.rep());
    allow_smem(kernel, cfg.smem);
    const int cs = s.rep() * cfg.tiles;
    cudaLaunchConfig_t lc = {};
    lc.gridDim = dim3(static_cast<unsigned>(s.key_heads * cs), static_cast<unsigned>(s.batch), 1);
    lc.blockDim = dim3(static_cast<unsigned>(cfg.nt), 1, 1);
    lc.dynamicSmemBytes = cfg.smem;
    lc.stream = ctx.stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(cs);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    lc.attrs = attr;
    lc.numAttrs = 1;
    if (cs > 8) {
      int clusters = 0;
      MT_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &lc));
      if (clusters < 1)
        fail("{}: this GPU cannot run clusters of {} blocks with {} bytes of shared memory each (dk {}, dv {}, {} "
             "value heads per key head)",
             op, cs, cfg.smem, s.dk, s.dv, s.rep());
    }
    MT_CUDA_CHECK(cudaLaunchKernelEx(&lc, kernel, dxc.ptr<T>(), dproj.ptr<T>(), dout.ptr<const T>(),
                                     xc.ptr<const T>(), proj.ptr<const T>(), static_cast<const void*>(a_log.data),
                                     static_cast<const void*>(dt_bias.data), pcode,
                                     static_cast<const void*>(states.data), st64, d, rs, cfg.tiles, cfg.nsl));
    gdn_decay_param_grad_kernel<T><<<static_cast<unsigned>(s.value_heads), 256, 0, ctx.stream>>>(
        da_log.data, ddt_bias.data, gcode, dproj.ptr<const T>(), proj.ptr<const T>(), dt_bias.data, pcode, d,
        accumulate);
  });
  MT_CUDA_CHECK_LAUNCH();
}

void launch_gate_forward(const KernelContext& ctx, Tensor y, Tensor n, Tensor proj, const GdnShape& s) {
  const char* op = "gdn_gate_forward";
  check_shape(s, op);
  const int64_t N = s.tokens(), W = s.value_width();
  check_2d(y, N, W, op, "y");
  check_2d(n, N, W, op, "n");
  check_2d(proj, N, s.proj_width(), op, "proj");
  check_data(y, proj.dtype, op, "y");
  check_data(n, proj.dtype, op, "n");
  const Dims d = dims_of(s);
  GDN_DISPATCH(proj.dtype, T, op, {
    gdn_gate_forward_kernel<T><<<flat_grid(ctx, N * W), 256, 0, ctx.stream>>>(y.ptr<T>(), n.ptr<const T>(),
                                                                              proj.ptr<const T>(), d);
  });
  MT_CUDA_CHECK_LAUNCH();
}

void launch_gate_backward(const KernelContext& ctx, Tensor dn, Tensor dproj, Tensor dy, Tensor n, Tensor proj,
                          const GdnShape& s) {
  const char* op = "gdn_gate_backward";
  check_shape(s, op);
  const int64_t N = s.tokens(), W = s.value_width();
  check_2d(dn, N, W, op, "dn");
  check_2d(dy, N, W, op, "dy");
  check_2d(n, N, W, op, "n");
  check_2d(proj, N, s.proj_width(), op, "proj");
  check_2d(dproj, N, s.proj_width(), op, "dproj");
  for (const Tensor* t : {&dn, &dproj, &dy, &n}) check_data(*t, proj.dtype, op, "a data tensor");
  const Dims d = dims_of(s);
  GDN_DISPATCH(proj.dtype, T, op, {
    gdn_gate_backward_kernel<T><<<flat_grid(ctx, N * W), 256, 0, ctx.stream>>>(
        dn.ptr<T>(), dproj.ptr<T>(), dy.ptr<const T>(), n.ptr<const T>(), proj.ptr<const T>(), d);
  });
  MT_CUDA_CHECK_LAUNCH();
}

#undef GDN_DISPATCH

}  // namespace
}  // namespace mt::cuda

namespace mt {

using cuda_dispatch::on_device;

void CudaBackend::gdn_conv_forward(Tensor xc, Tensor proj, Tensor w, const GdnShape& s) {
  on_device("gdn_conv_forward", xc, proj, w);
  MT_PROFILE_OP("gdn_conv_forward {}", xc.shape_string());
  cuda::launch_conv_forward(context(), xc, proj, w, s);
}
void CudaBackend::gdn_conv_backward(Tensor dproj, Tensor dw, Tensor dxc, Tensor proj, Tensor w, const GdnShape& s,
                                    bool accumulate) {
  on_device("gdn_conv_backward", dproj, dw, dxc, proj, w);
  MT_PROFILE_OP("gdn_conv_backward {}", dxc.shape_string());
  cuda::launch_conv_backward(context(), dproj, dw, dxc, proj, w, s, accumulate);
}
void CudaBackend::gdn_forward(Tensor out, Tensor states, Tensor xc, Tensor proj, Tensor a_log, Tensor dt_bias,
                              const GdnShape& s) {
  on_device("gdn_forward", out, states, xc, proj, a_log, dt_bias);
  MT_PROFILE_OP("gdn_forward {}", out.shape_string());
  cuda::launch_forward(context(), out, states, xc, proj, a_log, dt_bias, s);
}
void CudaBackend::gdn_backward(Tensor dxc, Tensor dproj, Tensor da_log, Tensor ddt_bias, Tensor dout, Tensor xc,
                               Tensor proj, Tensor a_log, Tensor dt_bias, Tensor states, const GdnShape& s,
                               bool accumulate) {
  on_device("gdn_backward", dxc, dproj, da_log, ddt_bias, dout, xc, proj, a_log, dt_bias, states);
  MT_PROFILE_OP("gdn_backward {}", dout.shape_string());
  cuda::launch_backward(context(), dxc, dproj, da_log, ddt_bias, dout, xc, proj, a_log, dt_bias, states, s,
                        accumulate);
}
void CudaBackend::gdn_gate_forward(Tensor y, Tensor n, Tensor proj, const GdnShape& s) {
  on_device("gdn_gate_forward", y, n, proj);
  MT_PROFILE_OP("gdn_gate_forward {}", y.shape_string());
  cuda::launch_gate_forward(context(), y, n, proj, s);
}
void CudaBackend::gdn_gate_backward(Tensor dn, Tensor dproj, Tensor dy, Tensor n, Tensor proj, const GdnShape& s) {
  on_device("gdn_gate_backward", dn, dproj, dy, n, proj);
  MT_PROFILE_OP("gdn_gate_backward {}", dy.shape_string());
  cuda::launch_gate_backward(context(), dn, dproj, dy, n, proj, s);
}

}  // namespace mt

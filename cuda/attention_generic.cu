// Generic attention kernels (see attention_generic.h): CUDA cores, float32 arithmetic, any head
// dim up to 256, float32/bf16/fp16 activations.
//
// Tiles of 32 query rows x 32 keys, 128 threads (4 warps). Tiles live in shared memory as float32
// with rows padded to d + 1 floats, so that 32 lanes reading 32 different rows at one column hit
// 32 different banks. The two thread mappings used everywhere:
//   score entries: lane = key column c, warp w takes rows w, w + 4, ... (8 entries per thread);
//                  the lanes read 32 key rows (conflict-free) and one broadcast query row.
//   row vectors:   lane = row (a query row, or a key row in the dK/dV kernel), warp w takes the
//                  columns x = w, w + 4, ... of that row's d-vector (DPT = ceil(d/4) per thread).
// Forward: online softmax over key tiles (running max m, sum l); out = acc / l, lse = m + log l.
// Backward (deterministic): delta = rowsum(dO * O) first; then one kernel per key tile of a KV
// group sums dK and dV over the group's heads and all query rows in a fixed order, and one kernel
// per query tile sums dQ over the keys in a fixed order. Scores and probabilities are recomputed
// from q, k and the saved lse, as in the reference (engine/reference/attention.cpp).
#include "cuda/attention_generic.h"

#include <fmt/format.h>

#include <cmath>

#include "cuda/attention.h"
#include "cuda/attention_masks.cuh"
#include "cuda/cuda_check.h"
#include "cuda/device_utils.cuh"
#include "engine/attention_dropout.h"

namespace mt::cuda::generic {
namespace {

constexpr int kRows = 32;  // query rows per tile
constexpr int kKeys = 32;  // keys per tile
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarp;
constexpr int kEntries = kRows / kWarps;  // score entries per thread
constexpr int kSld = kKeys + 1;           // padded row of a [kRows][kKeys] score tile

struct Args {
  const void* qkv = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  const void* dout = nullptr;
  void* dqkv = nullptr;
  float* delta = nullptr;
  int batch = 0, seq = 0, heads = 0, groups = 0, hpg = 0, d = 0;
  int64_t row_stride = 0;  // qkv elements per token row
  int64_t out_row = 0;     // out elements per token row (heads * d)
  float scale = 0;
  bool causal = true;
  int window = -1;  // sliding window: query q sees keys q - window ... q (-1: none)
  float dropout_p = 0, dropout_scale = 1;
  uint64_t dropout_key = 0;
  const int32_t* doc_start = nullptr;  // packed documents: [batch * seq], sample-major (null: none)

  // Element offsets of the vectors of sample i, position t.
  __device__ int64_t q_off(int i, int t, int h) const {
    return (static_cast<int64_t>(t) * batch + i) * row_stride + (static_cast<int64_t>(h / hpg) * (hpg + 2) + h % hpg) * d;
  }
  __device__ int64_t k_off(int i, int t, int g) const {
    return (static_cast<int64_t>(t) * batch + i) * row_stride + (static_cast<int64_t>(g) * (hpg + 2) + hpg) * d;
  }
  __device__ int64_t o_off(int i, int t, int h) const {
    return (static_cast<int64_t>(t) * batch + i) * out_row + static_cast<int64_t>(h) * d;
  }
  __device__ int64_t lse_index(int i, int h, int t) const {
    return (static_cast<int64_t>(i) * heads + h) * seq + t;
  }
  // Dropout factor of probability (i, h, q, k): 0 if dropped, 1/(1-p) if kept (engine/attention_dropout.h).
  __device__ float drop(int i, int h, int q, int k) const {
    if (dropout_p <= 0) return 1.0f;
    return attention_dropout_keep(dropout_key, static_cast<int64_t>(i) * heads + h, seq, q, k,
                                  dropout_threshold(dropout_p))
               ? dropout_scale
               : 0.0f;
  }
  __device__ bool visible(int i, int q, int k) const {
    return q < seq && k < seq && (!causal || k <= q) && (window < 0 || k >= q - window) &&
           (!doc_start || k >= doc_start[static_cast<int64_t>(i) * seq + q]);
  }
  // The first key tile (of kKeys) a query tile of sample i starting at q0 sees (the tile's first
  // query sees the earliest keys: window and document starts only grow along the sequence).
  __device__ int first_key_tile(int i, int q0) const {
    return first_visible_key(doc_start ? doc_start + static_cast<int64_t>(i) * seq : nullptr, window, q0) / kKeys * kKeys;
  }
};

// rows [0, kRows) x d of a strided matrix into a padded float tile; rows >= valid become zeros.
template <typename T>
__device__ __forceinline__ void load_tile(float* dst, int ld, const T* src, int64_t row_step, int valid, int d) {
  for (int idx = threadIdx.x; idx < kRows * d; idx += kThreads) {
    const int r = idx / d, x = idx - r * d;
    dst[r * ld + x] = r < valid ? to_float(src[r * row_step + x]) : 0.0f;
  }
}

// s[e] = Q[r_e] . K[lane] and (with dO, V) dp[e] = dO[r_e] . V[lane], r_e = warp + kWarps * e.
template <bool WITH_DP>
__device__ __forceinline__ void score_entries(float (&s)[kEntries], float (&dp)[kEntries], const float* Qs,
                                              const float* Ks, const float* dOs, const float* Vs, int ld, int d,
                                              int lane, int warp) {
#pragma unroll
  for (int e = 0; e < kEntries; ++e) s[e] = dp[e] = 0.0f;
#pragma unroll 4
  for (int x = 0; x < d; ++x) {
    const float kx = Ks[lane * ld + x];
    float vx = 0.0f;
    if constexpr (WITH_DP) vx = Vs[lane * ld + x];
#pragma unroll
    for (int e = 0; e < kEntries; ++e) {
      const int r = warp + kWarps * e;
      s[e] = fmaf(Qs[r * ld + x], kx, s[e]);
      if constexpr (WITH_DP) dp[e] = fmaf(dOs[r * ld + x], vx, dp[e]);
    }
  }
}

template <typename T, int DPT>
__global__ void __launch_bounds__(kThreads) forward_kernel(Args a) {
  extern __shared__ float smem[];
  const int d = a.d, ld = d + 1;
  float* Qs = smem;
  float* Ks = Qs + kRows * ld;
  float* Vs = Ks + kKeys * ld;
  float* S = Vs + kKeys * ld;
  float* row_alpha = S + kRows * kSld;
  float* row_m = row_alpha + kRows;
  float* row_l = row_m + kRows;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int q0 = blockIdx.x * kRows;
  const int i = blockIdx.y / a.heads, h = blockIdx.y % a.heads, g = h / a.hpg;
  const T* qkv = static_cast<const T*>(a.qkv);
  const int64_t step = static_cast<int64_t>(a.batch) * a.row_stride;

  load_tile(Qs, ld, qkv + a.q_off(i, q0, h), step, min(kRows, a.seq - q0), d);
  if (threadIdx.x < kRows) {
    row_m[threadIdx.x] = -INFINITY;
    row_l[threadIdx.x] = 0.0f;
  }
  float acc[DPT];
#pragma unroll
  for (int k = 0; k < DPT; ++k) acc[k] = 0.0f;

  const int k_end = a.causal ? min(a.seq, q0 + kRows) : a.seq;
  for (int k0 = a.first_key_tile(i, q0); k0 < k_end; k0 += kKeys) {
    __syncthreads();  // the previous tile's K, V and probabilities are no longer read
    const int64_t kbase = a.k_off(i, k0, g);
    load_tile(Ks, ld, qkv + kbase, step, min(kKeys, a.seq - k0), d);
    load_tile(Vs, ld, qkv + kbase + d, step, min(kKeys, a.seq - k0), d);
    __syncthreads();
    float s[kEntries], unused[kEntries];
    score_entries<false>(s, unused, Qs, Ks, nullptr, nullptr, ld, d, lane, warp);
#pragma unroll
    for (int e = 0; e < kEntries; ++e) {
      const int r = warp + kWarps * e;
      S[r * kSld + lane] = a.visible(i, q0 + r, k0 + lane) ? s[e] * a.scale : -INFINITY;
    }
    __syncwarp();
    // Online softmax: warp w updates its rows (the entries it just wrote); lane = key.
#pragma unroll
    for (int e = 0; e < kEntries; ++e) {
      const int r = warp + kWarps * e;
      const float v = S[r * kSld + lane];
      const float m_old = row_m[r];
      const float m_new = fmaxf(m_old, warp_max(v));
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing visible yet
      const float p = expf(v - m_use);
      const float sum = warp_sum(p);
      const float alpha = expf(m_old - m_use);
      const float kept = (p > 0.0f) ? p * a.drop(i, h, q0 + r, k0 + lane) : 0.0f;
      S[r * kSld + lane] = kept;  // the output takes the dropped probabilities; l the undropped ones
      __syncwarp();
      if (lane == 0) {
        row_alpha[r] = alpha;
        row_m[r] = m_new;
        row_l[r] = row_l[r] * alpha + sum;
      }
    }
    __syncthreads();
    // acc[row = lane] = alpha * acc + P V over this tile's keys.
    const float alpha = row_alpha[lane];
#pragma unroll
    for (int k = 0; k < DPT; ++k) acc[k] *= alpha;
    for (int c = 0; c < kKeys; ++c) {
      const float p = S[lane * kSld + c];
#pragma unroll
      for (int k = 0; k < DPT; ++k) {
        const int x = warp + kWarps * k;
        if (x < d) acc[k] = fmaf(p, Vs[c * ld + x], acc[k]);
      }
    }
  }
  __syncthreads();
  const int q = q0 + lane;
  if (q < a.seq) {
    const float l = row_l[lane];
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    T* out = static_cast<T*>(a.out) + a.o_off(i, q, h);
#pragma unroll
    for (int k = 0; k < DPT; ++k) {
      const int x = warp + kWarps * k;
      if (x < d) out[x] = from_float<T>(acc[k] * inv);
    }
    if (warp == 0) a.lse[a.lse_index(i, h, q)] = row_m[lane] + logf(l);
  }
}

// delta[(i*heads + h)*seq + t] = sum_x dO * O: one warp per row.
template <typename T>
__global__ void __launch_bounds__(kThreads) delta_kernel(Args a) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= static_cast<int64_t>(a.batch) * a.heads * a.seq) return;
  const int t = static_cast<int>(row % a.seq);
  const int64_t ih = row / a.seq;
  const int h = static_cast<int>(ih % a.heads), i = static_cast<int>(ih / a.heads);
  const int64_t off = a.o_off(i, t, h);
  const T* o = static_cast<const T*>(a.out) + off;
  const T* dout = static_cast<const T*>(a.dout) + off;
  float s = 0.0f;
  for (int x = lane; x < a.d; x += kWarp) s = fmaf(to_float(dout[x]), to_float(o[x]), s);
  s = warp_sum(s);
  if (lane == 0) a.delta[row] = s;
}

// dK, dV of one key tile of one KV group: summed over the group's heads and the query tiles.
template <typename T, int DPT>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(Args a) {
  extern __shared__ float smem[];
  const int d = a.d, ld = d + 1;
  float* Ks = smem;
  float* Vs = Ks + kKeys * ld;
  float* Qs = Vs + kKeys * ld;
  float* dOs = Qs + kRows * ld;
  float* P = dOs + kRows * ld;
  float* dS = P + kRows * kSld;
  float* row_lse = dS + kRows * kSld;
  float* row_delta = row_lse + kRows;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int k0 = blockIdx.x * kKeys;
  const int i = blockIdx.y / a.groups, g = blockIdx.y % a.groups;
  const T* qkv = static_cast<const T*>(a.qkv);
  const T* dout = static_cast<const T*>(a.dout);
  const int64_t step = static_cast<int64_t>(a.batch) * a.row_stride;
  const int64_t out_step = static_cast<int64_t>(a.batch) * a.out_row;

  const int64_t kbase = a.k_off(i, k0, g);
  load_tile(Ks, ld, qkv + kbase, step, min(kKeys, a.seq - k0), d);
  load_tile(Vs, ld, qkv + kbase + d, step, min(kKeys, a.seq - k0), d);
  float dk[DPT], dv[DPT];
#pragma unroll
  for (int k = 0; k < DPT; ++k) dk[k] = dv[k] = 0.0f;

  const int q_begin = a.causal ? k0 / kRows * kRows : 0;
  // With a sliding window no query after k0 + kKeys - 1 + window sees this tile's keys.
  int q_end = a.window >= 0 ? min(a.seq, k0 + kKeys + a.window) : a.seq;
  // With documents no query from the first one whose document starts after the tile's last key.
  if (a.doc_start) {
    const int k_last = min(a.seq - 1, k0 + kKeys - 1);
    q_end = first_query_past(a.doc_start + static_cast<int64_t>(i) * a.seq, a.causal ? k_last : 0, q_end, k_last);
  }
  for (int hh = 0; hh < a.hpg; ++hh) {
    const int h = g * a.hpg + hh;
    for (int q0 = q_begin; q0 < q_end; q0 += kRows) {
      __syncthreads();  // the previous query tile is no longer read
      const int valid = min(kRows, a.seq - q0);
      load_tile(Qs, ld, qkv + a.q_off(i, q0, h), step, valid, d);
      load_tile(dOs, ld, dout + a.o_off(i, q0, h), out_step, valid, d);
      if (threadIdx.x < kRows) {
        const bool ok = threadIdx.x < valid;
        row_lse[threadIdx.x] = ok ? a.lse[a.lse_index(i, h, q0 + threadIdx.x)] : 0.0f;
        row_delta[threadIdx.x] = ok ? a.delta[a.lse_index(i, h, q0 + threadIdx.x)] : 0.0f;
      }
      __syncthreads();
      float s[kEntries], dp[kEntries];
      score_entries<true>(s, dp, Qs, Ks, dOs, Vs, ld, d, lane, warp);
#pragma unroll
      for (int e = 0; e < kEntries; ++e) {
        const int r = warp + kWarps * e, q = q0 + r, k = k0 + lane;
        float pd = 0.0f, ds = 0.0f;
        if (a.visible(i, q, k)) {
          const float p = expf(s[e] * a.scale - row_lse[r]);
          const float f = a.drop(i, h, q, k);
          pd = p * f;
          ds = p * (dp[e] * f - row_delta[r]) * a.scale;
        }
        P[r * kSld + lane] = pd;
        dS[r * kSld + lane] = ds;
      }
      __syncthreads();
      // key row = lane: dV += P^T dO, dK += dS^T Q, rows in order.
      for (int r = 0; r < valid; ++r) {
        const float pr = P[r * kSld + lane], dsr = dS[r * kSld + lane];
#pragma unroll
        for (int k = 0; k < DPT; ++k) {
          const int x = warp + kWarps * k;
          if (x < d) {
            dv[k] = fmaf(pr, dOs[r * ld + x], dv[k]);
            dk[k] = fmaf(dsr, Qs[r * ld + x], dk[k]);
          }
        }
      }
    }
  }
  const int key = k0 + lane;
  if (key < a.seq) {
    T* dst = static_cast<T*>(a.dqkv) + a.k_off(i, key, g);
#pragma unroll
    for (int k = 0; k < DPT; ++k) {
      const int x = warp + kWarps * k;
      if (x < d) {
        dst[x] = from_float<T>(dk[k]);
        dst[d + x] = from_float<T>(dv[k]);
      }
    }
  }
}

// dQ of one query tile of one head: summed over the key tiles in order.
template <typename T, int DPT>
__global__ void __launch_bounds__(kThreads) dq_kernel(Args a) {
  extern __shared__ float smem[];
  const int d = a.d, ld = d + 1;
  float* Qs = smem;
  float* dOs = Qs + kRows * ld;
  float* Ks = dOs + kRows * ld;
  float* Vs = Ks + kKeys * ld;
  float* dS = Vs + kKeys * ld;
  float* row_lse = dS + kRows * kSld;
  float* row_delta = row_lse + kRows;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int q0 = blockIdx.x * kRows;
  const int i = blockIdx.y / a.heads, h = blockIdx.y % a.heads, g = h / a.hpg;
  const T* qkv = static_cast<const T*>(a.qkv);
  const int64_t step = static_cast<int64_t>(a.batch) * a.row_stride;
  const int valid = min(kRows, a.seq - q0);

  load_tile(Qs, ld, qkv + a.q_off(i, q0, h), step, valid, d);
  load_tile(dOs, ld, static_cast<const T*>(a.dout) + a.o_off(i, q0, h), static_cast<int64_t>(a.batch) * a.out_row,
            valid, d);
  if (threadIdx.x < kRows) {
    const bool ok = threadIdx.x < valid;
    row_lse[threadIdx.x] = ok ? a.lse[a.lse_index(i, h, q0 + threadIdx.x)] : 0.0f;
    row_delta[threadIdx.x] = ok ? a.delta[a.lse_index(i, h, q0 + threadIdx.x)] : 0.0f;
  }
  float dq[DPT];
#pragma unroll
  for (int k = 0; k < DPT; ++k) dq[k] = 0.0f;

  const int k_end = a.causal ? min(a.seq, q0 + kRows) : a.seq;
  for (int k0 = a.first_key_tile(i, q0); k0 < k_end; k0 += kKeys) {
    __syncthreads();
    const int64_t kbase = a.k_off(i, k0, g);
    load_tile(Ks, ld, qkv + kbase, step, min(kKeys, a.seq - k0), d);
    load_tile(Vs, ld, qkv + kbase + d, step, min(kKeys, a.seq - k0), d);
    __syncthreads();
    float s[kEntries], dp[kEntries];
    score_entries<true>(s, dp, Qs, Ks, dOs, Vs, ld, d, lane, warp);
#pragma unroll
    for (int e = 0; e < kEntries; ++e) {
      const int r = warp + kWarps * e, q = q0 + r, k = k0 + lane;
      float ds = 0.0f;
      if (a.visible(i, q, k)) {
        const float p = expf(s[e] * a.scale - row_lse[r]);
        ds = p * (dp[e] * a.drop(i, h, q, k) - row_delta[r]) * a.scale;
      }
      dS[r * kSld + lane] = ds;
    }
    __syncthreads();
    // query row = lane: dQ += dS K, keys in order.
    for (int c = 0; c < kKeys; ++c) {
      const float dsv = dS[lane * kSld + c];
#pragma unroll
      for (int k = 0; k < DPT; ++k) {
        const int x = warp + kWarps * k;
        if (x < d) dq[k] = fmaf(dsv, Ks[c * ld + x], dq[k]);
      }
    }
  }
  const int q = q0 + lane;
  if (q < a.seq) {
    T* dst = static_cast<T*>(a.dqkv) + a.q_off(i, q, h);
#pragma unroll
    for (int k = 0; k < DPT; ++k) {
      const int x = warp + kWarps * k;
      if (x < d) dst[x] = from_float<T>(dq[k]);
    }
  }
}

// ---- host side ---------------------------------------------------------------------------------

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

size_t forward_smem(int d) { return sizeof(float) * ((kRows + 2 * kKeys) * (d + 1) + kRows * kSld + 3 * kRows); }
size_t dkdv_smem(int d) { return sizeof(float) * ((2 * kKeys + 2 * kRows) * (d + 1) + 2 * kRows * kSld + 2 * kRows); }
size_t dq_smem(int d) { return sizeof(float) * ((2 * kRows + 2 * kKeys) * (d + 1) + kRows * kSld + 2 * kRows); }

void check(const AttentionShape& a, Tensor qkv, Tensor out, Tensor lse) {
  if (a.batch <= 0 || a.seq <= 0 || a.heads <= 0 || a.groups <= 0 || a.heads % a.groups != 0)
    fail("attention: invalid shape b={} s={} heads={} groups={} (heads must be a multiple of groups)", a.batch,
         a.seq, a.heads, a.groups);
  if (!supports_head_dim(a.head_dim))
    throw Unsupported(fmt::format("attention supports head dims 1 to {}, not {} (--kv-channels)", kMaxHeadDim,
                                  a.head_dim));
  if (!(a.dropout_p >= 0 && a.dropout_p < 1)) fail("attention: dropout probability {} not in [0, 1)", a.dropout_p);
  if (qkv.dtype != DType::f32 && qkv.dtype != DType::bf16 && qkv.dtype != DType::f16)
    throw Unsupported(fmt::format("attention needs float32, bf16 or fp16 activations, got {}", dtype_name(qkv.dtype)));
  const int64_t n = static_cast<int64_t>(a.batch) * a.seq;
  auto check_tensor = [&](const Tensor& t, const char* name, int64_t numel, DType dtype) {
    MT_CHECK(t.device == Device::cuda, "attention {} must be device memory", name);
    MT_CHECK(t.numel() == numel, "attention {} has {} elements, shape needs {}", name, t.numel(), numel);
    MT_CHECK(t.dtype == dtype, "attention {} is {}, expected {}", name, dtype_name(t.dtype), dtype_name(dtype));
  };
  check_tensor(qkv, "qkv", n * a.qkv_row_stride(), qkv.dtype);
  check_tensor(out, "out", n * a.heads * a.head_dim, qkv.dtype);
  check_tensor(lse, "lse", n * a.heads, DType::f32);
}

Args make_args(const AttentionShape& a, Tensor qkv) {
  Args r;
  r.qkv = qkv.data;
  r.batch = a.batch;
  r.seq = a.seq;
  r.heads = a.heads;
  r.groups = a.groups;
  r.hpg = a.heads / a.groups;
  r.d = a.head_dim;
  r.row_stride = a.qkv_row_stride();
  r.out_row = static_cast<int64_t>(a.heads) * a.head_dim;
  r.scale = a.softmax_scale;
  r.causal = a.causal;
  r.window = a.window_left;
  r.dropout_p = a.dropout_p;
  r.dropout_scale = 1.0f / (1.0f - a.dropout_p);
  r.dropout_key = a.dropout_key;
  r.doc_start = document_starts(a);
  return r;
}

template <typename Kernel>
void launch(Kernel kernel, dim3 grid, size_t smem, cudaStream_t stream, const Args& args) {
  if (smem > 48 * 1024) MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                           static_cast<int>(smem)));
  kernel<<<grid, kThreads, smem, stream>>>(args);
  MT_CUDA_CHECK_LAUNCH();
}

// Calls f.template operator()<T, DPT>() for the activation dtype and the smallest compiled
// per-thread width DPT >= ceil(d / 4).
template <typename F>
void dispatch(DType dtype, int d, F&& f) {
  auto by_width = [&]<typename T>() {
    const int need = (d + kWarps - 1) / kWarps;
    if (need <= 8) f.template operator()<T, 8>();
    else if (need <= 16) f.template operator()<T, 16>();
    else if (need <= 32) f.template operator()<T, 32>();
    else f.template operator()<T, 64>();
  };
  switch (dtype) {
    case DType::f32: by_width.template operator()<float>(); break;
    case DType::bf16: by_width.template operator()<bf16>(); break;
    case DType::f16: by_width.template operator()<f16>(); break;
    default: throw Unsupported(fmt::format("attention: dtype {}", dtype_name(dtype)));
  }
}

}  // namespace

bool supports_head_dim(int head_dim) { return head_dim >= 1 && head_dim <= kMaxHeadDim; }

size_t backward_workspace_bytes(const AttentionShape& a) {
  return align256(static_cast<size_t>(a.batch) * a.heads * a.seq * sizeof(float));
}

void forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a, cudaStream_t stream) {
  check(a, qkv, out, lse);
  Args args = make_args(a, qkv);
  args.out = out.data;
  args.lse = lse.ptr<float>();
  const dim3 grid((a.seq + kRows - 1) / kRows, static_cast<unsigned>(a.batch) * a.heads);
  dispatch(qkv.dtype, a.head_dim, [&]<typename T, int DPT>() {
    launch(forward_kernel<T, DPT>, grid, forward_smem(a.head_dim), stream, args);
  });
}

void backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a, void* workspace,
              size_t workspace_bytes, cudaStream_t stream) {
  check(a, qkv, out, lse);
  check(a, dqkv, dout, lse);
  MT_CHECK(dqkv.dtype == qkv.dtype && dout.dtype == qkv.dtype, "attention backward dtypes differ");
  MT_CHECK(workspace != nullptr && workspace_bytes >= backward_workspace_bytes(a),
           "attention backward workspace has {} bytes, needs {}", workspace_bytes, backward_workspace_bytes(a));
  Args args = make_args(a, qkv);
  args.out = out.data;
  args.lse = lse.ptr<float>();
  args.dout = dout.data;
  args.dqkv = dqkv.data;
  args.delta = static_cast<float*>(workspace);
  const int64_t rows = static_cast<int64_t>(a.batch) * a.heads * a.seq;
  const unsigned tiles_q = (a.seq + kRows - 1) / kRows, tiles_k = (a.seq + kKeys - 1) / kKeys;
  dispatch(qkv.dtype, a.head_dim, [&]<typename T, int DPT>() {
    launch(delta_kernel<T>, dim3(static_cast<unsigned>((rows + kWarps - 1) / kWarps)), 0, stream, args);
    launch(dkdv_kernel<T, DPT>, dim3(tiles_k, static_cast<unsigned>(a.batch) * a.groups), dkdv_smem(a.head_dim),
           stream, args);
    launch(dq_kernel<T, DPT>, dim3(tiles_q, static_cast<unsigned>(a.batch) * a.heads), dq_smem(a.head_dim), stream,
           args);
  });
}

}  // namespace mt::cuda::generic

// Knowledge distillation's losses (engine/backend.h, "knowledge distillation"): the kernels and the
// CudaBackend members that check and launch them.
//
// logsumexp_rows: one block per row reads the row once (16-byte loads where aligned) keeping an
// online log-sum-exp of x * scale (a running max and sum, in log2 units, as cross_entropy_kernels.cu),
// the threads' pairs merged in a fixed order.
// kd_logits_kl: one block per row, one pass: each thread reads s and t of its columns, adds
// p_t * (log p_t - log p_s) (log p = x * scale - lse, never the log of an exponential) to its
// partial sum and, with dloss, writes ds = (p_s - p_t) * scale * dloss[row] over the same columns
// (ds may be s: every element is read before the same thread writes it). The partial sums are
// reduced over the block in a fixed order (block_sum).
// hidden_loss_forward / _backward: a warp per row for rows of up to kWarpRowMaxCols elements (8
// rows per block), else a block per row. Cosine: one pass reduces a.b, |a|^2 and |b|^2; the backward
// then writes da (+)= g * (a * (a.b) / A - b) / sqrt(A B) (A, B: the squared norms plus 1e-12; g =
// dloss[row] * scale) in a second pass over the row (L1/L2-resident for these widths). MSE: loss =
// sum((a - b)^2) / h in one pass; the backward is elementwise, da (+)= g * 2 (a - b) / h.
// Every sum is float32, in an order fixed by the launch shape (deterministic); nothing allocates.
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/cuda_backend.h"
#include "cuda/cuda_backend_dispatch.h"
#include "cuda/cuda_check.h"
#include "cuda/device_utils.cuh"

namespace mt {
namespace cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kCosineEps = 1e-12f;  // torch.nn.functional.cosine_embedding_loss's EPSILON

// Merge (m2, s2) into (m, s); values in log2 units.
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  if (mm == -INFINITY) return;  // both empty
  s = s * exp2f(m - mm) + s2 * exp2f(m2 - mm);
  m = mm;
}

// (m, s) merged over the block in a fixed order; the block's pair in thread 0 (warp 0's threads).
// Calls __syncthreads: every thread of the block must call it.
__device__ __forceinline__ void block_lse_merge(float& m, float& s) {
  __shared__ float sm[kWarp], ss[kWarp];
  auto warp_merge = [&] {
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
      const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
      lse_merge(m, s, m2, s2);
    }
  };
  warp_merge();
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x / kWarp;
    m = lane < warps ? sm[lane] : -INFINITY;
    s = lane < warps ? ss[lane] : 0.0f;
    warp_merge();
  }
}

template <typename T, int VEC>
__global__ void logsumexp_rows_kernel(float* lse, const T* logits, int64_t cols, float scale) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * cols;
  const float k = scale * kLog2e;
  float m = -INFINITY, s = 0.0f;  // log2 units
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * VEC; c < cols; c += static_cast<int64_t>(blockDim.x) * VEC) {
    const Floats<VEC> v = load_vec<VEC>(x + c);
    float vmax = -INFINITY;
#pragma unroll
    for (int j = 0; j < VEC; ++j) vmax = fmaxf(vmax, v.v[j] * k);
    if (vmax == -INFINITY) continue;
    if (vmax > m) {
      s *= exp2f(m - vmax);
      m = vmax;
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) s += exp2f(fmaf(v.v[j], k, -m));
  }
  block_lse_merge(m, s);
  if (threadIdx.x == 0) lse[row] = m == -INFINITY ? -INFINITY : (m + log2f(s)) * kLn2;
}

// GRAD: ds is written (dloss given).
template <typename T, int VEC, bool GRAD>
__global__ void kd_logits_kl_kernel(float* kl, T* ds, const T* s, const T* t, const float* lse_s, const float* lse_t,
                                    float scale, const float* dloss, int64_t cols) {
  const int64_t row = blockIdx.x;
  const int64_t base = row * cols;
  const float k = scale * kLog2e;
  const float ls = lse_s[row] * kLog2e, lt = lse_t[row] * kLog2e;  // log2 units
  const float g = GRAD ? scale * dloss[row] : 0.0f;
  float acc = 0.0f;  // log2 units
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * VEC; c < cols; c += static_cast<int64_t>(blockDim.x) * VEC) {
    Floats<VEC> vs = load_vec<VEC>(s + base + c);
    const Floats<VEC> vt = load_vec<VEC>(t + base + c);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float ys = fmaf(vs.v[j], k, -ls), yt = fmaf(vt.v[j], k, -lt);  // log2 p_s, log2 p_t
      const float ps = exp2f(ys), pt = exp2f(yt);
      if (pt > 0.0f) acc = fmaf(pt, yt - ys, acc);  // p_t = 0: no term (kl_div's xlogy), even where p_s = 0
      if constexpr (GRAD) vs.v[j] = (ps - pt) * g;
    }
    if constexpr (GRAD) store_vec<VEC>(ds + base + c, vs);
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) kl[row] = acc * kLn2;
}

// ---- hidden-state losses --------------------------------------------------------------------------
constexpr int kHiddenBlock = 256;
constexpr int64_t kWarpRowMaxCols = 1024;  // wider rows: a block per row

// The row a thread works on and its place in the row's group of threads (a warp, or the block).
template <bool WARP_ROW>
struct RowGroup {
  int64_t row;
  int lane, width;
  __device__ RowGroup() {
    if constexpr (WARP_ROW) {
      row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
      lane = threadIdx.x % kWarp;
      width = kWarp;
    } else {
      row = blockIdx.x;
      lane = threadIdx.x;
      width = blockDim.x;
    }
  }
};

// Sums of x, y, z over the row's group (fixed order); every thread of the group gets them. The
// block version calls __syncthreads (every thread of the block calls it, once per kernel).
template <bool WARP_ROW>
__device__ __forceinline__ void group_sum3(float& x, float& y, float& z) {
  x = warp_sum(x);
  y = warp_sum(y);
  z = warp_sum(z);
  if constexpr (!WARP_ROW) {
    __shared__ float partial[3][kWarp];
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
    if (lane == 0) {
      partial[0][warp] = x;
      partial[1][warp] = y;
      partial[2][warp] = z;
    }
    __syncthreads();
    x = warp_sum(lane < warps ? partial[0][lane] : 0.0f);
    y = warp_sum(lane < warps ? partial[1][lane] : 0.0f);
    z = warp_sum(lane < warps ? partial[2][lane] : 0.0f);
  }
}

// Cosine: (a.b, |a|^2, |b|^2); MSE: (sum (a - b)^2, 0, 0). Over the thread's columns, then the group's.
template <typename T, int VEC, bool WARP_ROW, bool COSINE>
__device__ __forceinline__ void hidden_row_sums(const T* a, const T* b, int64_t h, const RowGroup<WARP_ROW>& grp,
                                                float& x, float& y, float& z) {
  x = y = z = 0.0f;
  for (int64_t c = static_cast<int64_t>(grp.lane) * VEC; c < h; c += static_cast<int64_t>(grp.width) * VEC) {
    const Floats<VEC> va = load_vec<VEC>(a + c), vb = load_vec<VEC>(b + c);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if constexpr (COSINE) {
        x = fmaf(va.v[j], vb.v[j], x);
        y = fmaf(va.v[j], va.v[j], y);
        z = fmaf(vb.v[j], vb.v[j], z);
      } else {
        const float d = va.v[j] - vb.v[j];
        x = fmaf(d, d, x);
      }
    }
  }
  group_sum3<WARP_ROW>(x, y, z);
}

template <typename T, int VEC, bool WARP_ROW, bool COSINE>
__global__ void __launch_bounds__(kHiddenBlock) hidden_loss_forward_kernel(float* loss, const T* a, const T* b,
                                                                           int64_t rows, int64_t h) {
  const RowGroup<WARP_ROW> grp;
  if (WARP_ROW && grp.row >= rows) return;  // a whole warp (no block barrier in the warp version)
  float x, y, z;
  hidden_row_sums<T, VEC, WARP_ROW, COSINE>(a + grp.row * h, b + grp.row * h, h, grp, x, y, z);
  if (grp.lane == 0) {
    if constexpr (COSINE) loss[grp.row] = 1.0f - x / (sqrtf(y + kCosineEps) * sqrtf(z + kCosineEps));
    else loss[grp.row] = x / static_cast<float>(h);
  }
}

template <typename T, int VEC, bool WARP_ROW, bool COSINE>
__global__ void __launch_bounds__(kHiddenBlock)
    hidden_loss_backward_kernel(T* da, const T* a, const T* b, const float* dloss, float scale, int64_t rows,
                                int64_t h, bool accumulate) {
  const RowGroup<WARP_ROW> grp;
  if (WARP_ROW && grp.row >= rows) return;
  const T* ar = a + grp.row * h;
  const T* br = b + grp.row * h;
  T* dr = da + grp.row * h;
  const float g = dloss[grp.row] * scale;
  // d loss / d a = ca * a + cb * b
  float ca, cb;
  if constexpr (COSINE) {
    float dot, aa, bb;
    hidden_row_sums<T, VEC, WARP_ROW, true>(ar, br, h, grp, dot, aa, bb);
    const float A = aa + kCosineEps, inv_d = 1.0f / (sqrtf(A) * sqrtf(bb + kCosineEps));
    ca = g * inv_d * (dot / A);
    cb = -g * inv_d;
  } else {
    ca = g * 2.0f / static_cast<float>(h);
    cb = -ca;
  }
  for (int64_t c = static_cast<int64_t>(grp.lane) * VEC; c < h; c += static_cast<int64_t>(grp.width) * VEC) {
    const Floats<VEC> va = load_vec<VEC>(ar + c), vb = load_vec<VEC>(br + c);
    Floats<VEC> out;
    if (accumulate) out = load_vec<VEC>(dr + c);  // (da may be a: read before written, by this thread)
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float d = fmaf(ca, va.v[j], cb * vb.v[j]);
      out.v[j] = accumulate ? out.v[j] + d : d;
    }
    store_vec<VEC>(dr + c, out);
  }
}

// One block per row: a grid dimension of at most 2^31 - 1.
void check_rows(const char* op, int64_t rows) {
  MT_CHECK(rows < (int64_t{1} << 31), "{}: too many rows ({})", op, rows);
}

void check_row_vector(const char* op, const char* name, const Tensor& v, int64_t rows) {
  MT_CHECK(!v.empty() && v.dtype == DType::f32 && v.numel() == rows, "{}: {} {} must be float32 [{}]", op, name,
           v.shape_string(), rows);
}

// Threads per row block for vocab rows: a small block for short rows (most of 512 threads would
// idle), else 512.
int logits_block(int64_t vectors_per_row) { return vectors_per_row <= 1024 ? 128 : 512; }

void check_hidden_pair(const char* op, const Tensor& a, const Tensor& b) {
  MT_CHECK(b.dtype == a.dtype && b.numel() == a.numel() && b.cols() == a.cols(),
           "{}: b {} ({}) must have a's shape {} and dtype ({})", op, b.shape_string(), dtype_name(b.dtype),
           a.shape_string(), dtype_name(a.dtype));
  MT_CHECK(a.numel() == 0 || a.cols() > 0, "{}: a {} has empty rows", op, a.shape_string());
  check_rows(op, a.rows());
}

void logsumexp_rows(const KernelContext& ctx, Tensor lse, Tensor logits, float scale) {
  const char* op = "logsumexp_rows";
  const int64_t rows = logits.rows(), cols = logits.cols();
  check_row_vector(op, "lse", lse, rows);
  check_rows(op, rows);
  if (rows == 0) return;
  MT_CHECK(cols > 0, "logsumexp_rows: logits {} has no columns", logits.shape_string());
  MT_DISPATCH_FLOAT(logits.dtype, T, op, {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = aligned16(logits.data) && cols % kVec == 0;
    const int threads = logits_block(vec ? cols / kVec : cols);
    if (vec)
      logsumexp_rows_kernel<T, kVec><<<static_cast<unsigned>(rows), threads, 0, ctx.stream>>>(
          lse.ptr<float>(), logits.ptr<const T>(), cols, scale);
    else
      logsumexp_rows_kernel<T, 1><<<static_cast<unsigned>(rows), threads, 0, ctx.stream>>>(
          lse.ptr<float>(), logits.ptr<const T>(), cols, scale);
  });
  MT_CUDA_CHECK_LAUNCH();
}

void kd_logits_kl(const KernelContext& ctx, Tensor kl, Tensor ds, Tensor s, Tensor t, Tensor lse_s, Tensor lse_t,
                  float scale, Tensor dloss) {
  const char* op = "kd_logits_kl";
  const int64_t rows = s.rows(), cols = s.cols();
  MT_CHECK(t.dtype == s.dtype && t.numel() == s.numel() && t.cols() == cols,
           "kd_logits_kl: teacher logits t {} ({}) must have the student's shape {} and dtype ({})", t.shape_string(),
           dtype_name(t.dtype), s.shape_string(), dtype_name(s.dtype));
  check_row_vector(op, "kl", kl, rows);
  check_row_vector(op, "lse_s", lse_s, rows);
  check_row_vector(op, "lse_t", lse_t, rows);
  const bool grad = !dloss.empty();
  if (grad) {
    check_row_vector(op, "dloss", dloss, rows);
    MT_CHECK(!ds.empty() && ds.dtype == s.dtype && ds.numel() == s.numel(),
             "kd_logits_kl: ds {} ({}) must have the student logits' shape {} and dtype ({})", ds.shape_string(),
             dtype_name(ds.dtype), s.shape_string(), dtype_name(s.dtype));
  }
  check_rows(op, rows);
  if (rows == 0) return;
  MT_CHECK(cols > 0, "kd_logits_kl: logits {} have no columns", s.shape_string());
  MT_DISPATCH_FLOAT(s.dtype, T, op, {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = aligned16(s.data) && aligned16(t.data) && (!grad || aligned16(ds.data)) && cols % kVec == 0;
    const int threads = logits_block(vec ? cols / kVec : cols);
    auto launch = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(rows), threads, 0, ctx.stream>>>(
          kl.ptr<float>(), grad ? ds.ptr<T>() : nullptr, s.ptr<const T>(), t.ptr<const T>(), lse_s.ptr<const float>(),
          lse_t.ptr<const float>(), scale, grad ? dloss.ptr<const float>() : nullptr, cols);
    };
    if (vec && grad) launch(kd_logits_kl_kernel<T, kVec, true>);
    else if (vec) launch(kd_logits_kl_kernel<T, kVec, false>);
    else if (grad) launch(kd_logits_kl_kernel<T, 1, true>);
    else launch(kd_logits_kl_kernel<T, 1, false>);
  });
  MT_CUDA_CHECK_LAUNCH();
}

// Grid and block of the hidden-loss kernels: a warp per row (kHiddenBlock / 32 rows per block) for
// rows up to kWarpRowMaxCols wide, else a block per row.
struct HiddenShape {
  bool warp_row;
  unsigned grid;
};
HiddenShape hidden_shape(int64_t rows, int64_t h) {
  const bool warp_row = h <= kWarpRowMaxCols;
  constexpr int64_t kRowsPerBlock = kHiddenBlock / kWarp;
  return {warp_row, static_cast<unsigned>(warp_row ? (rows + kRowsPerBlock - 1) / kRowsPerBlock : rows)};
}

// The hidden-loss kernels' eight variants per dtype: f(vector width, warp per row, cosine), each a
// compile-time constant (std::integral_constant).
template <int kVec, typename F>
void pick_hidden_variant(bool vec, bool warp_row, bool cosine, F&& f) {
  auto with_cosine = [&](auto v, auto w) {
    if (cosine) f(v, w, std::true_type{});
    else f(v, w, std::false_type{});
  };
  auto with_warp = [&](auto v) {
    if (warp_row) with_cosine(v, std::true_type{});
    else with_cosine(v, std::false_type{});
  };
  if (vec) with_warp(std::integral_constant<int, kVec>{});
  else with_warp(std::integral_constant<int, 1>{});
}

void hidden_loss_forward(const KernelContext& ctx, Tensor loss, Tensor a, Tensor b, Backend::HiddenLoss kind) {
  const char* op = "hidden_loss_forward";
  check_hidden_pair(op, a, b);
  const int64_t rows = a.rows(), h = a.cols();
  check_row_vector(op, "loss", loss, rows);
  if (rows == 0) return;
  const bool cosine = kind == Backend::HiddenLoss::cosine;
  const HiddenShape shape = hidden_shape(rows, h);
  MT_DISPATCH_FLOAT(a.dtype, T, op, {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = aligned16(a.data) && aligned16(b.data) && h % kVec == 0;
    auto launch = [&](auto kernel) {
      kernel<<<shape.grid, kHiddenBlock, 0, ctx.stream>>>(loss.ptr<float>(), a.ptr<const T>(), b.ptr<const T>(), rows,
                                                          h);
    };
    // (vec, warp_row, cosine): eight instances per dtype
    pick_hidden_variant<kVec>(vec, shape.warp_row, cosine, [&](auto v, auto w, auto c) {
      launch(hidden_loss_forward_kernel<T, decltype(v)::value, decltype(w)::value, decltype(c)::value>);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

void hidden_loss_backward(const KernelContext& ctx, Tensor da, Tensor a, Tensor b, Tensor dloss, float scale,
                          Backend::HiddenLoss kind, bool accumulate) {
  const char* op = "hidden_loss_backward";
  check_hidden_pair(op, a, b);
  const int64_t rows = a.rows(), h = a.cols();
  MT_CHECK(!da.empty() && da.dtype == a.dtype && da.numel() == a.numel() && da.cols() == h,
           "hidden_loss_backward: da {} ({}) must have a's shape {} and dtype ({})", da.shape_string(),
           dtype_name(da.dtype), a.shape_string(), dtype_name(a.dtype));
  check_row_vector(op, "dloss", dloss, rows);
  if (rows == 0) return;
  const bool cosine = kind == Backend::HiddenLoss::cosine;
  const HiddenShape shape = hidden_shape(rows, h);
  MT_DISPATCH_FLOAT(a.dtype, T, op, {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = aligned16(a.data) && aligned16(b.data) && aligned16(da.data) && h % kVec == 0;
    auto launch = [&](auto kernel) {
      kernel<<<shape.grid, kHiddenBlock, 0, ctx.stream>>>(da.ptr<T>(), a.ptr<const T>(), b.ptr<const T>(),
                                                          dloss.ptr<const float>(), scale, rows, h, accumulate);
    };
    pick_hidden_variant<kVec>(vec, shape.warp_row, cosine, [&](auto v, auto w, auto c) {
      launch(hidden_loss_backward_kernel<T, decltype(v)::value, decltype(w)::value, decltype(c)::value>);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace
}  // namespace cuda

// ---- CudaBackend members ------------------------------------------------------------------------
using cuda_dispatch::on_device;

void CudaBackend::logsumexp_rows(Tensor lse, Tensor logits, float scale) {
  on_device("logsumexp_rows", lse, logits);
  MT_PROFILE_OP("logsumexp_rows {}", logits.shape_string());
  cuda::logsumexp_rows(context(), lse, logits, scale);
}

void CudaBackend::kd_logits_kl(Tensor kl, Tensor ds, Tensor s, Tensor t, Tensor lse_s, Tensor lse_t, float scale,
                               Tensor dloss) {
  on_device("kd_logits_kl", kl, ds, s, t, lse_s, lse_t, dloss);
  MT_PROFILE_OP("kd_logits_kl {}{}", s.shape_string(), dloss.empty() ? "" : " grad");
  cuda::kd_logits_kl(context(), kl, ds, s, t, lse_s, lse_t, scale, dloss);
}

void CudaBackend::hidden_loss_forward(Tensor loss, Tensor a, Tensor b, HiddenLoss kind) {
  on_device("hidden_loss_forward", loss, a, b);
  MT_PROFILE_OP("hidden_loss_forward {} {}", a.shape_string(), kind == HiddenLoss::cosine ? "cosine" : "mse");
  cuda::hidden_loss_forward(context(), loss, a, b, kind);
}

void CudaBackend::hidden_loss_backward(Tensor da, Tensor a, Tensor b, Tensor dloss, float scale, HiddenLoss kind,
                                       bool accumulate) {
  on_device("hidden_loss_backward", da, a, b, dloss);
  MT_PROFILE_OP("hidden_loss_backward {} {}", a.shape_string(), kind == HiddenLoss::cosine ? "cosine" : "mse");
  cuda::hidden_loss_backward(context(), da, a, b, dloss, scale, kind, accumulate);
}

}  // namespace mt

// Rotary position embeddings, in place on the q and k heads of packed QKV rows (grouped layout:
// per KV group [q: heads/groups * d][k: d][v: d]); v is untouched. Only the first rot_dim dims of
// each head rotate (--rotary-percent). Pairs are (i, i + rot_dim/2) (Llama's rotate-half) or
// (2i, 2i+1) (interleaved); pair i turns by the angle whose cos/sin sit in cos_sin[position].
// The backward pass turns the gradient back by the same angle (the rotation's transpose).
#include <algorithm>

#include "cuda/cuda_check.h"
#include "cuda/device_utils.cuh"
#include "cuda/kernels.h"

namespace mt::cuda {
namespace {

// One block per token row; each thread turns P consecutive pairs of one head: P = 16 bytes of
// elements when the row, head and table layout allow 16-byte accesses, else 1.
template <typename T, int P>
__global__ void rope_kernel(T* qkv, const void* positions, bool positions64, const float* cos_sin, int64_t row_stride,
                            int q_per_group, int head_dim, int rot_dim, int rotated_heads, bool interleaved,
                            float sin_sign) {
  const int64_t row = blockIdx.x;
  const int half = rot_dim / 2, per_head = half / P;
  const int64_t pos = positions64 ? static_cast<const int64_t*>(positions)[row]
                                  : static_cast<const int32_t*>(positions)[row];
  const float* cs = cos_sin + pos * rot_dim;
  T* base = qkv + row * row_stride;
  for (int t = threadIdx.x; t < rotated_heads * per_head; t += blockDim.x) {
    const int head = t / per_head, i0 = (t % per_head) * P;
    const int group = head / (q_per_group + 1), in_group = head % (q_per_group + 1);  // q heads, then k
    T* x = base + (group * (q_per_group + 2) + in_group) * head_dim;
    const Floats<P> c = load_vec<P>(cs + i0);
    Floats<P> s = load_vec<P>(cs + half + i0);
#pragma unroll
    for (int j = 0; j < P; ++j) s.v[j] *= sin_sign;
    Floats<P> a, b;  // the pairs' first and second elements
    if (interleaved) {
      const Floats<2 * P> v = load_vec<2 * P>(x + 2 * i0);
#pragma unroll
      for (int j = 0; j < P; ++j) a.v[j] = v.v[2 * j], b.v[j] = v.v[2 * j + 1];
    } else {
      a = load_vec<P>(x + i0);
      b = load_vec<P>(x + half + i0);
    }
    Floats<P> ra, rb;
#pragma unroll
    for (int j = 0; j < P; ++j) {
      ra.v[j] = a.v[j] * c.v[j] - b.v[j] * s.v[j];
      rb.v[j] = b.v[j] * c.v[j] + a.v[j] * s.v[j];
    }
    if (interleaved) {
      Floats<2 * P> v;
#pragma unroll
      for (int j = 0; j < P; ++j) v.v[2 * j] = ra.v[j], v.v[2 * j + 1] = rb.v[j];
      store_vec<2 * P>(x + 2 * i0, v);
    } else {
      store_vec<P>(x + i0, ra);
      store_vec<P>(x + half + i0, rb);
    }
  }
}

// Multi-latent attention's attention input (Backend::mla_qkv_forward): one block per token row,
// a thread per output element. R turns interleaved pairs and writes them de-interleaved: output
// i < rot/2 of a RoPE part is a * c - b * s, output rot/2 + i is b * c + a * s, with (a, b) the
// input pair (2i, 2i + 1).
template <typename T>
__device__ __forceinline__ float mla_rope_value(const T* x, const float* cs, int i, int rot) {
  if (i >= rot) return to_float(x[i]);
  const int half = rot / 2, p = i < half ? i : i - half;
  const float a = to_float(x[2 * p]), b = to_float(x[2 * p + 1]), c = cs[p], s = cs[half + p];
  return i < half ? a * c - b * s : b * c + a * s;
}

// The transpose: input element j (pair j / 2) of a RoPE part from the de-interleaved gradient y.
template <typename T>
__device__ __forceinline__ float mla_rope_grad(const T* y, const float* cs, int j, int rot) {
  if (j >= rot) return to_float(y[j]);
  const int half = rot / 2, p = j / 2;
  const float a = to_float(y[p]), b = to_float(y[half + p]), c = cs[p], s = cs[half + p];
  return j % 2 == 0 ? a * c + b * s : b * c - a * s;
}

template <typename T>
__global__ void mla_qkv_forward_kernel(T* qkv, const T* q, const T* kv, const T* down, const int32_t* positions,
                                       const float* cos_sin, int64_t down_ld, int64_t kr_col, int heads, int dn,
                                       int dr, int rot, int dv) {
  const int64_t n = blockIdx.x;
  const int D = dn + dr, W = dn + dv;
  const float* cs = cos_sin + static_cast<int64_t>(positions[n]) * rot;
  const T* qrow = q + n * heads * D;
  const T* kvrow = kv + n * heads * W;
  const T* kr = down + n * down_ld + kr_col;
  T* out = qkv + n * heads * 3 * D;
  for (int t = threadIdx.x; t < heads * 3 * D; t += blockDim.x) {
    const int h = t / (3 * D), r = t % (3 * D), part = r / D, j = r % D;
    float v;
    if (part == 2) v = j < dv ? to_float(kvrow[h * W + dn + j]) : 0.0f;
    else if (j < dn) v = to_float(part == 0 ? qrow[h * D + j] : kvrow[h * W + j]);
    else v = mla_rope_value(part == 0 ? qrow + h * D + dn : kr, cs, j - dn, rot);
    out[t] = from_float<T>(v);
  }
}

template <typename T>
__global__ void mla_qkv_backward_kernel(T* dq, T* dkv, T* ddown, const T* dqkv, const int32_t* positions,
                                        const float* cos_sin, int64_t down_ld, int64_t kr_col, int heads, int dn,
                                        int dr, int rot, int dv) {
  const int64_t n = blockIdx.x;
  const int D = dn + dr, W = dn + dv;
  const float* cs = cos_sin + static_cast<int64_t>(positions[n]) * rot;
  const T* g = dqkv + n * heads * 3 * D;
  T* qrow = dq + n * heads * D;
  T* kvrow = dkv + n * heads * W;
  const int nq = heads * D, nkv = heads * W;
  for (int t = threadIdx.x; t < nq + nkv + dr; t += blockDim.x) {
    if (t < nq) {
      const int h = t / D, j = t % D;
      const T* G = g + h * 3 * D;
      qrow[t] = from_float<T>(j < dn ? to_float(G[j]) : mla_rope_grad(G + dn, cs, j - dn, rot));
    } else if (t < nq + nkv) {
      const int u = t - nq, h = u / W, j = u % W;
      const T* G = g + h * 3 * D;
      kvrow[u] = j < dn ? G[D + j] : G[2 * D + j - dn];
    } else {  // the shared k_rope: its gradient summed over the heads
      const int j = t - nq - nkv;
      float sum = 0;
      for (int h = 0; h < heads; ++h) sum += mla_rope_grad(g + h * 3 * D + D + dn, cs, j, rot);
      ddown[n * down_ld + kr_col + j] = from_float<T>(sum);
    }
  }
}

}  // namespace

void mla_qkv(const KernelContext& ctx, Tensor qkv, Tensor q, Tensor kv, Tensor down, Tensor positions, Tensor cos_sin,
             const MlaShape& m, bool backward) {
  const char* what = backward ? "mla_qkv_backward" : "mla_qkv_forward";
  const int64_t N = qkv.rows();
  check_mla_qkv_args(what, qkv, q, kv, down, positions, cos_sin, m);
  MT_CHECK(cos_sin.dtype == DType::f32, "{}: cos_sin must be float32", what);
  MT_CHECK(N < (int64_t{1} << 31), "{}: too many rows", what);
  if (N == 0) return;
  const int64_t work = backward ? m.q_width() + m.kv_width() + m.rope_dim : m.qkv_width();
  const int block = static_cast<int>(std::min<int64_t>(512, (work + 31) / 32 * 32));
  MT_DISPATCH_FLOAT(qkv.dtype, T, what, {
    if (backward)
      mla_qkv_backward_kernel<T><<<static_cast<unsigned>(N), block, 0, ctx.stream>>>(
          q.ptr<T>(), kv.ptr<T>(), down.ptr<T>(), qkv.ptr<const T>(), positions.ptr<const int32_t>(),
          cos_sin.ptr<const float>(), down.cols(), m.kr_col, m.heads, m.nope_dim, m.rope_dim, m.rot_dim, m.v_dim);
    else
      mla_qkv_forward_kernel<T><<<static_cast<unsigned>(N), block, 0, ctx.stream>>>(
          qkv.ptr<T>(), q.ptr<const T>(), kv.ptr<const T>(), down.ptr<const T>(), positions.ptr<const int32_t>(),
          cos_sin.ptr<const float>(), down.cols(), m.kr_col, m.heads, m.nope_dim, m.rope_dim, m.rot_dim, m.v_dim);
  });
  MT_CUDA_CHECK_LAUNCH();
}

void rope(const KernelContext& ctx, Tensor qkv, Tensor positions, Tensor cos_sin, const RopeShape& r, bool backward) {
  const char* what = backward ? "rope_backward" : "rope_forward";
  MT_CHECK(r.groups > 0 && r.heads % r.groups == 0, "{}: heads {} not a multiple of groups {}", what, r.heads, r.groups);
  MT_CHECK(r.rot_dim > 0 && r.rot_dim % 2 == 0 && r.rot_dim <= r.head_dim, "{}: rot_dim {} (head_dim {})", what,
           r.rot_dim, r.head_dim);
  const int q_per_group = r.heads / r.groups;
  const int64_t stride = static_cast<int64_t>(r.groups) * (q_per_group + 2) * r.head_dim;
  MT_CHECK(qkv.cols() == stride, "{}: qkv {} rows must hold {} values", what, qkv.shape_string(), stride);
  const int64_t rows = qkv.rows();
  MT_CHECK(positions.numel() == rows && (positions.dtype == DType::i32 || positions.dtype == DType::i64),
           "{}: positions {} must be int32/int64 [{}]", what, positions.shape_string(), rows);
  MT_CHECK(cos_sin.cols() == r.rot_dim && cos_sin.dtype == DType::f32, "{}: cos_sin {} must be float32 [*, {}]", what,
           cos_sin.shape_string(), r.rot_dim);
  MT_CHECK(rows < (int64_t{1} << 31), "{}: too many rows", what);
  if (rows == 0) return;
  const int rotated_heads = r.groups * (q_per_group + 1);
  MT_DISPATCH_FLOAT(qkv.dtype, T, what, {
    constexpr int kP = 16 / sizeof(T);
    const bool vec = r.rot_dim % (2 * kP) == 0 && r.head_dim % kP == 0 && aligned16(qkv.data) &&
                     aligned16(cos_sin.data) && r.rot_dim % 4 == 0;
    const int work = rotated_heads * (r.rot_dim / 2) / (vec ? kP : 1);
    const int block = std::min(256, (work + 31) / 32 * 32);
    auto launch = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(rows), block, 0, ctx.stream>>>(
          qkv.ptr<T>(), positions.data, positions.dtype == DType::i64, cos_sin.ptr<const float>(), stride, q_per_group,
          r.head_dim, r.rot_dim, rotated_heads, r.interleaved, backward ? -1.0f : 1.0f);
    };
    if (vec) launch(rope_kernel<T, kP>);
    else launch(rope_kernel<T, 1>);
  });
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda

// Rotary position embeddings, in place on the q and k heads of packed QKV rows (grouped layout:
// per KV group [q: heads/groups * d][k: d][v: d]); v is untouched. Only the first rot_dim dims of
// each head rotate (--rotary-percent). Pairs are (i, i + rot_dim/2) (Llama's rotate-half) or
// (2i, 2i+1) (interleaved); pair i turns by the angle whose cos/sin sit in cos_sin[position].
// The backward pass turns the gradient back by the same angle (the rotation's transpose).
#include "cuda/cuda_check.h"
#include "cuda/device_utils.cuh"
#include "cuda/kernels.h"

namespace mt::cuda {
namespace {

template <typename T>
__global__ void rope_kernel(T* qkv, const void* positions, bool positions64, const float* cos_sin, int64_t rows,
                            int64_t row_stride, int q_per_group, int head_dim, int rot_dim, int rotated_heads,
                            bool interleaved, float sin_sign) {
  const int half = rot_dim / 2;
  const int64_t total = rows * rotated_heads * half;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(t % half);
    const int64_t rh = t / half;
    const int head = static_cast<int>(rh % rotated_heads);
    const int64_t row = rh / rotated_heads;
    const int group = head / (q_per_group + 1), in_group = head % (q_per_group + 1);  // q heads, then k
    T* x = qkv + row * row_stride + (static_cast<int64_t>(group) * (q_per_group + 2) + in_group) * head_dim;
    const int64_t pos = positions64 ? static_cast<const int64_t*>(positions)[row]
                                    : static_cast<const int32_t*>(positions)[row];
    const float c = cos_sin[pos * rot_dim + i], s = sin_sign * cos_sin[pos * rot_dim + half + i];
    const int i1 = interleaved ? 2 * i : i, i2 = interleaved ? 2 * i + 1 : i + half;
    const float x1 = to_float(x[i1]), x2 = to_float(x[i2]);
    x[i1] = from_float<T>(x1 * c - x2 * s);
    x[i2] = from_float<T>(x2 * c + x1 * s);
  }
}

}  // namespace

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
  if (rows == 0) return;
  const int rotated_heads = r.groups * (q_per_group + 1);
  const int64_t total = rows * rotated_heads * (r.rot_dim / 2);
  const unsigned grid = grid_for(total, 256, ctx.num_sms * 16LL);
  MT_DISPATCH_FLOAT(qkv.dtype, T, what, {
    rope_kernel<T><<<grid, 256, 0, ctx.stream>>>(qkv.ptr<T>(), positions.data, positions.dtype == DType::i64,
                                                 cos_sin.ptr<const float>(), rows, stride, q_per_group, r.head_dim,
                                                 r.rot_dim, rotated_heads, r.interleaved, backward ? -1.0f : 1.0f);
  });
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda

// Cross-entropy over a (possibly vocab-parallel) logits shard, without ever storing probabilities.
//
// Forward: one block per row reads the row once (16-byte loads) keeping an online log-sum-exp:
// a running max m and sum s of exp(x - m), rescaled whenever the max grows; the partial (m, s)
// pairs of the threads are merged the same way. The target logit is read directly.
// Backward: dlogits = (exp(x - lse) - onehot(label)) * dloss[row], written over the logits (the
// in-place case) with the same one-row-per-block layout.
// Forward-backward (a whole vocabulary in training): both passes in one kernel, the row staged in
// shared memory where it fits (else the second read of each row goes to L2 or beyond); the same
// block reduction, so the same bits as the two kernels.
// logsumexp_combine merges per-shard lse values; masked_loss_sum is a single-block, fixed-order
// double-precision reduction (deterministic).
// logits_argmax: one block per row, each thread's (max, first column) merged by value, then by the
// lower column; argmax_match_count picks each row's shard and counts in one block (exact counts).
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include <cuda_pipeline.h>

#include "cuda/cuda_check.h"
#include "cuda/device_utils.cuh"
#include "cuda/kernels.h"

namespace mt::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ int64_t load_label(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

// Merge (m2, s2) into (m, s); values are in log2 units (x * log2 e).
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  if (mm == -INFINITY) return;  // both empty
  s = s * exp2f(m - mm) + s2 * exp2f(m2 - mm);
  m = mm;
}

// Every thread's pair (a, b) merged over the block in a fixed order, with merge(a, b, a2, b2) and
// (empty_a, empty_b) for the missing warps: the whole block's pair in warp 0's threads (the
// others keep their warp's). Calls __syncthreads: every thread of the block must call it.
template <typename A, typename B, typename Merge>
__device__ __forceinline__ void block_merge(A& a, B& b, A empty_a, B empty_b, Merge merge) {
  __shared__ A sa[kWarp];
  __shared__ B sb[kWarp];
  auto warp_merge = [&] {
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) {
      const A a2 = __shfl_xor_sync(0xffffffffu, a, o);
      const B b2 = __shfl_xor_sync(0xffffffffu, b, o);
      merge(a, b, a2, b2);
    }
  };
  warp_merge();
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) {
    sa[warp] = a;
    sb[warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x / kWarp;
    a = lane < warps ? sa[lane] : empty_a;
    b = lane < warps ? sb[lane] : empty_b;
    warp_merge();
  }
}

// The row's log-sum-exp (natural log; -inf for an all -inf row), by an online max/sum over the
// block's threads merged in a fixed order; every thread gets it.
template <typename T, int VEC>
__device__ float block_row_lse(const T* x, int64_t cols) {
  __shared__ float result;
  float m = -INFINITY, s = 0.0f;  // log2 units
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * VEC; c < cols; c += static_cast<int64_t>(blockDim.x) * VEC) {
    const Floats<VEC> v = load_vec<VEC>(x + c);
    float vmax = -INFINITY;
#pragma unroll
    for (int j = 0; j < VEC; ++j) vmax = fmaxf(vmax, v.v[j] * kLog2e);
    if (vmax == -INFINITY) continue;
    if (vmax > m) {
      s *= exp2f(m - vmax);
      m = vmax;
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) s += exp2f(v.v[j] * kLog2e - m);
  }
  block_merge(m, s, -INFINITY, 0.0f, lse_merge);
  if (threadIdx.x == 0) result = m == -INFINITY ? -INFINITY : (m + log2f(s)) * kLn2;
  __syncthreads();
  return result;
}

// dlogits = (exp(x - lse) - onehot(label)) * g over one row (d may be x: each element is read
// before it is written, by the same thread).
template <typename T, int VEC>
__device__ __forceinline__ void row_backward(T* d, const T* x, int64_t cols, float lse, float g, int64_t label) {
  const float row_lse = lse * kLog2e;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * VEC; c < cols; c += static_cast<int64_t>(blockDim.x) * VEC) {
    Floats<VEC> v = load_vec<VEC>(x + c);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float p = exp2f(v.v[j] * kLog2e - row_lse);
      v.v[j] = (p - (c + j == label ? 1.0f : 0.0f)) * g;
    }
    store_vec<VEC>(d + c, v);
  }
}

template <typename T, int VEC>
__global__ void cross_entropy_forward_kernel(float* lse, float* target, const T* logits, const void* labels,
                                             bool labels64, int64_t cols, int64_t vocab_start) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * cols;
  const float row_lse = block_row_lse<T, VEC>(x, cols);
  if (threadIdx.x == 0) {
    lse[row] = row_lse;
    const int64_t label = load_label(labels, labels64, row) - vocab_start;
    target[row] = (label >= 0 && label < cols) ? to_float(x[label]) : 0.0f;
  }
}

template <typename T, int VEC>
__global__ void cross_entropy_backward_kernel(T* dlogits, const T* logits, const void* labels, bool labels64,
                                              const float* lse, const float* dloss, int64_t cols, int64_t vocab_start) {
  const int64_t row = blockIdx.x;
  const int64_t label = load_label(labels, labels64, row) - vocab_start;
  row_backward<T, VEC>(dlogits + row * cols, logits + row * cols, cols, lse[row], dloss[row], label);
}

// Forward then backward of one row: the second pass re-reads the row the first just read (from
// L2 while it is still there). The target logit is read before any thread overwrites it.
template <typename T, int VEC>
__global__ void cross_entropy_forward_backward_kernel(float* lse, float* target, T* logits, const void* labels,
                                                      bool labels64, const float* dloss, int64_t cols) {
  const int64_t row = blockIdx.x;
  T* x = logits + row * cols;
  const int64_t label = load_label(labels, labels64, row);
  const float row_lse = block_row_lse<T, VEC>(x, cols);  // ends with a barrier
  if (threadIdx.x == 0) {
    lse[row] = row_lse;
    target[row] = (label >= 0 && label < cols) ? to_float(x[label]) : 0.0f;
  }
  __syncthreads();  // the target logit is read before the row is overwritten
  row_backward<T, VEC>(x, x, cols, row_lse, dloss[row], label);
}

// The same with the row staged in shared memory, for rows that fit (gpt2's 50304 bf16 logits are
// 98 KiB): one read of the row from global memory. The L2 re-read of the kernel above missed there
// (422 us per 4096-row chunk on an H100, where one read and one write of it take ~250 us). The
// values and the order of every operation are the same, so are the bits.
template <typename T, int VEC>
__global__ void cross_entropy_forward_backward_staged_kernel(float* lse, float* target, T* logits,
                                                             const void* labels, bool labels64, const float* dloss,
                                                             int64_t cols) {
  extern __shared__ int4 staged_row[];
  static_assert(VEC * sizeof(T) == sizeof(int4), "one 16-byte access per vector");
  T* staged = reinterpret_cast<T*>(staged_row);
  const int64_t row = blockIdx.x;
  T* x = logits + row * cols;
  const int4* src = reinterpret_cast<const int4*>(x);
  // Asynchronous copies, all in flight at once (a load-then-store loop waits for each load: the
  // first version of this kernel, 392 us per chunk).
  for (int64_t v = threadIdx.x; v < cols / VEC; v += blockDim.x) __pipeline_memcpy_async(&staged_row[v], &src[v], 16);
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads();
  const int64_t label = load_label(labels, labels64, row);
  const float row_lse = block_row_lse<T, VEC>(staged, cols);  // ends with a barrier
  if (threadIdx.x == 0) {
    lse[row] = row_lse;
    target[row] = (label >= 0 && label < cols) ? to_float(staged[label]) : 0.0f;
  }
  row_backward<T, VEC>(x, staged, cols, row_lse, dloss[row], label);
}

__global__ void logsumexp_combine_kernel(float* out, const float* parts, int64_t parts_count, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float m = -INFINITY;
    for (int64_t r = 0; r < parts_count; ++r) m = fmaxf(m, parts[r * n + i]);
    if (m == -INFINITY) {
      out[i] = -INFINITY;
      continue;
    }
    float s = 0.0f;
    for (int64_t r = 0; r < parts_count; ++r) s += expf(parts[r * n + i] - m);
    out[i] = m + logf(s);
  }
}

__device__ __forceinline__ double load_mask(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::f64: return static_cast<const double*>(p)[i];
    case DType::bf16: return __bfloat162float(static_cast<const bf16*>(p)[i]);
    case DType::f16: return __half2float(static_cast<const f16*>(p)[i]);
    case DType::i32: return static_cast<const int32_t*>(p)[i];
    case DType::i64: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DType::u8: return static_cast<const uint8_t*>(p)[i];
    case DType::fp8_e4m3:
    case DType::fp8_e5m2: break;  // not a loss-mask type (the host side checks the mask's dtype)
  }
  return 0.0;
}

constexpr int kLossBlock = 1024;

__global__ void masked_loss_sum_kernel(float* out, const float* loss, const void* mask, DType mask_type, int64_t n,
                                       bool accumulate) {
  double ls = 0.0, ms = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double w = load_mask(mask, mask_type, i);
    ms += w;
    if (w != 0.0) ls += static_cast<double>(loss[i]) * w;  // masked-out rows never count, even if not finite
  }
  ls = block_sum(ls);
  ms = block_sum(ms);
  if (threadIdx.x == 0) {
    out[0] = static_cast<float>((accumulate ? static_cast<double>(out[0]) : 0.0) + ls);
    out[1] = static_cast<float>((accumulate ? static_cast<double>(out[1]) : 0.0) + ms);
  }
}

constexpr int kRowBlock = 512;

// (a, ia) := the larger of (a, ia) and (b, ib), the lower index on a tie.
__device__ __forceinline__ void argmax_merge(float& a, int64_t& ia, float b, int64_t ib) {
  if (b > a || (b == a && ib < ia)) {
    a = b;
    ia = ib;
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kRowBlock) logits_argmax_kernel(float* max, int32_t* index, const T* logits,
                                                                   int64_t cols, int64_t vocab_start) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * cols;
  float m = -INFINITY;
  int64_t im = INT64_MAX;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * VEC; c < cols; c += static_cast<int64_t>(blockDim.x) * VEC) {
    const Floats<VEC> v = load_vec<VEC>(x + c);
#pragma unroll
    for (int j = 0; j < VEC; ++j) argmax_merge(m, im, v.v[j], c + j);  // (columns ascending per thread)
  }
  block_merge(m, im, -INFINITY, INT64_MAX, argmax_merge);
  if (threadIdx.x == 0) {  // (a row of -inf only: column 0, as torch.max)
    max[row] = m;
    index[row] = static_cast<int32_t>(vocab_start + (im == INT64_MAX ? 0 : im));
  }
}

__global__ void argmax_match_count_kernel(float* out, const float* max_parts, const int32_t* index_parts,
                                          const int32_t* labels, const void* mask, DType mask_type, int64_t parts,
                                          int64_t n, bool accumulate) {
  double correct = 0.0, total = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (load_mask(mask, mask_type, i) == 0.0) continue;
    int64_t best = 0;
    for (int64_t r = 1; r < parts; ++r)
      if (max_parts[r * n + i] > max_parts[best * n + i]) best = r;
    total += 1.0;
    if (index_parts[best * n + i] == labels[i]) correct += 1.0;
  }
  correct = block_sum(correct);
  total = block_sum(total);
  if (threadIdx.x == 0) {
    out[0] = static_cast<float>((accumulate ? static_cast<double>(out[0]) : 0.0) + correct);
    out[1] = static_cast<float>((accumulate ? static_cast<double>(out[1]) : 0.0) + total);
  }
}

// The largest row the staged forward-backward kernel keeps in shared memory: two blocks per SM
// (one would leave half the SM's threads idle while its block reduces), within the per-block
// opt-in limit.
size_t staged_row_limit() {
  static const size_t limit = [] {
    int device = 0, per_sm = 0, per_block = 0;
    MT_CUDA_CHECK(cudaGetDevice(&device));
    MT_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    MT_CUDA_CHECK(cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    // half the SM's shared memory, less the 1 KiB the system reserves per block and block_row_lse's own
    const size_t two_per_sm = static_cast<size_t>(per_sm) / 2 - 1024 - 512;
    return std::min(two_per_sm, static_cast<size_t>(per_block)) / 16 * 16;
  }();
  return limit;
}

// One block per row (a grid dimension of at most 2^31 - 1) and one int32/int64 label per row.
void check_rows_and_labels(const char* what, Tensor labels, int64_t rows) {
  MT_CHECK(rows < (int64_t{1} << 31), "{}: too many rows ({})", what, rows);
  MT_CHECK(labels.numel() == rows && (labels.dtype == DType::i32 || labels.dtype == DType::i64),
           "{}: labels {} must be int32/int64 [{}]", what, labels.shape_string(), rows);
}

}  // namespace

void cross_entropy_forward(const KernelContext& ctx, Tensor lse, Tensor target, Tensor logits, Tensor labels,
                           int64_t vocab_start) {
  const int64_t rows = logits.rows(), cols = logits.cols();
  MT_CHECK(lse.numel() == rows && lse.dtype == DType::f32 && target.numel() == rows && target.dtype == DType::f32,
           "cross_entropy_forward: lse and target must be float32 [{}]", rows);
  check_rows_and_labels("cross_entropy_forward", labels, rows);
  if (rows == 0) return;
  MT_DISPATCH_FLOAT(logits.dtype, T, "cross_entropy_forward", {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = aligned16(logits.data) && cols % kVec == 0;
    auto launch = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(rows), kRowBlock, 0, ctx.stream>>>(lse.ptr<float>(), target.ptr<float>(),
                                                                       logits.ptr<const T>(), labels.data,
                                                                       labels.dtype == DType::i64, cols, vocab_start);
    };
    if (vec) launch(cross_entropy_forward_kernel<T, kVec>);
    else launch(cross_entropy_forward_kernel<T, 1>);
  });
  MT_CUDA_CHECK_LAUNCH();
}

void cross_entropy_backward(const KernelContext& ctx, Tensor dlogits, Tensor logits, Tensor labels, Tensor lse,
                            Tensor dloss, int64_t vocab_start) {
  const int64_t rows = logits.rows(), cols = logits.cols();
  MT_CHECK(dlogits.numel() == logits.numel() && dlogits.dtype == logits.dtype,
           "cross_entropy_backward: dlogits {} vs logits {}", dlogits.shape_string(), logits.shape_string());
  MT_CHECK(lse.numel() == rows && lse.dtype == DType::f32 && dloss.numel() == rows && dloss.dtype == DType::f32,
           "cross_entropy_backward: lse and dloss must be float32 [{}]", rows);
  check_rows_and_labels("cross_entropy_backward", labels, rows);
  if (rows == 0) return;
  MT_DISPATCH_FLOAT(logits.dtype, T, "cross_entropy_backward", {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = aligned16(logits.data) && aligned16(dlogits.data) && cols % kVec == 0;
    auto launch = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(rows), kRowBlock, 0, ctx.stream>>>(
          dlogits.ptr<T>(), logits.ptr<const T>(), labels.data, labels.dtype == DType::i64, lse.ptr<const float>(),
          dloss.ptr<const float>(), cols, vocab_start);
    };
    if (vec) launch(cross_entropy_backward_kernel<T, kVec>);
    else launch(cross_entropy_backward_kernel<T, 1>);
  });
  MT_CUDA_CHECK_LAUNCH();
}

void cross_entropy_forward_backward(const KernelContext& ctx, Tensor lse, Tensor target, Tensor logits, Tensor labels,
                                    Tensor dloss) {
  const int64_t rows = logits.rows(), cols = logits.cols();
  MT_CHECK(lse.numel() == rows && lse.dtype == DType::f32 && target.numel() == rows && target.dtype == DType::f32 &&
               dloss.numel() == rows && dloss.dtype == DType::f32,
           "cross_entropy_forward_backward: lse, target and dloss must be float32 [{}]", rows);
  check_rows_and_labels("cross_entropy_forward_backward", labels, rows);
  if (rows == 0) return;
  MT_DISPATCH_FLOAT(logits.dtype, T, "cross_entropy_forward_backward", {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = aligned16(logits.data) && cols % kVec == 0;
    auto launch = [&](auto kernel, size_t shared_bytes = 0) {
      kernel<<<static_cast<unsigned>(rows), kRowBlock, shared_bytes, ctx.stream>>>(
          lse.ptr<float>(), target.ptr<float>(), logits.ptr<T>(), labels.data, labels.dtype == DType::i64,
          dloss.ptr<const float>(), cols);
    };
    const size_t row_bytes = static_cast<size_t>(cols) * sizeof(T);
    if (vec && row_bytes <= staged_row_limit()) {
      auto kernel = cross_entropy_forward_backward_staged_kernel<T, kVec>;
      // per device and call: a host-side attribute, cheap beside a kernel over a whole chunk
      MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(row_bytes)));
      launch(kernel, row_bytes);
    } else if (vec) {
      launch(cross_entropy_forward_backward_kernel<T, kVec>);
    } else {
      launch(cross_entropy_forward_backward_kernel<T, 1>);
    }
  });
  MT_CUDA_CHECK_LAUNCH();
}

void logsumexp_combine(const KernelContext& ctx, Tensor lse_out, Tensor lse_parts) {
  const int64_t n = lse_out.numel();
  MT_CHECK(lse_out.dtype == DType::f32 && lse_parts.dtype == DType::f32 && (n == 0 || lse_parts.numel() % n == 0),
           "logsumexp_combine: lse_parts {} must be float32 [R, {}]", lse_parts.shape_string(), n);
  if (n == 0) return;
  logsumexp_combine_kernel<<<grid_for(n, 256, ctx.num_sms * 8LL), 256, 0, ctx.stream>>>(
      lse_out.ptr<float>(), lse_parts.ptr<const float>(), lse_parts.numel() / n, n);
  MT_CUDA_CHECK_LAUNCH();
}

void logits_argmax(const KernelContext& ctx, Tensor max, Tensor index, Tensor logits, int64_t vocab_start) {
  const int64_t rows = logits.rows(), cols = logits.cols();
  MT_CHECK(max.numel() == rows && max.dtype == DType::f32 && index.numel() == rows && index.dtype == DType::i32,
           "logits_argmax: max float32 and index int32 [{}]", rows);
  MT_CHECK(rows < (int64_t{1} << 31) && cols > 0 && vocab_start + cols <= INT32_MAX,
           "logits_argmax: {} rows of {} columns from {}", rows, cols, vocab_start);
  if (rows == 0) return;
  MT_DISPATCH_FLOAT(logits.dtype, T, "logits_argmax", {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = aligned16(logits.data) && cols % kVec == 0;
    auto launch = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(rows), kRowBlock, 0, ctx.stream>>>(max.ptr<float>(), index.ptr<int32_t>(),
                                                                       logits.ptr<const T>(), cols, vocab_start);
    };
    if (vec) launch(logits_argmax_kernel<T, kVec>);
    else launch(logits_argmax_kernel<T, 1>);
  });
  MT_CUDA_CHECK_LAUNCH();
}

void argmax_match_count(const KernelContext& ctx, Tensor out, Tensor max_parts, Tensor index_parts, Tensor labels,
                        Tensor mask, bool accumulate) {
  const int64_t n = labels.numel(), parts = max_parts.numel() / std::max<int64_t>(1, n);
  MT_CHECK(out.numel() == 2 && out.dtype == DType::f32, "argmax_match_count: out must be float32 [2]");
  MT_CHECK(labels.dtype == DType::i32 && mask.numel() == n, "argmax_match_count: labels int32 [{}], mask {}", n,
           mask.shape_string());
  MT_CHECK(parts >= 1 && max_parts.dtype == DType::f32 && max_parts.numel() == parts * n &&
               index_parts.dtype == DType::i32 && index_parts.numel() == parts * n,
           "argmax_match_count: max_parts {} (float32) and index_parts {} (int32) must be [R, {}]",
           max_parts.shape_string(), index_parts.shape_string(), n);
  argmax_match_count_kernel<<<1, kLossBlock, 0, ctx.stream>>>(out.ptr<float>(), max_parts.ptr<const float>(),
                                                              index_parts.ptr<const int32_t>(),
                                                              labels.ptr<const int32_t>(), mask.data, mask.dtype, parts,
                                                              n, accumulate);
  MT_CUDA_CHECK_LAUNCH();
}

void masked_loss_sum(const KernelContext& ctx, Tensor out, Tensor loss, Tensor mask, bool accumulate) {
  MT_CHECK(out.numel() == 2 && out.dtype == DType::f32, "masked_loss_sum: out must be float32 [2]");
  MT_CHECK(loss.dtype == DType::f32 && mask.numel() == loss.numel(), "masked_loss_sum: loss {} (float32), mask {}",
           loss.shape_string(), mask.shape_string());
  masked_loss_sum_kernel<<<1, kLossBlock, 0, ctx.stream>>>(out.ptr<float>(), loss.ptr<const float>(), mask.data,
                                                           mask.dtype, loss.numel(), accumulate);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda

// Token (+ learned position) embedding: forward gather and a deterministic backward scatter.
//
// Forward: out[r] = wte[token[r] - vocab_start] (zero outside this vocab shard) + wpe[position[r]].
//
// Backward without float atomics, so dwte is bit-identical from run to run: the (row id, row)
// pairs are radix-sorted by id on the device (stable, so each id's rows stay in row order), runs
// of equal ids are found with a run-length encode, and one block owns each distinct id: its warps
// sum every 4th row of the run in order, the 4 warp sums are added in warp order, and the total
// is added to the gradient row (float32; or bfloat16 under --grad-reduce-in-bf16, the float32 sum
// of the old value and the total rounded once). Rows whose token is outside the shard get a
// sentinel id that sorts last and is skipped. The same routine scatters dwpe by position.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>

#include "cuda/cuda_check.h"
#include "cuda/device_utils.cuh"
#include "cuda/kernels.h"

namespace mt::cuda {
namespace {

__device__ __forceinline__ int64_t load_index(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

template <typename T, int VEC>
__global__ void embedding_forward_kernel(T* out, const void* tokens, bool tokens64, const void* positions,
                                         bool positions64, const T* wte, const T* wpe, int64_t rows, int64_t h,
                                         int64_t vocab_start, int64_t vocab_rows) {
  const int64_t per_row = h / VEC, total = rows * per_row;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = v / per_row, c = (v % per_row) * VEC;
    const int64_t tok = load_index(tokens, tokens64, r) - vocab_start;
    Floats<VEC> x;
    if (tok >= 0 && tok < vocab_rows) {
      x = load_vec<VEC>(wte + tok * h + c);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) x.v[j] = 0.0f;
    }
    if (wpe) {
      const Floats<VEC> p = load_vec<VEC>(wpe + load_index(positions, positions64, r) * h + c);
#pragma unroll
      for (int j = 0; j < VEC; ++j) x.v[j] += p.v[j];
    }
    store_vec<VEC>(out + r * h + c, x);
  }
}

__global__ void prepare_keys_kernel(uint32_t* keys, int32_t* rows_out, const void* ids, bool ids64, int64_t n,
                                    int64_t offset, int64_t num_keys) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t k = load_index(ids, ids64, i) - offset;
    keys[i] = (k >= 0 && k < num_keys) ? static_cast<uint32_t>(k) : static_cast<uint32_t>(num_keys);
    rows_out[i] = static_cast<int32_t>(i);
  }
}

constexpr int kScatterWarps = 4;

template <typename T, int VEC, typename G>
__global__ void scatter_accumulate_kernel(G* dst, const T* dout, int64_t h, const uint32_t* unique,
                                          const int32_t* counts, const int32_t* offsets, const int32_t* sorted_rows,
                                          const int32_t* num_runs, uint32_t sentinel) {
  // Two buffers, alternating per run: warp 0 may still read one run's sums while the others
  // write the next run's, so one barrier per run suffices.
  __shared__ float parts[2][kScatterWarps][kWarp * VEC];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.y) * kWarp + lane) * VEC;
  const int runs = *num_runs;
  int parity = 0;
  for (int run = blockIdx.x; run < runs; run += gridDim.x) {
    const uint32_t key = unique[run];
    if (key == sentinel) continue;  // the same for the whole block
    float (*part)[kWarp * VEC] = parts[parity];
    parity ^= 1;
    const int begin = offsets[run], count = counts[run];
    float s[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) s[j] = 0.0f;
    if (c0 < h) {
      for (int i = warp; i < count; i += kScatterWarps) {
        const int64_t row = sorted_rows[begin + i];
        const Floats<VEC> v = load_vec<VEC>(dout + row * h + c0);
#pragma unroll
        for (int j = 0; j < VEC; ++j) s[j] += v.v[j];
      }
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) part[warp][lane * VEC + j] = s[j];
    __syncthreads();
    if (warp == 0 && c0 < h) {
      G* out = dst + static_cast<int64_t>(key) * h + c0;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        float t = part[0][lane * VEC + j];
#pragma unroll
        for (int w = 1; w < kScatterWarps; ++w) t += part[w][lane * VEC + j];
        grad_add(out + j, t);
      }
    }
  }
}

bool is_index_type(DType t) { return t == DType::i32 || t == DType::i64; }

int bits_for(int64_t max_value) {
  int b = 1;
  while (b < 32 && (int64_t{1} << b) <= max_value) ++b;
  return b;
}

// dst[num_keys, h] (float32 or bfloat16) += rows of dout grouped by ids[r] - offset (ids outside [0, num_keys) skipped).
// `name` is the gradient's name in error messages.
void scatter_rows(const KernelContext& ctx, Tensor dst, Tensor dout, Tensor ids, int64_t offset, const char* what,
                  const char* name) {
  const int64_t n = dout.rows(), h = dout.cols(), num_keys = dst.rows();
  check_grad(dst, dst.numel(), what, name);
  MT_CHECK(dst.cols() == h, "{}: {} {} must have {} columns (dout {})", what, name, dst.shape_string(), h,
           dout.shape_string());
  MT_CHECK(ids.numel() == n && is_index_type(ids.dtype), "{}: ids {} must be int32/int64 [{}]", what,
           ids.shape_string(), n);
  MT_CHECK(n < (int64_t{1} << 31) && num_keys < (int64_t{1} << 31) - 1, "{}: too many rows", what);
  if (n == 0 || h == 0) return;
  Scratch& s = *ctx.scratch;
  uint32_t* keys_in = s.take_array<uint32_t>(n, what);
  uint32_t* keys_out = s.take_array<uint32_t>(n, what);
  int32_t* rows_in = s.take_array<int32_t>(n, what);
  int32_t* rows_out = s.take_array<int32_t>(n, what);
  uint32_t* unique = s.take_array<uint32_t>(n, what);
  int32_t* counts = s.take_array<int32_t>(n, what);
  int32_t* offsets = s.take_array<int32_t>(n, what);
  int32_t* num_runs = s.take_array<int32_t>(1, what);
  const int num_items = static_cast<int>(n);
  const int end_bit = bits_for(num_keys);
  size_t sort_bytes = 0, rle_bytes = 0, scan_bytes = 0;
  MT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, keys_in, keys_out, rows_in, rows_out, num_items,
                                                0, end_bit, ctx.stream));
  MT_CUDA_CHECK(cub::DeviceRunLengthEncode::Encode(nullptr, rle_bytes, keys_out, unique, counts, num_runs, num_items,
                                                   ctx.stream));
  MT_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, counts, offsets, num_items, ctx.stream));
  size_t temp_bytes = std::max({sort_bytes, rle_bytes, scan_bytes});
  void* temp = s.take(temp_bytes, what);

  prepare_keys_kernel<<<grid_for(n, 256, ctx.num_sms * 8LL), 256, 0, ctx.stream>>>(keys_in, rows_in, ids.data,
                                                                                  ids.dtype == DType::i64, n, offset,
                                                                                  num_keys);
  MT_CUDA_CHECK_LAUNCH();
  MT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, sort_bytes, keys_in, keys_out, rows_in, rows_out, num_items, 0,
                                                end_bit, ctx.stream));
  MT_CUDA_CHECK(cub::DeviceRunLengthEncode::Encode(temp, rle_bytes, keys_out, unique, counts, num_runs, num_items,
                                                   ctx.stream));
  MT_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp, scan_bytes, counts, offsets, num_items, ctx.stream));

  MT_DISPATCH_FLOAT(dout.dtype, T, what, {
    MT_DISPATCH_GRAD(dst.dtype, G, what, {
      constexpr int kVec = 16 / sizeof(T);
      const bool vec = aligned16(dout.data) && h % kVec == 0;
      const int per_block = kWarp * (vec ? kVec : 1);
      const dim3 grid(static_cast<unsigned>(std::min<int64_t>(n, ctx.num_sms * 32LL)),
                      static_cast<unsigned>((h + per_block - 1) / per_block));
      if (vec)
        scatter_accumulate_kernel<T, kVec, G><<<grid, kScatterWarps * kWarp, 0, ctx.stream>>>(
            dst.ptr<G>(), dout.ptr<const T>(), h, unique, counts, offsets, rows_out, num_runs,
            static_cast<uint32_t>(num_keys));
      else
        scatter_accumulate_kernel<T, 1, G><<<grid, kScatterWarps * kWarp, 0, ctx.stream>>>(
            dst.ptr<G>(), dout.ptr<const T>(), h, unique, counts, offsets, rows_out, num_runs,
            static_cast<uint32_t>(num_keys));
      MT_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace

void embedding_forward(const KernelContext& ctx, Tensor out, Tensor tokens, Tensor positions, Tensor wte, Tensor wpe,
                       int64_t vocab_start) {
  const int64_t rows = out.rows(), h = out.cols();
  MT_CHECK(wte.cols() == h && wte.dtype == out.dtype, "embedding_forward: wte {} for out {}", wte.shape_string(),
           out.shape_string());
  MT_CHECK(tokens.numel() == rows && is_index_type(tokens.dtype), "embedding_forward: tokens {} must be int32/int64 [{}]",
           tokens.shape_string(), rows);
  if (!wpe.empty()) {
    MT_CHECK(wpe.cols() == h && wpe.dtype == out.dtype, "embedding_forward: wpe {}", wpe.shape_string());
    MT_CHECK(positions.numel() == rows && is_index_type(positions.dtype),
             "embedding_forward: wpe needs positions int32/int64 [{}], got {}", rows, positions.shape_string());
  }
  if (rows == 0 || h == 0) return;
  MT_DISPATCH_FLOAT(out.dtype, T, "embedding_forward", {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = h % kVec == 0 && aligned16(out.data) && aligned16(wte.data) && (wpe.empty() || aligned16(wpe.data));
    const int64_t work = rows * (vec ? h / kVec : h);
    const unsigned grid = grid_for(work, 256, ctx.num_sms * 16LL);
    auto launch = [&](auto kernel) {
      kernel<<<grid, 256, 0, ctx.stream>>>(out.ptr<T>(), tokens.data, tokens.dtype == DType::i64, positions.data,
                                           positions.dtype == DType::i64, wte.ptr<const T>(), wpe.ptr<const T>(), rows,
                                           h, vocab_start, wte.rows());
    };
    if (vec) launch(embedding_forward_kernel<T, kVec>);
    else launch(embedding_forward_kernel<T, 1>);
  });
  MT_CUDA_CHECK_LAUNCH();
}

void embedding_backward(const KernelContext& ctx, Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens,
                        Tensor positions, int64_t vocab_start) {
  if (!dwte.empty()) scatter_rows(ctx, dwte, dout, tokens, vocab_start, "embedding_backward (wte)", "dwte");
  ctx.scratch->reset();  // the wte scatter's kernels precede the wpe scatter's on the stream
  if (!dwpe.empty()) scatter_rows(ctx, dwpe, dout, positions, 0, "embedding_backward (wpe)", "dwpe");
}

}  // namespace mt::cuda

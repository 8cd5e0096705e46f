#include "cuda/attention_kv_heads.h"

#include "cuda/cuda_check.h"
#include "cuda/device_utils.cuh"

namespace mt::cuda::kv_heads {
namespace {

constexpr int kBlock = 256;

// One 16-byte chunk (8 elements) of one (row, KV group) per thread. `t` indexes rows * groups *
// (d / 8) chunks; returns the chunk's element offsets in the packed row's k slot and in the
// per-head buffers' first query head of the group.
struct Chunk {
  int64_t packed_k, heads_first;
};
__device__ __forceinline__ Chunk chunk_at(int64_t t, int groups, int hpg, int d) {
  const int per_group = d / 8;
  const int64_t row = t / (static_cast<int64_t>(groups) * per_group);
  const int rest = static_cast<int>(t % (static_cast<int64_t>(groups) * per_group));
  const int g = rest / per_group, e = rest % per_group * 8;
  const int64_t packed_row = static_cast<int64_t>(groups) * (hpg + 2) * d, heads_row = static_cast<int64_t>(groups) * hpg * d;
  return {row * packed_row + (static_cast<int64_t>(g) * (hpg + 2) + hpg) * d + e,
          row * heads_row + static_cast<int64_t>(g) * hpg * d + e};
}

template <typename T>
__global__ void sum_kernel(T* dqkv, const T* dk_heads, const T* dv_heads, int64_t chunks, int groups, int hpg, int d) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < chunks;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Chunk c = chunk_at(t, groups, hpg, d);
    Floats<8> dk = load_vec<8>(dk_heads + c.heads_first), dv = load_vec<8>(dv_heads + c.heads_first);
    for (int j = 1; j < hpg; ++j) {
      const Floats<8> k = load_vec<8>(dk_heads + c.heads_first + static_cast<int64_t>(j) * d);
      const Floats<8> v = load_vec<8>(dv_heads + c.heads_first + static_cast<int64_t>(j) * d);
#pragma unroll
      for (int i = 0; i < 8; ++i) dk.v[i] += k.v[i], dv.v[i] += v.v[i];
    }
    store_vec<8>(dqkv + c.packed_k, dk);
    store_vec<8>(dqkv + c.packed_k + d, dv);
  }
}

int64_t chunks_of(const AttentionShape& a) {
  MT_CHECK(a.head_dim % 8 == 0 && a.groups > 0 && a.heads % a.groups == 0,
           "per-head KV buffers need a head dim that is a multiple of 8 (got {}) and whole groups", a.head_dim);
  return static_cast<int64_t>(a.batch) * a.seq * a.groups * (a.head_dim / 8);
}

void check_16bit(DType dtype) {
  MT_CHECK(dtype == DType::bf16 || dtype == DType::f16, "per-head KV buffers take bf16 or fp16, not {}", dtype_name(dtype));
}

}  // namespace

size_t buffer_bytes(const AttentionShape& a, DType dtype) {
  return static_cast<size_t>(a.batch) * a.seq * a.heads * a.head_dim * dtype_size(dtype);
}

void sum_grads(void* dqkv, const void* dk_heads, const void* dv_heads, const AttentionShape& a, DType dtype,
               cudaStream_t stream) {
  check_16bit(dtype);
  MT_CHECK(aligned16(dqkv) && aligned16(dk_heads) && aligned16(dv_heads), "per-head KV buffers need 16-byte alignment");
  const int64_t chunks = chunks_of(a);
  const int hpg = a.heads / a.groups;
  if (dtype == DType::bf16)
    sum_kernel<<<grid_for(chunks, kBlock), kBlock, 0, stream>>>(static_cast<bf16*>(dqkv),
                                                                static_cast<const bf16*>(dk_heads),
                                                                static_cast<const bf16*>(dv_heads), chunks, a.groups,
                                                                hpg, a.head_dim);
  else
    sum_kernel<<<grid_for(chunks, kBlock), kBlock, 0, stream>>>(static_cast<f16*>(dqkv),
                                                                static_cast<const f16*>(dk_heads),
                                                                static_cast<const f16*>(dv_heads), chunks, a.groups,
                                                                hpg, a.head_dim);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda::kv_heads

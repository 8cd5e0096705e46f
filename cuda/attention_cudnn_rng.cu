// Dropout's Philox state for cuDNN's fused attention (attention_cudnn.cpp): the seed and offset
// that its RNG operation reads from device memory, written on the stream by one thread, so that a
// call never waits on the host and a captured stream replays it.
#include <cstdint>

#include "cuda/attention_cudnn.h"
#include "cuda/cuda_check.h"

namespace mt::cuda::cudnn_attention {
namespace {

__global__ void write_state_kernel(int64_t* seed, int64_t* offset, int64_t seed_value) {
  *seed = seed_value;
  *offset = 0;
}

}  // namespace

void write_philox_state(void* seed, void* offset, uint64_t key, cudaStream_t stream) {
  write_state_kernel<<<1, 1, 0, stream>>>(static_cast<int64_t*>(seed), static_cast<int64_t*>(offset),
                                          static_cast<int64_t>(key));
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mt::cuda::cudnn_attention

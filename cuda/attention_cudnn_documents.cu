// Packed documents as cuDNN's ragged batch (attention_cudnn.cpp): each document of each sample (times
// the KV groups that GQA folds into the batch) becomes one batch entry, with its length and the
// element offsets of its first row in the three layouts the graphs bind. Built on the stream from
// the documents' starts, so that a call never waits on the host.
#include <cstdint>

#include "cuda/attention_cudnn.h"
#include "cuda/cuda_check.h"

namespace mt::cuda::cudnn_attention {
namespace {

constexpr int kThreads = 1024;

// One block. Pass 1 numbers the documents in order (sample-major) by a block-wide scan over the
// positions where a document starts, keeping each one's first position; pass 2 writes every
// entry; pass 3 empties the entries past the last document, up to the graph's batch.
__global__ void __launch_bounds__(kThreads) document_index_kernel(const int32_t* __restrict__ doc_start,
                                                                  DocumentIndexArgs p) {
  __shared__ int warp_sums[kThreads / 32];
  __shared__ int base;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t n = static_cast<int64_t>(p.batch) * p.seq;
  if (tid == 0) base = 0;
  __syncthreads();
  for (int64_t c = 0; c < n; c += kThreads) {
    const int64_t f = c + tid;
    const bool start = f < n && doc_start[f] == static_cast<int32_t>(f % p.seq);
    const unsigned ballot = __ballot_sync(0xffffffffu, start);
    if (lane == 0) warp_sums[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < kThreads / 32; ++w) {
      before += w < warp ? warp_sums[w] : 0;
      total += warp_sums[w];
    }
    const int index = base + before + __popc(ballot & ((1u << lane) - 1u));
    if (start && index < p.max_docs) p.first[index] = static_cast<int32_t>(f);
    __syncthreads();
    if (tid == 0) base += total;
    __syncthreads();
  }
  const int docs = min(base, p.max_docs);
  for (int j = tid; j < docs; j += kThreads) {
    const int64_t f = p.first[j], i = f / p.seq, t0 = f % p.seq;
    const int64_t next = j + 1 < docs ? static_cast<int64_t>(p.first[j + 1]) : n;
    const int64_t end = min(next, (i + 1) * p.seq);
    for (int g = 0; g < p.fold; ++g) {
      const int64_t e = static_cast<int64_t>(j) * p.fold + g;
      p.seq_len[e] = static_cast<int32_t>(end - f);
      p.off_qkv[e] = (t0 * p.batch + i) * p.qkv_row + g * p.qkv_group;
      p.off_out[e] = (t0 * p.batch + i) * p.heads * p.head_dim + g * p.heads_per_entry * p.head_dim;
      p.off_stats[e] = (i * p.heads + g * p.heads_per_entry) * p.seq + t0;
    }
  }
  for (int64_t e = static_cast<int64_t>(docs) * p.fold + tid; e <= p.entries; e += kThreads) {
    if (e < p.entries) p.seq_len[e] = 0;
    p.off_qkv[e] = 0;
    p.off_out[e] = 0;
    p.off_stats[e] = 0;
  }
}

}  // namespace

void document_index(const int32_t* doc_start, const DocumentIndexArgs& args, cudaStream_t stream) {
  document_index_kernel<<<1, kThreads, 0, stream>>>(doc_start, args);
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mt::cuda::cudnn_attention

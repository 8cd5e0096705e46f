// Attention mask bounds shared by megatrain's attention kernels (the tensor-core flash kernels
// and the generic CUDA-core ones): where a tile of queries starts seeing keys, and where the
// queries that see a key end. Sliding windows and packed documents only grow along a sequence
// (a later query's window and document start no earlier), so a tile's first query bounds it.
#pragma once

#include <cstdint>

namespace mt::cuda {

// The first key query q0 may see: 0, where its sliding window starts (window >= 0: keys q0 -
// window ... q0), or its document's start (doc: AttentionShape::doc_start of one sample, null
// without documents), whichever is last. Without causal masking (a context-parallel block of
// earlier keys) a document start may lie past the last key: the query then sees none.
__device__ __forceinline__ int first_visible_key(const int32_t* doc, int window, int q0) {
  int k = window >= 0 ? max(0, q0 - window) : 0;
  if (doc) k = max(k, doc[q0]);
  return k;
}

// The first query in [from, end) whose document starts after key k (end if none): the queries
// that see key k end there. doc is non-decreasing along the sample; from must not pass a query
// that sees k (causal: k itself; otherwise 0).
__device__ __forceinline__ int first_query_past(const int32_t* doc, int from, int end, int k) {
  int lo = from, hi = end;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (doc[mid] > k) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

}  // namespace mt::cuda

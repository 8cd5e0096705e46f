// Attention dropout: one rule, shared by the reference backend and the CUDA kernels, so that both
// drop exactly the same probabilities and the backward pass can redraw the mask instead of storing it.
//
// Element (i, h, q, k) -- sample i, query head h, query position q, key position k -- draws
//   u = uniform_at(dropout_key, ((i * heads + h) * seq + q) * seq + k)      (u in (0, 1])
// and is KEPT iff u > p (so P(keep) = 1 - p up to the 2^-24 resolution of u). Kept probabilities are
// scaled by 1 / (1 - p); dropped ones are 0. Dropout acts on the softmax probabilities after
// normalization; the saved log-sum-exp is that of the undropped scores.
#pragma once

#include <cstdint>

#include "core/philox.h"

namespace mt {

MT_HOST_DEVICE uint64_t attention_dropout_index(int64_t sample, int64_t head, int64_t heads, int64_t seq,
                                                int64_t query, int64_t key) {
  return static_cast<uint64_t>(((sample * heads + head) * seq + query) * seq + key);
}

MT_HOST_DEVICE bool attention_dropout_keep(uint64_t dropout_key, uint64_t index, float p) {
  return uniform_at(dropout_key, index) > p;
}

}  // namespace mt

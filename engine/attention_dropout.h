// Attention dropout: one rule, shared by the reference backend and the CUDA kernels, so that both
// drop exactly the same probabilities and the backward pass can redraw the mask instead of storing it.
//
// Each Philox draw (four 32-bit words) decides eight elements, 16 bits each. For sample i, query
// head h (bh = i * heads + h), query position q and key position k of a sequence of `seq`
// positions, split each position into its 16-block and its place in the block:
//   draw    = ((bh * n16 + q / 16) * n16 + k / 16) * 32 + ((q % 8) / 2) * 8 + k % 8,  n16 = ceil(seq / 16)
//   slot    = ((k % 16) / 8 * 2 + (q % 16) / 8) * 2 + q % 2                           (0..7)
//   u       = 16-bit half (slot % 2) of word (slot / 2) of philox4x32(draw, kAttentionDropoutStream, key)
// and the element is KEPT iff u >= threshold = round(p * 65536) (engine/dropout_mask.h's
// dropout_threshold), so P(drop) = threshold / 65536 (p to within 2^-17). Kept probabilities are
// scaled by 1 / (1 - p); dropped ones are 0. Dropout acts on the softmax probabilities after
// normalization; the saved log-sum-exp is that of the undropped scores.
//
// Why this layout: a draw's eight elements are two queries apart by one (q % 2) and 8 (q % 16 / 8)
// against two keys 8 apart (k % 16 / 8), which is what one thread holds of an mma.sync m16n8
// fragment of S^T = K Q^T in the flash backward (keys as rows): it draws once for eight elements.
// The forward's S = Q K^T fragments hold half of a draw per thread, and the thread four lanes over
// holds the other half: each draws one of the pair's two draws and they trade halves
// (cuda/attention_flash_forward.cu). One draw per element cost the flash kernels 3-6x their
// dropout-free time (bench/RESULTS.md).
#pragma once

#include <cstdint>

#include "core/philox.h"
#include "engine/dropout_mask.h"

namespace mt {

inline constexpr uint64_t kAttentionDropoutStream = 0x617474'6e64726f70ULL;  // "attndrop"

// The draw holding element (bh, q, k) of a sequence of `seq` positions.
MT_HOST_DEVICE uint64_t attention_dropout_draw(int64_t bh, int64_t seq, int64_t q, int64_t k) {
  const uint64_t n16 = static_cast<uint64_t>((seq + 15) / 16);
  const uint64_t tile = (static_cast<uint64_t>(bh) * n16 + static_cast<uint64_t>(q / 16)) * n16 + static_cast<uint64_t>(k / 16);
  return tile * 32 + static_cast<uint64_t>(((q % 8) / 2) * 8 + k % 8);
}

// The element's 16-bit slot (0..7) in its draw.
MT_HOST_DEVICE int attention_dropout_slot(int64_t q, int64_t k) {
  return static_cast<int>((((k % 16) / 8) * 2 + (q % 16) / 8) * 2 + q % 2);
}

MT_HOST_DEVICE Philox4 attention_dropout_words(uint64_t dropout_key, uint64_t draw) {
  return philox4x32(draw, kAttentionDropoutStream, dropout_key);
}

// One element on its own (one draw: the reference backend and the generic CUDA kernels).
MT_HOST_DEVICE bool attention_dropout_keep(uint64_t dropout_key, int64_t bh, int64_t seq, int64_t q, int64_t k,
                                           uint32_t threshold) {
  const Philox4 r = attention_dropout_words(dropout_key, attention_dropout_draw(bh, seq, q, k));
  return dropout_bits(r, attention_dropout_slot(q, k)) >= threshold;
}

}  // namespace mt

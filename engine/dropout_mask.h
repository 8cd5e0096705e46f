// Random draws shared by the reference and CUDA backends (host and device): dropout decisions and
// the MoE router's input jitter factors.
//
// Dropout of the elementwise ops (the flat index of the dropped tensor, engine/backend.h): one
// Philox draw decides eight consecutive elements, 16 bits each. Element `index` of a site with key
// `key` reads the 16-bit half (index % 8) % 2 of word (index % 8) / 2 of
// philox4x32(index / 8, kDropoutStream, key) and is kept iff those bits are at least
// round(p * 65536) (dropout_threshold), so P(drop) is p to within 2^-17; a kept element is scaled
// by 1 / (1 - p). The CUDA kernels handle eight elements (16 bytes of 16-bit values) per step and
// draw once for them. Attention's own layout is engine/attention_dropout.h. Nothing is stored:
// backward passes redraw the same mask from the same key.
#pragma once

#include <cstdint>

#include "core/philox.h"

namespace mt {

inline constexpr uint64_t kDropoutStream = 0x64726f70'6f757438ULL;  // "dropout8"

// round(p * 65536) (p * 65536 is exact in float32, so host and device agree); p in [0, 1).
MT_HOST_DEVICE uint32_t dropout_threshold(float p) { return static_cast<uint32_t>(p * 65536.0f + 0.5f); }

// The draw of elements [8 g, 8 g + 8), and element `index`'s 16 bits of it.
MT_HOST_DEVICE Philox4 dropout_words(uint64_t key, uint64_t group) { return philox4x32(group, kDropoutStream, key); }
MT_HOST_DEVICE uint32_t dropout_bits(const Philox4& r, uint64_t index) {
  const int slot = static_cast<int>(index % 8);
  return (r.v[slot / 2] >> (16 * (slot % 2))) & 0xffffu;
}

MT_HOST_DEVICE bool dropout_keep(uint64_t key, uint64_t index, float p) {
  return dropout_bits(dropout_words(key, index / 8), index) >= dropout_threshold(p);
}

// Backend::moe_jitter's factor of element `index`: (1 - eps) + (2 eps) u, rounded step by step in
// float32 (no fused multiply-add on the device), so both backends draw the same factors.
MT_HOST_DEVICE float moe_jitter_factor(uint64_t key, uint64_t index, float eps) {
  const float u = uniform_at(key, index);
#if defined(__CUDA_ARCH__)
  return __fadd_rn(1.0f - eps, __fmul_rn(2.0f * eps, u));
#else
  return (1.0f - eps) + (2.0f * eps) * u;
#endif
}

}  // namespace mt

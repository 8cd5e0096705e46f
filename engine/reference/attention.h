// Reference attention: plain loops on host memory, the oracle for the CUDA kernels and the CPU
// path of the reference backend. Semantics are exactly those of Backend::attention_forward and
// Backend::attention_backward (engine/backend.h):
// - qkv [N = s*b, groups * (heads/groups + 2) * d], rows sequence-major (row r = t*b + i); per row,
//   for each KV group g: [q of heads g*hpg .. g*hpg+hpg-1][k][v]   (hpg = heads/groups).
// - out [N, heads*d]: head h at columns [h*d, (h+1)*d).
// - lse [b, heads, s]: natural log-sum-exp of each row of scaled (and masked) scores, before dropout.
// - causal: query q sees keys 0..q; otherwise all s keys.
// - dropout on the normalized probabilities, mask rule in engine/attention_dropout.h.
// - backward overwrites dqkv (every q, k and v slot); dk, dv of a group sum over the group's heads.
//
// T is the element type of qkv/out/dout/dqkv (float or double, checked against the tensors' dtype);
// lse may be float32 or float64 in either case. Sums are accumulated in double.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "engine/backend.h"

namespace mt {

template <typename T>
void reference_attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a);

template <typename T>
void reference_attention_backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv,
                                  const AttentionShape& a);

// The same with an explicit dropout mask in place of engine/attention_dropout.h's draws: keep is
// [b, heads, s, s] (sample, query head, query, key), non-zero = kept (scaled by 1/(1-p)); a.dropout_p
// must be > 0 for it to act. The oracle for an implementation that draws its own mask (cuDNN's
// fused attention), given the mask it drew.
template <typename T>
void reference_attention_forward_masked(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a,
                                        const std::vector<uint8_t>& keep);
template <typename T>
void reference_attention_backward_masked(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv,
                                         const AttentionShape& a, const std::vector<uint8_t>& keep);

// Attention blocks (context parallelism): Backend::attention_block_forward, attention_block_backward,
// attention_merge, attention_kv_pack and attention_kv_unpack_add (engine/backend.h), in the layouts
// above; a block's kv is [b * kv_len, groups * 2 * d] (per row and group: k, then v). The mask
// and the dropout draws use global positions (blk.q_begin + t, blk.k_begin + u) in a sequence of
// blk.seq_total. Block backward ACCUMULATES into dq (its query slots only) and dkv.
// attention_merge takes its shape from lse, which must be 3-D [b, heads, s]; out is [b * s, heads * d].
template <typename T>
void reference_attention_block_forward(Tensor out, Tensor lse, Tensor q, Tensor kv, const AttentionShape& a,
                                       const AttentionBlock& blk);

template <typename T>
void reference_attention_block_backward(Tensor dq, Tensor dkv, Tensor dout, Tensor out, Tensor lse, Tensor q,
                                        Tensor kv, const AttentionShape& a, const AttentionBlock& blk);

template <typename T>
void reference_attention_merge(Tensor out, Tensor lse, Tensor out_blk, Tensor lse_blk);

// Backend::attention_sink_forward / attention_sink_backward (engine/backend.h): out, dout of type T
// [s * b, heads * d], lse [b, heads, s] (float32 or float64), sink and dsink [heads] of any float type.
template <typename T>
void reference_attention_sink_forward(Tensor out, Tensor lse, Tensor sink);
template <typename T>
void reference_attention_sink_backward(Tensor dsink, Tensor dout, Tensor out, Tensor lse, Tensor sink);

template <typename T>
void reference_attention_kv_pack(Tensor kv, Tensor qkv, const AttentionShape& a);

template <typename T>
void reference_attention_kv_unpack_add(Tensor dqkv, Tensor dkv, const AttentionShape& a);

// Fails unless the shape is valid: positive sizes, heads a multiple of groups, dropout in [0, 1),
// a window only with causal masking.
void check_attention_shape(const AttentionShape& a);

// Checks that the tensors match the shape (sizes, dtypes, host memory); fails with a message naming
// the offending tensor. Called by the forward and backward functions above.
void check_attention_tensors(const AttentionShape& a, Tensor qkv, Tensor out, Tensor lse, DType element);

// The argument checks of Backend::reserve_attention_blocks: a valid shape, at least one key per block.
void check_attention_blocks(const AttentionShape& a, int max_kv_len);

}  // namespace mt

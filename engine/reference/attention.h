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

#include "core/tensor.h"
#include "engine/backend.h"

namespace mt {

template <typename T>
void reference_attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a);

template <typename T>
void reference_attention_backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv,
                                  const AttentionShape& a);

// Checks that the tensors match the shape (sizes, dtypes, host memory); fails with a message naming
// the offending tensor. Called by both functions above.
void check_attention_tensors(const AttentionShape& a, Tensor qkv, Tensor out, Tensor lse, DType element);

}  // namespace mt

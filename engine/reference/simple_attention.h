// Plain causal GQA attention on packed QKV rows (engine/backend.h's layout), materializing each
// query's score row. A stand-in for the attention helper's reference attention
// (engine/reference/attention.{h,cpp}); the backend switches to theirs when it lands.
#pragma once

#include "engine/backend.h"
#include "engine/reference/reference_backend.h"

namespace mt::reference {

// out [b*s, heads*d] (sequence-major rows); lse [b, heads, s] (float32 or float64).
void simple_attention_forward(ReferenceBackend& be, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a);
// dqkv [b*s, row] is overwritten (q, k and v parts).
void simple_attention_backward(ReferenceBackend& be, Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv,
                               const AttentionShape& a);

}  // namespace mt::reference

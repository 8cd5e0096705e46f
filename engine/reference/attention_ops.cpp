// ReferenceBackend: attention entry points (the loops live in engine/reference/attention.cpp).
#include "engine/reference/attention.h"
#include "engine/reference/reference_backend.h"
#include "engine/reference/tensor_access.h"

namespace mt::reference {

void ReferenceBackend::attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a) {
  dispatch_float(qkv, "attention_forward",
                 [&](auto tag) { reference_attention_forward<decltype(tag)>(out, lse, qkv, a); });
}

void ReferenceBackend::attention_backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv,
                                          const AttentionShape& a) {
  dispatch_float(qkv, "attention_backward",
                 [&](auto tag) { reference_attention_backward<decltype(tag)>(dqkv, dout, out, lse, qkv, a); });
}

}  // namespace mt::reference

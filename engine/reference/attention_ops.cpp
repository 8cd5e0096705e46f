// ReferenceBackend: attention entry points.
#include "engine/reference/reference_backend.h"
#include "engine/reference/simple_attention.h"

namespace mt::reference {

void ReferenceBackend::attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a) {
  simple_attention_forward(*this, out, lse, qkv, a);
}

void ReferenceBackend::attention_backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv,
                                          const AttentionShape& a) {
  simple_attention_backward(*this, dqkv, dout, out, lse, qkv, a);
}

}  // namespace mt::reference

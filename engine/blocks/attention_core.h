// The attention core of a decoder layer: softmax(Q K^T / sqrt(d)) V over the layer's QKV (causal,
// grouped-query, optional sliding window and dropout: AttentionShape), keeping the log-sum-exp of
// each row for backward. The attention block (engine/blocks/attention.cpp) runs it between its
// QKV projection (with q/k norm and RoPE) and its output projection.
//
// Today's core is local: this rank's heads over the whole sequence, through the backend's fused
// attention. Cores that split the sequence (context parallelism) or change the head layout
// (multi-latent attention) implement the same interface.
#pragma once

#include <memory>

#include "core/tensor.h"
#include "engine/backend.h"

namespace mt {

class AttentionCore {
 public:
  virtual ~AttentionCore() = default;
  // Set-up: sizes what the core needs for this shape (workspaces), before any step.
  virtual void reserve(const AttentionShape& a, AttentionBackend backend, DType dtype) = 0;
  // out [N, heads * d] and lse [b, heads, s] from qkv [N, (heads + 2 * groups) * d].
  virtual void forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a) = 0;
  // dqkv from dout, with the forward's out, lse and qkv.
  virtual void backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a) = 0;
};

// This rank's heads over the whole sequence, by the backend's attention ops.
std::unique_ptr<AttentionCore> make_local_attention(Backend& backend);

}  // namespace mt

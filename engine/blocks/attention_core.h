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
#include "core/config.h"
#include "engine/backend.h"
#include "parallel/communicator.h"

namespace mt {

// Attention sinks (--softmax-type; Backend::attention_sink_forward): `enabled` adds each query
// head's sink logit to its rows' softmax: `logits` [heads on this TP rank], or empty for 0
// (off-by-one); `grad` (learnable) accumulates their gradient.
struct AttentionSinks {
  bool enabled = false;
  Tensor logits, grad;
};

class AttentionCore {
 public:
  virtual ~AttentionCore() = default;
  // Set-up: sizes what the core needs for this shape (workspaces), before any step.
  virtual void reserve(const AttentionShape& a, AttentionBackend backend, DType dtype) = 0;
  // out [N, heads * d] and lse [b, heads, s] from qkv [N, (heads + 2 * groups) * d], with the sinks.
  virtual void forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a, const AttentionSinks& sinks) = 0;
  // dqkv (and the sinks' gradient) from dout, with the forward's out, lse and qkv.
  virtual void backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a,
                        const AttentionSinks& sinks) = 0;
};

// This rank's heads over the whole sequence, by the backend's attention ops.
std::unique_ptr<AttentionCore> make_local_attention(Backend& backend);

// Context parallelism's buffers (GptModel::layout places them in the workspace, so that the step
// allocates nothing). R = b * s rows of this rank (s = its part of the sequence), kv rows of
// Backend::attention_kv_pack's layout.
struct CpBuffers {
  Tensor kv[2], dkv[2];     // [R, kv]: the ring's current and next key/value block and gradients
  Tensor kv_all, dkv_all;   // allgather: [CP * R, kv], rank-major
  Tensor out_blk, lse_blk;  // one block's output [R / 2, heads * d] and log-sum-exp [b, heads, s / 2]
  // a2a (A ranks): QKV, the output, its gradient and the QKV gradient in the heads' layout [A R,
  // width / A], and the all-to-all's staging (R x the widest of them).
  Tensor x, x_out, x_dout, x_dqkv, stage;
};

// Context parallelism (--context-parallel-size CP > 1; engine/blocks/attention_cp.cpp): this
// rank's two chunks of every sequence (ModelDims::global_position) attend to the whole sequence's
// keys and values, block by block (Backend::attention_block_forward), the blocks' outputs merged by
// their log-sum-exp. `type` says how the keys and values travel over the CP group: p2p (a ring:
// each step's block is sent on to the next rank while the next arrives) or allgather (all of them
// gathered first; their gradients reduce-scattered back), a2a (an all-to-all over the heads) or
// a2a+p2p (an all-to-all inside groups of a2a_size consecutive CP ranks, a ring across them). The
// lse it keeps is laid out per chunk ([2 A][b, heads / A, s / 2]); only the core reads it.
std::unique_ptr<AttentionCore> make_context_parallel_attention(Backend& backend, Communicator& cp, int cp_rank,
                                                               CpCommType type, int a2a_size,
                                                               const CpBuffers& buffers);

}  // namespace mt

// The attention block of a decoder layer, forward and backward: ln1 -> QKV (column-parallel) ->
// [q/k norm] -> [RoPE] -> the attention core -> output projection (row-parallel) -> bias + dropout
// + residual, whose pass also writes the MLP block's norm (ln2).
#include "engine/gpt_model.h"

#include "core/error.h"
#include "engine/gpt_model_parts.h"
#include "parallel/parallel_state.h"
#include "engine/blocks/attention_core.h"

namespace mt {

namespace {

class LocalAttention final : public AttentionCore {
 public:
  explicit LocalAttention(Backend& be) : be_(be) {}
  void reserve(const AttentionShape& a, AttentionBackend backend, DType dtype) override {
    be_.reserve_attention(a, backend, dtype);
  }
  void forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a, const AttentionSinks& sinks) override {
    be_.attention_forward(out, lse, qkv, a);
    if (sinks.enabled) be_.attention_sink_forward(out, lse, sinks.logits);
  }
  // With sinks, out and lse are the sinks' (attention_sink_forward): the attention's backward from
  // them is the sinks' attention's; the sink logits' own gradient comes first.
  void backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a,
                const AttentionSinks& sinks) override {
    if (sinks.enabled && !sinks.grad.empty()) be_.attention_sink_backward(sinks.grad, dout, out, lse, sinks.logits);
    be_.attention_backward(dqkv, dout, out, lse, qkv, a);
  }

 private:
  Backend& be_;
};

}  // namespace

std::unique_ptr<AttentionCore> make_local_attention(Backend& backend) {
  return std::make_unique<LocalAttention>(backend);
}

// What the attention block keeps for backward. Sequence parallelism: the norm output is gathered to
// all N rows (the QKV GEMM's input); the residual h1 and the norm statistics hold this rank's Nl rows.
void GptModel::layout_attention_acts(Arena& a, MemoryCategory c, LayerActs& A, bool softmax, bool gdn) {
  const int64_t N = d_.tokens(), Nl = d_.tokens_local(), h = d_.hidden;
  const DType T = opt_.compute, S = opt_.accum;
  A.ln1_out = A.norm_kept ? take_act(a, c, OffloadField::ln1_out, T, {N, h}) : ws_->tmp_h;
  A.ln1_mean = a.take(c, S, {Nl});
  A.ln1_rstd = a.take(c, S, {Nl});
  if (gdn) layout_gdn_acts(a, c, A);
  if (!softmax) {
    A.h1 = take_act(a, c, OffloadField::h1, T, {Nl, h});
    return;
  }
  if (d_.qk_norm) {
    const int64_t heads_normed = d_.groups_local() * (d_.heads / d_.groups + 1);
    A.qkv_raw = a.take(c, T, {N, d_.qkv_width_local()});
    A.qk_mean = a.take(c, S, {N, heads_normed});
    A.qk_rstd = a.take(c, S, {N, heads_normed});
  }
  if (d_.mla) layout_mla_acts(a, c, A);
  A.qkv = opt_.mla_recompute_up ? ws_->mla_qkv : take_act(a, c, OffloadField::qkv, T, {N, d_.qkv_width_local()});
  A.attn_out = take_act(a, c, OffloadField::attn_out, T, {N, d_.attn_width_local()});
  if (d_.output_gate) A.gate = a.take(c, T, {N, d_.attn_width_local()});
  A.lse = take_act(a, c, OffloadField::lse, S, {d_.micro_batch, d_.heads_local(), d_.seq});
  A.h1 = take_act(a, c, OffloadField::h1, T, {Nl, h});
}

// The attention block of layer `local`: x -> h1 = x + dropout(proj(attention(qkv(norm(x)))) + b),
// and the MLP block's norm of h1 in the same pass (ln2).
void GptModel::attention_forward(int local, Slot& s, const LayerActs& A, Tensor x) {
  if (d_.is_gdn(d_.layer_begin + local)) return gdn_forward(local, s, A, x);
  if (d_.mla) return mla_forward(local, s, A, x);
  const LayerParams& P = layer_params_[local];
  const Workspace& w = *ws_;
  const int layer = d_.layer_begin + local;
  const float hp = s.training ? d_.hidden_dropout : 0.0f;

  // Attention block: norm -> QKV (column-parallel) -> [qk norm] -> [rope] -> attention ->
  // projection (row-parallel, all-reduce) -> bias + dropout + residual.
  // With fp8_norm_cast the norms write only their statistics and the QKV / fc1 casts read x.
  const bool norm_cast = fp8_norm_cast(local, A);
  if (!norm_from_previous(local))
    be_.norm_forward(norm_cast ? Tensor() : local_rows(A.ln1_out), A.ln1_mean, A.ln1_rstd, x, P.ln1_w, P.ln1_b, norm_,
                     norm_cast_amax(local, A, Fp8State::qkv));
  if (!norm_cast) gather_rows(A.ln1_out);
  const NormInput ln1{x, A.ln1_mean, A.ln1_rstd, P.ln1_w, P.ln1_b};
  const NormInput* ln1_src = norm_cast ? &ln1 : nullptr;
  RopeShape rs{d_.heads_local(), d_.groups_local(), d_.head_dim, d_.rot_dim, d_.rope_interleaved};
  // The QKV projection (with the output gate: [q | gate | k | v] per group, split at once).
  const Tensor qkv_in = d_.qk_norm ? A.qkv_raw : A.qkv;
  linear_fwd(local, Fp8State::qkv, A, d_.output_gate ? w.qkvg : qkv_in, A.ln1_out, P.qkv_w, P.qkv_b, Activation::none,
             Tensor(), ln1_src);
  if (d_.output_gate) be_.attention_gate_split(qkv_in, A.gate, w.qkvg, gate_shape());
  if (d_.qk_norm)
    be_.qk_norm_forward(A.qkv, A.qk_mean, A.qk_rstd, A.qkv_raw, P.q_ln_w, P.q_ln_b, P.k_ln_w, P.k_ln_b, rs,
                        qk_norm_params());
  if (d_.position == PositionEmbedding::rope && !d_.is_nope(layer)) be_.rope_forward(A.qkv, s.positions, rope_table_, rs);
  attention_core(layer).forward(A.attn_out, A.lse, A.qkv, attention_shape(&s, layer), attention_sinks(local));
  if (d_.output_gate) be_.output_gate_forward(w.gated, A.attn_out, A.gate);
  const Tensor proj_in = d_.output_gate ? w.gated : A.attn_out;
  linear_fwd(local, Fp8State::proj, A, w.tmp_h, proj_in, P.proj_w, Tensor(), Activation::none, Tensor());
  // The attention block's bias + dropout + residual and the MLP block's norm in one op (one pass
  // over the rows on the GPU; the reference runs bias_dropout_add, then norm_forward).
  // (An MoE layer's router reads ln2's output: written whatever the QKV cast does.)
  const bool ln2_cast = norm_cast && !d_.is_moe(layer);
  be_.bias_dropout_add_norm(A.h1, ln2_cast ? Tensor() : local_rows(A.ln2_out), A.ln2_mean, A.ln2_rstd, x,
                            reduce_rows(w.tmp_h), P.proj_b, hp, hidden_key(s, layer, 1), P.ln2_w, P.ln2_b, norm_,
                            ln2_cast ? norm_cast_amax(local, A, Fp8State::fc1) : Tensor());
}

// The attention block's backward: the gradient of h1 (the workspace's gH, left by mlp_backward)
// -> dx, with the QKV, projection, q/k norm and ln1 parameter gradients.
void GptModel::attention_backward(int local, Slot& s, const LayerActs& A, Tensor x, Tensor dx) {
  if (d_.is_gdn(d_.layer_begin + local)) return gdn_backward(local, s, A, x, dx);
  if (d_.mla) return mla_backward(local, s, A, x, dx);
  const LayerParams &P = layer_params_[local], &G = layer_grads_[local];
  const Workspace& w = *ws_;
  const int layer = d_.layer_begin + local;
  const float hp = s.training ? d_.hidden_dropout : 0.0f;
  const bool kept = fp8_kept_inputs(local);
  const Tensor proj_db = proj_bias_grad_from_norm(local) ? Tensor() : G.proj_b;  // (else ln2's backward took it)

  // Attention block. gH is the gradient of h1 = x + dropout(proj + b).
  const Tensor proj_dy_amax = dy_amax_from_dropout(local, Fp8State::proj);
  const Tensor d_proj = expand_grad(w.gH, hp, hidden_key(s, layer, 1), proj_dy_amax);
  linear_quantize_dy(local, Fp8State::proj, d_proj, G.proj_b,
                     dy_amax_from_norm(s, local, Fp8State::proj) || !proj_dy_amax.empty());
  // The output gate's product is the projection's input: recomputed (into gATT's memory, which the
  // projection's input gradient overwrites after the weight gradient has read it).
  if (d_.output_gate) be_.output_gate_forward(w.gated, A.attn_out, A.gate);
  linear_bwd_weight(local, Fp8State::proj, A, G.proj_w, proj_db, d_proj, d_.output_gate ? w.gated : A.attn_out);
  linear_bwd_input(local, Fp8State::proj, w.gATT, d_proj, P.proj_w, Activation::none, Tensor());
  if (d_.output_gate) be_.output_gate_backward(w.gATT, A.gate, w.gATT, A.attn_out, A.gate);  // A.gate: d gate
  attention_core(layer).backward(w.gQKV, w.gATT, A.attn_out, A.lse, A.qkv, attention_shape(&s, layer),
                                 attention_sinks(local));
  RopeShape rs{d_.heads_local(), d_.groups_local(), d_.head_dim, d_.rot_dim, d_.rope_interleaved};
  if (d_.position == PositionEmbedding::rope && !d_.is_nope(layer)) be_.rope_backward(w.gQKV, s.positions, rope_table_, rs);
  if (d_.qk_norm)
    be_.qk_norm_backward(w.gQKV, G.q_ln_w, G.q_ln_b, G.k_ln_w, G.k_ln_b, w.gQKV, A.qkv_raw, A.qk_mean, A.qk_rstd,
                         P.q_ln_w, P.k_ln_w, rs, qk_norm_params());
  // The QKV projection's output gradient (with the output gate: merged back into its layout).
  if (d_.output_gate) be_.attention_gate_merge(w.gQKVG, w.gQKV, A.gate, gate_shape());
  const Tensor d_qkv = d_.output_gate ? w.gQKVG : w.gQKV;
  linear_quantize_dy(local, Fp8State::qkv, d_qkv, G.qkv_b);
  // dx is the previous layer's output gradient: its fc2 bias gradient is dx's column sums.
  const Tensor prev_fc2_db = prev_fc2_bias_grad(local);
  if (d_.sequence_parallel) {
    column_parallel_backward_sp(local, Fp8State::qkv, A, A.ln1_out, A.ln1_mean, A.ln1_rstd, x, P.ln1_w, P.ln1_b, G.ln1_w,
                                G.ln1_b, d_qkv, P.qkv_w, G.qkv_w, G.qkv_b, dx, w.gH);
  } else {
    linear_bwd_input(local, Fp8State::qkv, w.gT, d_qkv, P.qkv_w, Activation::none, Tensor());
    if (kept || A.norm_kept)
      be_.norm_backward(dx, G.ln1_w, G.ln1_b, reduce_rows(w.gT), x, A.ln1_mean, A.ln1_rstd, P.ln1_w, w.gH, prev_fc2_db,
                        norm_, dy_amax_slot(s, local - 1, Fp8State::fc2));
    else
      be_.norm_backward_recompute(local_rows(A.ln1_out), dx, G.ln1_w, G.ln1_b, reduce_rows(w.gT), x, A.ln1_mean,
                                  A.ln1_rstd, P.ln1_w, P.ln1_b, w.gH, prev_fc2_db, norm_);
    linear_bwd_weight(local, Fp8State::qkv, A, G.qkv_w, G.qkv_b, d_qkv, A.ln1_out);
  }
}

}  // namespace mt

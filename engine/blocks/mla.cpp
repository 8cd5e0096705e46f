// Multi-latent attention (--multi-latent-attention; Megatron-Core's MLASelfAttention), the attention
// block of its decoder layers, forward and backward:
//
//   x -> ln1 -> [q_down -> (norm) ->] q_up        = q  [heads x (d_nope | d_rope)]
//            -> kv_down = [c_kv | k_rope]; c_kv -> (norm) -> kv_up = kv [heads x (k_nope | v)]
//   (q, kv, k_rope) -> RoPE, packed per head as [Q | K | V padded to d_qk]  (mla_qkv_forward;
//      recomputed in backward with --recompute-modules mla_up_proj)
//   -> the layer's attention core (d_qk = d_nope + d_rope, groups = heads, Megatron's softmax
//      scale) -> the output's first d_v values per head -> proj (row-parallel) -> bias + dropout
//      + residual, and the MLP block's norm in the same pass.
//
// The padded values make the core the GQA core with groups = heads (context parallelism and the
// CUDA kernels as they are); the padding's output is zero and dropped. Under tensor parallelism the
// up projections split the heads; the down projections and the latent norms run whole on every TP
// rank over all N rows (the norm output gathered under sequence parallelism), so their gradients
// are TP-partial (summed over TP once per step: ParamDesc::tp_partial_grad), and so is the input
// gradient, reduced with the column-parallel ones'.
#include "engine/gpt_model.h"

#include <algorithm>

#include "core/error.h"
#include "engine/gpt_model_parts.h"
#include "parallel/parallel_state.h"

namespace mt {

namespace {
// A [rows, heads * d] matrix as [rows * heads, d]: one head's values per row.
Tensor per_head(Tensor t, int heads) { return t.view({t.rows() * heads, t.cols() / heads}); }
}  // namespace

MlaShape GptModel::mla_shape() const {
  return MlaShape{d_.heads_local(), d_.mla_nope, d_.mla_rope, d_.rot_dim, d_.mla_v, d_.kv_lora};
}

void GptModel::layout_mla_acts(Arena& a, MemoryCategory c, LayerActs& A) {
  const int64_t N = d_.tokens(), h = d_.hidden;
  const DType T = opt_.compute, S = opt_.accum;
  if (d_.q_lora > 0) {
    A.mla_cq_raw = a.take(c, T, {N, d_.q_lora});
    A.mla_cq = d_.mla_latent_norm ? a.take(c, T, {N, d_.q_lora}) : A.mla_cq_raw;
  } else if (d_.mla_latent_norm) {
    A.mla_cq = a.take(c, T, {N, h});  // the second norm of the input (the query projection's fused norm)
  }
  if (d_.mla_latent_norm) {
    A.mla_cq_mean = a.take(c, S, {N});
    A.mla_cq_rstd = a.take(c, S, {N});
  }
  A.mla_ckv = a.take(c, T, {N, d_.mla_down_width()});
  A.mla_ckv_raw = a.take(c, T, {N, d_.kv_lora});  // c_kv alone: the up projection's (or norm's) input
  if (d_.mla_latent_norm) {
    A.mla_ckv_n = a.take(c, T, {N, d_.kv_lora});
    A.mla_ckv_mean = a.take(c, S, {N});
    A.mla_ckv_rstd = a.take(c, S, {N});
  } else {
    A.mla_ckv_n = A.mla_ckv_raw;
  }
}

void GptModel::layout_mla_workspace(Arena& a) {
  Workspace& w = *ws_;
  w.mla_q = w.mla_kv = w.mla_out = w.mla_dckv = w.mla_dlat = w.mla_qkv = Tensor();
  if (!d_.mla || d_.stage_layers() == 0) return;
  const int64_t N = d_.tokens();
  const DType T = opt_.compute;
  w.mla_q = a.take(MemoryCategory::workspace, T, {N, d_.mla_q_width_local()});
  w.mla_kv = a.take(MemoryCategory::workspace, T, {N, d_.mla_kv_width_local()});
  w.mla_out = a.take(MemoryCategory::workspace, T, {N, d_.proj_width_local()});
  w.mla_dckv = a.take(MemoryCategory::workspace, T, {N, d_.mla_down_width()});
  const int64_t q_lat = d_.q_lora > 0 ? d_.q_lora : (d_.mla_latent_norm ? d_.hidden : 0);
  w.mla_dlat = a.take(MemoryCategory::workspace, T, {N * std::max<int64_t>(q_lat, d_.kv_lora)});
  if (opt_.mla_recompute_up) w.mla_qkv = a.take(MemoryCategory::workspace, T, {N, d_.qkv_width_local()});
}

// The queries, keys and values from the kept latents (and the input norm's output), packed with
// RoPE into A.qkv: the forward's, and backward's recompute under --recompute-modules mla_up_proj.
void GptModel::mla_up_projections(int local, const Slot& s, const LayerActs& A, const LayerParams& P) {
  const Workspace& w = *ws_;
  const Tensor q_in = d_.q_lora > 0 || d_.mla_latent_norm ? A.mla_cq : A.ln1_out;
  extra_linear_fwd(local, kMlaQ, w.mla_q, q_in, P.q_w);
  extra_linear_fwd(local, kMlaKvUp, w.mla_kv, A.mla_ckv_n, P.kv_up_w);
  be_.mla_qkv_forward(A.qkv, w.mla_q, w.mla_kv, A.mla_ckv, s.positions, rope_table_, mla_shape());
}

void GptModel::mla_forward(int local, Slot& s, const LayerActs& A, Tensor x) {
  const LayerParams& P = layer_params_[static_cast<size_t>(local)];
  const Workspace& w = *ws_;
  const int layer = d_.layer_begin + local;
  const float hp = s.training ? d_.hidden_dropout : 0.0f;

  if (!norm_from_previous(local))
    be_.norm_forward(local_rows(A.ln1_out), A.ln1_mean, A.ln1_rstd, x, P.ln1_w, P.ln1_b, norm_);
  gather_rows(A.ln1_out);
  // The latents: the queries' (or the normed input), [c_kv | k_rope], c_kv normed.
  if (d_.q_lora > 0) {
    extra_linear_fwd(local, kMlaQDown, A.mla_cq_raw, A.ln1_out, P.q_down_w);
    if (d_.mla_latent_norm)
      be_.norm_forward(A.mla_cq, A.mla_cq_mean, A.mla_cq_rstd, A.mla_cq_raw, P.q_lat_ln_w, P.q_lat_ln_b, norm_);
  } else if (d_.mla_latent_norm) {
    be_.norm_forward(A.mla_cq, A.mla_cq_mean, A.mla_cq_rstd, A.ln1_out, P.q_lat_ln_w, P.q_lat_ln_b, norm_);
  }
  extra_linear_fwd(local, kMlaKvDown, A.mla_ckv, A.ln1_out, P.kv_down_w);
  be_.copy_columns(A.mla_ckv_raw, 0, A.mla_ckv, 0, d_.kv_lora);
  if (d_.mla_latent_norm)
    be_.norm_forward(A.mla_ckv_n, A.mla_ckv_mean, A.mla_ckv_rstd, A.mla_ckv_raw, P.kv_lat_ln_w, P.kv_lat_ln_b, norm_);
  // The up projections, RoPE and the attention core.
  mla_up_projections(local, s, A, P);
  attention_core(layer).forward(A.attn_out, A.lse, A.qkv, attention_shape(&s, layer), attention_sinks(local));
  const int heads = d_.heads_local();
  be_.copy_columns(per_head(w.mla_out, heads), 0, per_head(A.attn_out, heads), 0, d_.mla_v);
  extra_linear_fwd(local, kMlaProj, w.tmp_h, w.mla_out, P.proj_w);
  be_.bias_dropout_add_norm(A.h1, local_rows(A.ln2_out), A.ln2_mean, A.ln2_rstd, x, reduce_rows(w.tmp_h), P.proj_b,
                            hp, hidden_key(s, layer, 1), P.ln2_w, P.ln2_b, norm_);
}

void GptModel::mla_backward(int local, Slot& s, const LayerActs& A, Tensor x, Tensor dx) {
  const LayerParams &P = layer_params_[static_cast<size_t>(local)], &G = layer_grads_[static_cast<size_t>(local)];
  const Workspace& w = *ws_;
  const int layer = d_.layer_begin + local;
  const float hp = s.training ? d_.hidden_dropout : 0.0f;
  const int heads = d_.heads_local();
  const int64_t N = d_.tokens();

  // The output projection (its input, the attention output without the padding, recomputed).
  const Tensor d_proj = expand_grad(w.gH, hp, hidden_key(s, layer, 1));
  const Tensor proj_db = proj_bias_grad_from_norm(local) ? Tensor() : G.proj_b;
  be_.copy_columns(per_head(w.mla_out, heads), 0, per_head(A.attn_out, heads), 0, d_.mla_v);
  extra_linear_bwd(local, kMlaProj, G.proj_w, proj_db, w.mla_out, d_proj, w.mla_out, P.proj_w, false);
  be_.fill(w.gATT, 0.0);
  be_.copy_columns(per_head(w.gATT, heads), 0, per_head(w.mla_out, heads), 0, d_.mla_v);
  // The core (its input recomputed under mla_up_proj: the up projections read the input norm's
  // output without a query rank or latent norm), then RoPE's and the packing's transpose.
  bool ln1_ready = A.norm_kept;
  const auto ensure_ln1 = [&] {
    if (ln1_ready) return;
    be_.norm_forward(local_rows(A.ln1_out), A.ln1_mean, A.ln1_rstd, x, P.ln1_w, P.ln1_b, norm_);
    gather_rows(A.ln1_out);
    ln1_ready = true;
  };
  if (opt_.mla_recompute_up) {
    if (d_.q_lora == 0 && !d_.mla_latent_norm) ensure_ln1();
    mla_up_projections(local, s, A, P);
  }
  attention_core(layer).backward(w.gQKV, w.gATT, A.attn_out, A.lse, A.qkv, attention_shape(&s, layer),
                                 attention_sinks(local));
  be_.mla_qkv_backward(w.mla_q, w.mla_kv, w.mla_dckv, w.gQKV, s.positions, rope_table_, mla_shape());
  // The key/value up projection and c_kv's norm, into d [c_kv | k_rope].
  const Tensor dkv_lat = w.mla_dlat.flat_slice(0, N * d_.kv_lora).view({N, d_.kv_lora});
  extra_linear_bwd(local, kMlaKvUp, G.kv_up_w, Tensor(), dkv_lat, w.mla_kv, A.mla_ckv_n, P.kv_up_w, false);
  if (d_.mla_latent_norm)
    be_.norm_backward(dkv_lat, G.kv_lat_ln_w, G.kv_lat_ln_b, dkv_lat, A.mla_ckv_raw, A.mla_ckv_mean, A.mla_ckv_rstd,
                      P.kv_lat_ln_w, Tensor(), Tensor(), norm_);
  be_.copy_columns(w.mla_dckv, 0, dkv_lat, 0, d_.kv_lora);
  // The down projections read the input norm's output (all N rows): recomputed where not kept.
  ensure_ln1();
  // Their output gradients are partial over TP (each rank's heads'), their weight gradients and input
  // gradients summed over TP later. In FP8 each rank would cast its part, so under TP they are
  // all-reduced first, as Megatron-LM reduces them, and TP rank 0 alone runs the backward: the whole
  // weight gradient (the others' zero, summed over TP as before) and input gradient (added to gT,
  // summed over TP).
  const bool down_reduced = fp8_extra_layer(local) && d_.tp_size > 1;
  const auto down_backward = [&](int g, Tensor dw, Tensor dy, Tensor weight, bool accumulate_dx) {
    if (down_reduced) {
      ps_.tp->all_reduce(dy);
      if (d_.tp_rank != 0) {
        if (!accumulate_weight_grad(dw)) be_.fill(dw, 0.0);
        if (!accumulate_dx) be_.fill(w.gT, 0.0);
        return;
      }
    }
    extra_linear_bwd(local, g, dw, Tensor(), w.gT, dy, A.ln1_out, weight, accumulate_dx);
  };
  down_backward(kMlaKvDown, G.kv_down_w, w.mla_dckv, P.kv_down_w, false);
  // The query projections, their input gradient added to gT.
  if (d_.q_lora > 0) {
    const Tensor dq_lat = w.mla_dlat.flat_slice(0, N * d_.q_lora).view({N, d_.q_lora});
    extra_linear_bwd(local, kMlaQ, G.q_w, Tensor(), dq_lat, w.mla_q, A.mla_cq, P.q_w, false);
    if (d_.mla_latent_norm)
      be_.norm_backward(dq_lat, G.q_lat_ln_w, G.q_lat_ln_b, dq_lat, A.mla_cq_raw, A.mla_cq_mean, A.mla_cq_rstd,
                        P.q_lat_ln_w, Tensor(), Tensor(), norm_);
    down_backward(kMlaQDown, G.q_down_w, dq_lat, P.q_down_w, true);
  } else if (d_.mla_latent_norm) {
    const Tensor dq_in = w.mla_dlat.flat_slice(0, N * d_.hidden).view({N, d_.hidden});
    extra_linear_bwd(local, kMlaQ, G.q_w, Tensor(), dq_in, w.mla_q, A.mla_cq, P.q_w, false);
    be_.norm_backward(w.gT, G.q_lat_ln_w, G.q_lat_ln_b, dq_in, A.ln1_out, A.mla_cq_mean, A.mla_cq_rstd, P.q_lat_ln_w,
                      w.gT, Tensor(), norm_);
  } else {
    extra_linear_bwd(local, kMlaQ, G.q_w, Tensor(), w.gT, w.mla_q, A.ln1_out, P.q_w, true);
  }
  // The input norm: gT summed over TP (its rows on this rank with SP), plus the residual's gH.
  be_.norm_backward(dx, G.ln1_w, G.ln1_b, reduce_rows(w.gT), x, A.ln1_mean, A.ln1_rstd, P.ln1_w, w.gH,
                    prev_fc2_bias_grad(local), norm_);
}

}  // namespace mt

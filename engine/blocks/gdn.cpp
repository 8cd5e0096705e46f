// Gated DeltaNet (--experimental-attention-variant gated_delta_net; Megatron-Core's GatedDeltaNet),
// the attention block of the layers --linear-attention-freq marks, forward and backward:
//
//   x -> ln1 -> in_proj (column-parallel)  = per key head [q | k | v | z | beta | alpha]
//   [q | k | v] -> causal depthwise conv -> SiLU = xc
//   (xc, beta, alpha, A_log, dt_bias) -> the gated delta rule  = o   (per value head; q, k L2-normed)
//   o -> out_norm (per value head) * SiLU(z) = y -> out_proj (row-parallel) -> dropout + residual,
//      and the MLP block's norm in the same pass.
//
// Tensor parallelism splits the key heads (each with its value heads); sequence parallelism
// gathers the norm's output, as for softmax attention. Kept for backward: the projection's output,
// the convolution's output, the recurrence's output with its states at chunk starts, and the output
// norm's statistics; the norm's output and the gated product are recomputed (which is what
// --recompute-modules gdn_norm_out asks of Megatron).
#include "engine/gpt_model.h"

#include "core/error.h"
#include "engine/gpt_model_parts.h"
#include "parallel/parallel_state.h"

namespace mt {

namespace {
// A [rows, heads * d] matrix as [rows * heads, d]: one head's values per row.
Tensor per_head(Tensor t, int heads) { return t.view({t.rows() * heads, t.cols() / heads}); }
}  // namespace

void GptModel::layout_gdn_acts(Arena& a, MemoryCategory c, LayerActs& A) {
  const GdnShape g = d_.gdn_shape();
  const int64_t N = d_.tokens();
  const DType T = opt_.compute, S = opt_.accum;
  A.gdn_proj = a.take(c, T, {N, g.proj_width()});
  A.gdn_xc = a.take(c, T, {N, g.conv_width()});
  A.gdn_o = a.take(c, T, {N, g.value_width()});
  A.gdn_states = a.take(c, S, {g.states_numel()});
  A.gdn_nmean = a.take(c, S, {N * g.value_heads});
  A.gdn_nrstd = a.take(c, S, {N * g.value_heads});
}

void GptModel::layout_gdn_workspace(Arena& a) {
  Workspace& w = *ws_;
  w.gdn_n = w.gdn_y = w.gdn_do = w.gdn_dxc = w.gdn_dproj = Tensor();
  if (!d_.any_gdn()) return;
  const GdnShape g = d_.gdn_shape();
  const int64_t N = d_.tokens();
  const DType T = opt_.compute;
  w.gdn_n = a.take(MemoryCategory::workspace, T, {N, g.value_width()});
  w.gdn_y = a.take(MemoryCategory::workspace, T, {N, g.value_width()});
  w.gdn_do = a.take(MemoryCategory::workspace, T, {N, g.value_width()});
  w.gdn_dxc = a.take(MemoryCategory::workspace, T, {N, g.conv_width()});
  w.gdn_dproj = a.take(MemoryCategory::workspace, T, {N, g.proj_width()});
}

// The output norm and gate: n = out_norm(o) per value head, y = n * silu(z) (the output
// projection's input), into the workspace; forward's and backward's recompute.
void GptModel::gdn_gated_norm(const LayerActs& A, const LayerParams& P) {
  const Workspace& w = *ws_;
  const GdnShape g = d_.gdn_shape();
  be_.norm_forward(per_head(w.gdn_n, g.value_heads), A.gdn_nmean, A.gdn_nrstd, per_head(A.gdn_o, g.value_heads),
                   P.gdn_norm_w, P.gdn_norm_b, norm_);
  be_.gdn_gate_forward(w.gdn_y, w.gdn_n, A.gdn_proj, g);
}

void GptModel::gdn_forward(int local, Slot& s, const LayerActs& A, Tensor x) {
  const LayerParams& P = layer_params_[static_cast<size_t>(local)];
  const Workspace& w = *ws_;
  const int layer = d_.layer_begin + local;
  const float hp = s.training ? d_.hidden_dropout : 0.0f;
  const GdnShape g = d_.gdn_shape();

  if (!norm_from_previous(local))
    be_.norm_forward(local_rows(A.ln1_out), A.ln1_mean, A.ln1_rstd, x, P.ln1_w, P.ln1_b, norm_);
  gather_rows(A.ln1_out);
  be_.linear_forward(A.gdn_proj, A.ln1_out, P.gdn_in_w, Tensor(), Activation::none, Tensor());
  be_.gdn_conv_forward(A.gdn_xc, A.gdn_proj, P.gdn_conv_w, g);
  be_.gdn_forward(A.gdn_o, A.gdn_states, A.gdn_xc, A.gdn_proj, P.gdn_a_log, P.gdn_dt_bias, g);
  gdn_gated_norm(A, P);
  be_.linear_forward(w.tmp_h, w.gdn_y, P.proj_w, Tensor(), Activation::none, Tensor());
  be_.bias_dropout_add_norm(A.h1, local_rows(A.ln2_out), A.ln2_mean, A.ln2_rstd, x, reduce_rows(w.tmp_h), Tensor(),
                            hp, hidden_key(s, layer, 1), P.ln2_w, P.ln2_b, norm_);
}

void GptModel::gdn_backward(int local, Slot& s, const LayerActs& A, Tensor x, Tensor dx) {
  const LayerParams &P = layer_params_[static_cast<size_t>(local)], &G = layer_grads_[static_cast<size_t>(local)];
  const Workspace& w = *ws_;
  const int layer = d_.layer_begin + local;
  const float hp = s.training ? d_.hidden_dropout : 0.0f;
  const GdnShape g = d_.gdn_shape();

  // The output projection (its input, the gated norm, recomputed), then the gate and the norm:
  // gdn_y holds the projection's input gradient, then (in place) the norm output's.
  const Tensor d_out = expand_grad(w.gH, hp, hidden_key(s, layer, 1));
  gdn_gated_norm(A, P);
  be_.linear_backward_weight(G.proj_w, Tensor(), d_out, w.gdn_y, accumulate_weight_grad(G.proj_w));
  be_.linear_backward_input(w.gdn_y, d_out, P.proj_w, false, Activation::none, Tensor());
  be_.gdn_gate_backward(w.gdn_y, w.gdn_dproj, w.gdn_y, w.gdn_n, A.gdn_proj, g);
  be_.norm_backward(per_head(w.gdn_do, g.value_heads), G.gdn_norm_w, G.gdn_norm_b, per_head(w.gdn_y, g.value_heads),
                    per_head(A.gdn_o, g.value_heads), A.gdn_nmean, A.gdn_nrstd, P.gdn_norm_w, Tensor(), Tensor(), norm_);
  // The recurrence (into dxc and dproj's beta and alpha columns), then the convolution (dproj's q,
  // k and v columns); their parameters' gradients are zeroed before the step, so they add.
  be_.gdn_backward(w.gdn_dxc, w.gdn_dproj, G.gdn_a_log, G.gdn_dt_bias, w.gdn_do, A.gdn_xc, A.gdn_proj, P.gdn_a_log,
                   P.gdn_dt_bias, A.gdn_states, g, true);
  be_.gdn_conv_backward(w.gdn_dproj, G.gdn_conv_w, w.gdn_dxc, A.gdn_proj, P.gdn_conv_w, g, true);
  // The input projection reads the input norm's output (all N rows): recomputed where not kept.
  if (!A.norm_kept) {
    be_.norm_forward(local_rows(A.ln1_out), A.ln1_mean, A.ln1_rstd, x, P.ln1_w, P.ln1_b, norm_);
    gather_rows(A.ln1_out);
  }
  be_.linear_backward_weight(G.gdn_in_w, Tensor(), w.gdn_dproj, A.ln1_out, accumulate_weight_grad(G.gdn_in_w));
  be_.linear_backward_input(w.gT, w.gdn_dproj, P.gdn_in_w, false, Activation::none, Tensor());
  // The input norm: gT summed over TP (its rows on this rank with SP), plus the residual's gH.
  be_.norm_backward(dx, G.ln1_w, G.ln1_b, reduce_rows(w.gT), x, A.ln1_mean, A.ln1_rstd, P.ln1_w, w.gH,
                    prev_fc2_bias_grad(local), norm_);
}

}  // namespace mt

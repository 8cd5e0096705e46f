// The MLP block of a decoder layer, forward and backward: ln2 (written by the attention block's
// closing op) -> fc1 (column-parallel) -> activation (GeLU, squared ReLU or SwiGLU) -> fc2
// (row-parallel) -> bias + dropout + residual, whose pass also writes the norm that follows.
// Dense today; a mixture of experts is another MLP block.
#include "engine/gpt_model.h"

#include "core/error.h"
#include "engine/gpt_model_parts.h"
#include "parallel/parallel_state.h"

namespace mt {

// What the MLP block keeps for backward: ln2's output (all N rows) and statistics (this rank's),
// fc1's output, the activation where kept (keep_act), what an MoE block keeps (moe), and the
// layer output where kept (keep_out).
void GptModel::layout_mlp_acts(Arena& a, MemoryCategory c, LayerActs& A, bool keep_act, bool keep_out, bool dense,
                               bool moe) {
  const int64_t N = d_.tokens(), Nl = d_.tokens_local(), h = d_.hidden;
  const DType T = opt_.compute, S = opt_.accum;
  A.ln2_out = !A.norm_kept ? ws_->tmp_h : moe ? take_act(a, c, OffloadField::moe_in, T, {N, h}) : a.take(c, T, {N, h});
  A.ln2_mean = a.take(c, S, {Nl});
  A.ln2_rstd = a.take(c, S, {Nl});
  if (dense) {
    A.fc1_pre = a.take(c, T, {N, d_.fc1_width_local()});
    A.act_kept = keep_act;
    A.fc1_act = keep_act ? a.take(c, T, {N, d_.ffn_local()}) : ws_->act;
  }
  if (moe) layout_moe_acts(a, c, A);
  if (keep_out) A.out = take_act(a, c, OffloadField::input, T, {Nl, h}, 1);  // (the next layer's input)
}

// The MLP block of layer `local`: h1 (normed by the attention block's closing op) -> out = h1 +
// dropout(fc2(act(fc1(ln2))) + b), and the norm that reads out (next) in the same pass.
void GptModel::mlp_forward(int local, Slot& s, const LayerActs& A, const NextNorm& next) {
  const LayerParams& P = layer_params_[local];
  const Workspace& w = *ws_;
  const int layer = d_.layer_begin + local;
  const float hp = s.training ? d_.hidden_dropout : 0.0f;
  const bool norm_cast = fp8_norm_cast(local, A);
  const NormInput ln2{A.h1, A.ln2_mean, A.ln2_rstd, P.ln2_w, P.ln2_b};

  // MLP block: norm (above) -> fc1 (column-parallel) + activation -> fc2 (row-parallel,
  // all-reduce) -> bias + dropout + residual.
  // With FP8 GEMMs, fc1 writes only its output (no GeLU epilogue) and fc2's input is cast to FP8
  // from it (fc2_fwd_from_fc1): the activation is never written in the compute dtype.
  if (!norm_cast) gather_rows(A.ln2_out);
  const MlpActivation mlp_act = d_.mlp_activation();
  if (fp8_gemms(local)) {
    linear_fwd(local, Fp8State::fc1, A, A.fc1_pre, A.ln2_out, P.fc1_w, P.fc1_b, Activation::none, Tensor(),
               norm_cast ? &ln2 : nullptr);
    fc2_fwd_from_fc1(local, A, w.tmp_h, A.fc1_pre, mlp_act);
  } else {
    if (d_.swiglu) {
      linear_fwd(local, Fp8State::fc1, A, A.fc1_pre, A.ln2_out, P.fc1_w, P.fc1_b, Activation::none, Tensor());
      be_.swiglu_forward(A.fc1_act, A.fc1_pre, d_.glu);
    } else {
      linear_fwd(local, Fp8State::fc1, A, A.fc1_act, A.ln2_out, P.fc1_w, P.fc1_b, d_.ungated_mlp_activation(),
                 A.fc1_pre);
    }
    linear_fwd(local, Fp8State::fc2, A, w.tmp_h, A.fc1_act, P.fc2_w, Tensor(), Activation::none, Tensor());
  }
  if (!next.fused)
    be_.bias_dropout_add(A.out, reduce_rows(w.tmp_h), P.fc2_b, A.h1, hp, hidden_key(s, layer, 2));
  else
    be_.bias_dropout_add_norm(A.out, next.out, next.mean, next.rstd, A.h1, reduce_rows(w.tmp_h), P.fc2_b, hp,
                              hidden_key(s, layer, 2), next.weight, next.bias, norm_, next.amax);
}

// The MLP block's backward: dy (the gradient of out) -> the gradient of h1 in the workspace's gH,
// with fc1's, fc2's and ln2's parameter gradients.
void GptModel::mlp_backward(int local, Slot& s, const LayerActs& A, Tensor dy) {
  const LayerParams &P = layer_params_[local], &G = layer_grads_[local];
  const Workspace& w = *ws_;
  const int layer = d_.layer_begin + local;
  const float hp = s.training ? d_.hidden_dropout : 0.0f;

  // MLP block. dy is the gradient of out = h1 + dropout(fc2 + b2) (this rank's rows with SP;
  // d_fc2 has all rows). The activation (fc2's input) is recomputed from fc1_pre by the
  // activation's backward, the norm output (fc1's input), unless kept (A.norm_kept), by the norm's
  // backward (then gathered to all rows with SP, as Megatron re-gathers it), so the weight
  // gradients come after them. FP8 layers with kept inputs (fp8_kept_inputs) need neither for
  // their weight gradients.
  const bool kept = fp8_kept_inputs(local);
  const Tensor fc2_dy_amax = dy_amax_from_dropout(local, Fp8State::fc2);
  const Tensor d_fc2 = expand_grad(dy, hp, hidden_key(s, layer, 2), fc2_dy_amax);
  // fc2's and proj's bias gradients where the norm backwards that produce their output gradients
  // took them (fc2: the next layer's or the final norm's; proj: ln2's below).
  const Tensor fc2_db = fc2_bias_grad_from_norm(local) ? Tensor() : G.fc2_b;
  const bool proj_db_from_norm = proj_bias_grad_from_norm(local);
  Tensor d_fc1;  // gradient of fc1's output
  bool d_fc1_quantized = false;  // FP8: cast to FP8 here, straight from the activation's gradient
  linear_quantize_dy(local, Fp8State::fc2, d_fc2, G.fc2_b,
                     dy_amax_from_norm(s, local, Fp8State::fc2) || !fc2_dy_amax.empty());
  if (d_.swiglu && kept) {
    // FP8 with kept inputs: fc1's output gradient [dgate | dup] is cast to FP8 straight from fc2's
    // input gradient and fc1_pre (the same bits as swiglu_backward, then the cast), after fc2's
    // weight gradient (which still needs the FP8 workspaces of its own output gradient).
    linear_bwd_input(local, Fp8State::fc2, w.act, d_fc2, P.fc2_w, Activation::none, Tensor());
    linear_bwd_weight(local, Fp8State::fc2, A, G.fc2_w, fc2_db, d_fc2, w.act);
    linear_quantize_dy_activation(local, w.act, A.fc1_pre, MlpActivation::swiglu, G.fc1_b);
    d_fc1 = A.fc1_pre;  // (its shape: the FP8 GEMMs below read only the quantized copies)
    d_fc1_quantized = true;
  } else if (d_.swiglu) {
    linear_bwd_input(local, Fp8State::fc2, w.act, d_fc2, P.fc2_w, Activation::none, Tensor());
    // In place: fc1_pre becomes its gradient and the activation gradient becomes the activation.
    be_.swiglu_backward_recompute(A.fc1_pre, w.act, w.act, A.fc1_pre, d_.glu);
    d_fc1 = A.fc1_pre;
    linear_bwd_weight(local, Fp8State::fc2, A, G.fc2_w, fc2_db, d_fc2, w.act);
  } else if (fp8_wgrad(local)) {
    // FP8 GEMMs with FP8 weight gradients: fc2's input gradient comes out plain (no DGELU epilogue)
    // into gFC, and fc1's output gradient gFC * act'(fc1_pre) is cast to FP8 (with fc1's bias
    // gradient) straight from it: never written in the compute dtype. Without kept inputs fc1_pre
    // must first become the activation (in place) for fc2's weight gradient, so fc1's output
    // gradient is formed by activation_backward in gFC and cast after it (the same bits as the
    // fused cast).
    const Activation act = d_.ungated_mlp_activation();
    linear_bwd_input(local, Fp8State::fc2, w.gFC, d_fc2, P.fc2_w, Activation::none, Tensor());
    if (kept) {
      linear_bwd_weight(local, Fp8State::fc2, A, G.fc2_w, fc2_db, d_fc2, A.fc1_pre);
      linear_quantize_dy_activation(local, w.gFC, A.fc1_pre, d_.mlp_activation(), G.fc1_b);
    } else {
      be_.activation_backward(w.gFC, w.gFC, A.fc1_pre, act);
      be_.activation_forward(A.fc1_pre, A.fc1_pre, act);
      linear_bwd_weight(local, Fp8State::fc2, A, G.fc2_w, fc2_db, d_fc2, A.fc1_pre);
      linear_quantize_dy(local, Fp8State::fc1, w.gFC, G.fc1_b);
    }
    d_fc1 = w.gFC;  // (its shape: the FP8 GEMMs below read only the quantized copies)
    d_fc1_quantized = true;
  } else if (A.act_kept && !fp8_gemms(local)) {
    // The activation kept from forward: fc2's input gradient takes the activation's backward
    // (cuBLASLt's DGELU epilogue for the tanh GeLU) into gFC, and its weight gradient the kept
    // activation.
    const Activation act = d_.ungated_mlp_activation();
    linear_bwd_input(local, Fp8State::fc2, w.gFC, d_fc2, P.fc2_w, act, A.fc1_pre);
    d_fc1 = w.gFC;
    linear_bwd_weight(local, Fp8State::fc2, A, G.fc2_w, fc2_db, d_fc2, A.fc1_act);
  } else {
    // fc1_pre becomes the activation (in place, unless kept); the gradient goes to gFC.
    const Activation act = d_.ungated_mlp_activation();
    if (fp8_gemms(local)) {
      linear_bwd_input(local, Fp8State::fc2, w.gFC, d_fc2, P.fc2_w, act, A.fc1_pre);
      if (!kept) be_.activation_forward(A.fc1_pre, A.fc1_pre, act);
    } else {
      be_.linear_backward_input_recompute(w.gFC, A.fc1_pre, d_fc2, compute_weight(local, Fp8State::fc2, P.fc2_w), act,
                                          A.fc1_pre);
    }
    d_fc1 = w.gFC;
    linear_bwd_weight(local, Fp8State::fc2, A, G.fc2_w, fc2_db, d_fc2, A.fc1_pre);
  }
  if (!d_fc1_quantized) linear_quantize_dy(local, Fp8State::fc1, d_fc1, G.fc1_b);
  if (d_.sequence_parallel) {
    column_parallel_backward_sp(local, Fp8State::fc1, A, A.ln2_out, A.ln2_mean, A.ln2_rstd, A.h1, P.ln2_w, P.ln2_b,
                                G.ln2_w, G.ln2_b, d_fc1, P.fc1_w, G.fc1_w, G.fc1_b, w.gH, dy);
  } else {
    linear_bwd_input(local, Fp8State::fc1, w.gT, d_fc1, P.fc1_w, Activation::none, Tensor());  // (d_fc2 is dead)
    // Column-parallel input gradient: summed over TP.
    if (kept || A.norm_kept)
      be_.norm_backward(w.gH, G.ln2_w, G.ln2_b, reduce_rows(w.gT), A.h1, A.ln2_mean, A.ln2_rstd, P.ln2_w, dy,
                        proj_db_from_norm ? G.proj_b : Tensor(), norm_, dy_amax_slot(s, local, Fp8State::proj));
    else
      be_.norm_backward_recompute(local_rows(A.ln2_out), w.gH, G.ln2_w, G.ln2_b, reduce_rows(w.gT), A.h1, A.ln2_mean,
                                  A.ln2_rstd, P.ln2_w, P.ln2_b, dy, proj_db_from_norm ? G.proj_b : Tensor(), norm_);
    linear_bwd_weight(local, Fp8State::fc1, A, G.fc1_w, G.fc1_b, d_fc1, A.ln2_out);
  }
}

}  // namespace mt

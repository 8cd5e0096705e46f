// The first and last pieces of a stage: the (vocab-parallel) embedding, forward and backward, and
// the head: the final norm, the output layer in chunks of rows and the vocab-parallel
// cross-entropy, whose backward runs at once in the forward (the loss gradient is known).
#include <algorithm>

#include "engine/gpt_model.h"

#include "core/error.h"
#include "engine/gpt_model_parts.h"
#include "parallel/parallel_state.h"

namespace mt {

void GptModel::embedding_forward(Slot& s) {
  const Globals& G = *globals_;
  const bool positions = d_.position == PositionEmbedding::learned_absolute && d_.tp_rank == 0;
  // Vocab-parallel: each rank contributes its vocabulary rows, summed over TP (with SP the sum
  // is reduce-scattered to the sequence shards).
  const Tensor full = d_.sequence_parallel ? ws_->tmp_h : s.input;
  be_.embedding_forward(full, s.tokens, s.positions, G.wte, positions ? G.wpe : Tensor(), d_.vocab_start());
  if (d_.sequence_parallel) ps_.tp->reduce_scatter(s.input, full);
  else ps_.tp->all_reduce(s.input);
  // --use-mup: the embeddings times --mup-embedding-mult, before the dropout (Megatron's order).
  if (d_.embedding_mult != 1.0f) be_.axpby(s.input, d_.embedding_mult, s.input, 0.0f, Tensor());
  if (s.training && d_.hidden_dropout > 0) be_.dropout_backward(s.input, s.input, d_.hidden_dropout, hidden_key(s, -1, 3));
}

void GptModel::head_forward(Slot& s, Tensor x, bool norm_done) {
  const Globals& G = *globals_;
  const Workspace& w = *ws_;
  if (!norm_done) be_.norm_forward(local_rows(w.y), w.fmean, w.frstd, x, G.final_w, G.final_b, norm_);
  gather_rows(w.y);
  if (opt_.frozen) return;  // (a teacher: its student's head reads w.y)
  if (opt_.distill.enabled) distill_head(s, w.y);
  else output_layer_loss(s, w.y, s.labels, s.mask, s.dloss, s.training ? train_loss_ : eval_loss_);
  if (!s.training) return;
  Tensor dy = reduce_rows(w.gT);
  if (opt_.distill.enabled) distill_intermediate_backward(s, -1, dy);
  if (d_.stage_mtp_layers() > 0) {  // the mtp depths read the final norm's output: they add to its gradient
    be_.copy(w.mtp_dy0, dy);
    mtp_forward_backward(s, w.mtp_dy0);
    dy = w.mtp_dy0;
  }
  const int last = d_.decoder_layers() - 1;
  const Tensor last_fc2_db = last >= 0 && fc2_bias_grad_from_norm(last) ? layer_grads_[last].fc2_b : Tensor();
  be_.norm_backward(s.d_output, G.dfinal_w, G.dfinal_b, dy, x, w.fmean, w.frstd, G.final_w, Tensor(), last_fc2_db,
                    norm_);
}

void GptModel::output_layer_loss(Slot& s, Tensor y, Tensor labels_all, Tensor mask, Tensor dloss, Tensor sums,
                                 Tensor accept, Tensor accept_mask) {
  const Globals& G = *globals_;
  const Workspace& w = *ws_;
  // The output layer runs over chunks of logits_rows_ rows, so that the logits (and, in place,
  // their gradient) exist for one chunk at a time; the head's whole backward but the final norm
  // happens per chunk. Vocab-parallel cross-entropy: per-shard log-sum-exp, gathered and
  // combined; the target logit lives on one shard (zero elsewhere), so a sum finds it.
  const int64_t N = d_.tokens(), V = d_.vocab_local(), tp = d_.tp_size;
  for (int64_t r0 = 0; r0 < N; r0 += logits_rows_) {
    const int64_t rows = std::min(logits_rows_, N - r0);
    const Tensor logits = w.logits.flat_slice(0, rows * V).view({rows, V});
    const Tensor yr = y.row_slice(r0, rows), labels = labels_all.flat_slice(r0, rows);
    be_.linear_forward(logits, yr, G.out_w, Tensor(), Activation::none, Tensor());
    // --use-mup: the logits times --mup-output-mult (in backward, their gradient too).
    if (d_.logits_mult != 1.0f) be_.axpby(logits, d_.logits_mult, logits, 0.0f, Tensor());
    // Acceptance: each row's argmax on this shard, before the loss's backward overwrites the logits.
    if (!accept.empty())
      be_.logits_argmax(w.mtp_max.flat_slice(r0, rows), w.mtp_argmax.flat_slice(r0, rows), logits, d_.vocab_start());
    Tensor lse = w.lse_part.flat_slice(r0, rows);
    // Training on the whole vocabulary (no TP): the loss and dlogits (in place) in one pass.
    const bool fused_ce = s.training && tp == 1;
    if (fused_ce)
      be_.cross_entropy_forward_backward(lse, w.target.flat_slice(r0, rows), logits, labels, dloss.flat_slice(r0, rows));
    else
      lse = lm_loss_forward_chunk(logits, labels, r0);
    if (!s.training) continue;
    // The output layer's backward, now: dlogits in place of the logits.
    if (!fused_ce)
      be_.cross_entropy_backward(logits, logits, labels, lse, dloss.flat_slice(r0, rows), d_.vocab_start());
    if (d_.logits_mult != 1.0f) be_.axpby(logits, d_.logits_mult, logits, 0.0f, Tensor());
    be_.linear_backward_weight(G.dout_w, Tensor(), logits, yr, accumulate_weight_grad(G.dout_w));
    be_.linear_backward_input(w.gT.row_slice(r0, rows), logits, G.out_w, false, Activation::none, Tensor());
  }
  if (!accept.empty()) {  // (with TP, the shard holding the row's largest logit decides)
    Tensor max_parts = w.mtp_max, argmax_parts = w.mtp_argmax;
    if (tp > 1) {
      ps_.tp->all_gather(w.mtp_max_parts, w.mtp_max);
      ps_.tp->all_gather(w.mtp_argmax_parts, w.mtp_argmax);
      max_parts = w.mtp_max_parts;
      argmax_parts = w.mtp_argmax_parts;
    }
    be_.argmax_match_count(accept, max_parts, argmax_parts, labels_all, accept_mask, true);
  }
  lm_loss_sum(sums, mask);
}

Tensor GptModel::lm_loss_forward_chunk(Tensor logits, Tensor labels, int64_t r0) {
  const Workspace& w = *ws_;
  const int64_t rows = logits.rows();
  const Tensor lse = w.lse_part.flat_slice(r0, rows);
  be_.cross_entropy_forward(lse, w.target.flat_slice(r0, rows), logits, labels, d_.vocab_start());
  if (d_.tp_size == 1) return lse;
  combine_lse_over_tp(w.lse.flat_slice(r0, rows), lse);
  return w.lse.flat_slice(r0, rows);
}

void GptModel::combine_lse_over_tp(Tensor out, Tensor part) {
  const int64_t rows = part.numel();
  const Tensor parts = ws_->lse_parts.flat_slice(0, d_.tp_size * rows).view({d_.tp_size, rows});
  ps_.tp->all_gather(parts, part);
  be_.logsumexp_combine(out, parts);
}

void GptModel::lm_loss_sum(Tensor sums, Tensor mask) {
  const Workspace& w = *ws_;
  const bool tp = d_.tp_size > 1;
  if (tp) ps_.tp->all_reduce(w.target);
  be_.axpby(w.loss, 1.0f, tp ? w.lse : w.lse_part, -1.0f, w.target);
  be_.masked_loss_sum(sums, w.loss, mask, true);
}

void GptModel::embedding_backward(Slot& s, Tensor grad) {
  const Globals& G = *globals_;
  if (s.training && d_.hidden_dropout > 0) be_.dropout_backward(grad, grad, d_.hidden_dropout, hidden_key(s, -1, 3));
  if (d_.embedding_mult != 1.0f) be_.axpby(grad, d_.embedding_mult, grad, 0.0f, Tensor());
  if (d_.sequence_parallel) {  // the embeddings need the gradient of every row
    ps_.tp->all_gather(ws_->gT, grad);
    grad = ws_->gT;
  }
  const bool positions = d_.position == PositionEmbedding::learned_absolute;
  zero_grad_if_unwritten(G.dwte);  // the scatter adds (the tied output layer's GEMM may have written first)
  be_.embedding_backward(G.dwte, positions ? G.dwpe : Tensor(), grad, s.tokens, s.positions, d_.vocab_start());
}

}  // namespace mt

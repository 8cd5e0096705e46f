// Knowledge distillation's head (Megatron-LM's ModelOpt path: ModelOpt's distill plugin for
// Megatron and megatron/post_training/loss_func.py), for a student on one stage whose frozen
// teacher ran forward on the same tokens (GptModel::forward runs it first):
//   * LogitsKLLoss: per token KL(teacher || student) of the output layers' logits over the
//     temperature, vocab-parallel (each shard's part with the rows' global log-sum-exps, summed
//     over TP); its gradient (p_s - p_t) / T goes straight into the output layer's backward, chunk
//     by chunk, as the cross-entropy's does;
//   * the intermediate pairs: per token 1 - cos (or the mean squared error) of two hidden states,
//     each a decoder layer's output (decoder.layers.N) or the final norm's (decoder.final_layernorm);
//     their gradients join the student's backward where it reaches those states;
//   * ModelOpt's LogitsAndIntermediatesLossBalancer with skip_lm_loss: the micro-batch's loss is
//     logits + intermediate x (logits / intermediate) (masked sums, the intermediate one the pairs'
//     mean; the ratio a constant, so the pairs' gradients are scaled by it), reported as "total
//     loss" beside both parts; the
//     language-model loss counts its tokens as zero in training (ModelOpt replaces it by zeros) and
//     is evaluated as usual.
#include <algorithm>

#include "engine/gpt_model.h"

#include "core/error.h"
#include "engine/gpt_model_parts.h"
#include "parallel/parallel_state.h"

namespace mt {

void GptModel::set_teacher(GptModel* teacher) {
  MT_CHECK(opt_.distill.enabled && d_.first_stage && d_.last_stage, "set_teacher: this model is not a one-stage student");
  MT_CHECK(teacher != nullptr && teacher->opt_.frozen && teacher->d_.first_stage && teacher->d_.last_stage,
           "set_teacher: the teacher must be a frozen one-stage model");
  MT_CHECK(teacher->d_.tokens() == d_.tokens() && teacher->d_.vocab_local() == d_.vocab_local(),
           "set_teacher: the teacher's {} tokens x {} vocabulary columns differ from the student's {} x {}",
           teacher->d_.tokens(), teacher->d_.vocab_local(), d_.tokens(), d_.vocab_local());
  MT_CHECK(opt_.distill.pairs.empty() || teacher->d_.hidden == d_.hidden,
           "set_teacher: the hidden states compared differ in width ({} and {})", d_.hidden, teacher->d_.hidden);
  teacher_ = teacher;
}

Tensor GptModel::features() const {
  MT_CHECK(opt_.frozen && d_.last_stage, "features: not a frozen last stage");
  return ws_->y;
}

void GptModel::teacher_logits(Tensor out, int64_t r0, int64_t rows) const {
  const Globals& G = *globals_;
  be_.linear_forward(out, features().row_slice(r0, rows), G.out_w, Tensor(), Activation::none, Tensor());
  if (d_.logits_mult != 1.0f) be_.axpby(out, d_.logits_mult, out, 0.0f, Tensor());
}

void GptModel::distill_head(Slot& s, Tensor y) {
  MT_CHECK(teacher_ != nullptr, "a distillation student's forward without its teacher (set_teacher)");
  const Globals& G = *globals_;
  const Workspace& w = *ws_;
  const ModelOptions::Distill& kd = opt_.distill;
  const int64_t N = d_.tokens(), V = d_.vocab_local(), tp = d_.tp_size;
  const float scale = kd.inv_temperature;
  for (int64_t r0 = 0; r0 < N; r0 += logits_rows_) {
    const int64_t rows = std::min(logits_rows_, N - r0);
    const Tensor logits = w.logits.flat_slice(0, rows * V).view({rows, V});
    const Tensor tlogits = w.kd_logits.flat_slice(0, rows * V).view({rows, V});
    const Tensor yr = y.row_slice(r0, rows);
    be_.linear_forward(logits, yr, G.out_w, Tensor(), Activation::none, Tensor());
    if (d_.logits_mult != 1.0f) be_.axpby(logits, d_.logits_mult, logits, 0.0f, Tensor());
    if (!s.training) lm_loss_forward_chunk(logits, s.labels.flat_slice(r0, rows), r0);  // (evaluated)
    teacher_->teacher_logits(tlogits, r0, rows);
    const Tensor lse_s = w.kd_lse_s.flat_slice(r0, rows), lse_t = w.kd_lse_t.flat_slice(r0, rows);
    be_.logsumexp_rows(lse_s, logits, scale);
    be_.logsumexp_rows(lse_t, tlogits, scale);
    if (tp > 1) {  // (the rows' global log-sum-exps)
      combine_lse_over_tp(lse_s, lse_s);
      combine_lse_over_tp(lse_t, lse_t);
    }
    // The KL divergence's part on this shard, and in training its gradient over the logits.
    be_.kd_logits_kl(w.kd_kl.flat_slice(r0, rows), logits, logits, tlogits, lse_s, lse_t, scale,
                     s.training ? s.dloss.flat_slice(r0, rows) : Tensor());
    if (!s.training) continue;
    if (d_.logits_mult != 1.0f) be_.axpby(logits, d_.logits_mult, logits, 0.0f, Tensor());
    be_.linear_backward_weight(G.dout_w, Tensor(), logits, yr, accumulate_weight_grad(G.dout_w));
    be_.linear_backward_input(w.gT.row_slice(r0, rows), logits, G.out_w, false, Activation::none, Tensor());
  }
  if (tp > 1) ps_.tp->all_reduce(w.kd_kl);
  // The language-model loss: in evaluation its sum, in training its tokens only (a sum of zero).
  if (s.training) {
    be_.fill(w.loss, 0.0);
    be_.masked_loss_sum(train_loss_, w.loss, s.mask, true);
  } else {
    lm_loss_sum(eval_loss_, s.mask);
  }
  // The distillation losses' masked sums: the logits' and each intermediate pair's (this rank's
  // rows, summed over TP under sequence parallelism; without it every TP rank has all of them).
  const std::vector<ModelOptions::Distill::Pair>& pairs = kd.pairs;
  const int P = static_cast<int>(pairs.size());
  be_.masked_loss_sum(w.kd_sums.flat_slice(0, 2), w.kd_kl, s.mask, false);
  const int64_t r0 = d_.local_row_begin(), n = d_.tokens_local();
  for (int p = 0; p < P; ++p) {
    const Tensor loss = w.kd_hidden.flat_slice(0, n);
    be_.hidden_loss_forward(loss, hidden_state_of(s, pairs[p].student), teacher_->hidden_state(0, pairs[p].teacher),
                            pairs[p].loss);
    be_.masked_loss_sum(w.kd_sums.flat_slice(2 + 2 * p, 2), loss, s.mask.flat_slice(r0, n), false);
  }
  if (P > 0 && d_.sequence_parallel) ps_.tp->all_reduce(w.kd_sums.flat_slice(2, 2 * P));
  std::vector<double>& host = kd_host_;  // (sized by layout: the sums' count)
  if (opt_.accum == DType::f64) {
    be_.copy_to_host(host.data(), w.kd_sums);
  } else {
    be_.copy_to_host(kd_host_f32_.data(), w.kd_sums);
    std::copy(kd_host_f32_.begin(), kd_host_f32_.end(), host.begin());
  }
  // ModelOpt's balancer: the intermediate loss is the pairs' mean; it enters the total as
  // intermediate x (logits / intermediate), detached, where it is > 0: each pair's gradient is
  // scaled by that ratio over the pairs.
  double inter = 0;
  for (int p = 0; p < P; ++p) inter += host[2 + 2 * static_cast<size_t>(p)];
  inter /= std::max(1, P);
  const double ratio = inter > 0 ? host[0] / inter : 1.0;
  kd_intermediate_scale_ = ratio / std::max(1, P);
  const Tensor out = s.training ? kd_train_loss_ : kd_eval_loss_;
  const Tensor logits_sum = w.kd_sums.flat_slice(0, 1);
  be_.axpby(out.flat_slice(0, 1), 1.0f, out.flat_slice(0, 1), 1.0f, logits_sum);
  be_.axpby(out.flat_slice(1, 1), 1.0f, out.flat_slice(1, 1), 1.0f, logits_sum);
  for (int p = 0; p < P; ++p) {
    const Tensor pair_sum = w.kd_sums.flat_slice(2 + 2 * p, 1);
    be_.axpby(out.flat_slice(0, 1), 1.0f, out.flat_slice(0, 1), static_cast<float>(kd_intermediate_scale_), pair_sum);
    be_.axpby(out.flat_slice(2, 1), 1.0f, out.flat_slice(2, 1), static_cast<float>(1.0 / P), pair_sum);
  }
}

Tensor GptModel::hidden_state(int slot, int layer) const { return hidden_state_of(slots_.at(static_cast<size_t>(slot)), layer); }

Tensor GptModel::hidden_state_of(const Slot& s, int layer) const {
  if (layer < 0) return local_rows(ws_->y);
  MT_CHECK(layer >= d_.layer_begin && layer - d_.layer_begin < d_.decoder_layers(), "hidden_state: layer {} is not on this stage",
           layer);
  const Tensor out = acts(s, layer - d_.layer_begin).out;
  MT_CHECK(!out.empty(), "hidden_state: layer {}'s output is not kept", layer);
  return out;
}

// The intermediate losses' gradients with respect to the student's hidden state `layer`, added to
// its gradient (this rank's rows).
void GptModel::distill_intermediate_backward(Slot& s, int layer, Tensor grad) {
  const int64_t r0 = d_.local_row_begin(), n = d_.tokens_local();
  for (const ModelOptions::Distill::Pair& p : opt_.distill.pairs)
    if (p.student == layer)
      be_.hidden_loss_backward(grad, hidden_state_of(s, layer), teacher_->hidden_state(0, p.teacher),
                               s.dloss.flat_slice(r0, n), static_cast<float>(kd_intermediate_scale_), p.loss, true);
}

}  // namespace mt

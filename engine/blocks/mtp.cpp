// Multi-token prediction (--mtp-num-layers D; Megatron-Core's MultiTokenPredictionBlock), on the
// chunk with the output layer, inside its head: depth j (1-based) predicts the tokens j + 1 ahead,
//
//   h_j = FinalNorm_j(Layer_j(eh_proj([enorm(Embedding(tokens rolled j left)) | hnorm(h_{j-1})])))
//
// from h_0, the decoder's output after its final norm; Layer_j is a decoder layer like the last one
// (its local index: the chunk's decoder layers, then the depths), the embedding and the output layer
// the model's (the tied copy on a last pipeline stage), the positions (RoPE) not rolled. Each depth's
// loss against the labels rolled j left, weighted (scale / D) / its tokens, is not part of lm loss;
// its gradient flows back through the depths into h_0's (Megatron's MTPLossAutoScaler). All of it
// runs at once in the training forward, where the loss gradient is known (as the output layer's
// backward does), so its activations live in the workspace: only the depth's decoder layer keeps
// its own (the slot's LayerActs).
//
// eh_proj is column-parallel: each TP rank computes h / TP of the output columns for all rows, which
// are gathered (and with sequence parallelism this rank's rows kept), as Megatron's gather from the
// tensor-parallel region and scatter to the sequence-parallel one.
#include "engine/gpt_model.h"

#include "core/error.h"
#include "engine/gpt_model_parts.h"
#include "parallel/parallel_state.h"

namespace mt {

void GptModel::layout_mtp(Arena& a) {
  Workspace& w = *ws_;
  w.mtp.clear();
  mtp_loss_ = mtp_accept_ = Tensor();
  const int D = d_.stage_mtp_layers();
  if (D == 0) return;
  const MemoryCategory c = MemoryCategory::workspace;
  const DType T = opt_.compute, S = opt_.accum;
  const int64_t N = d_.tokens(), Nl = d_.tokens_local(), h = d_.hidden, hl = h / d_.tp_size;
  for (int j = 0; j < D; ++j) {
    MtpActs M;
    M.e = a.take(c, T, {Nl, h});
    M.en = a.take(c, T, {Nl, h});
    M.hn = a.take(c, T, {Nl, h});
    M.cat = a.take(c, T, {N, 2 * h});
    M.u = a.take(c, T, {Nl, h});
    M.h = a.take(c, T, {Nl, h});
    for (Tensor* stat : {&M.en_mean, &M.en_rstd, &M.hn_mean, &M.hn_rstd, &M.f_mean, &M.f_rstd})
      *stat = a.take(c, S, {Nl});
    w.mtp.push_back(M);
  }
  for (Tensor* t : {&w.mtp_dy0, &w.mtp_carry, &w.mtp_dv, &w.mtp_du, &w.mtp_de, &w.mtp_dhn}) *t = a.take(c, T, {Nl, h});
  w.mtp_part = a.take(c, T, {N, hl});
  w.mtp_parts = a.take(c, T, {N * h});
  w.mtp_full = a.take(c, T, {N, h});
  w.mtp_dcat = a.take(c, T, {N, 2 * h});
  w.mtp_yall = a.take(c, T, {N, h});
  mtp_loss_ = a.take(c, S, {2 * int64_t{D}});
  mtp_accept_ = a.take(c, S, {2 * int64_t{D}});
  w.mtp_max = a.take(c, DType::f32, {N});
  w.mtp_argmax = a.take(c, DType::i32, {N});
  if (d_.tp_size > 1) {
    w.mtp_max_parts = a.take(c, DType::f32, {d_.tp_size * N});
    w.mtp_argmax_parts = a.take(c, DType::i32, {d_.tp_size * N});
  }
}

void GptModel::mtp_forward_backward(Slot& s, Tensor dy0) {
  const Workspace& w = *ws_;
  const Globals& G = *globals_;
  const int D = d_.stage_mtp_layers(), first = d_.decoder_layers();
  const int64_t N = d_.tokens(), h = d_.hidden, tp = d_.tp_size, hl = h / tp;
  const float p = s.training ? d_.hidden_dropout : 0.0f;
  // The word embeddings: the model's own, or on a last pipeline stage its copy (tied: the output layer).
  const Tensor emb = !G.wte.empty() ? G.wte : G.out_w, demb = !G.wte.empty() ? G.dwte : G.dout_w;
  MT_CHECK(!emb.empty(), "multi-token prediction without word embeddings on this stage");
  auto hidden_in = [&](int j) { return j == 0 ? local_rows(w.y) : w.mtp[static_cast<size_t>(j - 1)].h; };

  // Forward, depth by depth.
  for (int j = 0; j < D; ++j) {
    const MtpActs& M = w.mtp[static_cast<size_t>(j)];
    const MtpParams& P = mtp_params_[static_cast<size_t>(j)];
    const Slot::MtpRows& rows = s.mtp[static_cast<size_t>(j)];
    const int local = first + j, layer = d_.layer_begin + local;
    // The rolled tokens' embedding, summed over the vocabulary shards (with SP: this rank's rows).
    const Tensor full = d_.sequence_parallel ? w.tmp_h : M.e;
    be_.embedding_forward(full, rows.tokens, s.positions, emb, Tensor(), d_.vocab_start());
    if (d_.sequence_parallel) ps_.tp->reduce_scatter(M.e, full);
    else ps_.tp->all_reduce(M.e);
    if (p > 0) be_.dropout_backward(M.e, M.e, p, hidden_key(s, layer, 3));  // (as the model's embedding dropout)
    be_.norm_forward(M.en, M.en_mean, M.en_rstd, M.e, P.enorm_w, P.enorm_b, norm_);
    be_.norm_forward(M.hn, M.hn_mean, M.hn_rstd, hidden_in(j), P.hnorm_w, P.hnorm_b, norm_);
    be_.copy_columns(local_rows(M.cat), 0, M.en, 0, h);
    be_.copy_columns(local_rows(M.cat), h, M.hn, 0, h);
    gather_rows(M.cat);
    // eh_proj: this rank's columns of every row, gathered into whole rows.
    if (tp == 1) {
      extra_linear_fwd(local, extra_eh_gemm(), M.u, M.cat, P.eh_w);
    } else {
      extra_linear_fwd(local, extra_eh_gemm(), w.mtp_part, M.cat, P.eh_w);
      ps_.tp->all_gather(w.mtp_parts, w.mtp_part);
      for (int64_t r = 0; r < tp; ++r)
        be_.copy_columns(w.mtp_full, r * hl, w.mtp_parts.flat_slice(r * N * hl, N * hl).view({N, hl}), 0, hl);
      be_.copy(M.u, local_rows(w.mtp_full));
    }
    layer_forward(local, s, acts(s, local), M.u);
    be_.norm_forward(M.h, M.f_mean, M.f_rstd, acts(s, local).out, P.fnorm_w, P.fnorm_b, norm_);
  }

  // Backward, last depth first: its loss, then its layers back to the depth before (carry).
  for (int j = D - 1; j >= 0; --j) {
    const MtpActs& M = w.mtp[static_cast<size_t>(j)];
    const MtpParams &P = mtp_params_[static_cast<size_t>(j)], &Pg = mtp_grads_[static_cast<size_t>(j)];
    const Slot::MtpRows& rows = s.mtp[static_cast<size_t>(j)];
    const int local = first + j, layer = d_.layer_begin + local;
    const LayerActs A = acts(s, local);
    // The depth's loss and its output's gradient (this rank's rows), plus what the next depth carried.
    be_.copy(local_rows(w.mtp_yall), M.h);
    gather_rows(w.mtp_yall);
    // Megatron's logged value: the sum of the masked losses over their count, summed over
    // micro-batches; and its acceptance counts over the rolled loss mask.
    output_layer_loss(s, w.mtp_yall, rows.labels, rows.log_weight, rows.dloss, mtp_loss_.flat_slice(2 * j, 2),
                      mtp_accept_.flat_slice(2 * j, 2), rows.mask);
    Tensor dh = reduce_rows(w.gT);
    if (j + 1 < D) be_.axpby(dh, 1.0f, dh, 1.0f, w.mtp_carry);
    be_.norm_backward(w.mtp_dv, Pg.fnorm_w, Pg.fnorm_b, dh, A.out, M.f_mean, M.f_rstd, P.fnorm_w, Tensor(), Tensor(),
                      norm_);
    layer_backward(local, s, A, M.u, w.mtp_dv, w.mtp_du);
    // eh_proj: this rank's columns of the output gradient (all rows), then the input gradient
    // (TP-partial) reduced to this rank's rows.
    Tensor dpart = w.mtp_du;
    if (tp > 1) {
      be_.copy(local_rows(w.mtp_full), w.mtp_du);
      gather_rows(w.mtp_full);
      be_.copy_columns(w.mtp_part, 0, w.mtp_full, d_.tp_rank * hl, hl);
      dpart = w.mtp_part;
    }
    extra_linear_bwd(local, extra_eh_gemm(), Pg.eh_w, Tensor(), w.mtp_dcat, dpart, M.cat, P.eh_w, false);
    const Tensor dcat = reduce_rows(w.mtp_dcat);
    be_.copy_columns(w.mtp_de, 0, dcat, 0, h);
    be_.copy_columns(w.mtp_dhn, 0, dcat, h, h);
    // The embedding's norm, dropout and the embedding (every row's gradient: vocab-parallel).
    be_.norm_backward(w.mtp_de, Pg.enorm_w, Pg.enorm_b, w.mtp_de, M.e, M.en_mean, M.en_rstd, P.enorm_w, Tensor(),
                      Tensor(), norm_);
    if (p > 0) be_.dropout_backward(w.mtp_de, w.mtp_de, p, hidden_key(s, layer, 3));
    Tensor de = w.mtp_de;
    if (d_.sequence_parallel) {
      ps_.tp->all_gather(w.gT, w.mtp_de);
      de = w.gT;
    }
    zero_grad_if_unwritten(demb);
    be_.embedding_backward(demb, Tensor(), de, rows.tokens, s.positions, d_.vocab_start());
    // The hidden state's norm: the gradient of the previous depth's output (or the decoder's).
    be_.norm_backward(w.mtp_carry, Pg.hnorm_w, Pg.hnorm_b, w.mtp_dhn, hidden_in(j), M.hn_mean, M.hn_rstd, P.hnorm_w,
                      Tensor(), Tensor(), norm_);
  }
  be_.axpby(dy0, 1.0f, dy0, 1.0f, w.mtp_carry);
}

}  // namespace mt

// The linear layers of the decoder layers: their GEMMs in the compute dtype or in FP8 (the casts,
// the per-layer FP8 weight cache, FP8 parameters and their scaling state), and a column-parallel
// linear layer's backward under sequence parallelism with its overlapped TP communication.
#include "engine/gpt_model.h"

#include <algorithm>

#include "core/error.h"
#include "engine/gpt_model_parts.h"
#include "parallel/parallel_state.h"

namespace mt {

// FP8 layers with FP8 weight gradients keep the four linear inputs as the forward's casts quantized
// them, transposed [K, N] (LayerActs::fp8_xq_t), and with tensorwise scaling those casts' scale_inv.
void GptModel::layout_fp8_inputs(Arena& a, MemoryCategory c, LayerActs& A, bool dense_mlp, bool dense_attention) {
  const int64_t N = d_.tokens(), h = d_.hidden;
  const int64_t k[Fp8State::kGemms] = {h, d_.attn_width_local(), h, d_.ffn_local()};  // each GEMM's K
  // (An MoE layer's experts and multi-latent attention keep none: engine/blocks/fp8_gemms.cpp casts
  // their inputs again.)
  for (int g = dense_attention ? 0 : Fp8State::fc1; g < (dense_mlp ? Fp8State::kGemms : Fp8State::fc1); ++g)
    A.fp8_xq_t[g] = g == Fp8State::qkv    ? take_act(a, c, OffloadField::fp8_qkv, fp8_.dtype(Fp8State::x), {k[g], N})
                    : g == Fp8State::proj ? take_act(a, c, OffloadField::fp8_proj, fp8_.dtype(Fp8State::x), {k[g], N})
                                          : a.take(c, fp8_.dtype(Fp8State::x), {k[g], N});
  if (opt_.fp8.recipe == Fp8Recipe::tensorwise) A.fp8_x_scale_inv = a.take(c, DType::f32, {Fp8State::kGemms});
}

void GptModel::fp8_begin_step() { std::fill(fp8_fresh_.begin(), fp8_fresh_.end(), 0); }

void GptModel::fp8_end_step() {
  for (Fp8State* st : fp8_states()) st->end_step(be_, ps_);
  std::fill(fp8_fresh_.begin(), fp8_fresh_.end(), 0);  // the optimizer changed the weights
}

void GptModel::for_each_fp8_param_piece(int i, int64_t offset, int64_t numel,
                                        const std::function<void(int64_t, int64_t, const Fp8TensorMeta&)>& fn) const {
  const Fp8ParamSlot& s = fp8_param_slot_.at(static_cast<size_t>(i));
  MT_CHECK(s.state && s.group_numel > 0, "{} is not an FP8 parameter", descs_.at(static_cast<size_t>(i)).name);
  for (int64_t at = offset, end = offset + numel; at < end;) {
    const int64_t group = at / s.group_numel, stop = std::min(end, (group + 1) * s.group_numel);
    Fp8TensorMeta m = s.state->meta(s.local, s.first + s.stride * static_cast<int>(group), Fp8State::w);
    // A cast of one shard piece uses the weight's scale as it is (set from the whole weight's amax,
    // Fp8State::set_weight_scales*); tensorwise's own amax of the piece would give each piece its own.
    m.recipe = Fp8Recipe::delayed;
    m.fresh = Tensor();  // (no amax slot: delayed casts take none)
    fn(at, stop - at, m);
    at = stop;
  }
}

void GptModel::reduce_fp8_param_amax() {
  if (!fp8_params()) return;
  for (Fp8State* st : fp8_states())
    if (st->any()) st->reduce_amax(ps_);
}

void GptModel::update_fp8_param_scales() {
  if (!fp8_params() || opt_.fp8.recipe != Fp8Recipe::tensorwise) return;
  for (Fp8State* st : fp8_states())
    if (st->any()) st->update_weight_scales(be_);
}

bool GptModel::weights_amax_from_update() const {
  return opt_.seams.fp8_producer_amax && opt_.fp8.recipe == Fp8Recipe::tensorwise &&
         fp8_.any() && !fp8_params();
}

Tensor GptModel::weight_cast_amax_slot(int i) const {
  const auto [local, g] = fp8_weight_gemm_.at(static_cast<size_t>(i));
  if (local < 0 || !weights_amax_from_update()) return Tensor();
  return fp8_.fresh(local, static_cast<Fp8State::Gemm>(g), Fp8State::w);
}

void GptModel::fp8_weights_updated() {
  if (!weights_amax_from_update()) return;
  // The distributed optimizer's shards: each rank took its pieces' amaxes; the max over DP is the
  // whole weight's (the all-gather brings every rank the weights those pieces became).
  if (grad_layout_.sharded) fp8_.reduce_fresh_over_dp(ps_);
  for (int l = 0; l < d_.stage_layers(); ++l) fp8_weight_amax_taken_[static_cast<size_t>(l)] = fp8_layer(l) ? 1 : 0;
}

void GptModel::fp8_cast_shard(int b) {
  if (!fp8_params() || !grad_layout_.fp8_bucket(b)) return;
  const int64_t state = grad_layout_.state_offset[static_cast<size_t>(b)], flat = grad_layout_.shard_offset(b);
  const bool sharded = param_shard_bucket(b);  // (ZeRO-3: into this rank's shard, gathered when needed)
  for (const ShardSegment& s : grad_layout_.shard_segments(b))
    for_each_fp8_param_piece(s.param, s.param_offset, s.numel, [&](int64_t at, int64_t n, const Fp8TensorMeta& m) {
      // A piece of a weight is a [1, n] matrix to the cast: the row-major copy only, no transpose.
      const int64_t in_shard = s.shard_offset + (at - s.param_offset);
      const Tensor master = master_.flat_slice(state + in_shard, n).view({1, n});
      const Tensor out = sharded ? param_shard(b).flat_slice(in_shard, n) : param_storage(flat + in_shard, n);
      be_.fp8_quantize(out.view({1, n}), Tensor(), master, m);
    });
}

void GptModel::fp8_params_from_master(bool fresh_state) {
  if (!fp8_params()) return;
  const GradLayout& L = grad_layout_;
  if (fresh_state)
    for (Fp8State* st : fp8_states()) st->initialize(be_);
  if (fresh_state || opt_.fp8.recipe == Fp8Recipe::tensorwise) {
    // A first cast with the scales there are (its bits are overwritten below) records every
    // shard's amax; their max over TP and DP (the experts': over their replicas and expert TP)
    // sets each weight's scale, as the first delayed-scaling update would from the weight's amax
    // alone. The amax stays recorded for that update.
    for (int b = 0; b < L.num_buckets(); ++b) fp8_cast_shard(b);
    reduce_fp8_param_amax();
    for (Fp8State* st : fp8_states()) st->set_weight_scales_from_amax(be_);
  }
  for (int b = 0; b < L.num_buckets(); ++b) fp8_cast_shard(b);
  param_shards_updated();  // (sharded parameters: the layers gather theirs when needed)
  for (int b = 0; b < L.num_buckets(); ++b) {
    if (!L.fp8_bucket(b) || param_shard_bucket(b)) continue;
    Communicator& group = L.is_expert_bucket(b) ? ps_.expert_dist_opt_group() : ps_.dist_opt_group();
    if (group.size() <= 1) continue;
    const GradBucket& k = L.plan.buckets[static_cast<size_t>(b)];
    const Tensor whole = param_storage(k.offset, k.numel);
    group.all_gather(whole, whole.flat_slice(L.shard_offset(b) - k.offset, L.shard_numel(b)));
  }
  be_.synchronize();
  fp8_begin_step();  // the transposed copies follow
}

Tensor GptModel::compute_weight(int local, Fp8State::Gemm g, Tensor w) {
  if (!is_fp8(w.dtype)) return w;
  MT_CHECK(!fp8_w_compute_.empty(), "layer {}: an FP8 weight in a compute-dtype GEMM without a workspace",
           d_.layer_begin + local);
  const Tensor out = fp8_w_compute_.flat_slice(0, w.numel()).view({w.rows(), w.cols()});
  be_.fp8_dequantize(out, w, fp8_.scale_inv(local, g, Fp8State::w));
  return out;
}

// Evaluation forwards record no amax (their tensors are not the training step's), so a refresh
// made by one does not count as fresh for training.
Fp8TensorMeta GptModel::fp8_meta(int local, Fp8State::Gemm g, Fp8State::Role r) const {
  Fp8TensorMeta m = fp8_.meta(local, g, r);
  if (!fp8_training_) m.amax = Tensor();
  return m;
}

void GptModel::fp8_refresh_weights(int local) {
  const char fresh = fp8_training_ ? 1 : 2;  // 2: cast by an evaluation forward (no amax recorded)
  if (fp8_fresh_[static_cast<size_t>(local)] == 1 || fp8_fresh_[static_cast<size_t>(local)] == fresh) return;
  const LayerParams& P = layer_params_[static_cast<size_t>(local)];
  const Tensor w[Fp8State::kGemms] = {P.qkv_w, P.proj_w, P.fc1_w, P.fc2_w};
  const Fp8Weights& c = fp8_w_[static_cast<size_t>(local)];
  // The optimizer's last update took the weights' amaxes (weight_cast_amax_slot): this cast uses
  // them, whether a training or an evaluation forward's; a later recast takes its own.
  char& taken = fp8_weight_amax_taken_[static_cast<size_t>(local)];
  for (int g = 0; g < Fp8State::kGemms; ++g) {
    // (No cache: an MoE layer's fc1 and fc2, its experts cast their own; multi-latent attention's
    // projection, fp8_extra_'s.)
    if (w[g].empty() || c.q_t[g].empty()) continue;
    if (is_fp8(w[g].dtype)) {
      be_.fp8_transpose(c.q_t[g], c.q[g]);  // an FP8 parameter: cast by the optimizer
      continue;
    }
    Fp8TensorMeta m = fp8_meta(local, static_cast<Fp8State::Gemm>(g), Fp8State::w);
    m.fresh_taken = taken != 0;
    be_.fp8_quantize(c.q[g], c.q_t[g], w[g], m);
  }
  taken = 0;
  fp8_fresh_[static_cast<size_t>(local)] = fresh;
}


bool GptModel::fp8_norm_cast(int local, const LayerActs& A) const {
  // (Multi-latent attention's blocks write their norm outputs: its GEMMs are fp8_extra_'s.)
  return opt_.seams.fp8_norm_cast && fp8_gemms(local) && !A.norm_kept && !d_.sequence_parallel && !d_.mla;
}

bool GptModel::norm_takes_cast_amax(int local, const LayerActs& A) const {
  return opt_.seams.fp8_producer_amax && opt_.fp8.recipe == Fp8Recipe::tensorwise && fp8_norm_cast(local, A);
}

Tensor GptModel::norm_cast_amax(int local, const LayerActs& A, Fp8State::Gemm g) const {
  return norm_takes_cast_amax(local, A) ? fp8_.fresh(local, g, Fp8State::x) : Tensor();
}

// The norm backwards that write proj's and fc2's output gradients: the plain norm_backward (not
// the recomputing one) runs where layer_backward takes it, and the gradient the cast reads is the
// norm's dx itself only without hidden dropout and sequence parallelism (expand_grad). Not the
// final norm's for the last layer: the head's backward runs at the end of the forward, and other
// micro-batches' forwards may come before this one's backward (pipeline schedules).
bool GptModel::dy_amax_from_norm(const Slot& s, int local, Fp8State::Gemm g) const {
  if (!opt_.seams.fp8_producer_amax || opt_.fp8.recipe != Fp8Recipe::tensorwise || !fp8_layer(local) ||
      d_.hidden_dropout > 0 || d_.sequence_parallel)
    return false;
  const auto plain_norm_backward = [&](int l) { return fp8_kept_inputs(l) || acts(s, l).norm_kept; };
  // (An MoE layer's ln2 backward, moe_backward's, takes no amax; multi-latent attention's projection is
  // fp8_extra_'s.)
  if (g == Fp8State::proj) return plain_norm_backward(local) && !d_.is_moe(d_.layer_begin + local) && !d_.mla;
  MT_CHECK(g == Fp8State::fc2, "dy_amax_from_norm: GEMM {} has no norm backward writing its output gradient",
           static_cast<int>(g));
  // (Multi-latent attention's input norm backward takes no amax.)
  // (Nor an MTP depth's: its input is its projection's output, not this layer's.)
  return local + 1 < d_.stage_layers() && plain_norm_backward(local + 1) && !d_.mla &&
         !d_.is_mtp(d_.layer_begin + local + 1);
}

Tensor GptModel::dy_amax_slot(const Slot& s, int local, Fp8State::Gemm g) const {
  return local >= 0 && dy_amax_from_norm(s, local, g) ? fp8_.fresh(local, g, Fp8State::dy) : Tensor();
}

Tensor GptModel::dy_amax_from_dropout(int local, Fp8State::Gemm g) const {
  if (!opt_.seams.fp8_producer_amax || opt_.fp8.recipe != Fp8Recipe::tensorwise || !fp8_layer(local) ||
      d_.hidden_dropout <= 0 || d_.sequence_parallel)
    return Tensor();
  return fp8_.fresh(local, g, Fp8State::dy);
}

void GptModel::linear_fwd(int local, Fp8State::Gemm g, const LayerActs& A, Tensor y, Tensor x, Tensor w, Tensor bias,
                          Activation act, Tensor pre_act, const NormInput* norm) {
  MT_CHECK(!norm || fp8_gemms(local), "layer {}: an FP8 cast from a norm outside FP8 GEMMs", d_.layer_begin + local);
  if (!fp8_layer(local)) {
    be_.linear_forward(y, x, w, bias, act, pre_act);
    return;
  }
  fp8_refresh_weights(local);  // (calibrating: records the weights' amaxes)
  const Tensor xq = fp8_quantize_input(local, g, A, x, nullptr, norm);
  if (!fp8_gemms(local)) {  // calibrating: the cast above recorded x's amax; its bits go unused
    be_.linear_forward(y, x, compute_weight(local, g, w), bias, act, pre_act);
    return;
  }
  be_.fp8_linear_forward(y, xq, fp8_.scale_inv(local, g, Fp8State::x), fp8_w_[static_cast<size_t>(local)].q[g],
                         fp8_.scale_inv(local, g, Fp8State::w), bias, act, pre_act);
}

void GptModel::fc2_fwd_from_fc1(int local, const LayerActs& A, Tensor y, Tensor fc1_pre, MlpActivation act) {
  MT_CHECK(fp8_gemms(local), "layer {}: fc2's fused FP8 input cast outside FP8 GEMMs", d_.layer_begin + local);
  const Fp8State::Gemm g = Fp8State::fc2;
  fp8_refresh_weights(local);
  const Tensor xq = fp8_quantize_input(local, g, A, fc1_pre, &act);
  be_.fp8_linear_forward(y, xq, fp8_.scale_inv(local, g, Fp8State::x), fp8_w_[static_cast<size_t>(local)].q[g],
                         fp8_.scale_inv(local, g, Fp8State::w), Tensor(), Activation::none, Tensor());
}

// One cast for both FP8 GEMMs that take the input x (or act(x), act not null): the row-major copy
// for the forward GEMM (workspace, returned) and, in training, the transposed one for the weight
// gradient, kept with the layer's activations. (Evaluation forwards have no backward, and a
// recomputed layer's first forward none of its own: the recompute writes them again. Neither
// writes the copy nor its scale_inv.)
Tensor GptModel::fp8_quantize_input(int local, Fp8State::Gemm g, const LayerActs& A, Tensor x, const MlpActivation* act,
                                    const NormInput* norm) {
  if (norm) x = norm->x;
  const int64_t cols = act && *act == MlpActivation::swiglu ? x.cols() / 2 : x.cols();
  const Tensor xq = flat_block(fp8_xq_, 0, x.rows(), cols);
  const bool keep = fp8_kept_inputs(local) && fp8_training_ && fp8_keep_inputs_now_;
  if (keep) MT_CHECK(!A.fp8_xq_t[g].empty(), "layer {}: no kept FP8 input planned", d_.layer_begin + local);
  const Tensor xq_t = keep ? A.fp8_xq_t[g] : Tensor();
  Fp8TensorMeta meta = fp8_meta(local, g, Fp8State::x);
  if (keep && !A.fp8_x_scale_inv.empty()) meta.scale_inv_copy = A.fp8_x_scale_inv.flat_slice(g, 1);  // (tensorwise)
  if (norm) {
    meta.fresh_taken = norm_takes_cast_amax(local, A);  // the norm's statistics op took it
    be_.fp8_quantize_norm(xq, xq_t, norm->x, norm->mean, norm->rstd, norm->weight, norm->bias, norm_, meta);
  } else if (act) {
    be_.fp8_quantize_activation(xq, xq_t, x, *act, meta, d_.glu);
  } else {
    be_.fp8_quantize(xq, xq_t, x, meta);
  }
  return xq;
}

void GptModel::linear_quantize_dy(int local, Fp8State::Gemm g, Tensor dy, Tensor dbias, bool amax_taken) {
  if (!fp8_layer(local)) return;
  const Tensor dyq = flat_block(fp8_dyq_, 0, dy.rows(), dy.cols());
  const Tensor dyq_t = opt_.fp8.wgrad ? flat_block(fp8_dyq_t_, 0, dy.cols(), dy.rows()) : Tensor();
  Fp8TensorMeta meta = fp8_.meta(local, g, Fp8State::dy);
  meta.fresh_taken = amax_taken;
  if (fp8_wgrad(local) && !dbias.empty()) be_.fp8_quantize_with_dbias(dyq, dyq_t, dy, meta, dbias);
  else be_.fp8_quantize(dyq, dyq_t, dy, meta);
}

void GptModel::linear_quantize_dy_activation(int local, Tensor dout, Tensor pre, MlpActivation act, Tensor dbias) {
  const Fp8State::Gemm g = Fp8State::fc1;
  MT_CHECK(fp8_wgrad(local), "layer {}: the fused activation-gradient cast outside FP8 weight gradients",
           d_.layer_begin + local);
  const int64_t cols = act == MlpActivation::swiglu ? 2 * dout.cols() : dout.cols();  // fc1's output width
  be_.fp8_quantize_activation_backward(flat_block(fp8_dyq_, 0, dout.rows(), cols), flat_block(fp8_dyq_t_, 0, cols, dout.rows()),
                                       dout, pre, act, fp8_.meta(local, g, Fp8State::dy), dbias, d_.glu);
}

void GptModel::linear_bwd_input(int local, Fp8State::Gemm g, Tensor dx, Tensor dy, Tensor w, Activation act,
                                Tensor pre_act) {
  if (!fp8_gemms(local)) {  // (calibrating: linear_quantize_dy recorded dy's amax)
    be_.linear_backward_input(dx, dy, fp8_layer(local) ? compute_weight(local, g, w) : w, false, act, pre_act);
    return;
  }
  be_.fp8_linear_backward_input(dx, flat_block(fp8_dyq_, 0, dy.rows(), dy.cols()), fp8_.scale_inv(local, g, Fp8State::dy),
                                fp8_w_[static_cast<size_t>(local)].q_t[g], fp8_.scale_inv(local, g, Fp8State::w), false,
                                act, pre_act);
}

void GptModel::linear_bwd_weight(int local, Fp8State::Gemm g, const LayerActs& A, Tensor dw, Tensor dbias, Tensor dy,
                                 Tensor x) {
  const bool accumulate = accumulate_weight_grad(dw);
  if (!fp8_wgrad(local)) {
    be_.linear_backward_weight(dw, dbias, dy, x, accumulate);
    return;
  }
  Tensor xq_t, x_scale_inv = fp8_.scale_inv(local, g, Fp8State::x);
  if (fp8_kept_inputs(local)) {
    // The forward's transposed copy (delayed scaling: the scales hold still within a step).
    xq_t = A.fp8_xq_t[g];
    if (!A.fp8_x_scale_inv.empty()) x_scale_inv = A.fp8_x_scale_inv.flat_slice(g, 1);
  } else {
    // x was recomputed (or kept) in the compute dtype: quantized again with its forward scale
    // (tensorwise: recomputed from the same x), so the same bits as the forward's cast.
    xq_t = flat_block(fp8_xq_t_, 0, x.cols(), x.rows());
    be_.fp8_quantize(Tensor(), xq_t, x, fp8_.meta(local, g, Fp8State::x));
  }
  // (The bias gradient was taken by linear_quantize_dy's cast.)
  be_.fp8_linear_backward_weight(dw, Tensor(), Tensor(), flat_block(fp8_dyq_t_, 0, dy.cols(), dy.rows()),
                                 fp8_.scale_inv(local, g, Fp8State::dy), xq_t, x_scale_inv, accumulate);
}

// ---- micro-batch I/O ---------------------------------------------------------------------

// Norm -> column-parallel linear under sequence parallelism, backward from the linear's output
// gradient d_out (all rows) to dx (this rank's rows), in Megatron's overlapped order: the norm
// output is recomputed for this rank's rows (norm_forward from the norm's input: the same bits, the
// statistics rewritten with the values they hold) and all-gathered on the TP stream while the
// input-gradient GEMM runs; that gradient is reduce-scattered on the TP stream while the
// weight-gradient GEMM runs; then the norm's backward. (gT holds the input gradient, all rows.)
// FP8 layers with kept inputs skip the recompute and the all-gather: the weight-gradient GEMM
// takes the forward's FP8 copy of the gathered norm output (A.fp8_xq_t), and the norm's backward
// needs only its input and statistics.
void GptModel::column_parallel_backward_sp(int local, Fp8State::Gemm fp8_slot, const LayerActs& A, Tensor norm_out,
                                           Tensor norm_mean, Tensor norm_rstd, Tensor norm_in, Tensor norm_w,
                                           Tensor norm_b, Tensor norm_dw, Tensor norm_db, Tensor d_out, Tensor weight,
                                           Tensor dweight, Tensor dbias, Tensor dx, Tensor dresidual) {
  const Workspace& w = *ws_;
  const bool gather = !fp8_kept_inputs(local);
  if (gather) {
    be_.norm_forward(local_rows(norm_out), norm_mean, norm_rstd, norm_in, norm_w, norm_b, norm_);
    be_.tp_comm_wait_for_compute();
    tp_overlap_->all_gather(norm_out, local_rows(norm_out));
  }
  // (On the copy engines the all-gather needs SMs only for its few synchronizing steps; leaving the
  // GEMM fewer SMs for them measured no gain: bench_tp_overlap, bench/RESULTS.md.)
  linear_bwd_input(local, fp8_slot, w.gT, d_out, weight, Activation::none, Tensor());
  if (gather) be_.compute_wait_for_tp_comm();  // the norm output, all rows
  be_.tp_comm_wait_for_compute();  // the input gradient
  tp_overlap_->reduce_scatter(local_rows(w.gT), w.gT);
  linear_bwd_weight(local, fp8_slot, A, dweight, dbias, d_out, norm_out);
  be_.compute_wait_for_tp_comm();
  be_.norm_backward(dx, norm_dw, norm_db, local_rows(w.gT), norm_in, norm_mean, norm_rstd, norm_w, dresidual, Tensor(),
                    norm_);
}

}  // namespace mt

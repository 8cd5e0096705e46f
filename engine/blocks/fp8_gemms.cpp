// FP8 GEMMs beyond a dense layer's four (GptModel::Fp8Gemm): the routed experts' (one group of rows
// per local expert, each expert with its own scaling state, as Transformer Engine's grouped linear
// layers keep one per GEMM) and multi-latent attention's and the MTP projection's (one group of all
// rows). Each group's GEMMs are the FP8 linear ops of engine/backend.h on its rows:
//   forward         x cast with its scale (row-major), w cast (row-major): y = x . w^T
//   backward        dy cast (row-major, and transposed for the weight gradient): dx = dy . w (w
//                   cast transposed), dw (+)= dy^T . x (x cast again, transposed, with its forward
//                   scale: the forward's bits)
// Weights are cast at each use (the scales hold still within a step, so the same bits each time),
// where the dense layers keep a per-layer cache: an MoE layer's experts are most of the model. The
// casts of one op at a time share the workspaces laid out here. Each cast of an op's groups is one
// Backend::fp8_quantize_groups (one launch on the GPU for delayed scaling: a cast per expert, about
// 640 launches per MoE layer of 64 experts, made moe-fine-grained's FP8 step 14% longer on an H100,
// bench/RESULTS.md). FP8 parameters (--fp8-param-gather)
// are the optimizer's casts already, with the same scales: the forward reads them as they are, the
// input gradient a transposed copy, and while delayed scaling calibrates the compute-dtype GEMMs
// take them dequantized (as the dense layers' compute_weight).
#include <algorithm>
#include <array>

#include "core/error.h"
#include "engine/gpt_model.h"
#include "engine/gpt_model_parts.h"

namespace mt {

// The workspaces, for the largest op of this stage: inputs [rows, K] and their transposed blocks,
// output gradients [rows, N] likewise, one op's weights (all groups), and (multi-latent attention)
// an input gradient to add to another.
void GptModel::layout_fp8_gemm_workspace(Arena& a) {
  fp8_ex_.layout(a);
  fp8_extra_.layout(a);
  fp8_ex_q_ = fp8_ex_q_t_ = fp8_ex_dq_ = fp8_ex_dq_t_ = fp8_ex_w_ = fp8_ex_acc_ = fp8_ex_wc_ = Tensor();
  if (!fp8_ex_.any() && !fp8_extra_.any()) return;
  struct Gemm {
    int64_t rows, n, k, groups;  // y [rows, n] = x [rows, k] . w^T per group
  };
  std::vector<Gemm> gemms;
  const int64_t N = d_.tokens(), h = d_.hidden;
  if (fp8_ex_.any()) {
    const int64_t R = moe_max_rows(), El = d_.experts_local();
    gemms.push_back({R, d_.expert_fc1_width_local(), h, El});
    gemms.push_back({R, h, d_.expert_ffn_local(), El});
  }
  if (fp8_extra_.any() && d_.mla) {
    const int64_t q_in = d_.q_lora > 0 ? d_.q_lora : h;
    if (d_.q_lora > 0) gemms.push_back({N, d_.q_lora, h, 1});
    gemms.push_back({N, d_.mla_q_width_local(), q_in, 1});
    gemms.push_back({N, d_.mla_down_width(), h, 1});
    gemms.push_back({N, d_.mla_kv_width_local(), d_.kv_lora, 1});
    gemms.push_back({N, h, d_.proj_width_local(), 1});
  }
  if (fp8_extra_.any() && d_.stage_mtp_layers() > 0) gemms.push_back({N, h / d_.tp_size, 2 * h, 1});
  const bool shared = fp8_extra_.any() && d_.any_moe() && d_.shared_ffn > 0;
  if (shared) {
    gemms.push_back({N, d_.shared_fc1_width_local(), h, 1});
    gemms.push_back({N, h, d_.shared_ffn_local(), 1});
  }
  int64_t q = 0, dq = 0, w = 0, acc = 0, group_w = 0;
  for (const Gemm& g : gemms) {
    q = std::max(q, g.rows * g.k);
    dq = std::max(dq, g.rows * g.n);
    w = std::max(w, g.groups * g.n * g.k);
    group_w = std::max(group_w, g.n * g.k);
  }
  // (An input gradient added to gT's: MLA's query projections', the shared expert's.)
  if (fp8_extra_.any() && (d_.mla || shared)) acc = N * h;
  using C = MemoryCategory;
  const Fp8State& st = fp8_ex_.any() ? fp8_ex_ : fp8_extra_;
  const DType e4 = st.dtype(Fp8State::x), g = st.dtype(Fp8State::dy);
  fp8_ex_q_ = a.take(C::workspace, e4, {q});
  fp8_ex_dq_ = a.take(C::workspace, g, {dq});
  if (opt_.fp8.wgrad) {
    fp8_ex_q_t_ = a.take(C::workspace, e4, {q});
    fp8_ex_dq_t_ = a.take(C::workspace, g, {dq});
  }
  fp8_ex_w_ = a.take(C::workspace, e4, {w});
  // (The host side of the grouped casts: every group's meta and the weights' row offsets.)
  int64_t most_groups = 1;
  for (const Gemm& gm : gemms) most_groups = std::max(most_groups, gm.groups);
  fp8g_metas_.assign(static_cast<size_t>(most_groups), Fp8TensorMeta());
  fp8g_w_off_.assign(static_cast<size_t>(most_groups) + 1, 0);
  if (acc > 0) fp8_ex_acc_ = a.take(C::workspace, opt_.compute, {acc});
  // (FP8 parameters, delayed scaling: one group's weight dequantized for the calibrating step.)
  if (opt_.fp8.param_gather && opt_.fp8.recipe == Fp8Recipe::delayed)
    fp8_ex_wc_ = a.take(C::workspace, opt_.compute, {group_w});
}

Fp8TensorMeta GptModel::fp8g_meta(const Fp8Gemm& f, int local, int group, Fp8State::Role r) const {
  Fp8TensorMeta m = f.state->meta(local, f.first + f.stride * group, r);
  if (!fp8_training_) m.amax = Tensor();  // (evaluation forwards record nothing)
  m.fresh = Tensor();                     // (tensorwise: each cast takes its own amax)
  return m;
}

// Every group's meta of role r (in fp8g_metas_, laid out for the most groups of any op).
std::span<const Fp8TensorMeta> GptModel::fp8g_metas(const Fp8Gemm& f, int local, int groups, Fp8State::Role r) {
  MT_CHECK(static_cast<size_t>(groups) <= fp8g_metas_.size(), "{} FP8 GEMM groups, workspace for {}", groups,
           fp8g_metas_.size());
  for (int e = 0; e < groups; ++e) fp8g_metas_[static_cast<size_t>(e)] = fp8g_meta(f, local, e, r);
  return {fp8g_metas_.data(), static_cast<size_t>(groups)};
}

// Each group's weight cast with its own scale: row-major [N, K] blocks, or transposed [K, N] ones
// (the input gradient's operand), group after group in fp8_ex_w_. FP8 parameters: the row-major
// blocks are the parameter's own, the transposed ones copies.
void GptModel::fp8g_cast_weights(const Fp8Gemm& f, int local, Tensor w, int groups, bool transposed) {
  const int64_t Nw = w.rows() / groups, K = w.cols();
  if (is_fp8(w.dtype)) {
    if (!transposed) return;
    for (int e = 0; e < groups; ++e)
      be_.fp8_transpose(flat_block(fp8_ex_w_, e * Nw * K, K, Nw), w.row_slice(e * Nw, Nw));
    return;
  }
  for (int e = 0; e <= groups; ++e) fp8g_w_off_[static_cast<size_t>(e)] = e * Nw;
  const std::span<const int64_t> off(fp8g_w_off_.data(), static_cast<size_t>(groups) + 1);
  be_.fp8_quantize_groups(transposed ? Tensor() : flat_block(fp8_ex_w_, 0, groups * Nw, K),
                          transposed ? fp8_ex_w_ : Tensor(), w, off, fp8g_metas(f, local, groups, Fp8State::w));
}

// Group e's row-major FP8 weight after fp8g_cast_weights.
Tensor GptModel::fp8g_weight(Tensor w, int groups, int e) const {
  const int64_t Nw = w.rows() / groups, K = w.cols();
  return is_fp8(w.dtype) ? w.row_slice(e * Nw, Nw) : flat_block(fp8_ex_w_, e * Nw * K, Nw, K);
}

// FP8 parameters while the state calibrates: group e's weight in the compute dtype.
Tensor GptModel::fp8g_compute_weight(const Fp8Gemm& f, int local, Tensor w, int groups, int e) {
  MT_CHECK(!fp8_ex_wc_.empty(), "layer {}: an FP8 parameter in a compute-dtype GEMM without a workspace",
           d_.layer_begin + local);
  const int64_t Nw = w.rows() / groups, K = w.cols();
  const Tensor out = flat_block(fp8_ex_wc_, 0, Nw, K);
  be_.fp8_dequantize(out, w.row_slice(e * Nw, Nw), f.state->scale_inv(local, f.first + f.stride * e, Fp8State::w));
  return out;
}

void GptModel::fp8g_forward(const Fp8Gemm& f, int local, Tensor y, Tensor x, Tensor w, std::span<const int64_t> off) {
  const int groups = static_cast<int>(off.size()) - 1;
  const int64_t K = x.cols();
  const bool gemms = !f.state->calibrating();
  fp8g_cast_weights(f, local, w, groups, false);  // (calibrating: records the weights' amaxes)
  be_.fp8_quantize_groups(flat_block(fp8_ex_q_, 0, off.back(), K), Tensor(), x, off,
                          fp8g_metas(f, local, groups, Fp8State::x));
  for (int e = 0; e < groups; ++e) {
    const int64_t b = off[static_cast<size_t>(e)], M = off[static_cast<size_t>(e) + 1] - b;
    if (M == 0) continue;
    const int g = f.first + f.stride * e;
    const Tensor xq = flat_block(fp8_ex_q_, b * K, M, K);
    if (gemms)
      be_.fp8_linear_forward(y.row_slice(b, M), xq, f.state->scale_inv(local, g, Fp8State::x), fp8g_weight(w, groups, e),
                             f.state->scale_inv(local, g, Fp8State::w), Tensor(), Activation::none, Tensor());
  }
  if (gemms) return;
  // Calibrating: the compute-dtype GEMMs (the casts above recorded the amaxes).
  if (is_fp8(w.dtype)) {
    for (int e = 0; e < groups; ++e) {
      const int64_t b = off[static_cast<size_t>(e)], M = off[static_cast<size_t>(e) + 1] - b;
      if (M > 0)
        be_.linear_forward(y.row_slice(b, M), x.row_slice(b, M), fp8g_compute_weight(f, local, w, groups, e), Tensor(),
                           Activation::none, Tensor());
    }
  } else if (f.state->experts()) {
    be_.grouped_linear_forward(y, x, w, off);
  } else {
    be_.linear_forward(y, x, w, Tensor(), Activation::none, Tensor());
  }
}

void GptModel::fp8g_quantize_dy(const Fp8Gemm& f, int local, Tensor dy, std::span<const int64_t> off) {
  const int groups = static_cast<int>(off.size()) - 1;
  be_.fp8_quantize_groups(flat_block(fp8_ex_dq_, 0, off.back(), dy.cols()), fp8_ex_dq_t_, dy, off,
                          fp8g_metas(f, local, groups, Fp8State::dy));
}

void GptModel::fp8g_backward_input(const Fp8Gemm& f, int local, Tensor dx, Tensor dy, Tensor w,
                                   std::span<const int64_t> off, bool accumulate) {
  const int groups = static_cast<int>(off.size()) - 1;
  if (f.state->calibrating()) {  // (fp8g_quantize_dy recorded dy's amax)
    if (is_fp8(w.dtype)) {
      for (int e = 0; e < groups; ++e) {
        const int64_t b = off[static_cast<size_t>(e)], M = off[static_cast<size_t>(e) + 1] - b;
        if (M > 0)
          be_.linear_backward_input(dx.row_slice(b, M), dy.row_slice(b, M), fp8g_compute_weight(f, local, w, groups, e),
                                    accumulate, Activation::none, Tensor());
      }
    } else if (f.state->experts()) {
      MT_CHECK(!accumulate, "a grouped input gradient does not accumulate");
      be_.grouped_linear_backward_input(dx, dy, w, off);
    } else {
      be_.linear_backward_input(dx, dy, w, accumulate, Activation::none, Tensor());
    }
    return;
  }
  const int64_t Nw = w.rows() / groups, K = w.cols();
  // (The FP8 GEMM accumulates into float32 only: otherwise into the workspace, then added.)
  const bool staged = accumulate && dx.dtype != DType::f32;
  const Tensor out = staged ? flat_block(fp8_ex_acc_, 0, dx.rows(), dx.cols()) : dx;
  fp8g_cast_weights(f, local, w, groups, true);
  for (int e = 0; e < groups; ++e) {
    const int64_t b = off[static_cast<size_t>(e)], M = off[static_cast<size_t>(e) + 1] - b;
    if (M == 0) continue;
    const int g = f.first + f.stride * e;
    be_.fp8_linear_backward_input(out.row_slice(b, M), flat_block(fp8_ex_dq_, b * Nw, M, Nw),
                                  f.state->scale_inv(local, g, Fp8State::dy), flat_block(fp8_ex_w_, e * Nw * K, K, Nw),
                                  f.state->scale_inv(local, g, Fp8State::w), accumulate && !staged, Activation::none,
                                  Tensor());
  }
  if (staged) be_.axpby(dx, 1.0f, dx, 1.0f, out);
}

void GptModel::fp8g_backward_weight(const Fp8Gemm& f, int local, Tensor dw, Tensor dbias, Tensor dy, Tensor x,
                                    std::span<const int64_t> off) {
  const bool accumulate = accumulate_weight_grad(dw);
  const int groups = static_cast<int>(off.size()) - 1;
  if (f.state->calibrating() || !opt_.fp8.wgrad) {
    if (f.state->experts()) {
      MT_CHECK(dbias.empty(), "grouped weight gradients take no bias");
      be_.grouped_linear_backward_weight(dw, dy, x, off, accumulate);
    } else {
      be_.linear_backward_weight(dw, dbias, dy, x, accumulate);
    }
    return;
  }
  const int64_t Nw = dw.rows() / groups, K = dw.cols();
  // The input cast again with its forward scale (tensorwise: from the same values), so the
  // forward's bits; the output gradient's transposed blocks from fp8g_quantize_dy.
  be_.fp8_quantize_groups(Tensor(), fp8_ex_q_t_, x, off, fp8g_metas(f, local, groups, Fp8State::x));
  for (int e = 0; e < groups; ++e) {
    const int64_t b = off[static_cast<size_t>(e)], M = off[static_cast<size_t>(e) + 1] - b;
    const Tensor dwe = dw.row_slice(e * Nw, Nw);
    if (M == 0) {
      if (!accumulate) be_.fill(dwe, 0.0);
      continue;
    }
    const int g = f.first + f.stride * e;
    const Tensor xqt = flat_block(fp8_ex_q_t_, b * K, K, M);
    be_.fp8_linear_backward_weight(dwe, groups == 1 ? dbias : Tensor(), groups == 1 ? dy : Tensor(),
                                   flat_block(fp8_ex_dq_t_, b * Nw, Nw, M), f.state->scale_inv(local, g, Fp8State::dy), xqt,
                                   f.state->scale_inv(local, g, Fp8State::x), accumulate);
  }
}

// ---- the experts' GEMMs (engine/blocks/moe.cpp) -------------------------------------------

void GptModel::expert_linear_fwd(int local, int which, Tensor y, Tensor x, Tensor w, const ExpertOffsets& offsets) {
  if (!fp8_experts(local)) {
    be_.grouped_linear_forward(y, x, w, offsets);
    return;
  }
  MT_CHECK(static_cast<int>(offsets.host.size()) == d_.experts_local() + 1, "FP8 experts without their host offsets");
  fp8g_forward(expert_gemm(which), local, y, x, w, offsets.host);
}

void GptModel::expert_quantize_dy(int local, int which, Tensor dy, const ExpertOffsets& offsets) {
  if (fp8_experts(local)) fp8g_quantize_dy(expert_gemm(which), local, dy, offsets.host);
}

void GptModel::expert_linear_bwd_input(int local, int which, Tensor dx, Tensor dy, Tensor w,
                                       const ExpertOffsets& offsets) {
  if (!fp8_experts(local)) {
    be_.grouped_linear_backward_input(dx, dy, w, offsets);
    return;
  }
  fp8g_backward_input(expert_gemm(which), local, dx, dy, w, offsets.host, false);
}

void GptModel::expert_linear_bwd_weight(int local, int which, Tensor dw, Tensor dy, Tensor x,
                                        const ExpertOffsets& offsets) {
  if (!fp8_experts(local)) {
    // (ModelOptions::expert_grad_sumsq: the one write of the step, whose squares the norm takes.)
    const bool accumulate = accumulate_weight_grad(dw);
    MT_CHECK(expert_sumsq_.empty() || !accumulate, "the experts' weight gradient is added to while its sum of "
             "squares is taken as it is written (ModelOptions::expert_grad_sumsq)");
    be_.grouped_linear_backward_weight(dw, dy, x, offsets, accumulate, expert_sumsq_);
    return;
  }
  MT_CHECK(expert_sumsq_.empty(), "FP8 experts with their sum of squares taken in the GEMM");
  fp8g_backward_weight(expert_gemm(which), local, dw, Tensor(), dy, x, offsets.host);
}

// ---- multi-latent attention's and the MTP projection's GEMMs --------------------------------

void GptModel::extra_linear_fwd(int local, int g, Tensor y, Tensor x, Tensor w) {
  if (!fp8_extra_layer(local)) {
    be_.linear_forward(y, x, w, Tensor(), Activation::none, Tensor());
    return;
  }
  const std::array<int64_t, 2> off{0, x.rows()};
  fp8g_forward(extra_gemm(g), local, y, x, w, off);
}

void GptModel::extra_linear_bwd(int local, int g, Tensor dw, Tensor dbias, Tensor dx, Tensor dy, Tensor x, Tensor w,
                                bool accumulate_dx) {
  if (!fp8_extra_layer(local)) {
    be_.linear_backward_weight(dw, dbias, dy, x, accumulate_weight_grad(dw));
    be_.linear_backward_input(dx, dy, w, accumulate_dx, Activation::none, Tensor());
    return;
  }
  const std::array<int64_t, 2> off{0, dy.rows()};
  const Fp8Gemm f = extra_gemm(g);
  fp8g_quantize_dy(f, local, dy, off);
  fp8g_backward_weight(f, local, dw, dbias, dy, x, off);
  fp8g_backward_input(f, local, dx, dy, w, off, accumulate_dx);
}

void GptModel::extra_linear_bwd_input(int local, int g, Tensor dx, Tensor dy, Tensor w, bool accumulate_dx) {
  if (!fp8_extra_layer(local)) {
    be_.linear_backward_input(dx, dy, w, accumulate_dx, Activation::none, Tensor());
    return;
  }
  const std::array<int64_t, 2> off{0, dy.rows()};
  fp8g_quantize_dy(extra_gemm(g), local, dy, off);
  fp8g_backward_input(extra_gemm(g), local, dx, dy, w, off, accumulate_dx);
}

void GptModel::extra_linear_bwd_weight(int local, int g, Tensor dw, Tensor dy, Tensor x) {
  if (!fp8_extra_layer(local)) {
    be_.linear_backward_weight(dw, Tensor(), dy, x, accumulate_weight_grad(dw));
    return;
  }
  const std::array<int64_t, 2> off{0, dy.rows()};
  fp8g_backward_weight(extra_gemm(g), local, dw, Tensor(), dy, x, off);
}

}  // namespace mt

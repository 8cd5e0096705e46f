#include "engine/backend.h"

#include <vector>

#include "core/error.h"
#include "engine/gdn_shape_check.h"
#include "engine/moe_routing.h"

namespace mt {

void check_gdn_shape(const GdnShape& s, const char* op) {
  MT_CHECK(s.batch > 0 && s.seq > 0 && s.key_heads > 0 && s.value_heads >= s.key_heads &&
               s.value_heads % s.key_heads == 0 && s.dk > 0 && s.dv > 0 && s.conv_k > 0,
           "{}: bad shape (batch {}, seq {}, heads {}/{}, dk {}, dv {}, conv {})", op, s.batch, s.seq, s.key_heads,
           s.value_heads, s.dk, s.dv, s.conv_k);
}

void Backend::moe_capacity_drop(Tensor kept, Tensor idx, Tensor probs, int num_experts, int64_t capacity,
                                int64_t block_rows, bool by_position) {
  const char* op = "moe_capacity_drop";
  const int64_t N = idx.rows(), k = idx.cols();
  MT_CHECK(idx.dtype == DType::i32 && kept.dtype == DType::i32 && kept.numel() == N * k && probs.numel() == N * k &&
               (probs.dtype == DType::f32 || probs.dtype == DType::f64),
           "{}: kept {} {}, idx {} {}, probs {} {}", op, dtype_name(kept.dtype), kept.shape_string(),
           dtype_name(idx.dtype), idx.shape_string(), dtype_name(probs.dtype), probs.shape_string());
  // Host copies (grown once, at the first call: the training step's later calls allocate nothing).
  thread_local std::vector<int32_t> ids, out;
  thread_local std::vector<double> w;
  thread_local std::vector<float> w32;
  ids.resize(static_cast<size_t>(N * k));
  out.resize(ids.size());
  w.resize(ids.size());
  copy_to_host(ids.data(), idx);
  if (probs.dtype == DType::f64) {
    copy_to_host(w.data(), probs);
  } else {
    w32.resize(ids.size());
    copy_to_host(w32.data(), probs);
    for (size_t i = 0; i < w.size(); ++i) w[i] = w32[i];
  }
  moe_capacity_drop_host(out.data(), ids.data(), w.data(), N, static_cast<int>(k), num_experts, capacity, block_rows,
                         by_position);
  copy_from_host(kept, out.data());
}

void check_mla_qkv_args(const char* what, const Tensor& qkv, const Tensor& q, const Tensor& kv, const Tensor& down,
                        const Tensor& positions, const Tensor& cos_sin, const MlaShape& m) {
  const int64_t N = qkv.rows();
  MT_CHECK(m.heads > 0 && m.nope_dim >= 0 && m.rope_dim > 0 && m.v_dim > 0 && m.v_dim <= m.qk_dim() &&
               m.rot_dim % 2 == 0 && m.rot_dim > 0 && m.rot_dim <= m.rope_dim,
           "{}: heads {} nope {} rope {} (rotated {}) v {}", what, m.heads, m.nope_dim, m.rope_dim, m.rot_dim, m.v_dim);
  MT_CHECK(qkv.cols() == m.qkv_width() && q.rows() == N && q.cols() == m.q_width() && kv.rows() == N &&
               kv.cols() == m.kv_width() && down.rows() == N && down.cols() >= m.kr_col + m.rope_dim,
           "{}: qkv {} q {} kv {} down {} for {} heads", what, qkv.shape_string(), q.shape_string(), kv.shape_string(),
           down.shape_string(), m.heads);
  MT_CHECK(qkv.dtype == q.dtype && q.dtype == kv.dtype && kv.dtype == down.dtype, "{}: mixed dtypes", what);
  MT_CHECK(positions.dtype == DType::i32 && positions.numel() == N, "{}: positions [{}] int32", what, N);
  MT_CHECK(cos_sin.cols() == m.rot_dim, "{}: cos_sin {} must be [*, {}]", what, cos_sin.shape_string(), m.rot_dim);
}

void Backend::copy_columns(Tensor dst, int64_t dst_col, Tensor src, int64_t src_col, int64_t cols) {
  MT_CHECK(dst.dtype == src.dtype && dst.rows() == src.rows() && dst_col >= 0 && src_col >= 0 && cols >= 0 &&
               dst_col + cols <= dst.cols() && src_col + cols <= src.cols(),
           "copy_columns: [{}, +{}) of {} x {} into [{}, +{}) of {} x {}", src_col, cols, src.rows(), src.cols(),
           dst_col, cols, dst.rows(), dst.cols());
  for (int64_t r = 0; r < dst.rows(); ++r)
    copy(dst.flat_slice(r * dst.cols() + dst_col, cols), src.flat_slice(r * src.cols() + src_col, cols));
}

void Backend::fill_ranges(Tensor flat, const std::vector<FlatRange>& ranges, double value) {
  for (const FlatRange& r : ranges) fill(flat.flat_slice(r.offset, r.count), value);
}

void Backend::norm_backward_recompute(Tensor out, Tensor dx, Tensor dweight, Tensor dbias, Tensor dout, Tensor x,
                                      Tensor mean, Tensor rstd, Tensor weight, Tensor bias, Tensor dresidual,
                                      Tensor dx_colsum, const NormParams& p) {
  norm_backward(dx, dweight, dbias, dout, x, mean, rstd, weight, dresidual, dx_colsum, p);
  norm_forward(out, mean, rstd, x, weight, bias, p);  // deterministic: the statistics come out the same
}

void Backend::bias_dropout_add_norm(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor residual, Tensor x,
                                    Tensor x_bias, float dropout_p, uint64_t dropout_key, Tensor weight, Tensor bias,
                                    const NormParams& p, Tensor out_amax) {
  bias_dropout_add(sum, x, x_bias, residual, dropout_p, dropout_key);
  norm_forward(out, mean, rstd, sum, weight, bias, p, out_amax);
}

void Backend::linear_backward_input_recompute(Tensor dx, Tensor act_out, Tensor dy, Tensor w, Activation act,
                                              Tensor pre_act) {
  MT_CHECK(act != Activation::none, "linear_backward_input_recompute needs an activation");
  linear_backward_input(dx, dy, w, false, act, pre_act);
  activation_forward(act_out, pre_act, act);
}

void Backend::swiglu_backward_recompute(Tensor din, Tensor act_out, Tensor dout, Tensor in, const Glu& g) {
  MT_CHECK(din.data != in.data && act_out.data != dout.data,
           "swiglu_backward_recompute: the {} backend does not take aliased operands", name());
  swiglu_backward(din, dout, in, g);
  swiglu_forward(act_out, in, g);
}

void Backend::moe_swiglu_forward(Tensor out, Tensor in, Tensor p, const Glu& g) {
  swiglu_forward(out, in, g);
  moe_scale_rows(out, out, p);
}

void Backend::moe_swiglu_backward(Tensor din, Tensor act, Tensor dp, Tensor dout, Tensor in, Tensor p, const Glu& g) {
  swiglu_forward(act, in, g);
  moe_scale_rows_backward(dout, dp, dout, act, p);
  moe_scale_rows(act, act, p);
  swiglu_backward(din, dout, in, g);
}

void Backend::cross_entropy_forward_backward(Tensor lse, Tensor target, Tensor logits, Tensor labels, Tensor dloss) {
  cross_entropy_forward(lse, target, logits, labels, 0);
  cross_entropy_backward(logits, logits, labels, lse, dloss, 0);
}

void Backend::qk_norm_forward(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, const RopeShape&,
                              const NormParams&) {
  throw Unsupported("--qk-layernorm is not implemented by the " + name() + " backend yet");
}

void Backend::qk_norm_backward(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                               Tensor, const RopeShape&, const NormParams&) {
  throw Unsupported("--qk-layernorm is not implemented by the " + name() + " backend yet");
}

// Attention blocks (context parallelism): backends implement them where they can.
namespace {
[[noreturn]] void no_attention_blocks(const std::string& backend) {
  throw Unsupported("--context-parallel-size > 1 is not on the " + backend +
                    " backend yet (its attention blocks are missing); use --context-parallel-size 1");
}
}  // namespace
void Backend::reserve_attention_blocks(const AttentionShape&, int, DType) { no_attention_blocks(name()); }
void Backend::attention_block_forward(Tensor, Tensor, Tensor, Tensor, const AttentionShape&, const AttentionBlock&) {
  no_attention_blocks(name());
}
void Backend::attention_block_backward(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, const AttentionShape&,
                                       const AttentionBlock&) {
  no_attention_blocks(name());
}
void Backend::attention_merge(Tensor, Tensor, Tensor, Tensor) { no_attention_blocks(name()); }
void Backend::attention_kv_pack(Tensor, Tensor, const AttentionShape&) { no_attention_blocks(name()); }
void Backend::attention_kv_unpack_add(Tensor, Tensor, const AttentionShape&) { no_attention_blocks(name()); }

// FP8 ops: backends implement them where they can (the reference backend emulates them).
void Backend::fp8_quantize(Tensor, Tensor, Tensor, const Fp8TensorMeta&) {
  throw Unsupported("FP8 (--fp8-format): fp8_quantize is not on the " + name() + " backend yet");
}
void Backend::fp8_quantize_groups(Tensor q, Tensor q_t, Tensor x, std::span<const int64_t> off,
                                  std::span<const Fp8TensorMeta> metas) {
  MT_CHECK(!off.empty() && metas.size() + 1 == off.size(), "fp8_quantize_groups: {} offsets for {} groups", off.size(),
           metas.size());
  const int64_t C = x.cols();
  for (size_t g = 0; g < metas.size(); ++g) {
    const int64_t b = off[g], M = off[g + 1] - b;
    if (M == 0) continue;
    const Tensor qt = q_t.empty() ? Tensor() : q_t.flat_slice(b * C, C * M).view({C, M});
    fp8_quantize(q.empty() ? Tensor() : q.row_slice(b, M), qt, x.row_slice(b, M), metas[g]);
  }
}
void Backend::fp8_quantize_with_dbias(Tensor, Tensor, Tensor, const Fp8TensorMeta&, Tensor) {
  throw Unsupported("FP8 (--fp8-format): fp8_quantize_with_dbias is not on the " + name() + " backend yet");
}
void Backend::fp8_quantize_activation_backward(Tensor, Tensor, Tensor, Tensor, MlpActivation, const Fp8TensorMeta&, Tensor,
                                               const Glu&) {
  throw Unsupported("FP8 (--fp8-format): fp8_quantize_activation_backward is not on the " + name() + " backend yet");
}
void Backend::fp8_quantize_activation(Tensor, Tensor, Tensor, MlpActivation, const Fp8TensorMeta&, const Glu&) {
  throw Unsupported("FP8 (--fp8-format): fp8_quantize_activation is not on the " + name() + " backend yet");
}
void Backend::fp8_quantize_norm(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, const NormParams&,
                                const Fp8TensorMeta&) {
  throw Unsupported("FP8 (--fp8-format): fp8_quantize_norm is not on the " + name() + " backend yet");
}
void Backend::fp8_linear_forward(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Activation, Tensor) {
  throw Unsupported("FP8 (--fp8-format): fp8_linear_forward is not on the " + name() + " backend yet");
}
void Backend::fp8_linear_backward_input(Tensor, Tensor, Tensor, Tensor, Tensor, bool, Activation, Tensor) {
  throw Unsupported("FP8 (--fp8-format): fp8_linear_backward_input is not on the " + name() + " backend yet");
}
void Backend::fp8_linear_backward_weight(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool) {
  throw Unsupported("FP8 (--fp8-format): fp8_linear_backward_weight is not on the " + name() + " backend yet");
}
void Backend::fp8_transpose(Tensor, Tensor) {
  throw Unsupported("FP8 (--fp8-param-gather): fp8_transpose is not on the " + name() + " backend yet");
}
void Backend::fp8_dequantize(Tensor, Tensor, Tensor) {
  throw Unsupported("FP8 (--fp8-param-gather): fp8_dequantize is not on the " + name() + " backend yet");
}
void Backend::fp8_update_scales(Tensor, Tensor, Tensor, Tensor, const Fp8ScaleUpdate&) {
  throw Unsupported("FP8 (--fp8-format): fp8_update_scales is not on the " + name() + " backend yet");
}

}  // namespace mt

namespace mt {

namespace {
// Expert e's weight rows of a grouped layer's w [E * Nw, K].
Tensor expert_weight(const Tensor& w, size_t experts, size_t e) {
  const int64_t per = w.rows() / static_cast<int64_t>(experts);
  return w.row_slice(static_cast<int64_t>(e) * per, per);
}
}  // namespace

// The offsets on the host: as given, or the device's copied into `storage` (the stream waits);
// checked against the operands' rows: exactly with host offsets, as a bound with the device's.
std::span<const int64_t> expert_offsets_on_host(Backend& be, const ExpertOffsets& o, int64_t rows,
                                                std::vector<int64_t>& storage) {
  std::span<const int64_t> offsets = o.host;
  if (!o.on_host()) {
    std::vector<int32_t> v(static_cast<size_t>(o.device.numel()));
    be.copy_to_host(v.data(), o.device);
    storage.assign(v.begin(), v.end());
    offsets = storage;
  }
  MT_CHECK(offsets.size() >= 2 && offsets.front() == 0 &&
               (o.on_host() ? offsets.back() == rows : offsets.back() <= rows),
           "grouped linear: offsets end at {} for {} rows", offsets.empty() ? -1 : offsets.back(), rows);
  return offsets;
}

void Backend::grouped_linear_forward(Tensor y, Tensor x, Tensor w, const ExpertOffsets& o) {
  std::vector<int64_t> storage;
  const std::span<const int64_t> offsets = expert_offsets_on_host(*this, o, x.rows(), storage);
  const size_t E = offsets.size() - 1;
  for (size_t e = 0; e < E; ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n > 0)
      linear_forward(y.row_slice(offsets[e], n), x.row_slice(offsets[e], n), expert_weight(w, E, e), Tensor(),
                     Activation::none, Tensor());
  }
}

void Backend::grouped_linear_backward_input(Tensor dx, Tensor dy, Tensor w, const ExpertOffsets& o) {
  std::vector<int64_t> storage;
  const std::span<const int64_t> offsets = expert_offsets_on_host(*this, o, dy.rows(), storage);
  const size_t E = offsets.size() - 1;
  for (size_t e = 0; e < E; ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n > 0)
      linear_backward_input(dx.row_slice(offsets[e], n), dy.row_slice(offsets[e], n), expert_weight(w, E, e), false,
                            Activation::none, Tensor());
  }
}

void Backend::grouped_linear_backward_weight(Tensor dw, Tensor dy, Tensor x, const ExpertOffsets& o,
                                             bool accumulate, Tensor sumsq) {
  MT_CHECK(sumsq.empty() || !accumulate, "grouped_linear_backward_weight: the sum of squares of a gradient it adds to");
  std::vector<int64_t> storage;
  const std::span<const int64_t> offsets = expert_offsets_on_host(*this, o, dy.rows(), storage);
  const size_t E = offsets.size() - 1;
  for (size_t e = 0; e < E; ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    const Tensor dwe = expert_weight(dw, E, e);
    if (n > 0)
      linear_backward_weight(dwe, Tensor(), dy.row_slice(offsets[e], n), x.row_slice(offsets[e], n), accumulate);
    else if (!accumulate)
      fill(dwe, 0.0);
  }
  if (!sumsq.empty()) sum_squares(sumsq, dw, {}, true);
}

}  // namespace mt

#include "engine/fp8_state.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

#include "core/error.h"
#include "parallel/parallel_state.h"

namespace mt {

Fp8Options Fp8Options::from_config(const Config& cfg) {
  const TrainConfig& t = cfg.train;
  Fp8Options o;
  o.format = t.fp8_format;
  o.recipe = t.fp8_recipe;
  o.margin = t.fp8_margin;
  o.history_len = t.fp8_amax_history_len;
  o.algo = t.fp8_amax_compute_algo;
  o.wgrad = t.fp8_wgrad;
  o.param_gather = t.fp8_param_gather;
  const int L = cfg.model.num_layers, D = cfg.model.mtp_num_layers.value_or(0);
  o.layer_fp8.assign(static_cast<size_t>(std::max(L, 0) + std::max(D, 0)), 0);
  for (int l = 0; l < L; ++l) o.layer_fp8[static_cast<size_t>(l)] = t.fp8_layer(l, L) ? 1 : 0;
  // The multi-token prediction depths' layers (global L + j): FP8 whatever --first-last-layers-bf16
  // says (Megatron-LM's MTP block runs in the global FP8 context).
  for (int j = 0; j < D && t.fp8_format; ++j) o.layer_fp8[static_cast<size_t>(L + j)] = 1;
  if (o.enabled() && o.recipe != Fp8Recipe::delayed && o.recipe != Fp8Recipe::tensorwise)
    throw Unsupported("FP8: only the delayed and tensorwise recipes are built");
  return o;
}

void Fp8State::plan(const Fp8Options& o, int layer_begin, int layer_end) {
  plan_layers(o, layer_begin, layer_end, nullptr);
  gemms_ = kGemms;
  experts_ = false;
}

void Fp8State::plan_subset(const Fp8Options& o, int layer_begin, int layer_end, const std::vector<char>& only,
                           int gemms, bool experts) {
  plan_layers(o, layer_begin, layer_end, &only);
  gemms_ = std::max(gemms, 1);
  experts_ = experts;
}

void Fp8State::plan_layers(const Fp8Options& o, int layer_begin, int layer_end, const std::vector<char>* only) {
  opt_ = o;
  slot_.assign(static_cast<size_t>(std::max(layer_end - layer_begin, 0)), -1);
  global_.clear();
  n_layers_ = 0;
  for (int l = layer_begin; l < layer_end; ++l)
    if (o.global_layer_fp8(l) && (!only || (static_cast<size_t>(l) < only->size() && (*only)[static_cast<size_t>(l)]))) {
      slot_[static_cast<size_t>(l - layer_begin)] = n_layers_++;
      global_.push_back(l);
    }
}

void Fp8State::layout(Arena& a) {
  history_ = scale_ = scale_inv_ = fp8_max_ = fresh_ = Tensor();
  if (!any()) return;
  const int64_t n = operands();
  using C = MemoryCategory;
  history_ = a.take(C::optimizer_states, DType::f32, {opt_.history_len, n});
  scale_ = a.take(C::optimizer_states, DType::f32, {n});
  scale_inv_ = a.take(C::optimizer_states, DType::f32, {n});
  fp8_max_ = a.take(C::optimizer_states, DType::f32, {n});
  if (opt_.recipe == Fp8Recipe::tensorwise) fresh_ = a.take(C::optimizer_states, DType::f32, {n});
}

DType Fp8State::dtype(Role r) const {
  return r == dy && opt_.format == Fp8Format::hybrid ? DType::fp8_e5m2 : DType::fp8_e4m3;
}

void Fp8State::initialize(Backend& be) {
  if (!any()) return;
  be.fill(history_, 0.0);
  if (!fresh_.empty()) be.fill(fresh_, 0.0);
  be.fill(scale_, 1.0);
  be.fill(scale_inv_, 1.0);
  first_step_ = opt_.recipe == Fp8Recipe::delayed;
  std::vector<float> fmax(static_cast<size_t>(operands()));
  for (size_t i = 0; i < fmax.size(); ++i) fmax[i] = fp8_max(dtype(static_cast<Role>(i % kRoles)));
  be.copy_from_host(fp8_max_, fmax.data());
  be.synchronize();  // the host vector goes out of scope
}

int Fp8State::index(int local, int g, Role r) const {
  MT_CHECK(layer_fp8(local), "FP8 state asked for local layer {}, which is not an FP8 layer", local);
  MT_CHECK(g >= 0 && g < gemms_, "FP8 state asked for GEMM {} of {}", g, gemms_);
  return (slot_[static_cast<size_t>(local)] * gemms_ + g) * kRoles + r;
}

Fp8TensorMeta Fp8State::meta(int local, int g, Role r) const {
  const int i = index(local, g, r);
  Fp8TensorMeta m;
  m.scale = scale_.flat_slice(i, 1);
  m.scale_inv = scale_inv_.flat_slice(i, 1);
  m.amax = history_.flat_slice(i, 1);  // row 0
  m.recipe = opt_.recipe;
  m.margin = opt_.margin;
  m.fresh = fresh_.empty() ? Tensor() : fresh_.flat_slice(i, 1);
  return m;
}

Tensor Fp8State::scale_inv(int local, int g, Role r) const { return scale_inv_.flat_slice(index(local, g, r), 1); }

Tensor Fp8State::fresh(int local, Gemm g, Role r) const {
  const int i = index(local, g, r);
  return fresh_.empty() ? Tensor() : fresh_.flat_slice(i, 1);
}

void Fp8State::save_to_host(Backend& be, float* packed) const {
  if (!any()) return;
  const int64_t n = operands(), H = opt_.history_len, P = per_layer();
  std::vector<float> hist(static_cast<size_t>(H * n)), sc(static_cast<size_t>(n)), si(static_cast<size_t>(n));
  be.copy_to_host(hist.data(), history_);
  be.copy_to_host(sc.data(), scale_);
  be.copy_to_host(si.data(), scale_inv_);
  for (int j = 0; j < n_layers_; ++j) {
    float* b = packed + j * layer_floats();
    for (int64_t r = 0; r < H; ++r)
      for (int k = 0; k < P; ++k) b[r * P + k] = hist[static_cast<size_t>(r * n + j * P + k)];
    for (int k = 0; k < P; ++k) {
      b[H * P + k] = sc[static_cast<size_t>(j * P + k)];
      b[(H + 1) * P + k] = si[static_cast<size_t>(j * P + k)];
    }
  }
}

void Fp8State::load_from_host(Backend& be, const float* packed) {
  if (!any()) return;
  const int64_t n = operands(), H = opt_.history_len, P = per_layer();
  std::vector<float> hist(static_cast<size_t>(H * n)), sc(static_cast<size_t>(n)), si(static_cast<size_t>(n));
  for (int j = 0; j < n_layers_; ++j) {
    const float* b = packed + j * layer_floats();
    for (int64_t r = 0; r < H; ++r)
      for (int k = 0; k < P; ++k) hist[static_cast<size_t>(r * n + j * P + k)] = b[r * P + k];
    for (int k = 0; k < P; ++k) {
      sc[static_cast<size_t>(j * P + k)] = b[H * P + k];
      si[static_cast<size_t>(j * P + k)] = b[(H + 1) * P + k];
    }
  }
  // No scale update yet (every input and gradient scale 1; FP8 parameters set their weights'
  // scales before it): the layers calibrate (see the header).
  bool all_one = true;
  for (int64_t i = 0; i < n; ++i)
    if (i % kRoles != w) all_one = all_one && sc[static_cast<size_t>(i)] == 1.0f && si[static_cast<size_t>(i)] == 1.0f;
  first_step_ = opt_.recipe == Fp8Recipe::delayed && all_one;
  be.copy_from_host(history_, hist.data());
  be.copy_from_host(scale_, sc.data());
  be.copy_from_host(scale_inv_, si.data());
  be.synchronize();  // the host vectors go out of scope
}

void Fp8State::reduce_amax(ParallelState& ps) {
  if (!any()) return;
  // The amax of a sharded tensor is the max over its shards; replicated tensors agree anyway. Max
  // is associative, so TP then DP equals one reduction over DP x TP. (DP x CP with context
  // parallelism: every replica of the weights keeps the same scales.)
  const Tensor current = history_.flat_slice(0, operands());
  if (experts_) {
    // The experts' shards over their TP group (the dense TP group where ETP = TP; none where ETP = 1:
    // whole experts); their replicas.
    if (ps.etp_size > 1) {
      MT_CHECK(ps.etp || ps.etp_size == ps.tp_size, "FP8 experts: no expert TP group of {} ranks (TP {})", ps.etp_size,
               ps.tp_size);
      (ps.etp ? *ps.etp : *ps.tp).all_reduce(current, ReduceOp::max);
    }
    if (ps.expert_dp().size() > 1) ps.expert_dp().all_reduce(current, ReduceOp::max);
    return;
  }
  if (ps.tp_size > 1) ps.tp->all_reduce(current, ReduceOp::max);
  if (ps.replicas_size() > 1) ps.replicas().all_reduce(current, ReduceOp::max);
}

void Fp8State::reduce_fresh_over_dp(ParallelState& ps) {
  if (fresh_.empty() || ps.replicas_size() == 1) return;
  ps.replicas().all_reduce(fresh_, ReduceOp::max);
}

void Fp8State::set_weight_scales_from_amax(Backend& be) {
  if (!any()) return;
  const int64_t n = operands();
  std::vector<float> amax(static_cast<size_t>(n)), sc(static_cast<size_t>(n)), si(static_cast<size_t>(n)),
      fmax(static_cast<size_t>(n));
  be.copy_to_host(amax.data(), history_.flat_slice(0, n));
  be.copy_to_host(sc.data(), scale_);
  be.copy_to_host(si.data(), scale_inv_);
  be.copy_to_host(fmax.data(), fp8_max_);
  for (int64_t i = w; i < n; i += kRoles) {
    const float a = amax[static_cast<size_t>(i)];
    if (!(a > 0.0f && std::isfinite(a))) continue;
    // fp8_update_scales' arithmetic (engine/backend.h), in float32.
    float s = (fmax[static_cast<size_t>(i)] / a) / std::ldexp(1.0f, opt_.margin);
    if (std::isinf(s)) s = FLT_MAX;
    sc[static_cast<size_t>(i)] = s;
    si[static_cast<size_t>(i)] = 1.0f / s;
  }
  be.copy_from_host(scale_, sc.data());
  be.copy_from_host(scale_inv_, si.data());
  be.synchronize();  // the host vectors go out of scope
}

void Fp8State::update_weight_scales(Backend& be) {
  if (!any()) return;
  // Row 0 alone as a one-row history: "most recent" reads it, and the roll of one row clears it.
  const int64_t n = operands();
  Fp8ScaleUpdate u;
  u.algo = Fp8AmaxAlgo::most_recent;
  u.margin = opt_.margin;
  be.fp8_update_scales(history_.flat_slice(0, n).view({1, n}), scale_, scale_inv_, fp8_max_, u);
}

void Fp8State::end_step(Backend& be, ParallelState& ps) {
  if (!any()) return;
  const Tensor current = history_.flat_slice(0, operands());
  if (opt_.recipe == Fp8Recipe::tensorwise) {
    be.fill(current, 0.0);
    // Every cast zeroes its slot; this only guards the next step against a slot a producer
    // filled for a cast that never ran (an interrupted step).
    be.fill(fresh_, 0.0);
    return;
  }
  reduce_amax(ps);
  Fp8ScaleUpdate u;
  u.algo = opt_.algo;
  u.margin = opt_.margin;
  be.fp8_update_scales(history_, scale_, scale_inv_, fp8_max_, u);
  first_step_ = false;
}

}  // namespace mt

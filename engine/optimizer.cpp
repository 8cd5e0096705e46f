#include "engine/optimizer.h"

#include <cmath>

#include "core/error.h"
#include "parallel/parallel_state.h"

namespace mt {

namespace {
// Layout of GptModel::scalars() during a step.
enum Scalar { kLossSum = 0, kTokens = 1, kGradSumSq = 2, kZeros = 3, kCount = 4 };
}  // namespace

Optimizer::Optimizer(const Config& cfg, GptModel& model, ParallelState& ps, LrSchedule& schedule, LossScaler& scaler)
    : cfg_(cfg), model_(model), ps_(ps), schedule_(schedule), scaler_(scaler), be_(model.backend()) {
  const TrainConfig& t = cfg.train;
  const bool decoupled = t.decoupled_lr.has_value();
  // Update segments merge neighbours of one group across the alignment padding (padding holds
  // zeros with zero gradients, which AdamW and SGD leave at zero); the norm segments cover the
  // counted parameters exactly (--log-num-zeros-in-grad must not count the padding).
  int64_t end = 0;
  for (const ParamDesc& p : model.params()) {
    int g = p.weight_decay ? kDecay : kNoDecay;
    if (decoupled && p.decoupled_lr) g += 2;
    if (!segments_.empty() && segments_.back().group == g) segments_.back().count = p.offset + p.numel() - segments_.back().offset;
    else segments_.push_back(OptimSegment{p.offset, p.numel(), g});
    if (!p.shared_copy && (!p.tp_duplicated || ps.tp_rank == 0)) {
      if (!norm_segments_.empty() && end == p.offset) norm_segments_.back().count += p.numel();
      else norm_segments_.push_back(OptimSegment{p.offset, p.numel(), 0});
      end = p.offset + p.numel();
    }
  }
  be_.register_optim_segments(segments_);
  be_.register_optim_segments(norm_segments_);
  const double lr = t.lr.value_or(0.0);
  max_lr_[kDecay] = max_lr_[kNoDecay] = lr;
  min_lr_[kDecay] = min_lr_[kNoDecay] = t.min_lr;
  max_lr_[kDecoupledDecay] = max_lr_[kDecoupledNoDecay] = t.decoupled_lr.value_or(lr);
  min_lr_[kDecoupledDecay] = min_lr_[kDecoupledNoDecay] = t.decoupled_min_lr.value_or(t.min_lr);
  // Megatron turns the NaN check off under fp16 dynamic loss scaling (overflows are expected).
  check_nan_ = t.check_for_nan_in_loss_and_grad && scaler.kind() != LossScaler::Kind::dynamic;
}

double Optimizer::learning_rate() const { return schedule_.lr(max_lr_[kDecay], min_lr_[kDecay]); }

std::optional<double> Optimizer::decoupled_learning_rate() const {
  if (!cfg_.train.decoupled_lr) return std::nullopt;
  return schedule_.lr(max_lr_[kDecoupledDecay], min_lr_[kDecoupledDecay]);
}

OptimStepParams Optimizer::step_params(double grad_scale) const {
  const TrainConfig& t = cfg_.train;
  OptimStepParams p;
  const double wd = schedule_.weight_decay();
  for (int g = 0; g < OptimStepParams::kMaxGroups; ++g) {
    p.lr[g] = static_cast<float>(schedule_.lr(max_lr_[g], min_lr_[g]));
    p.weight_decay[g] = (g == kDecay || g == kDecoupledDecay) ? static_cast<float>(wd) : 0.0f;
  }
  p.beta1 = static_cast<float>(t.adam_beta1);
  p.beta2 = static_cast<float>(t.adam_beta2);
  p.eps = static_cast<float>(t.adam_eps);
  p.sgd_momentum = static_cast<float>(t.sgd_momentum);
  p.step = steps_ + 1;
  p.grad_scale = static_cast<float>(grad_scale);
  return p;
}

StepOutcome Optimizer::step(int64_t iteration) {
  const TrainConfig& t = cfg_.train;
  const ModelDims& d = model_.dims();
  Tensor grads = model_.grads_flat(), scalars = model_.scalars();

  // Gradient reductions across replicas. (The parallel code replaces the plain data-parallel
  // all-reduce with bucketed, overlapped reductions.)
  if (ps_.dp_size > 1) ps_.dp->all_reduce(grads);
  if (d.pipeline && d.tied_embeddings && (d.first_stage || d.last_stage)) {
    const int i = find_param(model_.params(), d.first_stage ? "embedding.word_embeddings.weight" : "output_layer.weight");
    if (i >= 0) ps_.embedding->all_reduce(model_.grad(i));
  }

  // Loss sums (last stage) and gradient statistics, then the one readback.
  be_.fill(scalars, 0.0);
  if (d.last_stage) be_.copy(scalars.flat_slice(kLossSum, 2), model_.loss_sums(false));
  ps_.dp->all_reduce(scalars.flat_slice(kLossSum, 2));
  be_.sum_squares(scalars.flat_slice(kGradSumSq, 1), grads, norm_segments_, false);
  if (cfg_.logging.log_num_zeros_in_grad) be_.count_zeros(scalars.flat_slice(kZeros, 1), grads, norm_segments_, false);
  ps_.model_parallel->all_reduce(scalars.flat_slice(kGradSumSq, 2));
  if (d.pipeline) ps_.pp->all_reduce(scalars.flat_slice(kLossSum, 2));  // only the last stage has a loss
  double host[kCount];
  if (model_.options().accum == DType::f64) {
    be_.copy_to_host(host, scalars.flat_slice(0, kCount));
  } else {
    float f[kCount];
    be_.copy_to_host(f, scalars.flat_slice(0, kCount));
    for (int k = 0; k < kCount; ++k) host[k] = f[k];
  }

  StepOutcome out;
  out.loss_sum = host[kLossSum];
  out.tokens = host[kTokens];
  // The gradients in the buffer are scaled by the loss scale and summed over DP ranks; per-token
  // loss normalizes by the global batch's tokens instead of per micro-batch.
  double inv = 1.0 / scaler_.scale();
  if (t.calculate_per_token_loss) inv /= std::max(1.0, out.tokens);
  else inv /= ps_.dp_size;
  const double sumsq = host[kGradSumSq];
  const bool finite = std::isfinite(sumsq);
  if (scaler_.checks_overflow()) {
    scaler_.update(!finite);
    if (!finite) {
      out.skipped = true;
      return out;
    }
  }
  const double norm = std::sqrt(sumsq) * inv;
  if (check_nan_ && (!std::isfinite(out.loss()) || !std::isfinite(norm)))
    fail("NaN or Inf at iteration {}: {} (disable this check with --no-check-for-nan-in-loss-and-grad)",
         iteration, !std::isfinite(out.loss()) ? fmt::format("lm loss {}", out.loss()) : fmt::format("grad norm {}", norm));
  double clip = 1.0;
  if (t.clip_grad > 0) {
    out.grad_norm = norm;
    clip = std::min(1.0, t.clip_grad / (norm + 1e-6));
  } else {
    out.grad_norm = 0.0;  // Megatron reports 0 without clipping
  }
  if (cfg_.logging.log_num_zeros_in_grad) out.num_zeros = static_cast<int64_t>(host[kZeros]);

  const OptimStepParams p = step_params(inv * clip);
  Tensor model_copy = model_.has_master_copy() ? model_.params_flat() : Tensor();
  if (t.optimizer == OptimizerKind::adam) {
    be_.adamw_step(model_.master_flat(), grads, model_.exp_avg_flat(), model_.exp_avg_sq_flat(), model_copy,
                   segments_, p);
  } else {
    be_.sgd_step(model_.master_flat(), grads, model_.exp_avg_flat(), model_copy, segments_, p);
  }
  ++steps_;
  schedule_.step(t.global_batch);
  return out;
}

double Optimizer::params_norm() {
  Tensor s = model_.scalars().flat_slice(kCount, 1);
  be_.sum_squares(s, model_.master_flat(), norm_segments_, false);
  ps_.model_parallel->all_reduce(s);
  if (model_.options().accum == DType::f64) {
    double v;
    be_.copy_to_host(&v, s);
    return std::sqrt(v);
  }
  float v;
  be_.copy_to_host(&v, s);
  return std::sqrt(static_cast<double>(v));
}

}  // namespace mt

#include "engine/optimizer.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <span>
#include <string>

#include "core/error.h"
#include "core/log.h"
#include "engine/muon.h"
#include "engine/reporter.h"
#include "engine/scalar_reduce.h"
#include "parallel/parallel_state.h"

namespace mt {

namespace {
// Layout of GptModel::scalars() during a step: the loss sums and the MoE losses' sums (reduced
// over DP and PP together), then the gradient statistics: of the dense parameters, and under
// expert parallelism of the routed experts (reduced over their own groups).
// (params_norm uses kCount and kCount + 1; multi-token prediction's logged losses, one per depth,
// from kMtp on, then each depth's acceptance counts {right, counted}: ModelDims allows at most
// kMtpMax depths.)
enum Scalar {
  kLossSum = 0, kTokens = 1, kMoe = 2, kGradSumSq = kMoe + 2 * GptModel::kMoeTerms, kZeros, kExpertSumSq,
  kExpertZeros, kCount, kMtp = kCount + 2, kMtpMax = 6, kKd = kMtp + 3 * kMtpMax, kScalars = kKd + 3
};
static_assert(static_cast<int>(kScalars) <= static_cast<int>(kFirstScalarSlot),
              "the optimizer's scalars overlap engine/scalar_reduce.h's slots");

// The logged MoE losses in Megatron's order: name, place in GptModel::moe_loss_sums()' pairs, and
// whether the value is summed over DP (global_aux_loss, reduced over TP x DP x CP) rather than
// averaged. Those the model's settings log (ModelDims::moe_log_*).
struct MoeTerm {
  std::string name;
  int slot = 0;
  bool over_dp = false;
};
std::vector<MoeTerm> moe_terms(const ModelDims& d) {
  std::vector<MoeTerm> terms;
  using G = GptModel;
  if (d.moe_log_aux) terms.push_back({"load_balancing_loss", 2 * G::kMoeAuxTerm, false});
  if (d.moe_log_seq) terms.push_back({"seq_load_balancing_loss", 2 * G::kMoeSeqTerm, false});
  if (d.moe_log_global) terms.push_back({"global_load_balancing_loss", 2 * G::kMoeGlobalTerm, true});
  if (d.moe_log_z) terms.push_back({"z_loss", 2 * G::kMoeAuxTerm + 1, false});
  return terms;
}
}  // namespace

Optimizer::Optimizer(const Config& cfg, std::vector<GptModel*> chunks, ParallelState& ps, LrSchedule& schedule,
                     LossScaler& scaler)
    : cfg_(cfg),
      chunks_(std::move(chunks)),
      ps_(ps),
      schedule_(schedule),
      scaler_(scaler),
      be_(chunks_.at(0)->backend()) {
  const TrainConfig& t = cfg.train;
  const bool decoupled = t.decoupled_lr.has_value();
  sharded_ = chunks_.front()->grad_layout().sharded;
  mtp_depths_ = chunks_.front()->dims().mtp;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    if (chunks_[c]->dims().last_stage) output_chunk_ = chunks_[c];
    for (OptimRange& r : plan_optim_ranges(*chunks_[c], static_cast<int>(c), ps.tp_rank, decoupled)) {
      // Muon's parameters leave AdamW's segments.
      if (t.optimizer == OptimizerKind::muon) r.update = without_muon_params(r.update, chunks_[c]->params(), r.flat_offset);
      const auto fused = [m = chunks_[c]](const ParamDesc& p) { return m->sumsq_fused(p); };
      r.grad_norm = without_params(r.norm, chunks_[c]->params(), r.flat_offset, fused);
      r.expert_grad_norm = without_params(r.expert_norm, chunks_[c]->params(), r.flat_offset, fused);
      for (const auto* segments : {&r.update, &r.norm, &r.expert_norm, &r.grad_norm, &r.expert_grad_norm})
        be_.register_optim_segments(*segments);
      ranges_.push_back(std::move(r));
    }
  }
  grad_sync_ = std::make_unique<DpGradSync>(cfg, ps, chunks_);
  if (sharded_ && (ps.dist_opt_size() > 1 || (ps.edp && ps.expert_dist_opt_size() > 1)))
    param_gather_ = std::make_unique<ParamGather>(chunks_, grad_sync_->comm(), grad_sync_->expert_comm(),
                                                  cfg.parallel.overlap_param_gather && be_.comm_stream() != nullptr);
  if (t.optimizer == OptimizerKind::muon) plan_muon();
  plan_update_pieces();
  const double lr = t.lr.value_or(0.0);
  max_lr_[kDecay] = max_lr_[kNoDecay] = lr;
  min_lr_[kDecay] = min_lr_[kNoDecay] = t.min_lr;
  max_lr_[kDecoupledDecay] = max_lr_[kDecoupledNoDecay] = t.decoupled_lr.value_or(lr);
  min_lr_[kDecoupledDecay] = min_lr_[kDecoupledNoDecay] = t.decoupled_min_lr.value_or(t.min_lr);
  // MuP (Megatron's get_mup_config_overrides, width multiplier w != 1): Adam and the other
  // optimizers take the hidden matrices at lr / w (Adam also eps / w); SGD keeps them at lr and
  // takes the vector-like parameters (1-D, the embeddings and the output layer; not those with
  // --decoupled-lr) at lr x w. (Without MuP the hidden group is empty.)
  max_lr_[kMupHidden] = lr;
  min_lr_[kMupHidden] = t.min_lr;
  const ModelConfig& mc = cfg.model;
  if (mc.use_mup && mc.mup_width_mult != 1.0) {
    const double w = mc.mup_width_mult;
    if (t.optimizer == OptimizerKind::sgd) {
      for (int g : {kDecay, kNoDecay}) {
        max_lr_[g] = lr * w;
        min_lr_[g] = t.min_lr * w;
      }
      if (!t.decoupled_lr)
        for (int g : {kDecoupledDecay, kDecoupledNoDecay}) {
          max_lr_[g] = lr * w;
          min_lr_[g] = t.min_lr * w;
        }
    } else {
      max_lr_[kMupHidden] = lr / w;
      min_lr_[kMupHidden] = t.min_lr / w;
      if (t.optimizer == OptimizerKind::adam) mup_hidden_eps_ = t.adam_eps / w;
    }
  }
  // Megatron turns the NaN check off under fp16 dynamic loss scaling (overflows are expected).
  // Under --rerun-mode validate_results / report_stats the rerun state machine checks instead,
  // once its hook is installed (`validate`); without one this check stands.
  check_nan_ = t.check_for_nan_in_loss_and_grad && scaler.kind() != LossScaler::Kind::dynamic;
}

Optimizer::~Optimizer() {
  if (!pieces_.empty())
    for (GptModel* m : chunks_) m->on_params_needed = nullptr;
}

void Optimizer::wait_for_params() {
  if (param_gather_) param_gather_->wait_all();
  join_update();
}

namespace {
// MEGATRAIN_OPTIMIZER_OVERLAP=1: the update beside the next forward where it applies; unset or 0:
// one pass on the compute stream. Off by default: on one H100 it cost 3% of mixtral-proxy's step and
// 1% of llama-1b's (bench/RESULTS.md): the forward's GEMMs leave the update no SMs to share, so
// the pieces wait for gaps the forward does not have.
bool overlap_allowed() {
  const char* env = std::getenv("MEGATRAIN_OPTIMIZER_OVERLAP");
  if (!env) return false;
  const std::string v = env;
  if (v != "0" && v != "1") fail("MEGATRAIN_OPTIMIZER_OVERLAP={}: expected 0 or 1", v);
  return v == "1";
}
}  // namespace

// Each range's update segments cut where the forward starts needing a unit's parameters (the
// padding after a parameter goes with it), so that the next forward waits only for the pieces of
// the layers it has reached.
void Optimizer::plan_update_pieces() {
  const TrainConfig& t = cfg_.train;
  if (!overlap_allowed() || param_gather_ ||
      (t.optimizer != OptimizerKind::adam && t.optimizer != OptimizerKind::sgd))
    return;
  for (const GptModel* m : chunks_)
    if (m->options().fp8.enabled() || m->options().shard_grads || m->options().frozen || m->on_params_needed) return;
  for (size_t ri = 0; ri < ranges_.size(); ++ri) {
    const OptimRange& r = ranges_[ri];
    const GptModel& m = *chunks_[static_cast<size_t>(r.chunk)];
    const std::vector<int> bounds = m.forward_param_boundaries();
    std::vector<std::pair<int64_t, int>> starts;  // (offset in the range, piece) of each parameter in it
    for (int i = 0; i < static_cast<int>(m.params().size()); ++i) {
      const ParamDesc& p = m.params()[static_cast<size_t>(i)];
      const int64_t o = p.offset - r.flat_offset;
      if (p.numel() == 0 || o >= r.numel || o + p.numel() <= 0) continue;  // (a bucket's range: its parameters)
      starts.push_back({std::max<int64_t>(o, 0),
                        static_cast<int>(std::upper_bound(bounds.begin(), bounds.end(), i) - bounds.begin()) - 1});
    }
    if (starts.empty()) continue;
    std::sort(starts.begin(), starts.end());
    std::vector<std::vector<OptimSegment>> cut(bounds.size());
    int64_t total = 0;
    for (const OptimSegment& seg : r.update) {
      total += seg.count;
      for (int64_t a = seg.offset, end = seg.offset + seg.count; a < end;) {
        const auto next = std::upper_bound(starts.begin(), starts.end(), std::pair<int64_t, int>{a, INT_MAX});
        const int piece = next == starts.begin() ? starts.front().second : std::prev(next)->second;
        const int64_t b = next == starts.end() ? end : std::min(end, next->first);
        std::vector<OptimSegment>& list = cut[static_cast<size_t>(piece)];
        const bool plain = !seg.fp8_scale && !seg.fp8_amax;
        if (plain && !list.empty() && list.back().offset + list.back().count == a && list.back().group == seg.group &&
            !list.back().fp8_scale && !list.back().fp8_amax) {
          list.back().count += b - a;
        } else {
          OptimSegment part = seg;
          part.offset = a;
          part.count = b - a;
          list.push_back(part);
        }
        a = b;
      }
    }
    for (size_t k = 0; k < cut.size(); ++k) {
      for (const OptimSegment& seg : cut[k]) total -= seg.count;
      if (cut[k].empty()) continue;
      be_.register_optim_segments(cut[k]);
      pieces_.push_back({ri, bounds[k], std::move(cut[k])});
    }
    MT_CHECK(total == 0, "the update's pieces of range {} miss {} elements", ri, total);
  }
  if (pieces_.empty()) return;
  log::info("> the optimizer's update runs beside the next forward, in {} pieces (MEGATRAIN_OPTIMIZER_OVERLAP=1)",
            pieces_.size());
  be_.reserve_side_marks(static_cast<int>(pieces_.size()));
  chunk_pieces_.assign(chunks_.size(), {});
  for (size_t k = 0; k < pieces_.size(); ++k)
    chunk_pieces_[static_cast<size_t>(ranges_[pieces_[k].range].chunk)].push_back(k);
  next_wait_.assign(chunks_.size(), 0);
  for (size_t c = 0; c < chunks_.size(); ++c)
    chunks_[c]->on_params_needed = [this, c](int end) { await_update(static_cast<int>(c), end); };
}

void Optimizer::await_update(int chunk, int end) {
  const size_t c = static_cast<size_t>(chunk);
  if (!chunks_[c]->update_pending()) return;
  const std::vector<size_t>& mine = chunk_pieces_[c];
  for (size_t& k = next_wait_[c]; k < mine.size() && pieces_[mine[k]].first_param < end; ++k)
    be_.compute_wait_for_side_mark(static_cast<int>(mine[k]));
  if (end < static_cast<int>(chunks_[c]->params().size())) return;
  be_.compute_wait_for_side();  // (the whole chunk: its gradients may be written next)
  chunks_[c]->update_joined();
}

void Optimizer::join_update() {
  if (std::none_of(chunks_.begin(), chunks_.end(), [](const GptModel* m) { return m->update_pending(); })) return;
  be_.compute_wait_for_side();
  for (GptModel* m : chunks_)
    if (m->update_pending()) m->update_joined();
}

// Reads scalars()[0, count) of the first chunk into host doubles: the iteration's one readback.
double Optimizer::read_scalars(double* host, int count) {
  const Tensor s = chunks_.front()->scalars().flat_slice(0, count);
  if (chunks_.front()->options().accum == DType::f64) {
    be_.copy_to_host(host, s);
  } else {
    float f[kScalars];
    be_.copy_to_host(f, s);
    for (int k = 0; k < count; ++k) host[k] = f[k];
  }
  return host[0];
}

// The logged rate: the schedule of --lr and --min-lr (Megatron's first parameter group without an lr
// override: with --use-mup and SGD the vector-like groups run at w times it).
double Optimizer::learning_rate() const {
  return schedule_.lr(cfg_.train.lr.value_or(0.0), cfg_.train.min_lr);
}

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
    p.weight_decay[g] = (g == kDecay || g == kDecoupledDecay || g == kMupHidden) ? static_cast<float>(wd) : 0.0f;
  }
  p.beta1 = static_cast<float>(t.adam_beta1);
  p.beta2 = static_cast<float>(t.adam_beta2);
  p.eps = static_cast<float>(t.adam_eps);
  if (mup_hidden_eps_ > 0) p.group_eps[kMupHidden] = static_cast<float>(mup_hidden_eps_);
  p.sgd_momentum = static_cast<float>(t.sgd_momentum);
  p.step = steps_ + 1;
  p.grad_scale = static_cast<float>(grad_scale);
  return p;
}

StepOutcome Optimizer::step(int64_t iteration, int64_t global_batch) {
  const TrainConfig& t = cfg_.train;
  const Tensor scalars = chunks_.front()->scalars();
  join_update();  // (the backward joined the last update already; a step without one still must)

  // Gradient reductions across replicas (and the tied embeddings across the pipeline), unless the
  // trainer finished them at the end of forward-backward.
  grad_sync_->finish();
  grad_sync_->step_done();
  // Aux-loss-free balancing: the expert biases follow this step's token counts (Megatron does this
  // in finalize_model_grads, whether or not the update is then skipped).
  for (GptModel* m : chunks_) m->update_expert_bias();

  // Loss sums (the last stage's) and gradient statistics, then the one readback. Timed as
  // Megatron's optimizer-clip-main-grad (the gradient norm); counting zeros separately.
  double host[kScalars];
  // Distillation: the student's {total, logits, intermediate} loss sums, reduced as the loss's.
  const bool kd = output_chunk_ && !output_chunk_->kd_loss_sums(false).empty();
  {
    const ScopedTimer timed(timer, "optimizer-clip-main-grad");
    be_.fill(scalars, 0.0);
    if (output_chunk_) be_.copy(scalars.flat_slice(kLossSum, 2), output_chunk_->loss_sums(false));
    if (kd) {
      be_.copy(scalars.flat_slice(kKd, 3), output_chunk_->kd_loss_sums(false));
      ps_.replicas().all_reduce(scalars.flat_slice(kKd, 3));
    }
    for (GptModel* m : chunks_)
      if (!m->moe_loss_sums().empty())
        be_.axpby(scalars.flat_slice(kMoe, 2 * GptModel::kMoeTerms), 1.0f,
                  scalars.flat_slice(kMoe, 2 * GptModel::kMoeTerms), 1.0f, m->moe_loss_sums());
    ps_.replicas().all_reduce(scalars.flat_slice(kLossSum, kGradSumSq));  // (DP x CP: each CP rank has its tokens' part)
    const int D = mtp_depths_;
    if (D > 0) {
      if (output_chunk_) {  // the depths' logged sums: every other element of the model's [2 D]
        for (int j = 0; j < D; ++j)
          be_.copy(scalars.flat_slice(kMtp + j, 1), output_chunk_->mtp_loss_sums().flat_slice(2 * j, 1));
        be_.copy(scalars.flat_slice(kMtp + D, 2 * D), output_chunk_->mtp_accept_counts());
      }
      // (The acceptance counts are summed over DP x CP as Megatron's; the TP ranks' are the same.)
      ps_.replicas().all_reduce(scalars.flat_slice(kMtp, 3 * D));
    }
    for (const OptimRange& r : ranges_) {
      const Tensor g = optim_views(*chunks_[static_cast<size_t>(r.chunk)], r).grad;
      // (An empty list would mean the whole tensor.)
      if (!r.grad_norm.empty()) be_.sum_squares(scalars.flat_slice(kGradSumSq, 1), g, r.grad_norm, true);
      if (!r.expert_grad_norm.empty())
        be_.sum_squares(scalars.flat_slice(kExpertSumSq, 1), g, r.expert_grad_norm, true);
    }
    // The routed experts' squares their weight-gradient GEMMs summed (ModelOptions::expert_grad_sumsq),
    // counted where their norm segments would have been.
    for (GptModel* m : chunks_)
      if (!m->expert_grad_sumsq().empty()) {
        const Tensor at = scalars.flat_slice(m->dims().experts_own_grid() ? kExpertSumSq : kGradSumSq, 1);
        be_.axpby(at, 1.0f, at, 1.0f, m->expert_grad_sumsq());
      }
  }
  if (cfg_.logging.log_num_zeros_in_grad) {
    const ScopedTimer timed(timer, "optimizer-count-zeros");
    for (const OptimRange& r : ranges_) {
      const Tensor g = optim_views(*chunks_[static_cast<size_t>(r.chunk)], r).grad;
      if (!r.norm.empty()) be_.count_zeros(scalars.flat_slice(kZeros, 1), g, r.norm, true);
      if (!r.expert_norm.empty()) be_.count_zeros(scalars.flat_slice(kExpertZeros, 1), g, r.expert_norm, true);
    }
  }
  {
    const ScopedTimer timed(timer, "optimizer-clip-main-grad");
    // With the distributed optimizer each DP rank counted its shards only.
    // (Over its instance: --num-distributed-optimizer-instances gives every instance all shards.)
    if (sharded_) ps_.dist_opt_group().all_reduce(scalars.flat_slice(kGradSumSq, 2));
    ps_.model_parallel->all_reduce(scalars.flat_slice(kGradSumSq, 2));
    reduce_expert_statistics(scalars.flat_slice(kExpertSumSq, 2));
    // Only the last stage has a loss; the MoE losses are summed over the stages' layers.
    if (ps_.pp_size > 1) ps_.pp->all_reduce(scalars.flat_slice(kLossSum, kGradSumSq));
    if (ps_.pp_size > 1 && mtp_depths_ > 0) ps_.pp->all_reduce(scalars.flat_slice(kMtp, 3 * mtp_depths_));
    read_scalars(host, kd ? kScalars : mtp_depths_ > 0 ? kMtp + 3 * mtp_depths_ : kCount);
  }

  StepOutcome out;
  out.loss_sum = host[kLossSum];
  out.tokens = host[kTokens];
  // Megatron's report of ModelOpt's losses: each summed over micro-batches and DP x CP, over the tokens.
  if (kd)
    for (int i = 0; i < 3; ++i) out.kd_losses.push_back({kDistillLossNames[i], host[kKd + i] / std::max(1.0, host[kTokens])});
  const ModelDims& d = chunks_.front()->dims();
  if (d.experts > 0) {
    // Megatron's MoE loss logging: the per-layer sums over micro-batches, averaged over DP (but
    // global_aux_loss's), micro-batches and MoE layers.
    int moe_layers = 0;
    for (int l = 0; l < d.num_layers + d.mtp; ++l) moe_layers += d.is_moe(l) ? 1 : 0;  // (with MoE mtp layers)
    const double m = static_cast<double>(global_batch > 0 ? global_batch : t.global_batch) /
                     (static_cast<double>(t.micro_batch_size) * ps_.dp_size);
    for (const MoeTerm& term : moe_terms(d)) {
      const double per_layer = m * (term.over_dp ? 1.0 : static_cast<double>(ps_.dp_size));
      out.moe_losses.push_back({term.name, host[kMoe + term.slot] / (per_layer * std::max(1, moe_layers)), {}});
    }
    if (d.moe_per_layer_logging) read_moe_layer_losses(out, m);
  }
  // Multi-token prediction: Megatron's mtp_<j> loss, each depth's per-micro-batch mean summed over
  // micro-batches, averaged over DP x CP and divided by the micro-batches.
  if (mtp_depths_ > 0) {
    const double m = static_cast<double>(global_batch > 0 ? global_batch : t.global_batch) /
                     (static_cast<double>(t.micro_batch_size) * ps_.dp_size);
    for (int j = 0; j < mtp_depths_; ++j) out.mtp_losses.push_back(host[kMtp + j] / (ps_.replicas_size() * m));
    for (int j = 0; j < mtp_depths_; ++j)
      out.mtp_accept.push_back({host[kMtp + mtp_depths_ + 2 * j], host[kMtp + mtp_depths_ + 2 * j + 1]});
  }
  // The gradients in the buffer are scaled by the loss scale and summed over DP (x CP) ranks;
  // per-token loss normalizes by the global batch's tokens instead of per micro-batch. With CP,
  // Megatron's objective is the mean over CP ranks of each one's local mean (each rank's loss
  // gradient is divided by its own tokens: GptModel::stage_micro_batch).
  double inv = 1.0 / scaler_.scale();
  if (t.calculate_per_token_loss) inv /= std::max(1.0, out.tokens);
  else inv /= ps_.replicas_size();
  const double sumsq = host[kGradSumSq] + host[kExpertSumSq];
  const bool finite = std::isfinite(sumsq);
  if (validate) {
    const double checked_norm = std::sqrt(sumsq) * inv;
    if (!validate(out.loss(), checked_norm)) {
      out.held = true;
      out.grad_norm = checked_norm;
      return out;
    }
  }
  if (scaler_.checks_overflow()) {
    scaler_.update(!finite);
    if (!finite) {
      out.skipped = true;
      // FP8 parameters: the unchanged master weights again, with the scales the trainer just updated.
      if (cast_fp8_params() && param_gather_) param_gather_->start();
      return out;
    }
  }
  const double norm = std::sqrt(sumsq) * inv;
  if (check_nan_ && !validate && (!std::isfinite(out.loss()) || !std::isfinite(norm)))
    fail("NaN or Inf at iteration {}: {} (disable this check with --no-check-for-nan-in-loss-and-grad)",
         iteration, !std::isfinite(out.loss()) ? fmt::format("lm loss {}", out.loss()) : fmt::format("grad norm {}", norm));
  double clip = 1.0;
  if (t.clip_grad > 0) {
    out.grad_norm = norm;
    clip = std::min(1.0, t.clip_grad / (norm + 1e-6));
  } else {
    out.grad_norm = 0.0;  // Megatron reports 0 without clipping
  }
  if (cfg_.logging.log_num_zeros_in_grad) out.num_zeros = static_cast<int64_t>(host[kZeros] + host[kExpertZeros]);

  const OptimStepParams p = step_params(inv * clip);
  {
    // One fused pass per range: the update also writes the compute-dtype model copy, or casts the
    // FP8 parameters (Megatron's separate optimizer-copy-main-to-model-params phase has no
    // counterpart).
    const ScopedTimer timed(timer, "optimizer-inner-step");
    const auto update = [&](const OptimRange& r, std::span<const OptimSegment> segments) {
      const OptimViews v = optim_views(*chunks_[static_cast<size_t>(r.chunk)], r);
      if (t.optimizer == OptimizerKind::sgd) be_.sgd_step(v.master, v.grad, v.state1, v.model_copy, segments, p);
      else be_.adamw_step(v.master, v.grad, v.state1, v.state2, v.model_copy, segments, p, v.ties);
    };
    if (!pieces_.empty()) {  // beside the next forward (update_beside_forward)
      be_.begin_side_ops();
      for (size_t k = 0; k < pieces_.size(); ++k) {
        update(ranges_[pieces_[k].range], pieces_[k].update);
        be_.record_side_mark(static_cast<int>(k));
      }
      be_.end_side_ops();
      for (size_t c = 0; c < chunks_.size(); ++c) {
        next_wait_[c] = 0;
        chunks_[c]->update_in_flight();
      }
    } else {
      for (const OptimRange& r : ranges_)
        if (!r.update.empty()) update(r, r.update);
    }
    if (t.optimizer == OptimizerKind::muon) muon_step(p);
    reduce_fp8_param_amax();  // (the update cast the FP8 parameters)
    rescale_fp8_params();
    for (GptModel* m : chunks_) m->fp8_weights_updated();  // (the update took the weights' amaxes)
  }
  if (param_gather_) {
    const ScopedTimer timed(timer, "params-all-gather");
    param_gather_->start();
  }
  ++steps_;
  schedule_.step(global_batch > 0 ? global_batch : t.global_batch);
  return out;
}

// What Muon's step needs of each chunk, once: its matrices, the parameters' groups, the ranges'
// views, which matrices this rank orthogonalizes and (distributed optimizer) the buckets that hold
// Muon parameters.
void Optimizer::plan_muon() {
  const bool decoupled = cfg_.train.decoupled_lr.has_value();
  Communicator& dense = grad_sync_->comm();
  Communicator& experts = grad_sync_->expert_comm() ? *grad_sync_->expert_comm() : dense;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    GptModel& m = *chunks_[c];
    const std::vector<ParamDesc>& params = m.params();
    MuonChunk mc;
    mc.matrices = muon_matrices(params, m.dims(), cfg_.train.muon);
    for (const ParamDesc& d : params) mc.group.push_back(optim_group(d, decoupled, muon_param(d)));
    for (const OptimRange& r : ranges_) {
      if (r.chunk != static_cast<int>(c)) continue;
      const OptimViews o = optim_views(m, r);
      mc.pieces.push_back(MuonRange{r.flat_offset, r.numel, o.master, o.state1, o.model_copy, o.ties});
    }
    mc.views.grad = m.grads_flat();
    mc.views.workspace = m.muon_workspace();
    // Unsharded, every rank orthogonalizes every matrix (nothing would hand it the others' results).
    mc.owned = sharded_ ? muon_owned(params, mc.matrices, dense.rank(), dense.size(), experts.rank(), experts.size())
                        : std::vector<char>(mc.matrices.size(), 1);
    const GradLayout& L = m.grad_layout();
    for (int b = 0; sharded_ && b < L.num_buckets(); ++b) {
      const GradBucket& k = L.plan.buckets[static_cast<size_t>(b)];
      if (std::any_of(params.begin(), params.end(), [&](const ParamDesc& d) {
            return muon_param(d) && d.offset < k.offset + k.numel && d.offset + d.numel() > k.offset;
          }))
        mc.buckets.push_back(b);
    }
    muon_.push_back(std::move(mc));
  }
}

// Muon's parameters (engine/muon.h): the momentum phase on this rank's pieces, the
// orthogonalization (with the distributed optimizer of this rank's share of the matrices, between
// an all-gather and a reduce-scatter of the buckets holding Muon parameters), then the update.
// Each parameter takes its group's learning rate and weight decay.
void Optimizer::muon_step(const OptimStepParams& p) {
  std::vector<std::vector<float>> lr(chunks_.size()), wd(chunks_.size());
  for (size_t c = 0; c < chunks_.size(); ++c) {
    for (const int g : muon_[c].group) {
      lr[c].push_back(p.lr[g]);
      wd[c].push_back(p.weight_decay[g]);
    }
    muon_momentum(be_, cfg_.train.muon, chunks_[c]->params(), muon_[c].views, muon_[c].pieces, lr[c], wd[c],
                  p.grad_scale);
  }
  // With the distributed optimizer: the buckets holding Muon parameters, their updates all-gathered
  // from the shards before the orthogonalization and its results reduce-scattered back after it.
  const auto over_muon_buckets = [&](auto&& collective) {
    be_.comm_wait_for_compute();
    for (size_t c = 0; c < chunks_.size(); ++c) {
      const GradLayout& L = chunks_[c]->grad_layout();
      for (const int b : muon_[c].buckets) {
        const GradBucket& k = L.plan.buckets[static_cast<size_t>(b)];
        Communicator& group = L.is_expert_bucket(b) ? *grad_sync_->expert_comm() : grad_sync_->comm();
        if (group.size() == 1) continue;
        const Tensor whole = chunks_[c]->grads_flat().flat_slice(k.offset, k.numel);
        collective(group, whole, whole.flat_slice(L.shard_offset(b) - k.offset, L.shard_numel(b)));
      }
    }
    be_.compute_wait_for_comm();
  };
  if (sharded_) over_muon_buckets([](Communicator& g, Tensor whole, Tensor shard) { g.all_gather(whole, shard); });
  for (size_t c = 0; c < chunks_.size(); ++c)
    muon_orthogonalize(be_, cfg_.train.muon, chunks_[c]->params(), muon_[c].matrices, muon_[c].owned, muon_[c].views,
                       ps_.tp.get());
  if (sharded_)
    over_muon_buckets([](Communicator& g, Tensor whole, Tensor shard) { g.reduce_scatter(shard, whole); });
  for (size_t c = 0; c < chunks_.size(); ++c)
    muon_apply(be_, chunks_[c]->params(), muon_[c].views, muon_[c].pieces, lr[c]);
}

bool Optimizer::cast_fp8_params() {
  bool any = false;
  for (const OptimRange& r : ranges_) {
    GptModel& m = *chunks_[static_cast<size_t>(r.chunk)];
    if (!m.fp8_params()) continue;
    m.fp8_cast_shard(r.bucket);
    any = true;
  }
  reduce_fp8_param_amax();
  return any;
}

void Optimizer::reduce_fp8_param_amax() {
  // Each rank recorded its shards' amaxes; their max makes the weights' amax whole at once (as the
  // step's end would), so that the FP8 state does not depend on the DP layout (checkpoints).
  for (GptModel* m : chunks_) m->reduce_fp8_param_amax();
}

void Optimizer::rescale_fp8_params() {
  // Current scaling (Transformer Engine's with FP8 parameters) scales each weight by the amax of
  // its new values, which is whole only after the update and the reduction above. The update's cast
  // with the previous scales (one more byte written per weight) yields that amax in the same pass.
  bool any = false;
  for (GptModel* m : chunks_)
    if (m->fp8_params() && m->fp8_state().options().recipe == Fp8Recipe::tensorwise) {
      m->update_fp8_param_scales();
      any = true;
    }
  if (any) cast_fp8_params();
}

// Under expert parallelism: the routed experts' sums of this rank's pieces, over the experts'
// shards (distributed optimizer: the expert-DP group), then over the experts' model-parallel group
// (tp x ep x pp: every expert once). Nothing to do without it (the slots hold zeros).
void Optimizer::reduce_expert_statistics(Tensor sums) {
  if (!ps_.expert_model_parallel) return;
  if (sharded_) ps_.expert_dist_opt_group().all_reduce(sums);  // (an instance holds every shard)
  ps_.expert_model_parallel->all_reduce(sums);
}

void Optimizer::read_moe_layer_losses(StepOutcome& out, double micro_batches) {
  // Every rank calls the same collectives: the chunks without MoE layers hold zeros.
  Tensor sums;
  for (GptModel* m : chunks_) {
    const Tensor t = m->moe_layer_loss_sums();
    if (t.empty()) continue;
    if (sums.empty()) sums = t;
    else be_.axpby(sums, 1.0f, sums, 1.0f, t);
  }
  const ModelDims& d = chunks_.front()->dims();
  const int64_t n = 2 * GptModel::kMoeTerms * int64_t{d.num_layers + d.mtp};
  MT_CHECK(!sums.empty() && sums.numel() == n, "--moe-per-layer-logging: no per-layer buffer on this rank");
  ps_.replicas().all_reduce(sums);  // (each CP rank's values add up to its micro-batch's)
  if (ps_.pp_size > 1) ps_.pp->all_reduce(sums);
  moe_layer_host_.resize(static_cast<size_t>(n));
  if (sums.dtype == DType::f64) {
    be_.copy_to_host(moe_layer_host_.data(), sums);
  } else {
    moe_layer_f32_.resize(static_cast<size_t>(n));
    be_.copy_to_host(moe_layer_f32_.data(), sums);
    std::copy(moe_layer_f32_.begin(), moe_layer_f32_.end(), moe_layer_host_.begin());
  }
  const size_t width = 2 * GptModel::kMoeTerms;
  const std::vector<MoeTerm> terms = moe_terms(d);  // (out.moe_losses' order)
  for (size_t i = 0; i < terms.size(); ++i) {
    const double divisor = micro_batches * (terms[i].over_dp ? 1.0 : static_cast<double>(ps_.dp_size));
    for (int l = 0; l < d.num_layers + d.mtp; ++l)
      out.moe_losses[i].layers.push_back(moe_layer_host_[width * static_cast<size_t>(l) + static_cast<size_t>(terms[i].slot)] /
                                         divisor);
  }
}

double Optimizer::params_norm() {
  join_update();
  const Tensor s = chunks_.front()->scalars().flat_slice(kCount, 2);  // dense, experts
  be_.fill(s, 0.0);
  for (const OptimRange& r : ranges_) {
    // Master weights kept as remainders: rounded to nearest even, joined exactly (the separate
    // copy's bits); the precision-aware optimizer's, the norm of their bf16 parameters (within 2^-9).
    const OptimViews v = optim_views(*chunks_[static_cast<size_t>(r.chunk)], r);
    const auto sum = [&](Tensor out, std::span<const OptimSegment> segments) {
      if (segments.empty()) return;
      if (!v.ties.empty()) be_.master_sum_squares(out, v.model_copy, v.master, v.ties, segments, true);
      else be_.sum_squares(out, v.master.dtype == DType::i16 ? v.model_copy : v.master, segments, true);
    };
    sum(s.flat_slice(0, 1), r.norm);
    sum(s.flat_slice(1, 1), r.expert_norm);
  }
  if (sharded_) ps_.dist_opt_group().all_reduce(s.flat_slice(0, 1));
  ps_.model_parallel->all_reduce(s.flat_slice(0, 1));
  reduce_expert_statistics(s.flat_slice(1, 1));
  double v[kCount + 2];
  read_scalars(v, kCount + 2);
  return std::sqrt(v[kCount] + v[kCount + 1]);
}

}  // namespace mt

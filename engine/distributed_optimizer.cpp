#include "engine/distributed_optimizer.h"

#include <algorithm>

#include "core/error.h"
#include "parallel/communicator.h"

namespace mt {

int optim_group(const ParamDesc& p, bool decoupled_lr, bool muon_managed) {
  if (p.mup_hidden && !muon_managed) return kOptimMupHidden;
  int g = p.weight_decay ? kOptimDecay : kOptimNoDecay;
  if (decoupled_lr && p.decoupled_lr) g += 2;
  return g;
}

namespace {

// A piece of one parameter inside a range: [offset, offset + numel) relative to the range start,
// from param_offset on in the parameter.
struct Piece {
  int64_t offset = 0, numel = 0;
  int param = 0;
  int64_t param_offset = 0;
};

void add_segments(OptimRange& r, std::vector<Piece> pieces, const GptModel& model, int tp_rank, bool decoupled_lr) {
  const std::vector<ParamDesc>& params = model.params();
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.offset < b.offset; });
  int64_t norm_end = -1, expert_norm_end = -1;
  const bool expert_parallel = model.dims().experts_own_grid();
  for (const Piece& k : pieces) {
    const ParamDesc& p = params[static_cast<size_t>(k.param)];
    const int g = optim_group(p, decoupled_lr);
    const Tensor cast_amax = p.fp8_storage ? Tensor() : model.weight_cast_amax_slot(k.param);
    if (p.fp8_storage) {
      // An FP8 weight's piece: segments of their own, each cast with its scale (an expert's block of
      // the experts' weight, or the whole weight's).
      model.for_each_fp8_param_piece(k.param, k.param_offset, k.numel,
                                     [&](int64_t at, int64_t n, const Fp8TensorMeta& meta) {
                                       r.update.push_back(OptimSegment{k.offset + (at - k.param_offset), n, g,
                                                                       meta.scale.ptr<float>(), meta.amax.ptr<float>()});
                                     });
    } else if (!cast_amax.empty()) {
      // A whole weight whose next tensorwise cast takes its amax from the update: a segment of its own.
      r.update.push_back(OptimSegment{k.offset, k.numel, g, nullptr, cast_amax.ptr<float>()});
    } else if (!r.update.empty() && r.update.back().group == g && !r.update.back().fp8_amax) {
      r.update.back().count = k.offset + k.numel - r.update.back().offset;
    } else {
      r.update.push_back(OptimSegment{k.offset, k.numel, g});
    }
    if (!p.shared_copy && (!p.tp_duplicated || tp_rank == 0)) {
      const bool expert = expert_parallel && p.expert;
      std::vector<OptimSegment>& norm = expert ? r.expert_norm : r.norm;
      int64_t& end = expert ? expert_norm_end : norm_end;
      if (!norm.empty() && end == k.offset) norm.back().count += k.numel;
      else norm.push_back(OptimSegment{k.offset, k.numel, 0});
      end = k.offset + k.numel;
    }
  }
}

}  // namespace

std::vector<OptimRange> plan_optim_ranges(const GptModel& model, int chunk, int tp_rank, bool decoupled_lr) {
  const GradLayout& L = model.grad_layout();
  const std::vector<ParamDesc>& params = model.params();
  std::vector<OptimRange> out;
  if (!L.sharded) {
    OptimRange r;
    r.chunk = chunk;
    r.numel = model.grads_flat().numel();
    std::vector<Piece> pieces;
    for (size_t i = 0; i < params.size(); ++i)
      pieces.push_back({params[i].offset, params[i].numel(), static_cast<int>(i), 0});
    add_segments(r, std::move(pieces), model, tp_rank, decoupled_lr);
    out.push_back(std::move(r));
    return out;
  }
  for (int b = 0; b < L.num_buckets(); ++b) {
    OptimRange r;
    r.chunk = chunk;
    r.bucket = b;
    r.flat_offset = L.shard_offset(b);
    r.state_offset = L.state_offset[static_cast<size_t>(b)];
    r.numel = L.shard_numel(b);
    std::vector<Piece> pieces;
    for (const ShardSegment& s : L.shard_segments(b)) pieces.push_back({s.shard_offset, s.numel, s.param, s.param_offset});
    add_segments(r, std::move(pieces), model, tp_rank, decoupled_lr);
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<OptimSegment> without_params(const std::vector<OptimSegment>& segments, const std::vector<ParamDesc>& params,
                                         int64_t flat_offset, const std::function<bool(const ParamDesc&)>& leave) {
  std::vector<std::pair<int64_t, int64_t>> cut;  // [begin, end) relative to the range
  for (const ParamDesc& p : params)
    if (leave(p)) cut.push_back({p.offset - flat_offset, p.offset - flat_offset + p.numel()});
  std::sort(cut.begin(), cut.end());
  std::vector<OptimSegment> out;
  for (const OptimSegment& s : segments) {
    int64_t at = s.offset;
    const int64_t end = s.offset + s.count;
    for (const auto& [b, e] : cut) {
      if (e <= at || b >= end) continue;
      if (b > at) {
        OptimSegment piece = s;
        piece.offset = at;
        piece.count = b - at;
        out.push_back(piece);
      }
      at = std::max(at, e);
    }
    if (at < end) {
      OptimSegment piece = s;
      piece.offset = at;
      piece.count = end - at;
      out.push_back(piece);
    }
  }
  return out;
}

OptimViews optim_views(const GptModel& m, const OptimRange& r) {
  OptimViews v;
  auto state = [&](const Tensor& t) { return t.empty() ? Tensor() : t.flat_slice(r.state_offset, r.numel); };
  // (Sharded gradients: the shards, laid out like the states.)
  v.grad = m.options().shard_grads ? m.grad_shards().flat_slice(r.state_offset, r.numel)
                                   : m.grads_flat().flat_slice(r.flat_offset, r.numel);
  if (m.has_master_copy()) {
    v.master = state(m.master_flat());
    v.ties = m.master_ties(r.state_offset);
    // (FP8 parameters: the update casts them, each segment with its weight's scale.)
    // (Sharded parameters: a layer's bucket's output is this rank's shard of its parameters.)
    v.model_copy = r.bucket >= 0 && m.param_shard_bucket(r.bucket) ? m.param_shard(r.bucket)
                                                                    : m.param_storage(r.flat_offset, r.numel);
  } else {
    v.master = m.params_flat().flat_slice(r.flat_offset, r.numel);  // the parameters are the master weights
  }
  v.state1 = state(m.exp_avg_flat());
  v.state2 = state(m.exp_avg_sq_flat());
  return v;
}

// ---- parameter all-gather --------------------------------------------------------------------

ParamGather::ParamGather(std::vector<GptModel*> chunks, Communicator& dp, Communicator* expert_dp, bool overlap)
    : chunks_(std::move(chunks)), dp_(dp), expert_dp_(expert_dp), overlap_(overlap) {
  int marks = 0;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    first_mark_.push_back(marks);
    marks += chunks_[c]->grad_layout().num_buckets();
    pending_.emplace_back(static_cast<size_t>(chunks_[c]->grad_layout().num_buckets()), 0);
  }
  if (!overlap_) return;
  const int first = chunks_.front()->backend().allocate_comm_marks(marks);
  for (int& m : first_mark_) m += first;
  for (size_t c = 0; c < chunks_.size(); ++c)
    chunks_[c]->on_params_needed = [this, c](int end) { wait_needed(static_cast<int>(c), end); };
}

ParamGather::~ParamGather() {
  if (overlap_)
    for (GptModel* m : chunks_) m->on_params_needed = nullptr;
}

void ParamGather::start() {
  MT_CHECK(num_pending_ == 0, "parameter gathers of the previous step were never waited for");
  Backend& be = chunks_.front()->backend();
  be.comm_wait_for_compute();  // the shards are updated
  for (size_t c = 0; c < chunks_.size(); ++c) {
    GptModel& m = *chunks_[c];
    const GradLayout& L = m.grad_layout();
    m.param_shards_updated();  // (sharded parameters: each layer's are gathered when needed)
    // Buckets in forward order (the last bucket holds the first layers), so that the first
    // forward's parameters arrive first.
    for (int b = L.num_buckets() - 1; b >= 0; --b) {
      if (m.param_shard_bucket(b)) continue;
      const GradBucket& k = L.plan.buckets[static_cast<size_t>(b)];
      const Tensor whole = m.param_storage(k.offset, k.numel);  // FP8 buckets: FP8 bytes
      Communicator& group = L.is_expert_bucket(b) ? *expert_dp_ : dp_;
      if (group.size() > 1) group.all_gather(whole, whole.flat_slice(L.shard_offset(b) - k.offset, L.shard_numel(b)));
      if (overlap_) {
        be.record_comm_mark(first_mark_[c] + b);
        pending_[c][static_cast<size_t>(b)] = 1;
        ++num_pending_;
      }
    }
  }
  if (!overlap_) be.compute_wait_for_comm();
}

void ParamGather::wait_needed(int chunk, int end) {
  if (num_pending_ == 0) return;
  GptModel& m = *chunks_[static_cast<size_t>(chunk)];
  const GradLayout& L = m.grad_layout();
  std::vector<char>& pend = pending_[static_cast<size_t>(chunk)];
  for (int b = 0; b < L.num_buckets(); ++b) {
    if (!pend[static_cast<size_t>(b)] || L.bucket_first_param[static_cast<size_t>(b)] >= end) continue;
    m.backend().compute_wait_for_mark(first_mark_[static_cast<size_t>(chunk)] + b);
    pend[static_cast<size_t>(b)] = 0;
    --num_pending_;
  }
}

void ParamGather::wait_all() {
  if (num_pending_ == 0) return;
  chunks_.front()->backend().compute_wait_for_comm();
  for (auto& p : pending_) std::fill(p.begin(), p.end(), 0);
  num_pending_ = 0;
}

}  // namespace mt

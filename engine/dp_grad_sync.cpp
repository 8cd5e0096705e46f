#include "engine/dp_grad_sync.h"

#include "core/config.h"
#include "core/error.h"
#include "parallel/parallel_state.h"

namespace mt {

DpGradSync::DpGradSync(const Config& cfg, ParallelState& ps, std::vector<GptModel*> chunks)
    : ps_(ps), chunks_(std::move(chunks)) {
  MT_CHECK(!chunks_.empty(), "no model chunks");
  const ParallelConfig& p = cfg.parallel;
  // (Also with one DP rank when the experts' data-parallel group is larger: experts replicated over
  // TP ranks that dispatched other rows.)
  reduce_ = ps.replicas_size() > 1 || ps.edp_size > 1;
  overlap_ = p.overlap_grad_reduce;
  sharded_ = chunks_.front()->grad_layout().sharded;
  // The distributed optimizer reduce-scatters over its instance (ps.dist_opt_group(): the DP group
  // unless --num-distributed-optimizer-instances splits it), then all-reduces the shards over
  // the instances; otherwise one all-reduce over DP (DP x CP with context parallelism).
  Communicator& group = sharded_ ? ps.dist_opt_group() : ps.replicas();
  const int group_size = sharded_ ? ps.dist_opt_size() : ps.replicas_size();
  const int group_rank = sharded_ ? ps.dist_opt_rank() : ps.replicas_rank();
  for (GptModel* m : chunks_)
    MT_CHECK(m->grad_layout().sharded == sharded_ && (!sharded_ || (m->options().shard_size == group_size &&
                                                                    m->options().shard_rank == group_rank)),
             "model chunks planned for another data-parallel layout");
  Backend& be = chunks_.front()->backend();
  comm_ = &group;
  inter_ = sharded_ ? ps.dist_opt_inter.get() : nullptr;
  if (reduce_ && be.comm_stream()) {
    // Communicators of their own, so that the optimizer's small DP collectives stay on the
    // compute stream (collective over the group: every member builds its DpGradSync alike).
    own_comm_ = group.split(0, group_rank, "dp_grad");
    own_comm_->set_stream(be.comm_stream());
    comm_ = own_comm_.get();
    if (inter_) {
      own_inter_ = inter_->split(0, inter_->rank(), "dp_grad_inter");
      own_inter_->set_stream(be.comm_stream());
      inter_ = own_inter_.get();
    }
  }
  // The routed experts' buckets (expert parallelism): over the expert-DP group (of one rank when
  // EP = DP: nothing to reduce).
  bool experts = false;
  for (GptModel* m : chunks_)
    for (char e : m->grad_layout().expert_bucket) experts |= e != 0;
  if (experts) {
    // (With optimizer instances: sharded over this rank's instance of the expert-DP group, the
    // shards then summed over the instances, as the dense buckets are.)
    MT_CHECK(ps.edp != nullptr, "expert buckets without an expert-DP group");
    const bool instances = sharded_ && ps.edp_intra;
    const int esize = instances ? ps.expert_dist_opt_size() : ps.edp_size;
    const int erank = instances ? ps.expert_dist_opt_rank() : ps.edp_rank;
    for (GptModel* m : chunks_)
      MT_CHECK(m->grad_layout().expert_dp_rank == erank && m->options().expert_shard_size == esize,
               "model chunks planned for another expert-data-parallel layout");
    Communicator& egroup = instances ? *ps.edp_intra : *ps.edp;
    ecomm_ = &egroup;
    einter_ = instances ? ps.edp_inter.get() : nullptr;
    if (reduce_ && be.comm_stream()) {
      own_ecomm_ = egroup.split(0, erank, "expert_dp_grad");
      own_ecomm_->set_stream(be.comm_stream());
      ecomm_ = own_ecomm_.get();
      if (einter_) {
        own_einter_ = einter_->split(0, einter_->rank(), "expert_dp_grad_inter");
        own_einter_->set_stream(be.comm_stream());
        einter_ = own_einter_.get();
      }
    }
  }
  next_bucket_.assign(chunks_.size(), 0);
  // Sharded gradients (ModelOptions::shard_grads) are reduced in every micro-batch's backward.
  shard_grads_ = chunks_.front()->options().shard_grads;
  for (GptModel* m : chunks_)
    MT_CHECK(m->options().shard_grads == shard_grads_, "model chunks with and without sharded gradients");
  if ((reduce_ && overlap_) || shard_grads_)
    for (size_t c = 0; c < chunks_.size(); ++c)
      chunks_[c]->on_grads_final = [this, c](int first) { grads_final(static_cast<int>(c), first); };
  // Sharded gradients with --overlap-grad-reduce: a layer's reduce-scatter is finished (its sum added
  // into this rank's shard) only when its slot is next zeroed, so that it runs beside the layers
  // below. Sharded parameters with --overlap-param-gather: the layers' prefetched gathers run on
  // this class's groups (the communication stream). Marks per chunk: the slots' gathers, then their
  // reduce-scatters.
  defer_units_ = shard_grads_ && overlap_;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    GptModel& m = *chunks_[c];
    const int slots = m.options().unit_slots;
    deferred_.emplace_back(static_cast<size_t>(slots));
    unit_marks_.push_back(-1);
    const bool prefetch = m.options().prefetch_units && own_comm_;
    if (!defer_units_ && !prefetch) continue;
    MT_CHECK(!defer_units_ || slots == 3, "deferred reduce-scatters need three gradient slots, the model has {}",
             slots);
    unit_marks_.back() = be.allocate_comm_marks(2 * slots);
    if (prefetch) m.set_unit_gather({comm_, ecomm_, unit_marks_.back()});
    if (defer_units_) m.on_grad_slot_reuse = [this, c](int slot) { finish_slot(static_cast<int>(c), slot); };
  }
}

DpGradSync::~DpGradSync() {
  for (GptModel* m : chunks_) {
    m->on_grads_final = nullptr;
    m->on_grad_slot_reuse = nullptr;
    m->set_unit_gather({});
  }
}

// The sum of bucket b's reduce-scatter (its shard of the staging buffer) added into this rank's
// shard of the main gradients.
void DpGradSync::add_shard(GptModel& m, int b) {
  const GradLayout& L = m.grad_layout();
  const Tensor g = m.grad_bucket(b);
  const Tensor shard = g.flat_slice(L.shard_offset(b) - L.plan.buckets[static_cast<size_t>(b)].offset, L.shard_numel(b));
  const Tensor sum = m.grad_shards().flat_slice(L.state_offset[static_cast<size_t>(b)], L.shard_numel(b));
  m.backend().axpby(sum, 1.0f, sum, 1.0f, shard);
}

// The deferred reduce-scatters from gradient slot `slot` of a chunk: the compute stream waits for
// them, then adds their sums.
void DpGradSync::finish_slot(int chunk, int slot) {
  std::vector<int>& pending = deferred_[static_cast<size_t>(chunk)][static_cast<size_t>(slot)];
  if (pending.empty()) return;
  GptModel& m = *chunks_[static_cast<size_t>(chunk)];
  m.backend().compute_wait_for_mark(unit_marks_[static_cast<size_t>(chunk)] + m.options().unit_slots + slot);
  for (const int b : pending) add_shard(m, b);
  pending.clear();
}

void DpGradSync::start_step() {
  next_bucket_.assign(chunks_.size(), 0);
  finished_ = false;
}

// Buckets are launched in order (the same on every DP rank, as collectives must be), each once
// all its gradients are final.
void DpGradSync::grads_final(int chunk, int first_param) {
  GptModel& m = *chunks_[static_cast<size_t>(chunk)];
  const GradLayout& L = m.grad_layout();
  int& next = next_bucket_[static_cast<size_t>(chunk)];
  if (first_param == GptModel::kBackwardBegins) {  // (sharded gradients: every backward reduces them all)
    next = 0;
    return;
  }
  while (next < L.num_buckets() && L.bucket_first_param[static_cast<size_t>(next)] >= first_param) launch(chunk, next++);
}

void DpGradSync::launch(int chunk, int b) {
  GptModel& m = *chunks_[static_cast<size_t>(chunk)];
  Backend& be = m.backend();
  const GradLayout& L = m.grad_layout();
  const GradBucket& k = L.plan.buckets[static_cast<size_t>(b)];
  const Tensor g = m.grad_bucket(b);  // in the main grads' dtype
  const bool expert = L.is_expert_bucket(b);
  Communicator& group = expert ? *ecomm_ : *comm_;
  Communicator* inter = expert ? einter_ : inter_;  // across optimizer instances
  if (shard_grads_) {
    // This micro-batch's sum over the instance's ranks, added into this rank's shard of the main
    // gradients; the staging buffer is then free (a layer's slot is zeroed by its next user, the
    // others here). Across optimizer instances the shards are summed once, in finish(). Deferred
    // (a layer's bucket under --overlap-grad-reduce): the sum is added when the slot is next needed.
    const Tensor shard = g.flat_slice(L.shard_offset(b) - k.offset, L.shard_numel(b));
    const int unit = L.bucket_unit[static_cast<size_t>(b)];
    if (group.size() > 1) {
      be.comm_wait_for_compute();
      group.reduce_scatter(shard, g);
      if (defer_units_ && unit >= 0) {
        const int slot = m.grad_unit_slot(unit - m.dims().layer_begin);
        be.record_comm_mark(unit_marks_[static_cast<size_t>(chunk)] + m.options().unit_slots + slot);
        deferred_[static_cast<size_t>(chunk)][static_cast<size_t>(slot)].push_back(b);
        return;
      }
      be.compute_wait_for_comm();
    }
    add_shard(m, b);
    if (unit < 0) be.fill(g, 0.0);
    return;
  }
  if (group.size() == 1 && !inter) return;  // (a group of one: nothing to reduce)
  be.comm_wait_for_compute();
  if (sharded_) {
    const Tensor shard = g.flat_slice(L.shard_offset(b) - k.offset, L.shard_numel(b));
    group.reduce_scatter(shard, g);
    if (inter) inter->all_reduce(shard);  // the same shard of every instance
  } else {
    group.all_reduce(g);
  }
}

void DpGradSync::finish() {
  if (finished_) return;
  finished_ = true;
  finish_dp();
  const ScopedTimer timed(timer, "embedding-grads-all-reduce");
  finish_embeddings();
}

void DpGradSync::finish_dp() {
  const ScopedTimer timed(timer, "all-grads-sync");
  if (shard_grads_) {  // (every bucket was reduced in its micro-batch's backward)
    for (size_t c = 0; c < chunks_.size(); ++c)
      for (size_t slot = 0; slot < deferred_[c].size(); ++slot) finish_slot(static_cast<int>(c), static_cast<int>(slot));
    if (inter_) {
      Backend& be = chunks_.front()->backend();
      be.comm_wait_for_compute();
      for (GptModel* m : chunks_) {
        const GradLayout& L = m->grad_layout();
        if (!einter_) {  // (no expert buckets of their own: one call)
          inter_->all_reduce(m->grad_shards());
          continue;
        }
        for (int b = 0; b < L.num_buckets(); ++b)  // each shard over its own instances' group
          (L.is_expert_bucket(b) ? einter_ : inter_)
              ->all_reduce(m->grad_shards().flat_slice(L.state_offset[static_cast<size_t>(b)], L.shard_numel(b)));
      }
      be.compute_wait_for_comm();
    }
    return;
  }
  if (reduce_) {
    for (size_t c = 0; c < chunks_.size(); ++c) {
      const int n = chunks_[c]->grad_layout().num_buckets();
      while (next_bucket_[c] < n) launch(static_cast<int>(c), next_bucket_[c]++);
    }
    chunks_.front()->backend().compute_wait_for_comm();
  }
}

void DpGradSync::finish_embeddings() {
  // Tied word embeddings across pipeline stages (Megatron's _allreduce_word_embedding_grads): the
  // first stage's embedding and the last stage's output-layer copy get the sum of both gradients.
  for (GptModel* m : chunks_) {
    const ModelDims& d = m->dims();
    // (Untied with mtp layers: the first stage's embedding and the last stage's copy for the depths.)
    if (!d.pipeline || !(d.tied_embeddings || d.mtp > 0)) continue;
    const char* name = d.first_stage  ? "embedding.word_embeddings.weight"
                       : !d.last_stage ? nullptr
                       : d.tied_embeddings ? "output_layer.weight"
                                           : "embedding.word_embeddings.weight";
    if (!name) continue;
    const int i = find_param(m->params(), name);
    MT_CHECK(i >= 0 && ps_.embedding, "tied embeddings: no {} or no embedding group on this rank", name);
    if (shard_grads_) {
      // Sharded gradients: the summed gradients are this rank's shard. Each copy has a bucket of its
      // own (engine/grad_layout.h), sharded alike on both stages' ranks of the same data-parallel rank.
      const GradLayout& L = m->grad_layout();
      const int b = m->param_bucket(i);
      MT_CHECK(L.plan.buckets[static_cast<size_t>(b)].params.size() == 1,
               "tied embeddings: {} has no gradient bucket of its own", name);
      ps_.embedding->all_reduce(m->grad_shards().flat_slice(L.state_offset[static_cast<size_t>(b)], L.shard_numel(b)));
      continue;
    }
    ps_.embedding->all_reduce(m->grad(i));
  }
}

}  // namespace mt

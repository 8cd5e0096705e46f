#include "engine/pipeline_runner.h"

#include <algorithm>
#include <map>

#include "core/error.h"
#include "engine/straggler.h"
#include "parallel/parallel_state.h"

namespace mt {

// ---- slot plan -------------------------------------------------------------------------------

PipelinePlan PipelinePlan::build(const Config& cfg, int pp_rank, int num_microbatches) {
  ScheduleSpec spec;
  spec.pp_size = cfg.parallel.pipeline_model_parallel_size;
  spec.num_microbatches = num_microbatches > 0 ? num_microbatches : cfg.train.num_microbatches;
  spec.num_chunks = std::max(1, cfg.parallel.virtual_pipeline_size);
  spec.microbatch_group_size = cfg.parallel.microbatch_group_size_per_virtual_pipeline_stage.value_or(0);
  return from_schedule(build_pipeline_schedule(spec, pp_rank));
}

PipelinePlan PipelinePlan::from_schedule(PipelineSchedule schedule) {
  PipelinePlan p;
  p.schedule = std::move(schedule);
  const int V = p.schedule.num_chunks;
  p.num_slots.assign(static_cast<size_t>(V), 0);
  std::vector<std::vector<int>> free(static_cast<size_t>(V));  // free slots per chunk, smallest last
  std::map<std::pair<int, int>, int> held;                      // (micro-batch, chunk) -> slot
  auto take = [&](int mb, int c) {
    auto it = held.find({mb, c});
    if (it != held.end()) return it->second;
    std::vector<int>& f = free[static_cast<size_t>(c)];
    int s;
    if (f.empty()) {
      s = p.num_slots[static_cast<size_t>(c)]++;
    } else {
      s = f.back();
      f.pop_back();
    }
    held[{mb, c}] = s;
    return s;
  };
  auto holding = [&](int mb, int c) {
    auto it = held.find({mb, c});
    MT_CHECK(it != held.end(), "pipeline plan: micro-batch {} of chunk {} holds no slot", mb, c);
    return it->second;
  };
  for (const PipelineAction& a : p.schedule.actions) {
    std::vector<int> slots;
    switch (a.op) {
      case PipelineOp::forward: slots.push_back(take(a.microbatch, a.chunk)); break;
      case PipelineOp::backward: {
        const int s = holding(a.microbatch, a.chunk);
        slots.push_back(s);
        held.erase({a.microbatch, a.chunk});
        std::vector<int>& f = free[static_cast<size_t>(a.chunk)];
        f.push_back(s);
        std::sort(f.rbegin(), f.rend());  // reuse the smallest free slot first (deterministic)
        break;
      }
      case PipelineOp::communicate:
        for (const P2PTransfer& t : a.transfers) {
          if (t.channel == PipelineChannel::activation) slots.push_back(t.is_send ? holding(t.microbatch, t.chunk)
                                                                                  : take(t.microbatch, t.chunk));
          else slots.push_back(t.is_send ? -1 : holding(t.microbatch, t.chunk));
        }
        break;
    }
    p.slots.push_back(std::move(slots));
  }
  MT_CHECK(held.empty(), "pipeline plan: {} slots still held after the step", held.size());
  for (int& n : p.num_slots) n = std::max(n, 1);  // evaluation uses slot 0 of every chunk
  p.next_backward.assign(p.schedule.actions.size(), -1);
  std::vector<std::pair<PipelineOp, int>> next(static_cast<size_t>(V), {PipelineOp::communicate, -1});
  for (size_t i = p.schedule.actions.size(); i-- > 0;) {
    const PipelineAction& a = p.schedule.actions[i];
    if (a.op == PipelineOp::communicate) continue;
    const auto& [op, slot] = next[static_cast<size_t>(a.chunk)];
    if (op == PipelineOp::backward) p.next_backward[i] = slot;
    next[static_cast<size_t>(a.chunk)] = {a.op, p.slots[i][0]};
  }
  return p;
}

std::vector<int> scheduled_microbatch_counts(const Config& cfg) {
  const TrainConfig& t = cfg.train;
  if (t.batch_size_schedule.empty()) return {t.num_microbatches};
  const int per_step = t.micro_batch_size * cfg.parallel.data_parallel_size;
  std::vector<int> out;
  for (const auto& [threshold, batch] : t.batch_size_schedule)
    if (batch % per_step == 0 && std::find(out.begin(), out.end(), batch / per_step) == out.end())
      out.push_back(batch / per_step);
  if (out.empty()) out.push_back(t.num_microbatches);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<int> pipeline_slots_needed(const Config& cfg, int pp_rank) {
  std::vector<int> slots;
  for (int m : scheduled_microbatch_counts(cfg)) {
    const PipelinePlan p = PipelinePlan::build(cfg, pp_rank, m);
    if (slots.empty()) slots.assign(p.num_slots.size(), 0);
    for (size_t c = 0; c < slots.size(); ++c) slots[c] = std::max(slots[c], p.num_slots[c]);
  }
  return slots;
}

// ---- runner ------------------------------------------------------------------------------

PipelineRunner::PipelineRunner(const Config& cfg, ParallelState& ps, std::vector<GptModel*> chunks)
    : cfg_(cfg), ps_(ps), chunks_(std::move(chunks)) {
  for (int m : scheduled_microbatch_counts(cfg)) {
    const PipelinePlan& plan = plans_.emplace(m, PipelinePlan::build(cfg, ps.pp_rank, m)).first->second;
    MT_CHECK(static_cast<int>(chunks_.size()) == plan.schedule.num_chunks, "{} model chunks for a schedule of {}",
             chunks_.size(), plan.schedule.num_chunks);
    for (size_t c = 0; c < chunks_.size(); ++c)
      MT_CHECK(chunks_[c]->options().num_slots >= plan.num_slots[c],
               "chunk {} has {} activation slots, the schedule of {} micro-batches needs {}", c,
               chunks_[c]->options().num_slots, m, plan.num_slots[c]);
  }
  int reading = 0;
  for (size_t c = 0; c < chunks_.size(); ++c) reading += needs_data(static_cast<int>(c));
  reads_data_ = reading > 0;
  keep_step_ = reading > 1;
  if (ps_.pp_size > 1 && chunks_.front()->backend().device() == Device::cuda) connect_neighbours();
}

// NCCL sets up point-to-point connections lazily, at a pair's first transfer in each direction.
// Inside the schedule that first transfer finds the peer already waiting in a receive kernel (the
// last stage posts its receive long before the first stage has computed a forward), and PP=2
// over NCCL hung there on 2 H200s while the same setup with both ranks arriving together works.
// So every rank exchanges one activation-sized buffer with both ring neighbours, in both
// directions, before training: all the connections the schedules use exist before the first step.
// (Collective over the pipeline group; the buffers' contents are overwritten before any use.)
void PipelineRunner::connect_neighbours() {
  const int P = ps_.pp_size, r = ps_.pp_rank;
  const int next = (r + 1) % P, prev = (r + P - 1) % P;
  GptModel& m = *chunks_.front();
  Tensor out = m.stage_output(0), in = m.stage_input(0), grad_in = m.output_grad(0);
  if (grad_in.numel() != in.numel()) grad_in = in;
  Communicator& c = *ps_.pp;
  c.group_start();
  c.send(out, next);
  c.recv(in, prev);
  c.send(out, prev);
  c.recv(grad_in, next);
  c.group_end();
  c.barrier();
}

const PipelinePlan& PipelineRunner::plan(int num_microbatches) const {
  auto it = plans_.find(num_microbatches);
  MT_CHECK(it != plans_.end(), "no pipeline schedule planned for {} micro-batches", num_microbatches);
  return it->second;
}

bool every_stage_reads_data(const Config& cfg) {
  const ModelConfig& m = cfg.model;
  const bool rotary = m.position_embedding_type == PositionEmbedding::rope ||
                      m.position_embedding_type == PositionEmbedding::yarn || m.multi_latent_attention;
  return cfg.data.documents() || (cfg.data.document_positions() && rotary);
}

bool PipelineRunner::needs_data(int chunk) const {
  const ModelDims& d = chunks_[static_cast<size_t>(chunk)]->dims();
  return d.first_stage || d.last_stage || every_stage_reads_data(cfg_);
}

// Reads this step's micro-batches up to `mb` in order (step_mbs_); batch(mb) is then `mb`.
bool PipelineRunner::fetch(BatchSource* data, int mb) {
  MT_CHECK(data, "this rank reads data but has no data source");
  MT_CHECK(keep_step_ || mb >= fetched_ - 1, "micro-batch {} wanted after micro-batch {} was read", mb, fetched_ - 1);
  const size_t need = keep_step_ ? static_cast<size_t>(mb) + 1 : 1;
  if (step_mbs_.size() < need) step_mbs_.resize(need);
  while (fetched_ <= mb) {
    time("batch-generator", true);
    const bool ok = data->next(step_mbs_[keep_step_ ? static_cast<size_t>(fetched_) : 0]);
    time("batch-generator", false);
    if (!ok) return false;
    ++fetched_;
  }
  return true;
}

void PipelineRunner::communicate(const PipelineAction& a, const std::vector<int>& slots) {
  bool act = false, grad = false;
  bool send_act = false, recv_act = false, send_grad = false, recv_grad = false;
  for (const P2PTransfer& t : a.transfers) {
    const bool is_act = t.channel == PipelineChannel::activation;
    (is_act ? act : grad) = true;
    (is_act ? (t.is_send ? send_act : recv_act) : (t.is_send ? send_grad : recv_grad)) = true;
  }
  // Megatron's p2p timer of this combination (--timing-log-level 2), around the whole group.
  const ScopedTimer timed(timer, p2p_timer_name(send_act, recv_act, send_grad, recv_grad));
  Communicator* ca = ps_.pp.get();
  // On the GPU both directions go through one NCCL communicator: NCCL matches sends and receives
  // per peer in issue order, and a group spanning two communicators launches one kernel per
  // communicator on the stream, whose order can differ between neighbours and deadlock (seen:
  // PP=2 hung on 2 H200s). Over MPI the separate gradient communicator stays: it keeps a schedule
  // defect from pairing an activation with a gradient silently.
  const bool one_comm = chunks_.front()->backend().device() == Device::cuda;
  Communicator* cg = one_comm ? ca : ps_.pp_grad.get();
  MT_CHECK(ca && (!grad || cg), "pipeline transfers without pipeline communicators");
  if (act || (grad && one_comm)) ca->group_start();
  if (grad && !one_comm) cg->group_start();
  for (size_t i = 0; i < a.transfers.size(); ++i) {
    const P2PTransfer& t = a.transfers[i];
    const GptModel& m = *chunks_[static_cast<size_t>(t.chunk)];
    const int slot = slots[i];
    if (t.channel == PipelineChannel::activation) {
      if (t.is_send) ca->send(m.stage_output(slot), t.peer);
      else ca->recv(m.stage_input(slot), t.peer);
    } else {
      if (t.is_send) cg->send(m.input_grad(), t.peer);
      else cg->recv(m.output_grad(slot), t.peer);
    }
  }
  if (act || (grad && one_comm)) ca->group_end();
  if (grad && !one_comm) cg->group_end();
}

void PipelineRunner::train_step(BatchSource* data, double loss_grad_scale, bool per_token_loss, uint64_t serial,
                                int64_t iteration, int num_microbatches) {
  const PipelinePlan& p = plan(num_microbatches);
  const int M = p.schedule.num_microbatches;
  fetched_ = 0;
  for (size_t i = 0; i < p.schedule.actions.size(); ++i) {
    const PipelineAction& a = p.schedule.actions[i];
    const std::vector<int>& slots = p.slots[i];
    if (a.op == PipelineOp::communicate) {
      communicate(a, slots);
      continue;
    }
    GptModel& m = *chunks_[static_cast<size_t>(a.chunk)];
    if (a.op == PipelineOp::forward) {
      const uint64_t key = serial + static_cast<uint64_t>(a.microbatch);
      if (needs_data(a.chunk)) {
        if (straggler) straggler->batch_begin();
        if (!fetch(data, a.microbatch))
          fail("the training data ran out at iteration {} (micro-batch {} of {}): provide more data or fewer "
               "--train-iters/--train-samples", iteration, a.microbatch + 1, M);
        m.stage_micro_batch(slots[0], batch(a.microbatch), loss_grad_scale, per_token_loss, key, true);
        if (straggler) straggler->batch_end();
      } else {
        m.stage_without_data(slots[0], key, true, loss_grad_scale);
      }
      time("forward-compute", true);
      if (straggler) straggler->forward_begin();
      // Activation offloading: a forward whose own backward comes next keeps its last layers in place.
      if (p.next_backward[i] == slots[0]) m.backward_follows(slots[0]);
      m.forward(slots[0]);
      if (straggler) straggler->forward_end();
      time("forward-compute", false);
    } else {
      time("backward-compute", true);
      m.backward(slots[0], a.grad_sync);
      time("backward-compute", false);
    }
    // ... and the backward that comes next on this chunk gets its last layer back from host memory
    // while the rest of the schedule runs.
    if (p.next_backward[i] >= 0) m.prefetch_backward(p.next_backward[i]);
  }
}

void PipelineRunner::skip_step(BatchSource* data, int64_t iteration, int num_microbatches) {
  if (!reads_data_) return;
  for (int m = 0; m < num_microbatches; ++m)
    if (!data || !data->next(mb_)) fail("the training data ran out at iteration {}", iteration);
}

// Forward only, micro-batch by micro-batch through the whole virtual pipeline: each stage receives
// its input, runs and sends its output on. Every rank's transfers follow the order of (micro-batch,
// stage), in which each one waits only for earlier ones, so the plain sends and receives cannot
// deadlock.
bool PipelineRunner::eval_step(BatchSource* data) {
  const int P = ps_.pp_size, V = static_cast<int>(chunks_.size());
  fetched_ = 0;
  // --eval-global-batch-size: its micro-batches per DP rank (a multiple, checked by the parser).
  const TrainConfig& t = cfg_.train;
  // (With --step-batch-size-schedule the default is Megatron's args.global_batch_size, micro-batch x DP.)
  const int M = t.eval_global_batch_size.value_or(t.global_batch) / (t.micro_batch_size * ps_.dp_size);
  for (int mb = 0; mb < M; ++mb) {
    for (int c = 0; c < V; ++c) {
      GptModel& m = *chunks_[static_cast<size_t>(c)];
      const int stage = c * P + ps_.pp_rank;
      if (stage > 0) {
        ps_.pp->group_start();
        ps_.pp->recv(m.stage_input(0), (stage - 1) % P);
        ps_.pp->group_end();
      }
      if (needs_data(c)) {
        if (!fetch(data, mb)) return false;
        m.stage_micro_batch(0, batch(mb), 1.0, false, 0, false);
      } else {
        m.stage_without_data(0, 0, false);
      }
      m.forward(0);
      if (stage + 1 < P * V) {
        ps_.pp->group_start();
        ps_.pp->send(m.stage_output(0), (stage + 1) % P);
        ps_.pp->group_end();
      }
    }
  }
  return true;
}

}  // namespace mt

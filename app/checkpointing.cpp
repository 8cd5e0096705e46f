#include "app/checkpointing.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdlib>

#include "app/checkpoint_args.h"
#include "checkpoint/file_io.h"
#include "checkpoint/megatron_names.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/model_chunks.h"
#include "engine/param_layout.h"
#include "engine/scalar_reduce.h"
#include "parallel/parallel_state.h"

namespace mt {

using nlohmann::json;

namespace {

Tensor host_view(std::vector<unsigned char>& buf, DType dtype, int64_t offset, int64_t count) {
  return Tensor(buf.data() + static_cast<size_t>(offset) * dtype_size(dtype), dtype, Device::cpu, {count});
}

// FP8 scaling state of one decoder layer (Transformer Engine keeps it in each module's extra
// state): checkpoint/FORMAT.md.
std::string fp8_meta_name(int layer, const char* what) { return fmt::format("decoder.layers.{}.fp8_meta.{}", layer, what); }

// The MoE layers of a chunk that hold an expert bias (GptModel::has_expert_bias), in order.
std::vector<int> expert_bias_layers(const GptModel& m) {
  std::vector<int> out;
  if (!m.has_expert_bias()) return out;
  const ModelDims& d = m.dims();
  for (int l = d.layer_begin; l < d.layer_end; ++l)
    if (d.is_moe(l)) out.push_back(l);
  return out;
}

// (Muon keeps its momentum where AdamW keeps exp_avg: its parameters' exp_avg entries hold it.)
const char* first_state_suffix(OptimizerKind k) { return k == OptimizerKind::sgd ? ".momentum_buffer" : ".exp_avg"; }
constexpr const char* kSecondStateSuffix = ".exp_avg_sq";

const char* optimizer_name(OptimizerKind k) {
  switch (k) {
    case OptimizerKind::sgd: return "sgd";
    case OptimizerKind::muon: return "muon";
    case OptimizerKind::adam: break;
  }
  return "adam";
}

const char* scaler_kind_name(LossScaler::Kind k) {
  switch (k) {
    case LossScaler::Kind::none: return "none";
    case LossScaler::Kind::constant: return "constant";
    case LossScaler::Kind::dynamic: return "dynamic";
  }
  return "?";
}

// What the tracker of `save_dir` names now (for error messages), or "none".
std::string tracker_text(const std::string& save_dir) {
  const std::string t = checkpoint_tracker_path(save_dir);
  if (!path_exists(t)) return "no checkpoint";
  try {
    std::string s = read_text_file(t);
    while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
    return s == "release" ? std::string("the release checkpoint") : "the checkpoint of iteration " + s;
  } catch (const std::exception&) {
    return "an unreadable tracker";
  }
}

}  // namespace

SaveGroup make_save_group(ParallelState& ps, GptModel& model) {
  SaveGroup g;
  g.rank = ps.rank;
  g.world_size = ps.world_size;
  if (ps.world_size > 1) {
    g.all_ok = [&ps, &model](bool ok) {
      return all_reduce_scalar(ps, model, kSaveAgreementSlot, ok ? 1.0 : 0.0, ReduceOp::min) > 0.5;
    };
  }
  return g;
}

TrainingCheckpoints::TrainingCheckpoints(const Config& cfg, ParallelState& ps, std::vector<GptModel*> chunks)
    : cfg_(cfg),
      ps_(ps),
      chunks_(std::move(chunks)),
      model_(*chunks_.at(0)),
      group_(make_save_group(ps, model_)),
      progress_(cfg.checkpoint.save, cfg.logging.log_progress, ps.rank, ps.world_size,
                std::getenv("SLURM_JOB_ID") ? std::getenv("SLURM_JOB_ID") : ""),
      retention_(cfg.checkpoint.save.value_or(""), cfg.checkpoint.save_retain_interval, ps.rank,
                 [this](int64_t it) { progress_.checkpoint_deleted(it); }),
      non_persistent_dir_(cfg.checkpoint.save && cfg.checkpoint.non_persistent_ckpt_type == "global"
                              ? non_persistent_directory(cfg.checkpoint.non_persistent_global_ckpt_dir, cfg.checkpoint.save)
                              : std::string()),
      non_persistent_cleanup_(non_persistent_dir_, ps.rank) {
  // Megatron appends this once initialized, before loading a checkpoint.
  progress_.job_started();
  if (!cfg.checkpoint.save) return;
  auto size_of = [](const Tensor& t) { return t.empty() ? size_t{0} : t.nbytes(); };
  for (GptModel* m : chunks_) {
    Staging h;
    // (Sharded parameters: the whole buckets' parts of the flat layout; the rest stays unused.)
    h.params.resize(m->options().shard_params
                        ? static_cast<size_t>(m->grad_layout().plan.numel) * dtype_size(m->options().compute)
                        : size_of(m->params_flat()));
    // FP8 parameters' and sharded parameters' model weights come from the master weights
    // (GptModel::fp8_params, ModelOptions::shard_params).
    if (m->fp8_params() || m->options().shard_params) {
      h.master.resize(size_of(m->master_flat()));
      h.fp8_model.resize(static_cast<size_t>(m->master_flat().numel()) * dtype_size(m->options().compute));
    }
    if (!cfg.checkpoint.no_save_optim && m->has_master_copy()) {
      const Tensor master = m->master_flat();
      if (master.dtype == DType::i16) {  // remainders: saved joined, as float32
        h.master.resize(static_cast<size_t>(master.numel()) * sizeof(float));
        h.master_raw.resize(size_of(master));
        h.master_ties.resize(size_of(m->master_tie_words()));
      } else {
        h.master.resize(size_of(master));
      }
    }
    if (!cfg.checkpoint.no_save_optim) {
      h.state1.resize(size_of(m->exp_avg_flat()));
      h.state2.resize(size_of(m->exp_avg_sq_flat()));
    }
    h.expert_bias.resize(expert_bias_layers(*m).size() * static_cast<size_t>(m->dims().experts));
    const Fp8State& f = m->fp8_state();
    h.fp8.resize(static_cast<size_t>(f.operands() / Fp8State::kPerLayer * f.layer_floats()) * sizeof(float));
    const Fp8State& fx = m->fp8_extra_state();
    if (fx.any()) h.fp8_extra.resize(static_cast<size_t>(fx.operands() / fx.per_layer() * fx.layer_floats()) * sizeof(float));
    const Fp8State& fe = m->fp8_expert_state();
    if (fe.any()) {
      h.fp8_experts.resize(static_cast<size_t>(fe.operands() / fe.per_layer() * fe.layer_floats()));
      h.fp8_experts_out.resize(h.fp8_experts.size());
    }
    staging_.push_back(std::move(h));
  }
}

TrainingCheckpoints::~TrainingCheckpoints() = default;

bool TrainingCheckpoints::owns(const ParamDesc& p) const {
  // One replica of each slice: DP (and CP) rank 0 (for the routed experts under expert parallelism,
  // expert-DP rank 0: each EP rank holds other experts); TP rank 0 for what every TP rank holds
  // alike; never the last stage's copy of tied embeddings (the first stage saves them).
  // (The experts' grid folds CP into its EP x expert-DP ranks: its expert-DP rank alone decides.)
  const bool first_replica = p.expert && ps_.edp ? ps_.edp_rank == 0 : ps_.dp_rank == 0 && ps_.cp_rank == 0;
  return !p.shared_copy && first_replica && (!p.tp_duplicated || ps_.tp_rank == 0);
}

// ---------------------------------------------------------------------------------------------
// Saving

void TrainingCheckpoints::stage_chunk(CheckpointWriter& w, GptModel& m, Staging& h, bool optim) {
  Backend& be = m.backend();
  // The only device->host traffic of a save: one copy per flat buffer into the staging memory.
  const GradLayout& L = m.grad_layout();
  const bool shard_params = m.options().shard_params;
  if (shard_params) {  // (the whole buckets; a layer's parameters come from the master weights)
    const size_t elem = dtype_size(m.options().compute);
    for (int b = 0; b < L.num_buckets(); ++b) {
      const GradBucket& k = L.plan.buckets[static_cast<size_t>(b)];
      if (!m.param_shard_bucket(b))
        be.copy_to_host(h.params.data() + static_cast<size_t>(k.offset) * elem, m.param_storage(k.offset, k.numel));
    }
  } else {
    be.copy_to_host(h.params.data(), m.params_flat());
  }
  if (optim || m.fp8_params() || shard_params) {
    if (!h.master_raw.empty()) {  // (int16 remainders: joined with the parameters' bf16 bits)
      be.copy_to_host(h.master_raw.data(), m.master_flat());
      if (!h.master_ties.empty()) be.copy_to_host(h.master_ties.data(), m.master_tie_words());
      m.master_to_host(reinterpret_cast<float*>(h.master.data()), h.params.data(), h.master_raw.data(),
                       h.master_ties.empty() ? nullptr : h.master_ties.data());
    } else if (!h.master.empty()) {
      be.copy_to_host(h.master.data(), m.master_flat());
    }
    if (!h.state1.empty()) be.copy_to_host(h.state1.data(), m.exp_avg_flat());
    if (!h.state2.empty()) be.copy_to_host(h.state2.data(), m.exp_avg_sq_flat());
  }
  const DType T = m.options().compute, S = m.options().accum;
  const std::vector<ParamDesc>& ps = m.params();
  auto add_optim = [&](const ParamDesc& p, const ShardSlice& slice, int64_t at, int64_t n) {
    if (!h.master.empty())
      w.add(p.name, CheckpointKind::main_params, slice, host_view(h.master, S, at, n), p.global_shape);
    // (Moments in their own dtype: bf16 ones with --exp-avg-dtype bf16 load into float32 ones
    // exactly, and float32 ones into bf16 rounded to nearest even.)
    if (!h.state1.empty())
      w.add(p.name + first_state_suffix(cfg_.train.optimizer), CheckpointKind::optimizer, slice,
            host_view(h.state1, m.exp_avg_flat().dtype, at, n), p.global_shape);
    if (!h.state2.empty())
      w.add(p.name + kSecondStateSuffix, CheckpointKind::optimizer, slice,
            host_view(h.state2, m.exp_avg_sq_flat().dtype, at, n), p.global_shape);
  };
  for (size_t i = 0; i < ps.size(); ++i) {
    const ParamDesc& p = ps[i];
    if (!owns(p)) continue;
    const ShardSlice slice = ShardSlice::whole(p.shard);
    if (!p.fp8_storage && !m.param_sharded(static_cast<int>(i)))
      w.add(p.name, CheckpointKind::model, slice, host_view(h.params, T, p.offset, p.numel()), p.global_shape);
    if (optim && !L.sharded) add_optim(p, slice, p.offset, p.numel());
  }
  stage_fp8_params(w, m, h);
  // Expert biases: replicated; one writer, as for the FP8 state below.
  const std::vector<int> bias_layers = expert_bias_layers(m);
  if (!bias_layers.empty() && ps_.dp_rank == 0 && ps_.cp_rank == 0 && ps_.tp_rank == 0) {
    const int64_t E = m.dims().experts;
    for (size_t j = 0; j < bias_layers.size(); ++j) {
      const std::span<float> b = m.expert_bias(bias_layers[j]);
      float* dst = h.expert_bias.data() + j * static_cast<size_t>(E);
      std::copy(b.begin(), b.end(), dst);
      w.add(expert_bias_name(bias_layers[j]), CheckpointKind::model, ShardSlice::whole(ShardIndex::whole(E, 1)),
            Tensor(dst, DType::f32, Device::cpu, {E}), {E});
    }
  }
  // FP8 scaling state: per FP8 layer, replicated over DP and (after the amax reduction) TP; the
  // dense GEMMs' and the extra ones' (multi-latent attention's, the MTP projection's).
  if (ps_.dp_rank == 0 && ps_.cp_rank == 0 && ps_.tp_rank == 0) {
    stage_fp8_state(w, be, m.fp8_state(), h.fp8, "");
    stage_fp8_state(w, be, m.fp8_extra_state(), h.fp8_extra, "extra_");
  }
  stage_fp8_experts(w, m, h);
  if (!optim || !L.sharded) return;
  // Distributed optimizer: this DP rank's pieces of every bucket, as flat ranges of the
  // parameters' TP blocks (with CP the pieces are spread over DP x CP). With
  // --num-distributed-optimizer-instances every instance holds all pieces: the first one writes them.
  for (int b = 0; b < L.num_buckets(); ++b) {
    if (!first_instance(L, b)) continue;
    for (const ShardSegment& seg : L.shard_segments(b)) {
      const ParamDesc& p = ps[static_cast<size_t>(seg.param)];
      if (p.shared_copy || (p.tp_duplicated && ps_.tp_rank != 0)) continue;
      add_optim(p, ShardSlice{p.shard, seg.param_offset, seg.numel}, L.state_offset[static_cast<size_t>(b)] + seg.shard_offset,
                seg.numel);
    }
  }
}

// Whether this rank is in the first distributed-optimizer instance of bucket b's group (the
// experts' own data-parallel group for their buckets under expert parallelism).
bool TrainingCheckpoints::first_instance(const GradLayout& L, int b) const {
  if (L.is_expert_bucket(b) && ps_.edp) return ps_.edp_rank < ps_.expert_dist_opt_size();
  return ps_.replicas_rank() < ps_.dist_opt_size();
}

// The model weights of FP8 parameters are what a run without --fp8-param-gather saves: the master
// weights rounded to the compute dtype (not the FP8 values), so that such a checkpoint loads,
// converts and exports like any other. Every DP rank writes its shards' pieces (the master copy is
// sharded), as for the optimizer state.
void TrainingCheckpoints::stage_fp8_params(CheckpointWriter& w, GptModel& m, Staging& h) {
  // (Sharded parameters likewise: each DP rank writes its pieces of the layers' weights.)
  const bool shard_params = m.options().shard_params;
  if (!m.fp8_params() && !shard_params) return;
  const DType T = m.options().compute, S = m.options().accum;
  MT_CHECK(S == DType::f32, "FP8 parameters with {} master weights", dtype_name(S));
  const float* master = reinterpret_cast<const float*>(h.master.data());
  const GradLayout& L = m.grad_layout();
  for (int b = 0; b < L.num_buckets(); ++b) {
    if ((!L.fp8_bucket(b) && !m.param_shard_bucket(b)) || !first_instance(L, b)) continue;
    for (const ShardSegment& seg : L.shard_segments(b)) {
      const ParamDesc& p = m.params()[static_cast<size_t>(seg.param)];
      if (p.shared_copy || (p.tp_duplicated && ps_.tp_rank != 0)) continue;
      const int64_t at = L.state_offset[static_cast<size_t>(b)] + seg.shard_offset;
      const Tensor out = host_view(h.fp8_model, T, at, seg.numel);
      for (int64_t i = 0; i < seg.numel; ++i) {
        const float v = master[at + i];
        if (T == DType::bf16) out.ptr<uint16_t>()[i] = float_to_bf16_bits(v);
        else if (T == DType::f16) out.ptr<uint16_t>()[i] = float_to_f16_bits(v);
        else out.ptr<float>()[i] = v;
      }
      w.add(p.name, CheckpointKind::model, ShardSlice{p.shard, seg.param_offset, seg.numel}, out, p.global_shape);
    }
  }
}

std::unique_ptr<CheckpointWriter> TrainingCheckpoints::stage(Trainer& trainer, const std::string& dir) {
  const CheckpointConfig& k = cfg_.checkpoint;
  const Trainer::Counters c = trainer.counters();
  auto w = std::make_unique<CheckpointWriter>(dir, c.iteration, ps_.rank, ps_.world_size);
  w->set_integrity_manifest(k.verify_integrity);
  const bool optim = !k.no_save_optim;
  trainer.optimizer().wait_for_params();  // overlapped parameter gathers
  for (size_t i = 0; i < chunks_.size(); ++i) stage_chunk(*w, *chunks_[i], staging_[i], optim);

  RunState rs;
  rs.iteration = c.iteration;
  rs.consumed_train_samples = c.consumed_samples;
  rs.consumed_valid_samples = c.consumed_valid_samples;
  rs.skipped_train_samples = c.skipped_samples;
  rs.num_floating_point_operations_so_far = flops_so_far(c.consumed_samples);
  if (optim) {
    // Megatron saves the scheduler with the optimizer (both skipped by --no-save-optim).
    rs.lr_scheduler = lr_schedule_to_json(trainer.schedule().params(), trainer.schedule().num_steps());
    const LossScaler& s = trainer.loss_scaler();
    rs.loss_scaler = json{{"kind", scaler_kind_name(s.kind())},
                          {"scale", s.scale()},
                          {"growth_tracker", s.growth_tracker()},
                          {"hysteresis_tracker", s.hysteresis_tracker()}};
    rs.extra["optimizer"] = json{{"kind", optimizer_name(cfg_.train.optimizer)},
                                 {"successful_steps", trainer.optimizer().successful_steps()}};
  }
  rs.config = checkpoint_config_json(cfg_);
  w->set_run_state(rs);
  if (!k.no_save_rng)
    w->set_rank_state(json{{"dropout_rng", {{"seed", cfg_.train.seed}, {"micro_batch_serial", c.micro_batch_serial}}}});
  return w;
}

void TrainingCheckpoints::save(Trainer& trainer, bool non_persistent) {
  const CheckpointConfig& k = cfg_.checkpoint;
  MT_CHECK(k.save.has_value(), "save without --save");
  MT_CHECK(!non_persistent || !non_persistent_dir_.empty(), "non-persistent save without --non-persistent-ckpt-type global");
  const std::string& dir = non_persistent ? non_persistent_dir_ : *k.save;
  // The staging buffers still feed the previous background write until it is committed.
  commit_pending(/*wait=*/true);
  const int64_t it = trainer.iteration();
  log::info("saving checkpoint at iteration {:7d} to {} in megatrain format", it, dir);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string before = tracker_text(dir);
  const std::optional<int64_t> previous = tracked_iteration(dir);
  try {
    if (k.async_save) {
      async_.start(stage(trainer, dir), group_);
      pending_iteration_ = it;
      pending_non_persistent_ = non_persistent;
      pending_previous_ = previous;
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      log::info("  scheduled an asynchronous save of iteration {:7d} (training paused {:.1f} ms)", it, ms);
    } else {
      stage(trainer, dir)->save(group_);
      log::info("  successfully saved checkpoint from iteration {:7d} to {} [ t {}/{}, p {}/{} ]", it, dir,
                ps_.tp_rank + 1, ps_.tp_size, ps_.pp_rank + 1, ps_.pp_size);
      committed(it, non_persistent, previous);
    }
  } catch (const Error& e) {
    fail("saving the checkpoint of iteration {} to {} failed: {} ({} remains the latest, unchanged)", it, dir,
         e.what(), before);
  }
  last_saved_ = it;
  // (Megatron's progress log leaves non-persistent saves out.)
  if (!non_persistent)
    progress_.checkpoint_saved(it, flops_so_far(trainer.consumed_samples()),
                               static_cast<double>(trainer.consumed_samples()) * cfg_.model.seq_length, k.async_save);
}

// After the tracker names `it`: the deletions that follow a commit (app/checkpoint_retention.h).
void TrainingCheckpoints::committed(int64_t it, bool non_persistent, std::optional<int64_t> previous) {
  if (non_persistent) return non_persistent_cleanup_.committed(it);
  retention_.committed(previous, it);
}

void TrainingCheckpoints::commit_pending(bool wait) {
  // Every rank starts its saves at the same iterations, so "pending" agrees across ranks and the
  // collective calls below are made by all or none.
  if (!async_.pending()) return;
  const std::string& dir = pending_non_persistent_ ? non_persistent_dir_ : *cfg_.checkpoint.save;
  const std::string before = tracker_text(dir);
  try {
    if (wait) async_.finalize(group_);
    else if (!async_.finalize_if_done(group_)) return;
  } catch (const Error& e) {
    fail("the asynchronous save of iteration {} to {} failed: {} ({} remains the latest, unchanged)",
         pending_iteration_, dir, e.what(), before);
  }
  log::info("  successfully saved checkpoint from iteration {:7d} to {} (asynchronously) [ t {}/{}, p {}/{} ]",
            pending_iteration_, dir, ps_.tp_rank + 1, ps_.tp_size, ps_.pp_rank + 1, ps_.pp_size);
  if (!pending_non_persistent_) progress_.async_checkpoint_committed(pending_iteration_);
  committed(pending_iteration_, pending_non_persistent_, pending_previous_);
}

void TrainingCheckpoints::poll() { commit_pending(/*wait=*/false); }

void TrainingCheckpoints::finish() {
  commit_pending(/*wait=*/true);
  retention_.wait();
  non_persistent_cleanup_.wait();
}

// ---------------------------------------------------------------------------------------------
// Loading

// Fills every parameter's slice of `dst` (a full-size flat buffer of model m) from the checkpoint
// tensors "<name><suffix>" of `kind`. With from_model_fallback, a parameter without a `kind`
// tensor is read from the model weights instead (fp32 runs keep no separate main weights).
void TrainingCheckpoints::read_flat(CheckpointReader& reader, GptModel& m, CheckpointKind kind,
                                   const std::string& suffix, Tensor dst, bool from_model_fallback) {
  std::vector<unsigned char> host;
  for (const ParamDesc& p : m.params())
    read_param(reader, m, p, kind, suffix, dst.flat_slice(p.offset, p.numel()), from_model_fallback, host);
}

// One parameter's tensor into dst (p.numel() elements), through the host buffer `host`.
void TrainingCheckpoints::read_param(CheckpointReader& reader, GptModel& m, const ParamDesc& p, CheckpointKind kind,
                                     const std::string& suffix, Tensor dst, bool from_model_fallback,
                                     std::vector<unsigned char>& host) {
  Backend& be = m.backend();
  // The last stage's copy of tied embeddings holds the word embeddings (and their state).
  const std::string name = (p.shared_copy ? p.init_name : p.name) + suffix;
  const int key = static_cast<int>(kind == CheckpointKind::optimizer ? CheckpointKind::optimizer : CheckpointKind::model);
  if (absent_.count({key, name})) {
    // Not in the checkpoint, and --dist-ckpt-strictness lets the load go on: optimizer states
    // start at zero, weights keep the values initialization draws for them.
    if (kind == CheckpointKind::optimizer) {
      be.fill(dst, 0.0);
    } else {
      const Tensor w = p.is_1d() ? dst : dst.view({p.local_rows(), p.local_cols()});
      init_param(be, p, w, m.dims().seed, cfg_.checkpoint.perform_initialization);
    }
    be.synchronize();
    loaded_tensor(0);
    return;
  }
  CheckpointKind from = kind;
  if (from_model_fallback && !reader.has(name, kind)) from = CheckpointKind::model;
  host.resize(static_cast<size_t>(p.numel()) * dtype_size(dst.dtype));
  Tensor hv(host.data(), dst.dtype, Device::cpu, {p.numel()});
  reader.read(name, from, ShardSlice::whole(p.shard), hv, p.global_shape);
  be.copy_from_host(dst, host.data());
  be.synchronize();  // `host` is reused for the next parameter
  loaded_tensor(host.size());
}

// A load that takes a while says how far it got every few seconds (log::progress_interval; rank 0,
// every rank reads alike).
void TrainingCheckpoints::loaded_tensor(size_t bytes) {
  LoadProgress& p = load_progress_;
  ++p.done;
  p.bytes += static_cast<double>(bytes);
  const auto now = std::chrono::steady_clock::now();
  if (now < p.next_report || p.done >= p.total) return;
  p.next_report = now + log::progress_interval();
  const double s = std::chrono::duration<double>(now - p.start).count();
  log::info("  loading checkpoint from {} ({} of {} tensors, {:.2f} GiB in {:.0f} s, {:.1f} MiB/s)", p.directory, p.done,
            p.total, p.bytes / 1073741824.0, s, p.bytes / 1048576.0 / std::max(s, 1e-9));
}

// One chunk's weights (and optimizer states). Master weights: the saved main copy when resuming
// the optimizer, else the model weights (Megatron re-copies fp16/bf16 main params from the model
// params); the model weights then follow the master weights as after every optimizer step. With
// sharded master weights or states the full tensors are read into the (unused) gradient buffer
// first, and each rank keeps its shards; with bf16 main grads (GptModel::stages_per_param) one
// parameter at a time instead.
void TrainingCheckpoints::load_chunk(CheckpointReader& reader, GptModel& m, bool load_optim) {
  Backend& be = m.backend();
  const GradLayout& L = m.grad_layout();
  const OptimizerKind opt = cfg_.train.optimizer;
  std::vector<unsigned char> host;
  auto read_sharded = [&](CheckpointKind kind, const std::string& suffix, Tensor dst, bool fallback, bool to_params) {
    m.stage_full_params([&](int i, Tensor v) {
      read_param(reader, m, m.params()[static_cast<size_t>(i)], kind, suffix, v.flat_slice(0, v.numel()), fallback, host);
    }, dst, to_params);
  };
  auto keep_shards = [&](Tensor dst) {
    for (int b = 0; b < L.num_buckets(); ++b) {
      const int64_t n = L.shard_numel(b);
      // (a cast: bf16 moments take their rounding)
      be.cast(dst.flat_slice(L.state_offset[static_cast<size_t>(b)], n), m.grads_flat().flat_slice(L.shard_offset(b), n));
    }
  };
  const CheckpointKind master_kind = load_optim ? CheckpointKind::main_params : CheckpointKind::model;
  if (L.sharded && m.has_master_copy() && m.stages_per_param()) {
    read_sharded(master_kind, "", m.master_flat(), load_optim, true);
  } else if ((L.sharded || m.options().master_remainders) && m.has_master_copy()) {
    read_flat(reader, m, master_kind, "", m.grads_flat(), load_optim);
    m.params_from_full_master(m.grads_flat());  // (FP8 parameters: below)
  } else {
    read_flat(reader, m, master_kind, "", m.master_flat(), load_optim);
    if (m.has_master_copy()) be.cast(m.params_flat(), m.master_flat());
  }
  if (!m.exp_avg_flat().empty()) be.fill(m.exp_avg_flat(), 0.0);
  if (!m.exp_avg_sq_flat().empty()) be.fill(m.exp_avg_sq_flat(), 0.0);
  if (load_optim) {
    auto read_state = [&](const std::string& suffix, Tensor dst) {
      if (dst.empty()) return;
      if (!L.sharded) return read_flat(reader, m, CheckpointKind::optimizer, suffix, dst, false);
      if (m.stages_per_param()) return read_sharded(CheckpointKind::optimizer, suffix, dst, false, false);
      read_flat(reader, m, CheckpointKind::optimizer, suffix, m.grads_flat(), false);
      keep_shards(dst);
    };
    read_state(first_state_suffix(opt), m.exp_avg_flat());
    read_state(kSecondStateSuffix, m.exp_avg_sq_flat());
  }
  if ((L.sharded || m.options().master_remainders) && !m.stages_per_param()) be.fill(m.grads_flat(), 0.0);
  be.synchronize();
  // FP8 parameters: cast from the loaded master weights with the saved scales (the bits the saving
  // run used), or scaled afresh without FP8 state in the checkpoint.
  m.fp8_params_from_master(!load_fp8_state(reader, m));
  load_expert_bias(reader, m);
}

// Expert biases: every rank reads its MoE layers' (replicated) biases. A checkpoint saved without
// --moe-router-enable-expert-bias has none: they start at zero, as in a fresh run, and a line says so.
void TrainingCheckpoints::load_expert_bias(CheckpointReader& reader, GptModel& m) {
  const std::vector<int> layers = expert_bias_layers(m);
  if (layers.empty()) return;
  const int64_t E = m.dims().experts;
  bool missing = false;
  for (int layer : layers) {
    const std::span<float> b = m.expert_bias(layer);
    if (!reader.has(expert_bias_name(layer))) {
      std::fill(b.begin(), b.end(), 0.0f);
      missing = true;
      continue;
    }
    reader.read(expert_bias_name(layer), CheckpointKind::model, ShardSlice::whole(ShardIndex::whole(E, 1)),
                Tensor(b.data(), DType::f32, Device::cpu, {E}), {E});
  }
  if (missing) log::info("  the checkpoint holds no expert bias for some MoE layers: those start at zero");
  m.expert_bias_loaded();
}

// FP8 scaling state: every rank reads its FP8 layers' (replicated) state. A checkpoint without it
// (saved without --fp8-format) leaves the initial scales (1), as a fresh FP8 run.
bool TrainingCheckpoints::load_fp8_state(CheckpointReader& reader, GptModel& m) {
  if (!m.fp8_state().any()) return false;
  if (!load_fp8_layers(reader, m, m.fp8_state_mutable(), "")) return false;
  if (m.fp8_extra_state().any() && !load_fp8_layers(reader, m, m.fp8_extra_state_mutable(), "extra_"))
    log::info("  the checkpoint holds no FP8 scaling state of the extra GEMMs (multi-latent attention's, the MTP "
              "projection's): their FP8 scales start at 1");
  load_fp8_experts(reader, m);
  m.fp8_begin_step();  // the weight cache follows the loaded weights
  return true;
}

// One FP8 state's tensors per FP8 layer: <prefix>amax_history [H, P], <prefix>scale and
// <prefix>scale_inv [P] (P = the state's operands per layer).
void TrainingCheckpoints::stage_fp8_state(CheckpointWriter& w, Backend& be, const Fp8State& f,
                                          std::vector<unsigned char>& staging, const std::string& prefix) {
  if (!f.any()) return;
  f.save_to_host(be, reinterpret_cast<float*>(staging.data()));
  const int64_t H = f.options().history_len, K = f.per_layer();
  for (size_t j = 0; j < f.fp8_global_layers().size(); ++j) {
    const int layer = f.fp8_global_layers()[j];
    const int64_t at = static_cast<int64_t>(j) * f.layer_floats();
    w.add(fp8_meta_name(layer, (prefix + "amax_history").c_str()), CheckpointKind::model,
          ShardSlice::whole(ShardIndex::whole(H, K)), host_view(staging, DType::f32, at, H * K), {H, K});
    w.add(fp8_meta_name(layer, (prefix + "scale").c_str()), CheckpointKind::model,
          ShardSlice::whole(ShardIndex::whole(1, K)), host_view(staging, DType::f32, at + H * K, K), {K});
    w.add(fp8_meta_name(layer, (prefix + "scale_inv").c_str()), CheckpointKind::model,
          ShardSlice::whole(ShardIndex::whole(1, K)), host_view(staging, DType::f32, at + (H + 1) * K, K), {K});
  }
}

namespace {
// Whether the checkpoint holds fp8_meta.<what> of any and of all of these layers.
std::pair<bool, bool> saved_for(const CheckpointReader& reader, const std::vector<int>& layers, const std::string& what) {
  bool any = false, all = true;
  for (int layer : layers) {
    const bool has = reader.has(fp8_meta_name(layer, what.c_str()));
    any |= has;
    all &= has;
  }
  return {any, all};
}
}  // namespace

// Every rank reads its FP8 layers' (replicated) state. A checkpoint without it (saved without
// --fp8-format) leaves the initial scales (1), as a fresh FP8 run: returns false.
bool TrainingCheckpoints::load_fp8_layers(CheckpointReader& reader, GptModel& m, Fp8State& f, const std::string& prefix) {
  const int64_t H = f.options().history_len, K = f.per_layer();
  const std::vector<int>& layers = f.fp8_global_layers();
  const auto name = [&](int layer, const char* what) { return fp8_meta_name(layer, (prefix + what).c_str()); };
  const auto [any_saved, all_saved] = saved_for(reader, layers, prefix + "amax_history");
  if (!any_saved) {
    if (prefix.empty()) log::info("  the checkpoint holds no FP8 scaling state: FP8 scales start at 1");
    return false;
  }
  if (!all_saved)
    fail("the checkpoint holds FP8 scaling state for some of this run's FP8 layers only (saved with other "
         "--first-last-layers-bf16 settings?)");
  std::vector<float> packed(static_cast<size_t>(static_cast<int64_t>(layers.size()) * f.layer_floats()));
  for (size_t j = 0; j < layers.size(); ++j) {
    float* b = packed.data() + static_cast<int64_t>(j) * f.layer_floats();
    try {
      reader.read(name(layers[j], "amax_history"), CheckpointKind::model, ShardSlice::whole(ShardIndex::whole(H, K)),
                  Tensor(b, DType::f32, Device::cpu, {H * K}), {H, K});
    } catch (const Error& e) {
      fail("FP8 amax history of layer {}: {} (was the checkpoint saved with another --fp8-amax-history-len than {}?)",
           layers[j], e.what(), H);
    }
    reader.read(name(layers[j], "scale"), CheckpointKind::model, ShardSlice::whole(ShardIndex::whole(1, K)),
                Tensor(b + H * K, DType::f32, Device::cpu, {K}), {K});
    reader.read(name(layers[j], "scale_inv"), CheckpointKind::model, ShardSlice::whole(ShardIndex::whole(1, K)),
                Tensor(b + (H + 1) * K, DType::f32, Device::cpu, {K}), {K});
  }
  f.load_from_host(m.backend(), packed.data());
  return true;
}

// The experts' FP8 state in the checkpoint, per FP8 MoE layer: amax_history [E, H, 6], scale and
// scale_inv [E, 6], expert e's row: its fc1's x, w, dy, then its fc2's (Fp8State::plan_experts'
// order), whatever the expert-parallel layout. One writer per expert: the first of its replicas
// (expert-DP rank 0) and, where the experts split over TP, TP rank 0 (the amaxes are reduced over
// both; tensorwise scales are that rank's last casts', as for the dense layers).
bool TrainingCheckpoints::writes_expert_state() const {
  const bool first_replica = ps_.edp ? ps_.edp_rank == 0 : ps_.dp_rank == 0 && ps_.cp_rank == 0;
  return first_replica && (ps_.etp_size == 1 || ps_.etp_rank == 0);  // (one rank of the experts' TP shards)
}

namespace {
constexpr int64_t kExpertOperands = 2 * Fp8State::kRoles;  // per expert: fc1's and fc2's x, w, dy
// The checkpoint tensors of layer j's experts: [E, H, 6] / [E, 6] / [E, 6] from (to, with
// to_packed) Fp8State's packed block [H, El * 6], [El * 6], [El * 6].
void fp8_experts_reorder(float* packed, float* out, int64_t H, int64_t El, bool to_packed) {
  const int64_t P = El * kExpertOperands;
  const int64_t rows[3] = {H, 1, 1}, at_packed[3] = {0, H * P, (H + 1) * P}, at_out[3] = {0, El * H * kExpertOperands,
                                                                                           El * (H + 1) * kExpertOperands};
  for (int t = 0; t < 3; ++t)
    for (int64_t e = 0; e < El; ++e)
      for (int64_t r = 0; r < rows[t]; ++r)
        for (int64_t k = 0; k < kExpertOperands; ++k) {
          const int64_t a = at_packed[t] + r * P + e * kExpertOperands + k;
          const int64_t b = at_out[t] + (e * rows[t] + r) * kExpertOperands + k;
          if (to_packed) packed[a] = out[b];
          else out[b] = packed[a];
        }
}
}  // namespace

void TrainingCheckpoints::stage_fp8_experts(CheckpointWriter& w, GptModel& m, Staging& h) {
  const Fp8State& f = m.fp8_expert_state();
  if (!f.any() || !writes_expert_state()) return;
  const ModelDims& d = m.dims();
  const int64_t H = f.options().history_len, E = d.experts, El = d.experts_local(), K = kExpertOperands;
  f.save_to_host(m.backend(), h.fp8_experts.data());
  const int64_t per = f.layer_floats();
  for (size_t j = 0; j < f.fp8_global_layers().size(); ++j) {
    const int layer = f.fp8_global_layers()[j];
    float* out = h.fp8_experts_out.data() + static_cast<int64_t>(j) * per;
    fp8_experts_reorder(h.fp8_experts.data() + static_cast<int64_t>(j) * per, out, H, El, false);
    const int64_t b = d.expert_begin();
    w.add(fp8_meta_name(layer, "experts_amax_history"), CheckpointKind::model,
          ShardSlice::whole(ShardIndex{E, H * K, b, 0, El, H * K, 1}), Tensor(out, DType::f32, Device::cpu, {El * H * K}),
          {E, H, K});
    w.add(fp8_meta_name(layer, "experts_scale"), CheckpointKind::model, ShardSlice::whole(ShardIndex{E, K, b, 0, El, K, 1}),
          Tensor(out + El * H * K, DType::f32, Device::cpu, {El * K}), {E, K});
    w.add(fp8_meta_name(layer, "experts_scale_inv"), CheckpointKind::model,
          ShardSlice::whole(ShardIndex{E, K, b, 0, El, K, 1}), Tensor(out + El * (H + 1) * K, DType::f32, Device::cpu, {El * K}),
          {E, K});
  }
}

void TrainingCheckpoints::load_fp8_experts(CheckpointReader& reader, GptModel& m) {
  Fp8State& f = m.fp8_expert_state_mutable();
  if (!f.any()) return;
  const ModelDims& d = m.dims();
  const int64_t H = f.options().history_len, E = d.experts, El = d.experts_local(), K = kExpertOperands;
  const std::vector<int>& layers = f.fp8_global_layers();
  const auto [any_saved, all_saved] = saved_for(reader, layers, "experts_amax_history");
  if (!any_saved) {
    log::info("  the checkpoint holds no FP8 scaling state of the experts: their FP8 scales start at 1");
    return;
  }
  if (!all_saved) fail("the checkpoint holds the experts' FP8 scaling state for some of this run's MoE layers only");
  const int64_t per = f.layer_floats(), b = d.expert_begin();
  std::vector<float> packed(static_cast<size_t>(static_cast<int64_t>(layers.size()) * per)), out(static_cast<size_t>(per));
  for (size_t j = 0; j < layers.size(); ++j) {
    try {
      reader.read(fp8_meta_name(layers[j], "experts_amax_history"), CheckpointKind::model,
                  ShardSlice::whole(ShardIndex{E, H * K, b, 0, El, H * K, 1}),
                  Tensor(out.data(), DType::f32, Device::cpu, {El * H * K}), {E, H, K});
    } catch (const Error& e) {
      fail("FP8 amax history of layer {}'s experts: {} (was the checkpoint saved with another --fp8-amax-history-len "
           "than {}?)", layers[j], e.what(), H);
    }
    reader.read(fp8_meta_name(layers[j], "experts_scale"), CheckpointKind::model,
                ShardSlice::whole(ShardIndex{E, K, b, 0, El, K, 1}),
                Tensor(out.data() + El * H * K, DType::f32, Device::cpu, {El * K}), {E, K});
    reader.read(fp8_meta_name(layers[j], "experts_scale_inv"), CheckpointKind::model,
                ShardSlice::whole(ShardIndex{E, K, b, 0, El, K, 1}),
                Tensor(out.data() + El * (H + 1) * K, DType::f32, Device::cpu, {El * K}), {E, K});
    fp8_experts_reorder(packed.data() + static_cast<int64_t>(j) * per, out.data(), H, El, true);
  }
  f.load_from_host(m.backend(), packed.data());
}

// Megatron-LM's StrictHandling (megatron/core/dist_checkpointing/validation.py), for megatrain's
// own checkpoints. "Unexpected": tensors the run loads that the checkpoint lacks; "missing":
// tensors the checkpoint holds that no rank loads (only the kinds this load reads: model weights,
// plus main weights and optimizer states when the optimizer is loaded). Every rank computes both
// over all pipeline stages (the tensors' names do not depend on TP or DP), so the ranks agree:
//   assume_ok_unexpected  no comparison; a lacking tensor fails its read, naming it; extra ones
//                         are ignored (megatrain's behaviour without the flag)
//   log_unexpected        lacking ones are logged (rank 0) and left as initialized
//   log_all               also the extra ones are logged
//   raise_unexpected      lacking ones fail the load before anything is read, all named
//   raise_all             lacking or extra ones fail the load, all named
//   return_unexpected, return_all, ignore_all
//                         lacking ones are left as initialized without a word (Megatron returns
//                         them to its caller, which megatrain's training does not ask for)
// FP8 scaling state is outside this: a checkpoint without it starts the scales at 1 (load_fp8_state).
// Training is the only load the flag reaches: it never reads Megatron-LM's own checkpoints
// (`megatrain import-megatron` converts them first), and the subcommands that read megatrain
// checkpoints take no training flags (forward-logits loads through here with the default).
void TrainingCheckpoints::check_strictness(const CheckpointReader& reader, bool load_optim) {
  absent_.clear();
  const std::string& strict = cfg_.checkpoint.dist_ckpt_strictness;
  if (strict == "assume_ok_unexpected") return;
  const bool all = strict == "log_all" || strict == "raise_all" || strict == "return_all" || strict == "ignore_all";

  // What the run loads, over every pipeline stage (and its virtual chunks).
  std::set<std::string> weights;
  for (int pp = 0; pp < cfg_.parallel.pipeline_model_parallel_size; ++pp)
    for (const ChunkSpec& s : model_chunk_specs(cfg_, RankPosition::stage(cfg_, pp), precision_dtype(cfg_))) {
      int64_t n = 0;
      for (const ParamDesc& p : build_param_descs(s.dims, &n)) weights.insert(p.shared_copy ? p.init_name : p.name);
    }
  std::vector<std::string> suffixes;
  if (load_optim && !chunks_.empty()) {
    if (!chunks_.front()->exp_avg_flat().empty()) suffixes.push_back(first_state_suffix(cfg_.train.optimizer));
    if (!chunks_.front()->exp_avg_sq_flat().empty()) suffixes.push_back(kSecondStateSuffix);
  }

  std::vector<std::string> unexpected, missing;
  for (const std::string& w : weights) {
    const bool has = reader.has(w, CheckpointKind::model) || (load_optim && reader.has(w, CheckpointKind::main_params));
    if (!has) {
      unexpected.push_back(w);
      absent_.insert({static_cast<int>(CheckpointKind::model), w});
    }
    for (const std::string& sfx : suffixes)
      if (!reader.has(w + sfx, CheckpointKind::optimizer)) {
        unexpected.push_back(w + sfx);
        absent_.insert({static_cast<int>(CheckpointKind::optimizer), w + sfx});
      }
  }
  if (all) {
    const bool fp8 = cfg_.train.fp8_format.has_value();
    const bool bias = cfg_.model.moe.enabled() && cfg_.model.moe.router_enable_expert_bias;
    for (const std::string& n : reader.names(CheckpointKind::model))
      if (!weights.count(n) && !(fp8 && n.find(".fp8_meta.") != std::string::npos) &&
          !(bias && n.ends_with(".mlp.router.expert_bias")))
        missing.push_back(n);
    if (load_optim) {
      for (const std::string& n : reader.names(CheckpointKind::main_params))
        if (!weights.count(n)) missing.push_back(n + " (main weights)");
      for (const std::string& n : reader.names(CheckpointKind::optimizer)) {
        bool wanted = false;
        for (const std::string& sfx : suffixes)
          wanted |= n.size() > sfx.size() && n.compare(n.size() - sfx.size(), sfx.size(), sfx) == 0 &&
                    weights.count(n.substr(0, n.size() - sfx.size())) > 0;
        if (!wanted) missing.push_back(n + " (optimizer state)");
      }
    }
  }
  if (unexpected.empty() && missing.empty()) return;

  auto list = [](const std::vector<std::string>& names) {
    std::string s;
    const size_t shown = std::min<size_t>(names.size(), 20);
    for (size_t i = 0; i < shown; ++i) s += (i ? ", " : "") + names[i];
    if (names.size() > shown) s += fmt::format(" and {} more", names.size() - shown);
    return s;
  };
  std::string what;
  if (!unexpected.empty())
    what = fmt::format("{} tensor{} this run loads {} not in it: {}", unexpected.size(), unexpected.size() == 1 ? "" : "s",
                       unexpected.size() == 1 ? "is" : "are", list(unexpected));
  if (!missing.empty())
    what += fmt::format("{}{} tensor{} in it {} not loaded by this run: {}", what.empty() ? "" : "; ", missing.size(),
                        missing.size() == 1 ? "" : "s", missing.size() == 1 ? "is" : "are", list(missing));
  const std::string& dir = reader.directory();
  if (strict == "raise_unexpected" || strict == "raise_all")
    fail("checkpoint {} does not match this run (--dist-ckpt-strictness {}): {}", dir, strict, what);
  if (strict == "log_unexpected" || strict == "log_all")
    log::warn0("checkpoint {} does not match this run (--dist-ckpt-strictness {}): {}{}", dir, strict, what,
               unexpected.empty() ? "" : "; the tensors it lacks keep their initial values (optimizer states: zero)");
}

// --verify-integrity: rank 0 rehashes the checkpoint's files against its integrity manifest before
// anything is read (Megatron's verify_integrity_manifest); the other ranks learn the outcome.
void TrainingCheckpoints::verify_integrity(const std::string& dir) {
  std::optional<std::string> error;
  size_t files = 0;
  if (ps_.rank == 0) {
    try {
      files = verify_integrity_manifest(dir);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  const bool ok = group_.agree(!error);
  if (error) fail("{}", *error);
  if (!ok) fail("checkpoint {} failed its integrity verification on rank 0 (see its error)", dir);
  log::info("Checkpoint integrity verified: {} file(s) OK in {}", files, dir);
}

ResumePoint TrainingCheckpoints::load() {
  const CheckpointConfig& k = cfg_.checkpoint;
  ResumePoint r;
  const std::optional<CheckpointLocation> loc = checkpoint_to_load(k);
  if (!loc) {
    // Flags that only mean something for a loaded checkpoint (with --load given but empty).
    const std::string where = k.load ? *k.load : std::string("(none)");
    if (!k.perform_initialization)
      fail("--no-initialization: --load {} holds no checkpoint, so the weights would stay undrawn; drop "
           "--no-initialization to start from random initialization", where);
    if (k.override_ckpt_iteration)
      fail("--override-ckpt-iteration {}: --load {} holds no checkpoint to resume", *k.override_ckpt_iteration, where);
    return r;
  }
  if (k.verify_integrity) verify_integrity(loc->directory);
  CheckpointReader reader = CheckpointReader::open_directory(loc->directory);
  const std::string manifest = join_path(loc->directory, "manifest.json");
  const RunState& rs = reader.run_state();
  if (rs.config.contains("model")) check_checkpoint_model(rs.config.at("model"), cfg_.model, manifest);

  // Megatron: --finetune, release checkpoints and the --pretrained-checkpoint fallback load the
  // weights only; --no-load-optim skips the optimizer and the scheduler; --no-load-rng leaves the
  // RNG as seeded.
  const bool model_only = k.finetune || loc->release || loc->pretrained;
  if (model_only && k.override_ckpt_iteration)
    fail("--override-ckpt-iteration: checkpoint {} loads as a finetune ({}), which starts at iteration 0; drop "
         "--override-ckpt-iteration", loc->directory, loc->release ? "a release checkpoint" : "the --pretrained-checkpoint fallback");
  const bool load_optim = !model_only && !k.no_load_optim;
  const bool load_rng = !model_only && !k.no_load_rng;
  const OptimizerKind opt = cfg_.train.optimizer;
  if (load_optim) {
    if (!rs.extra.contains("optimizer") || rs.lr_scheduler.empty())
      fail("checkpoint {} holds no optimizer state (saved with --no-save-optim?): pass --no-load-optim (or "
           "--finetune) to load the weights only", loc->directory);
    const std::string saved = rs.extra["optimizer"].value("kind", std::string());
    if (saved != optimizer_name(opt))
      fail("checkpoint {} holds {} optimizer state but this run uses --optimizer {}: pass --no-load-optim to start "
           "the optimizer afresh", loc->directory, saved, optimizer_name(opt));
  }
  load_progress_ = LoadProgress{};
  load_progress_.directory = loc->directory;
  load_progress_.start = std::chrono::steady_clock::now();
  load_progress_.next_report = load_progress_.start + log::progress_interval();
  for (GptModel* m : chunks_) {
    const int64_t passes = 1 + (load_optim ? (m->exp_avg_flat().empty() ? 0 : 1) + (m->exp_avg_sq_flat().empty() ? 0 : 1) : 0);
    load_progress_.total += passes * static_cast<int64_t>(m->params().size());
  }
  check_strictness(reader, load_optim);
  try {
    for (GptModel* m : chunks_) load_chunk(reader, *m, load_optim);
  } catch (const Error& e) {
    fail("cannot load checkpoint {}: {}", loc->directory, e.what());
  }

  r.loaded = true;
  r.directory = loc->directory;
  // Megatron keeps counting FLOPs across finetunes too (num_floating_point_operations_so_far).
  r.flops_so_far = rs.num_floating_point_operations_so_far;
  if (!model_only) {
    r.counters.iteration = rs.iteration;
    r.counters.consumed_samples = rs.consumed_train_samples;
    r.counters.consumed_valid_samples = rs.consumed_valid_samples;
    r.counters.skipped_samples = rs.skipped_train_samples;
    if (k.override_ckpt_iteration) override_iteration(r, rs, manifest);
  }
  if (load_rng) {
    json s = reader.rank_state(ps_.rank);
    if (s.is_null()) s = reader.rank_state(0);  // a rank the saving layout did not have
    if (!s.is_object() || !s.contains("dropout_rng"))
      fail("checkpoint {} holds no RNG state (saved with --no-save-rng?): pass --no-load-rng (or --finetune)",
           loc->directory);
    const json& d = s.at("dropout_rng");
    r.counters.micro_batch_serial = d.at("micro_batch_serial").get<uint64_t>();
    const int seed = d.value("seed", cfg_.train.seed);
    if (seed != cfg_.train.seed)
      log::warn0("checkpoint {} was trained with --seed {}; this run's --seed {} draws different dropout masks "
                 "from here on", loc->directory, seed, cfg_.train.seed);
  }
  if (load_optim) {
    const LrScheduleParams current = LrSchedule::params_from_config(cfg_);
    const LrScheduleParams saved = lr_schedule_params_from_json(rs.lr_scheduler, manifest);
    reconcile_lr_schedule(current, saved, cfg_.train, manifest);
    if (cfg_.train.use_checkpoint_opt_param_scheduler) r.schedule = saved;
    r.optimizer_state = true;
    r.scheduler_num_steps = rs.lr_scheduler.at("num_steps").get<int64_t>();
    r.optimizer_steps = rs.extra.at("optimizer").at("successful_steps").get<int64_t>();
    r.loss_scale = rs.loss_scaler.value("scale", 1.0);
    r.scaler_growth_tracker = rs.loss_scaler.value("growth_tracker", int64_t{0});
    r.scaler_hysteresis_tracker = rs.loss_scaler.value("hysteresis_tracker", 0);
    if (rs.loss_scaler.value("kind", std::string()) != "dynamic") r.scaler_hysteresis_tracker = -1;  // nothing to restore
  }
  log::info("  successfully loaded checkpoint from {} [ t {}/{}, p {}/{} ] at iteration {}",
            parent_directory(loc->directory),
            ps_.tp_rank + 1, ps_.tp_size, ps_.pp_rank + 1, ps_.pp_size, r.counters.iteration);
  return r;
}

// Megatron's --override-ckpt-iteration: the run resumes at that iteration and its data at the
// samples of that many global batches; the optimizer and scheduler keep the checkpoint's state.
void TrainingCheckpoints::override_iteration(ResumePoint& r, const RunState& rs, const std::string& manifest) const {
  const int64_t it = *cfg_.checkpoint.override_ckpt_iteration;
  const int64_t B = cfg_.train.global_batch;
  const json& derived = rs.config.contains("derived") ? rs.config.at("derived") : json::object();
  const int64_t saved_batch = derived.value("global_batch_size", B);
  if (saved_batch != B)
    log::warn0("--override-ckpt-iteration: {} was saved with global batch size {}, this run uses {}: consumed "
               "samples are counted as {} x {}", manifest, saved_batch, B, it, B);
  r.counters.iteration = it;
  r.counters.consumed_samples = 0;  // it global batches (of the --step-batch-size-schedule)
  for (int64_t i = 0; i < it; ++i) r.counters.consumed_samples += cfg_.train.global_batch_at(r.counters.consumed_samples);
  r.counters.skipped_samples = 0;
  log::info("--override-ckpt-iteration: start at iteration {} (consumed_train_samples {})", it,
            r.counters.consumed_samples);
}

void TrainingCheckpoints::restore(const ResumePoint& r, Trainer& trainer) {
  if (!r.loaded) return;
  trainer.set_counters(r.counters);
  start_iteration_ = r.counters.iteration;
  start_consumed_ = r.counters.consumed_samples;
  start_flops_ = r.flops_so_far;
  progress_.set_flops_at_start(r.flops_so_far);
  if (!r.optimizer_state) return;
  if (r.schedule) trainer.schedule() = LrSchedule(*r.schedule);
  trainer.schedule().set_num_steps(r.scheduler_num_steps);
  trainer.optimizer().set_successful_steps(r.optimizer_steps);
  LossScaler& s = trainer.loss_scaler();
  if (s.kind() == LossScaler::Kind::dynamic) {
    if (r.scaler_hysteresis_tracker < 0)
      log::warn0("checkpoint {} has no dynamic loss-scaler state: the loss scale starts at --initial-loss-scale",
                 r.directory);
    else
      s.set_state(r.loss_scale, r.scaler_growth_tracker, r.scaler_hysteresis_tracker);
  }
}

}  // namespace mt

#include "engine/trainer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdlib>

#include <unistd.h>

#include "core/error.h"
#include "core/exit_signals.h"
#include "core/log.h"
#include "engine/scalar_reduce.h"
#include "parallel/parallel_state.h"

namespace mt {

namespace {
std::atomic<bool> g_sigterm{false};
extern "C" void on_sigterm(int) { g_sigterm.store(true); }
// --exit-signal-handler-for-training: SIGINT or SIGTERM asks for an orderly shutdown (no save).
std::atomic<bool> g_shutdown{false};
extern "C" void on_shutdown(int) { g_shutdown.store(true); }

// --exit-signal's number (the names the CLI accepts: core/exit_signals.h).
int exit_signal_number(const std::string& name) {
  for (const auto& [n, s] : exit_signals())
    if (name == n) return s;
  fail("--exit-signal {}: not a signal megatrain handles", name);
}
}  // namespace

Trainer::Trainer(const Config& cfg, ParallelState& ps, std::vector<GptModel*> chunks, BatchSource* train,
                 BatchSource* valid, Reporter& reporter)
    : cfg_(cfg),
      ps_(ps),
      chunks_(chunks),
      model_(*chunks.at(0)),
      train_(train),
      valid_(valid),
      has_validation_(valid != nullptr),
      reporter_(reporter),
      schedule_(LrSchedule::params_from_config(cfg)),
      scaler_(LossScaler::from_config(cfg)),
      optimizer_(cfg, chunks, ps, schedule_, scaler_),
      runner_(cfg, ps, chunks),
      replica_check_(ps, cfg.train.test_mode ? chunks : std::vector<GptModel*>{}),
      weight_hash_(ps, cfg.train.check_weight_hash_across_dp_replicas_interval ? chunks : std::vector<GptModel*>{}),
      timers_(cfg.logging.timing_log_level, [this] { model_.backend().synchronize(); }) {
  // --timing-log-level 0 installs no hooks at all: the step pays nothing for timing.
  if (timers_.level() > 0) {
    const TimerHook hook = [this](const char* name, bool start) { start ? timers_.start(name) : timers_.stop(name); };
    runner_.timer = hook;
    optimizer_.timer = hook;
    optimizer_.grad_sync().timer = hook;
    if (ps.world_size > 1) {
      const size_t n = megatron_timers().size();
      timer_buffer_elems_ = cfg.logging.timing_log_option == "all" ? n * static_cast<size_t>(ps.world_size) : 2 * n;
      timer_buffer_ = model_.backend().allocate(timer_buffer_elems_ * dtype_size(model_.options().accum));
    }
  }
  if (cfg.logging.log_straggler) {
    straggler_ = std::make_unique<StragglerDetector>(cfg, ps, model_.backend(),
                                                     cfg.train.num_microbatches * static_cast<int>(chunks.size()));
    runner_.straggler = straggler_.get();
  }
  if (cfg.logging.gpu_sniff_test_interval > 0)
    sniff_ = std::make_unique<GpuSniffTest>(cfg, ps, model_.backend(), model_.options().compute);
  if (cfg.train.num_microbatches < 1) fail("the number of micro-batches per iteration must be >= 1");
  if (cfg.train.total_iters <= 0) fail("nothing to train: --train-iters / --train-samples gives {} iterations", cfg.train.total_iters);
  if (cfg.train.exit_signal_handler) std::signal(exit_signal_number(cfg.train.exit_signal), on_sigterm);
  // (Installed after --exit-signal-handler's, as Megatron-LM does: SIGINT and SIGTERM then shut down.)
  if (cfg.train.exit_signal_handler_for_training) {
    std::signal(SIGINT, on_shutdown);
    std::signal(SIGTERM, on_shutdown);
  }
  const TrainConfig& t = cfg.train;
  const RerunStateMachine::Mode mode = RerunStateMachine::parse_mode(t.rerun_mode);
  if (mode != RerunStateMachine::Mode::disabled || t.check_for_spiky_loss || t.check_for_large_grads) {
    char host[256] = {0};
    if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
    rerun_ = std::make_unique<RerunStateMachine>(
        mode, t.error_injection_rate, RerunStateMachine::parse_injection(t.error_injection_type),
        static_cast<uint64_t>(t.seed) * 1000003u + 17u, ps.rank, std::string(host), cfg.parallel.local_rank,
        [this](bool v) {
          if (ps_.world_size == 1) return v;
          return all_reduce_scalar(ps_, model_, kRerunSlot, v ? 1.0 : 0.0, ReduceOp::max) > 0.5;
        });
    if (train_) replay_ = std::make_unique<ReplayBatchSource>(train_);
    optimizer_.validate = [this](double loss, double grad_norm) { return validate_step(loss, grad_norm); };
  }
}

namespace {

// Seconds in a minute of --exit-duration-in-mins: 60, or MEGATRAIN_DEBUG_SECONDS_PER_MINUTE (a
// hidden test hook, so that a test of the flag need not run for a minute).
double seconds_per_minute() {
  static const double value = [] {
    const char* env = std::getenv("MEGATRAIN_DEBUG_SECONDS_PER_MINUTE");
    if (!env) return 60.0;
    char* end = nullptr;
    const double v = std::strtod(env, &end);
    if (end == env || *end != '\0' || !(v > 0))
      fail("MEGATRAIN_DEBUG_SECONDS_PER_MINUTE={}: expected a positive number of seconds", env);
    return v;
  }();
  return value;
}

}  // namespace

// --exit-duration-in-mins and --exit-signal-handler, decided by every rank alike (max over ranks).
bool Trainer::should_exit() {
  const TrainConfig& t = cfg_.train;
  if (!t.exit_duration_in_mins && !t.exit_signal_handler && !t.exit_signal_handler_for_training) return false;
  const double minutes = std::chrono::duration<double>(Clock::now() - run_start_).count() / seconds_per_minute();
  double flags[3] = {t.exit_duration_in_mins && minutes > *t.exit_duration_in_mins ? 1.0 : 0.0,
                     t.exit_signal_handler && g_sigterm.load() ? 1.0 : 0.0,
                     t.exit_signal_handler_for_training && g_shutdown.load() ? 1.0 : 0.0};
  if (ps_.world_size > 1) {  // one small collective per iteration, only with these flags
    Backend& be = model_.backend();
    Tensor s = model_.scalars().flat_slice(kExitFlagsSlot, 3);
    if (model_.options().accum == DType::f64) {
      be.copy_from_host(s, flags);
      ps_.world->all_reduce(s, ReduceOp::max);
      be.copy_to_host(flags, s);
    } else {
      float f[3] = {static_cast<float>(flags[0]), static_cast<float>(flags[1]), static_cast<float>(flags[2])};
      be.copy_from_host(s, f);
      ps_.world->all_reduce(s, ReduceOp::max);
      be.copy_to_host(f, s);
      for (int k = 0; k < 3; ++k) flags[k] = f[k];
    }
  }
  if (flags[2] > 0) {
    log::info("Termination requested. Performing orderly shutdown.");
    shutdown_ = true;
    return true;
  }
  if (flags[0] > 0) {
    log::info(" exiting program after {} minutes", minutes);
    return true;
  }
  if (flags[1] > 0) {
    log::info(" exiting program at iteration {} on {}", iteration_, cfg_.train.exit_signal);
    return true;
  }
  return false;
}

Trainer::~Trainer() {
  if (timer_buffer_) model_.backend().deallocate(timer_buffer_);
}

int64_t Trainer::next_global_batch() const {
  const TrainConfig& t = cfg_.train;
  const int64_t B = t.global_batch_at(consumed_samples_);
  const int per_step = t.micro_batch_size * cfg_.parallel.data_parallel_size;
  // Megatron's consistency check of the scheduled batch (num_microbatches_calculator.py): the
  // parser could not check entries the run might never reach.
  if (B % per_step != 0)
    fail("--step-batch-size-schedule: current global batch size ({}) is not divisible by micro_batch_size ({}) * "
         "data_parallel_size ({})", B, t.micro_batch_size, cfg_.parallel.data_parallel_size);
  return B;
}

void Trainer::forward_backward(int M) {
  const TrainConfig& t = cfg_.train;
  const double loss_grad_scale = scaler_.scale() / (t.calculate_per_token_loss ? 1.0 : M);
  timers_.start("forward-backward");
  if (straggler_) straggler_->step_done();  // (the step before, a re-run's first attempt: read back, so complete)
  runner_.train_step(replay_ ? static_cast<BatchSource*>(replay_.get()) : train_, loss_grad_scale, t.calculate_per_token_loss, micro_batch_serial_, iteration_ + 1, M);
  micro_batch_serial_ += static_cast<uint64_t>(M);
  // Megatron's finalize_model_grads runs at the end of the schedule, inside forward-backward.
  optimizer_.grad_sync().finish();
  timers_.stop("forward-backward");
}

void Trainer::collect_timers(IterationStats& s, double iterations) {
  const std::vector<TimerName>& names = megatron_timers();
  const size_t n = names.size();
  std::vector<double> mine(n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    auto it = timers_.elapsed_ms().find(names[i].name);
    if (it != timers_.elapsed_ms().end()) mine[i] = it->second / iterations;
  }
  const bool all = cfg_.logging.timing_log_option == "all";
  const int W = ps_.world_size;
  std::vector<double> buf;
  if (W == 1) {
    buf = all ? mine : std::vector<double>();
  } else {
    // One all-reduce over the world: all: each rank's row, summed; else max of t and of -t
    // (Megatron's min and max over the ranks where the timer ran, t > 0).
    buf.assign(timer_buffer_elems_, 0.0);
    if (all) {
      std::copy(mine.begin(), mine.end(), buf.begin() + static_cast<std::ptrdiff_t>(n) * ps_.rank);
    } else {
      for (size_t i = 0; i < n; ++i) {
        buf[i] = mine[i];
        buf[n + i] = mine[i] > 0 ? -mine[i] : -1e30;
      }
    }
    Backend& be = model_.backend();
    const DType dt = model_.options().accum;
    Tensor t(timer_buffer_, dt, be.device(), {static_cast<int64_t>(buf.size())});
    if (dt == DType::f64) {
      be.copy_from_host(t, buf.data());
      ps_.world->all_reduce(t, all ? ReduceOp::sum : ReduceOp::max);
      be.copy_to_host(buf.data(), t);
    } else {
      std::vector<float> f(buf.begin(), buf.end());
      be.copy_from_host(t, f.data());
      ps_.world->all_reduce(t, all ? ReduceOp::sum : ReduceOp::max);
      be.copy_to_host(f.data(), t);
      std::copy(f.begin(), f.end(), buf.begin());
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const char* name = names[i].name;
    if (all) {
      std::vector<double> per_rank(static_cast<size_t>(W));
      bool any = false;
      for (int r = 0; r < W; ++r) {
        per_rank[static_cast<size_t>(r)] = buf[static_cast<size_t>(r) * n + i];
        any = any || per_rank[static_cast<size_t>(r)] > 0;
      }
      if (any) s.timers_all_ranks_ms[name] = per_rank;
    } else if (W == 1) {
      if (mine[i] > 0) s.timers_ms[name] = {mine[i], mine[i]};
    } else if (buf[i] > 0) {
      s.timers_ms[name] = {-buf[n + i], buf[i]};
    }
  }
}

StepOutcome Trainer::train_step() { return train_step(next_global_batch()); }

StepOutcome Trainer::train_step(int64_t global_batch) {
  const int M = static_cast<int>(global_batch / (cfg_.train.micro_batch_size * cfg_.parallel.data_parallel_size));
  if (!rerun_) return run_step_once(global_batch, M);
  // Megatron's `while rerun_state_machine.should_run_forward_backward(...)`: a re-run starts from
  // the same micro-batches and dropout keys; nothing was applied (the checks come before the update).
  const uint64_t serial0 = micro_batch_serial_;
  if (replay_) replay_->begin();
  rerun_->should_run_forward_backward(iteration_);
  for (;;) {
    rerun_again_ = false;
    const StepOutcome o = run_step_once(global_batch, M);
    if (!o.held) return o;
    if (!rerun_again_) {  // the machine decided to stop: the iteration is not applied
      exit_code_ = rerun_exit_.exit_code;
      return o;
    }
    micro_batch_serial_ = serial0;
    if (replay_) replay_->rewind();
    rerun_->clear_restore_request();
  }
}

bool Trainer::validate_step(double loss, double grad_norm) {
  RerunStateMachine& sm = *rerun_;
  const TrainConfig& t = cfg_.train;
  // Megatron's order: the loss (in the loss function), then the gradients (after backward).
  const bool nan_check = t.check_for_nan_in_loss_and_grad && sm.mode() != RerunStateMachine::Mode::disabled;
  auto is_nan = [](double v) { return std::isnan(v); };
  auto is_inf = [](double v) { return std::isinf(v); };
  if (nan_check) {
    sm.validate_result(loss, is_nan, "found NaN in local forward loss calculation", 0.0, true);
    sm.validate_result(loss, is_inf, "found Inf in local forward loss calculation", 0.0, true);
  }
  if (t.check_for_spiky_loss)
    sm.validate_result(loss, [&sm](double v) { return sm.is_unexpectedly_large(v, 10.0, "loss"); }, "Spiky loss", 0.0,
                       false);
  if (nan_check) {
    sm.validate_result(grad_norm, is_nan, "found NaN in grad norm before the optimizer step", 0.001, true);
    sm.validate_result(grad_norm, is_inf, "found Inf in grad norm before the optimizer step", 0.001, true);
  }
  if (t.check_for_large_grads)
    sm.validate_result(grad_norm, [&sm](double v) { return sm.is_unexpectedly_large(v, 10.0, "grads"); },
                       "found unexpected large grads before the optimizer step", 0.001, false);
  if (sm.should_run_forward_backward(iteration_)) {
    rerun_again_ = true;
    return false;
  }
  rerun_exit_ = sm.should_checkpoint_and_exit();
  return !rerun_exit_.exit;
}

StepOutcome Trainer::run_step_once(int64_t global_batch, int M) {
  Backend& be = model_.backend();
  // The plan is the run's: a step allocates nothing on the device (checked, not assumed).
  const size_t allocated_before = be.bytes_allocated();
  if (!replica_check_.empty()) {
    optimizer_.wait_for_params();
    replica_check_.run();
  }
  for (GptModel* m : chunks_) {
    m->zero_grads();
    be.fill(m->loss_sums(false), 0.0);
    if (!m->moe_loss_sums().empty()) be.fill(m->moe_loss_sums(), 0.0);
    if (!m->kd_loss_sums(false).empty()) be.fill(m->kd_loss_sums(false), 0.0);
    if (!m->moe_layer_loss_sums().empty()) be.fill(m->moe_layer_loss_sums(), 0.0);
    if (!m->mtp_loss_sums().empty()) be.fill(m->mtp_loss_sums(), 0.0);
    if (!m->mtp_accept_counts().empty()) be.fill(m->mtp_accept_counts(), 0.0);
    m->moe_begin_step();
    m->fp8_begin_step();
  }
  optimizer_.grad_sync().start_step();
  forward_backward(M);
  for (GptModel* m : chunks_) m->check_grads_written();
  // FP8: this step's amaxes give the next step's scales (delayed scaling); new weights to cast.
  // Before the optimizer step, which with FP8 parameters casts the new weights with those scales.
  for (GptModel* m : chunks_) m->fp8_end_step();
  timers_.start("optimizer");
  StepOutcome o = optimizer_.step(iteration_ + 1, global_batch);
  timers_.stop("optimizer");
  MT_CHECK(be.bytes_allocated() == allocated_before,
           "training step {} changed the device memory allocated from {} to {} bytes (a step must allocate nothing)",
           iteration_ + 1, allocated_before, be.bytes_allocated());
  return o;
}

int64_t Trainer::train() {
  const TrainConfig& t = cfg_.train;
  const int per_step = t.micro_batch_size * cfg_.parallel.data_parallel_size;
  // Megatron's update_num_microbatches before each iteration: a schedule's new batch size
  // (checked after the checkpoint its change asks for, as Megatron checks it).
  int num_microbatches = static_cast<int>(t.global_batch_at(consumed_samples_) / per_step);
  interval_start_ = Clock::now();
  interval_paused_s_ = 0;
  if (energy_joules) energy_read_ = energy_joules();
  energy_outside_ = 0;
  energy_run_start_ = energy_interval_start_ = training_energy();
  const size_t warmup = static_cast<size_t>(std::max(0, cfg_.logging.benchmark_warmup_iters));
  energy_after_warmup_.reset();
  if (energy_joules && warmup == 0) energy_after_warmup_ = energy_mark();
  // Megatron checks the weight hashes once before the first iteration as well.
  check_weight_hashes();
  bool first = true;
  while (iteration_ < t.total_iters) {
    const int64_t B = next_global_batch();  // (with Megatron's consistency check)
    if (B / per_step != num_microbatches) {
      if (B / per_step < num_microbatches)
        fail("--step-batch-size-schedule: Number of microbatches should not decrease; going from {} to {}",
             num_microbatches, B / per_step);
      if (on_microbatches_change) on_microbatches_change(iteration_);
      num_microbatches = static_cast<int>(B / per_step);
    }
    batch_ = B;
    if (std::find(t.iterations_to_skip.begin(), t.iterations_to_skip.end(), iteration_ + 1) !=
        t.iterations_to_skip.end()) {
      // --iterations-to-skip: consume the batch without a step, as Megatron's dummy step.
      runner_.skip_step(train_, iteration_ + 1, num_microbatches);
      micro_batch_serial_ += static_cast<uint64_t>(num_microbatches);
      ++iteration_;
      consumed_samples_ += B;
      skipped_samples_ += B;
      continue;
    }
    const auto step_start = Clock::now();
    const StepOutcome o = train_step(B);  // ends with the step's one readback, so the time is complete
    if (exit_code_ != 0) {  // the rerun state machine stopped the run (the iteration was not applied)
      if (before_rerun_exit) before_rerun_exit(iteration_, rerun_exit_.checkpoint);
      break;
    }
    step_seconds_.push_back(std::chrono::duration<double>(Clock::now() - step_start).count());
    step_samples_.push_back(B);
    // One energy read where the summary's steps begin (an NVML read takes milliseconds while the
    // GPU idles, so the counter is read there, at log lines, around pauses and at the end only).
    if (energy_joules && step_seconds_.size() == warmup) {
      energy_read_ = energy_joules();
      energy_after_warmup_ = energy_mark();
    }
    ++iteration_;
    consumed_samples_ += B;
    if (o.skipped) {
      ++interval_skipped_;
      if (!std::isfinite(o.loss())) ++interval_nan_;
    } else {
      ++interval_advanced_;
      interval_loss_ += o.loss();
      for (const StepOutcome::MoeLoss& m : o.moe_losses) interval_moe_[m.name] += m.value;
      for (const auto& [name, value] : o.kd_losses) interval_moe_[name] += value;
      for (size_t j = 0; j < o.mtp_losses.size(); ++j) interval_moe_[fmt::format("mtp_{} loss", j + 1)] += o.mtp_losses[j];
      loss_history_.push_back(o.loss());
    }
    report_iteration(o, first);
    // Megatron's update_pg_timeout once the run's first iteration has finished (the slowest one:
    // connections, plans): the ranks meet, then every group waits at most this long.
    if (first && ps_.world && cfg_.parallel.distributed_timeout_seconds_after_init) {
      const auto after = std::chrono::seconds(*cfg_.parallel.distributed_timeout_seconds_after_init);
      ps_.world->barrier();
      ps_.world->set_timeout(after);
      log::info(" collective timeout now {} (--distributed-timeout-seconds-after-init)", format_duration(after));
    }
    first = false;
    if (cfg_.train.eval_interval && *cfg_.train.eval_interval > 0 && iteration_ % *cfg_.train.eval_interval == 0 &&
        has_validation_ && t.eval_iters > 0 && (!t.start_eval_at_iter || iteration_ >= *t.start_eval_at_iter)) {
      outside_interval([&] { evaluate(false); });
    }
    if (sniff_ && iteration_ % cfg_.logging.gpu_sniff_test_interval == 0)
      outside_interval([&] { sniff_->run(iteration_); });
    // After the evaluation, before the checkpoint save (Megatron's post_training_step_callbacks).
    if (t.check_weight_hash_across_dp_replicas_interval &&
        iteration_ % *t.check_weight_hash_across_dp_replicas_interval == 0)
      check_weight_hashes();
    if (after_iteration && !after_iteration(iteration_)) break;
    bool stop = should_exit();
    if (!stop && t.exit_interval && *t.exit_interval > 0 && iteration_ % *t.exit_interval == 0) {
      log::info(" exiting program at iteration {}", iteration_);
      stop = true;
    }
    if (stop) {
      if (before_early_exit) before_early_exit(iteration_);
      break;
    }
  }
  if (energy_joules) {
    energy_read_ = energy_joules();
    energy_at_end_ = energy_mark();
    report_total_energy();
  }
  print_summary();
  return iteration_;
}

void Trainer::check_weight_hashes() {
  if (!weight_hash_.enabled()) return;
  // With --overlap-param-gather the next step's parameter all-gathers may still be in flight.
  optimizer_.wait_for_params();
  weight_hash_.run(iteration_);
}

void Trainer::outside_interval(const std::function<void()>& f) {
  const auto t0 = Clock::now();
  const double e0 = energy_joules ? energy_joules() : 0.0;
  f();
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  interval_paused_s_ += s;
  outside_s_ += s;
  if (energy_joules) {
    energy_read_ = energy_joules();
    energy_outside_ += energy_read_ - e0;
  }
}

void Trainer::report_total_energy() {
  const double mine = training_energy() - energy_run_start_;
  const double total = all_reduce_scalar(ps_, model_, kEnergySlot, mine, ReduceOp::sum);
  log::info("Total training energy (GPU): {:.3f} MJ", total / 1e6);
}

// Every iteration goes to the reporters (TensorBoard keeps per-iteration values); the log line's
// averages cover the interval and are valid where interval_end is set: every --log-interval
// iterations and, as HEAD Megatron does, after the first iteration of the run (without resetting
// the interval).
void Trainer::report_iteration(const StepOutcome& o, bool first_of_run) {
  const bool interval_end = iteration_ % cfg_.logging.log_interval == 0 || first_of_run;
  const auto now = Clock::now();
  const double elapsed = std::chrono::duration<double>(now - interval_start_).count() - interval_paused_s_;
  const int64_t iters = std::max<int64_t>(1, interval_advanced_ + interval_skipped_);
  IterationStats s;
  s.iteration = iteration_;
  s.interval_end = interval_end;
  s.is_first_iteration = first_of_run;
  s.train_iters = cfg_.train.total_iters;
  s.consumed_samples = consumed_samples_;
  s.skipped_samples = skipped_samples_;
  s.elapsed_ms_per_iteration = elapsed / iters * 1000.0;
  const double per_iter_s = elapsed / iters;
  if (cfg_.logging.log_throughput && flops_per_iteration && per_iter_s > 0)
    s.tflops_per_gpu = flops_per_iteration(batch_) / (per_iter_s * 1e12 * ps_.world_size);
  if (energy_joules && interval_end) {
    energy_read_ = energy_joules();
    const double lap = training_energy() - energy_interval_start_;  // this rank's, J
    const double all = all_reduce_scalar(ps_, model_, kEnergySlot, lap, ReduceOp::sum);
    s.energy_per_gpu_j = all / static_cast<double>(iters) / ps_.world_size;
    if (per_iter_s > 0) s.power_per_gpu_w = *s.energy_per_gpu_j / per_iter_s;
  }
  s.learning_rate = optimizer_.learning_rate();
  s.decoupled_learning_rate = optimizer_.decoupled_learning_rate();
  s.global_batch_size = batch_ > 0 ? batch_ : cfg_.train.global_batch;
  // Megatron prints the key once any iteration succeeded (0 for an interval of skipped ones).
  if (!loss_history_.empty()) s.losses["lm loss"] = interval_loss_ / std::max<int64_t>(1, interval_advanced_);
  if (!o.skipped) s.iteration_losses["lm loss"] = o.loss();
  if (!o.skipped)
    for (const auto& [name, value] : o.kd_losses) s.iteration_losses[name] = value;
  // MoE losses: in the line after lm loss (the map's order), as Megatron's total_loss_dict has them.
  for (const auto& [key, sum] : interval_moe_)
    if (!loss_history_.empty()) s.losses[key] = sum / std::max<int64_t>(1, interval_advanced_);
  // Megatron-LM's MoE and MTP trackers' TensorBoard scalars: this iteration's values.
  if (!o.skipped) {
    for (const StepOutcome::MoeLoss& m : o.moe_losses) s.tracker_scalars.push_back({m.name, m.value});
    for (const StepOutcome::MoeLoss& m : o.moe_losses)
      for (size_t l = 0; l < m.layers.size(); ++l)
        s.tracker_scalars.push_back({fmt::format("moe/{}_layer_{}", m.name, l), m.layers[l]});
  }
  // Multi-token prediction: each depth's loss, and its acceptance rates in percent (argmax ==
  // label, of this iteration and since the process started; a count of 0 gives 0).
  mtp_accept_total_.resize(o.mtp_accept.size());
  for (size_t j = 0; j < o.mtp_accept.size(); ++j) {
    auto& [right, counted] = mtp_accept_total_[j];
    right += o.mtp_accept[j].first;
    counted += o.mtp_accept[j].second;
    if (j < o.mtp_losses.size() && !o.skipped) s.tracker_scalars.push_back({fmt::format("mtp_{} loss", j + 1), o.mtp_losses[j]});
    s.tracker_scalars.push_back({fmt::format("mtp_{}_acceptance_rate", j + 1),
                                 100.0 * o.mtp_accept[j].first / std::max(1.0, o.mtp_accept[j].second)});
    s.tracker_scalars.push_back(
        {fmt::format("mtp_{}_cumulative_acceptance_rate", j + 1), 100.0 * right / std::max(1.0, counted)});
  }
  s.loss_scale = scaler_.scale();
  s.grad_norm = o.grad_norm;
  s.num_zeros = o.num_zeros;
  if (cfg_.logging.log_params_norm && interval_end) s.params_norm = optimizer_.params_norm();
  s.skipped_iterations = interval_skipped_;
  s.nan_iterations = interval_nan_;
  s.weight_decay = optimizer_.weight_decay();
  s.tokens_per_second =
      per_iter_s > 0 ? static_cast<double>(s.global_batch_size) * cfg_.model.seq_length / per_iter_s : 0;
  s.world_size = ps_.world_size;
  if (interval_end && timers_.level() > 0) collect_timers(s, static_cast<double>(iters));
  reporter_.on_iteration(s);
  // --log-straggler: this step's forwards completed with its read back; every --log-interval
  // iterations the ranks' figures (Megatron reports after the log line, per log_interval).
  if (straggler_) {
    straggler_->step_done();
    if (flops_per_iteration) straggler_flops_ += flops_per_iteration(batch_);
    if (iteration_ % cfg_.logging.log_interval == 0) {
      straggler_->report(straggler_flops_, cfg_.logging.log_interval);
      straggler_flops_ = 0;
    }
  }
  if (interval_end && !first_of_run) {
    interval_loss_ = 0;
    for (auto& [key, sum] : interval_moe_) sum = 0;
    interval_advanced_ = interval_skipped_ = interval_nan_ = 0;
    interval_start_ = now;
    interval_paused_s_ = 0;
    energy_interval_start_ = training_energy();
    timers_.reset();
  }
}

void Trainer::evaluate(bool after_training) {
  // Every rank evaluates or none does (set_has_validation): ranks that read no data (middle
  // pipeline stages) have no validation source of their own.
  if (!has_validation_) return;
  const TrainConfig& t = cfg_.train;
  Backend& be = model_.backend();
  optimizer_.wait_for_params();  // (the last update, which may run beside a forward: Optimizer::update_beside_forward)
  for (GptModel* m : chunks_) {
    be.fill(m->loss_sums(true), 0.0);
    if (!m->kd_loss_sums(true).empty()) be.fill(m->kd_loss_sums(true), 0.0);
  }
  replica_check_.run();
  int64_t done = 0;
  for (int it = 0; it < t.eval_iters; ++it) {
    if (!runner_.eval_step(valid_)) {
      // Ranks that read data run out together; a pipeline's middle stages would wait for them.
      if (ps_.pp_size > 1)
        fail("the validation data ran out after {} of {} evaluation iterations", done, t.eval_iters);
      log::warn0("the validation data ran out after {} of {} evaluation iterations", done, t.eval_iters);
      break;
    }
    ++done;
    consumed_valid_samples_ += t.eval_global_batch_size.value_or(t.global_batch);  // args.consumed_valid_samples
  }
  // Loss sums live on the last stage; every DP (and CP) rank contributes. Then a distillation
  // student's {total, logits, intermediate} sums (a one-stage model).
  const bool kd = !model_.kd_loss_sums(true).empty();
  const int n = kd ? 5 : 2;
  Tensor s = model_.scalars().flat_slice(0, n);
  be.fill(s, 0.0);
  for (GptModel* m : chunks_)
    if (m->dims().last_stage) be.copy(s.flat_slice(0, 2), m->loss_sums(true));
  if (kd) be.copy(s.flat_slice(2, 3), model_.kd_loss_sums(true));
  ps_.replicas().all_reduce(s);
  if (ps_.pp_size > 1) ps_.pp->all_reduce(s);
  double host[5];
  if (model_.options().accum == DType::f64) {
    be.copy_to_host(host, s);
  } else {
    float f[5];
    be.copy_to_host(f, s);
    std::copy(f, f + n, host);
  }
  if (done == 0) return;
  EvalStats e;
  e.iteration = iteration_;
  e.after_training = after_training;
  e.consumed_train_samples = consumed_samples_;
  e.losses["lm loss"] = host[0] / std::max(1.0, host[1]);
  if (kd)
    for (int i = 0; i < 3; ++i) e.losses[kDistillLossNames[i]] = host[2 + i] / std::max(1.0, host[1]);
  reporter_.on_eval(e);
}

}  // namespace mt

namespace mt {

// The end-of-run summary: means over the steps after --benchmark-warmup-iters (start-up, cuBLASLt
// plan selection and the first data loads stay out of it). MFU is against the dense bf16/fp16
// peak of an H100/H200 SXM (989 TFLOP/s), the convention of Megatron's README; it is printed
// only for GPU runs.
void Trainer::print_summary() const {
  const int64_t skip = std::max(0, cfg_.logging.benchmark_warmup_iters);
  if (static_cast<int64_t>(step_seconds_.size()) <= skip) return;
  double seconds = 0, samples = 0;
  for (size_t i = static_cast<size_t>(skip); i < step_seconds_.size(); ++i) {
    seconds += step_seconds_[i];
    samples += static_cast<double>(step_samples_[i]);
  }
  const double steps = static_cast<double>(step_seconds_.size()) - static_cast<double>(skip);
  const double per_step = seconds / steps;
  // Per step (the mean over the steps: --step-batch-size-schedule varies the batch).
  const double tokens = samples / steps * cfg_.model.seq_length;
  std::string line = fmt::format("[megatrain] summary: iterations {}-{} | mean ms per iteration: {:.1f} | "
                                 "tokens/s: {:.1f} | tokens/s/GPU: {:.1f}",
                                 skip + 1, step_seconds_.size(), per_step * 1e3, tokens / per_step,
                                 tokens / per_step / ps_.world_size);
  if (flops_per_iteration) {
    const double tflops = flops_per_iteration(static_cast<int64_t>(samples / steps)) / (per_step * 1e12 * ps_.world_size);
    line += fmt::format(" | TFLOP/s/GPU: {:.1f}", tflops);
    if (cfg_.train.device == DeviceKind::gpu) line += fmt::format(" | MFU: {:.1f}%", tflops / 989.0 * 100.0);
  }
  if (energy_after_warmup_ && energy_at_end_) {
    // This (the last) rank's GPU from the counter read after the warm-up steps to the one after
    // the last step: joules per step, and watts over the wall time between those reads without
    // the evaluations and saves (whose energy is left out too).
    const EnergyMark &a = *energy_after_warmup_, &b = *energy_at_end_;
    const double joules = b.joules - a.joules;
    const double wall = std::chrono::duration<double>(b.at - a.at).count() - (b.outside_s - a.outside_s);
    line += fmt::format(" | GPU energy (this GPU): {:.1f} J/iteration, {:.1f} W, {:.4f} J/token", joules / steps,
                        wall > 0 ? joules / wall : 0.0, joules / steps / (tokens / ps_.world_size));
  }
  const size_t in_use = model_.backend().memory_in_use();
  if (in_use > 0) line += fmt::format(" | peak memory: {:.2f} GiB", in_use / 1073741824.0);
  log::info_last("{}", line);
}

}  // namespace mt

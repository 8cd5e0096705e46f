// Trainer: Megatron's training loop around this rank's model chunks. Per iteration: M
// micro-batches forward and backward in the pipeline schedule's order (engine/pipeline_runner.h;
// without pipelining one after the other, accumulating gradients), the optimizer step with its
// single host readback, logging averaged over --log-interval, evaluation every --eval-interval,
// the weight hash check every --check-weight-hash-across-dp-replicas-interval, and the exit
// conditions (--train-iters / --train-samples, --exit-interval).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/config.h"
#include "data/batch.h"
#include "engine/gpt_model.h"
#include "engine/loss_scaler.h"
#include "engine/lr_schedule.h"
#include "engine/optimizer.h"
#include "engine/phase_timers.h"
#include "engine/pipeline_runner.h"
#include "engine/replica_check.h"
#include "engine/rerun_state_machine.h"
#include "engine/sniff_test.h"
#include "engine/straggler.h"
#include "engine/reporter.h"

namespace mt {

struct ParallelState;

class Trainer {
 public:
  // chunks: this rank's model chunks in chunk order. train/valid may be null on ranks that read
  // no data (middle pipeline stages).
  Trainer(const Config& cfg, ParallelState& ps, std::vector<GptModel*> chunks, BatchSource* train,
          BatchSource* valid, Reporter& reporter);
  Trainer(const Config& cfg, ParallelState& ps, GptModel& model, BatchSource& train, BatchSource* valid,
          Reporter& reporter)
      : Trainer(cfg, ps, std::vector<GptModel*>{&model}, &train, valid, reporter) {}
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Model FLOPs of one iteration of global_batch samples (for --log-throughput): set by the caller.
  std::function<double(int64_t global_batch)> flops_per_iteration;
  // --step-batch-size-schedule: called before the iteration after `iteration` when its number of
  // micro-batches differs from the previous iteration's (Megatron saves a checkpoint there).
  std::function<void(int64_t iteration)> on_microbatches_change;
  // Called after every iteration (checkpoint saving, signal checks...): return false to stop.
  std::function<bool(int64_t iteration)> after_iteration;
  // Called once when training stops early (--exit-interval, --exit-duration-in-mins, SIGTERM with
  // --exit-signal-handler), before returning: Megatron saves a checkpoint there.
  std::function<void(int64_t iteration)> before_early_exit;
  // --log-energy: this rank's GPU energy counter in joules (app/energy_meter.h). Read at the
  // start, at log lines, after the summary's warm-up steps, around evaluations and
  // outside_interval calls (their energy is left out, as their time is) and at the end; each log
  // line's figure is summed over the ranks (one small collective).
  std::function<double()> energy_joules;
  // Runs f (a checkpoint save) outside the log interval's time and energy, as Megatron stops its
  // interval timer and energy monitor around evaluations and saves (evaluations: done here).
  void outside_interval(const std::function<void()>& f);
  // The rerun state machine stopped the run (engine/rerun_state_machine.h): called once before
  // train() returns, with whether Megatron saves a checkpoint there (the last completed iteration).
  std::function<void(int64_t iteration, bool checkpoint)> before_rerun_exit;
  // --log-straggler's detector (engine/straggler.h), or null: the caller sets its GPU readings.
  StragglerDetector* straggler() { return straggler_.get(); }
  GpuSniffTest* sniff_test() { return sniff_.get(); }  // --gpu-sniff-test-interval's probes, or null
  // Megatron's exit code when the rerun state machine stopped the run (16 or 17), else 0.
  int exit_code() const { return exit_code_; }
  // --exit-signal-handler-for-training: SIGINT or SIGTERM stopped the run (after its step, without a save).
  bool shutdown_requested() const { return shutdown_; }

  // Trains from the current iteration to the end, or until --exit-interval, --exit-duration-in-mins
  // or (with --exit-signal-handler) SIGTERM stops it after an iteration; returns the last iteration.
  int64_t train();
  // Forward-only loss over --eval-iters evaluation global batches (--eval-global-batch-size, default
  // the training global batch) of the validation source.
  void evaluate(bool after_training);
  // Whether the run has a validation split (default: a validation source was given). Ranks that
  // read no data learn it from the others (app/train.cpp), as all ranks must evaluate together.
  void set_has_validation(bool v) { has_validation_ = v; }
  bool has_validation() const { return has_validation_; }
  // One iteration (exposed for tests): returns the step outcome.
  StepOutcome train_step();
  StepOutcome train_step(int64_t global_batch);  // the iteration's global batch, computed once
  // The global batch of the next iteration (from the consumed samples: --step-batch-size-schedule),
  // with Megatron's consistency check.
  int64_t next_global_batch() const;

  int64_t iteration() const { return iteration_; }
  int64_t consumed_samples() const { return consumed_samples_; }
  void set_progress(int64_t iteration, int64_t consumed_samples) {
    iteration_ = iteration;
    consumed_samples_ = consumed_samples;
  }
  // Everything of the loop a checkpoint restores besides the model, optimizer, schedule and loss
  // scaler. The micro-batch serial is the dropout RNG state: masks are keyed by it (and the seed),
  // so restoring it continues the same random stream.
  struct Counters {
    int64_t iteration = 0, consumed_samples = 0, skipped_samples = 0, consumed_valid_samples = 0;
    uint64_t micro_batch_serial = 0;
  };
  Counters counters() const {
    return {iteration_, consumed_samples_, skipped_samples_, consumed_valid_samples_, micro_batch_serial_};
  }
  void set_counters(const Counters& c) {
    iteration_ = c.iteration;
    consumed_samples_ = c.consumed_samples;
    skipped_samples_ = c.skipped_samples;
    consumed_valid_samples_ = c.consumed_valid_samples;
    micro_batch_serial_ = c.micro_batch_serial;
  }
  LrSchedule& schedule() { return schedule_; }
  LossScaler& loss_scaler() { return scaler_; }
  Optimizer& optimizer() { return optimizer_; }
  // Losses of every successful iteration so far (tests, summaries).
  const std::vector<double>& loss_history() const { return loss_history_; }

 private:
  using Clock = std::chrono::steady_clock;
  void forward_backward(int num_microbatches);
  StepOutcome run_step_once(int64_t global_batch, int M);
  // The rerun state machine's checks of one pass (Optimizer::validate): false keeps the update back.
  bool validate_step(double loss, double grad_norm);
  void report_iteration(const StepOutcome& o, bool first_of_run);
  // Fills s.timers_ms (and with --timing-log-option all s.timers_all_ranks_ms) from this
  // interval's timers: per-iteration means, min/max over the ranks that ran them (one small
  // collective over the world at log intervals, only with --timing-log-level >= 1).
  void collect_timers(IterationStats& s, double iterations);
  bool should_exit();
  bool shutdown_ = false;
  void print_summary() const;
  // This rank's energy counter at the last read without what outside_interval excluded (J).
  double training_energy() const { return energy_read_ - energy_outside_; }
  // Megatron's "Total training energy (GPU)" line, summed over the ranks (collective).
  void report_total_energy();

  const Config& cfg_;
  ParallelState& ps_;
  std::vector<GptModel*> chunks_;
  GptModel& model_;  // chunk 0 (its backend and scalar buffer serve all chunks)
  BatchSource* train_;
  BatchSource* valid_;
  bool has_validation_ = false;
  Reporter& reporter_;
  LrSchedule schedule_;
  LossScaler scaler_;
  Optimizer optimizer_;
  PipelineRunner runner_;
  ReplicaCheck replica_check_;  // --test-mode (empty otherwise)
  WeightHashCheck weight_hash_;  // --check-weight-hash-across-dp-replicas-interval (off otherwise)
  void check_weight_hashes();

  int64_t iteration_ = 0, consumed_samples_ = 0, skipped_samples_ = 0, consumed_valid_samples_ = 0;
  uint64_t micro_batch_serial_ = 0;
  // --rerun-mode other than disabled, --check-for-spiky-loss, --check-for-large-grads (else null).
  std::unique_ptr<RerunStateMachine> rerun_;
  std::unique_ptr<StragglerDetector> straggler_;  // --log-straggler
  std::unique_ptr<GpuSniffTest> sniff_;            // --gpu-sniff-test-interval
  double straggler_flops_ = 0;                    // model FLOPs since its last report
  std::unique_ptr<ReplayBatchSource> replay_;  // the iteration's micro-batches again for a re-run
  bool rerun_again_ = false;
  RerunStateMachine::Decision rerun_exit_;
  int exit_code_ = 0;
  std::vector<double> loss_history_;
  std::vector<double> step_seconds_;  // wall time of each train_step of this run (for the summary)
  std::vector<int64_t> step_samples_;  // the global batch of each of those steps
  int64_t batch_ = 0;  // the global batch of the iteration in progress (report_iteration)
  // training_energy(), when it was read and the seconds outside_interval had taken by then,
  // after the warm-up steps and at the end (--log-energy): the summary's energy figures.
  struct EnergyMark {
    double joules = 0;
    Clock::time_point at;
    double outside_s = 0;
  };
  EnergyMark energy_mark() const { return {training_energy(), Clock::now(), outside_s_}; }
  std::optional<EnergyMark> energy_after_warmup_, energy_at_end_;
  double outside_s_ = 0;  // seconds spent in outside_interval so far

  // Log-interval accumulators (Megatron's total_loss_dict).
  double interval_loss_ = 0;
  std::map<std::string, double> interval_moe_;  // MoE losses' sums over the interval, by log name
  // Multi-token prediction: each depth's acceptance counts {right, counted} since this process
  // started (Megatron's cumulative rate, which restarts with the process as Megatron's does).
  std::vector<std::pair<double, double>> mtp_accept_total_;
  int64_t interval_advanced_ = 0, interval_skipped_ = 0, interval_nan_ = 0;
  Clock::time_point interval_start_;
  Clock::time_point run_start_ = Clock::now();
  double interval_paused_s_ = 0;
  // --log-energy, J, this rank: the last counter read, the energy left out so far, and the
  // training energy where the run and the log interval began.
  double energy_read_ = 0, energy_outside_ = 0, energy_run_start_ = 0, energy_interval_start_ = 0;
  PhaseTimers timers_;
  void* timer_buffer_ = nullptr;  // device buffer of the timers' cross-rank reduction (level >= 1)
  size_t timer_buffer_elems_ = 0;
};

}  // namespace mt

// Megatron-LM's rerun state machine (megatron/core/rerun_state_machine.py), as the trainer uses it
// (engine/trainer.cpp): --rerun-mode, --check-for-spiky-loss, --check-for-large-grads,
// --error-injection-rate and --error-injection-type.
//
// An iteration runs (forward, backward, reductions, the one readback) and is then validated
// before anything is applied: the loss (NaN, Inf, spiky) and the gradient norm (NaN, Inf, large),
// each a "validation call" in that order. Under validate_results a rejected result (or an injected
// error) asks for a re-run of the iteration from the same state (same micro-batches, same dropout
// keys, same parameters; the ranks agree through one all-reduce of "any rank asks"). The re-run's
// value at the failed call is compared with the first one:
//   - different (beyond the call's tolerance): "Possible transient error!"; a fatal check (NaN,
//     Inf) then stops the run with exit code 17, a non-fatal one (spiky loss, large grads)
//     continues with the re-run's result;
//   - the same: a fatal check saves a checkpoint (with --save) and exits 16 ("resume to
//     disambiguate" on another GPU); a non-fatal one continues.
// Validation starts at the second iteration of each run (Megatron: a checkpoint must be possible).
// report_stats re-runs every iteration, records the relative difference of each validation
// call's value and logs the statistics every 2 iterations. disabled keeps megatrain's NaN/Inf stop.
//
// What megatrain does not carry over: the rerun state is not saved in checkpoints, so a run
// resumed after exit code 16 validates the iteration afresh (no "second re-run on a different
// GPU"); --result-rejected-tracker-filename is not implemented; the injection draws come from a
// generator of megatrain's own seeded by --seed (Megatron draws from Python's random module).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "data/batch.h"

namespace mt {

// Megatron's exit codes.
inline constexpr int kExitResumeToDisambiguate = 16;
inline constexpr int kExitFailedOnResultValidation = 17;

// Megatron's QuickStats: the distribution of relative differences (report_stats).
struct RerunQuickStats {
  std::vector<double> samples;
  int64_t zero_count = 0;
  double max = 0;
  void record(double d);
  std::string str();  // Megatron's print_stats()
};

class RerunStateMachine {
 public:
  enum class Mode { disabled, validate_results, report_stats };
  enum class State { not_running_yet, initial_run, rerunning_in_place, will_rerun_from_checkpoint };
  enum class Injected { none, correct_result, transient_error, persistent_error };

  // reduce_any: true on every rank when any rank passes true (a collective; identity on one rank).
  RerunStateMachine(Mode mode, int error_injection_rate, Injected error_injection_type, uint64_t seed, int rank,
                    std::string node, int device, std::function<bool(bool)> reduce_any);
  static Mode parse_mode(const std::string& s);
  static Injected parse_injection(const std::string& s);

  Mode mode() const { return mode_; }
  // Megatron's should_run_forward_backward: true to run (or re-run) the iteration's forward and
  // backward. `iteration0`: the 0-indexed iteration about to run (used on the first call only).
  bool should_run_forward_backward(int64_t iteration0);
  // Megatron's should_checkpoint_and_exit, after the loop: (checkpoint, exit, exit code).
  struct Decision {
    bool checkpoint = false, exit = false;
    int exit_code = 0;
  };
  Decision should_checkpoint_and_exit();
  // Megatron's validate_result for one value. rejected: the check's verdict on `value` (called only
  // when Megatron would evaluate it). tolerance: relative difference accepted between runs.
  void validate_result(double value, const std::function<bool(double)>& rejected, const std::string& message,
                       double tolerance, bool fatal);
  // Megatron's is_unexpectedly_large: the first 100 values of `context` set its maximum; after
  // that, a value >= threshold x that maximum is unexpectedly large (NaN and Inf are not).
  bool is_unexpectedly_large(double value, double threshold, const std::string& context, int num_samples = 100);

  // State the trainer saves at an iteration's start and restores for a re-run (besides the data).
  bool restore_requested() const { return restore_requested_; }
  void clear_restore_request() { restore_requested_ = false; }

 private:
  struct Call {
    std::string message;
    int sequence = 0;
    bool operator==(const Call& o) const { return message == o.message && sequence == o.sequence; }
    bool operator<(const Call& o) const { return message < o.message || (message == o.message && sequence < o.sequence); }
  };
  Call call_info(const std::string& message);
  bool maybe_inject();
  double maybe_miscompare(double initial, double result);
  void log_failure(const std::string& message, bool fatal) const;
  void maybe_report_stats();
  void save_state();
  void restore_state();

  Mode mode_;
  State state_ = State::not_running_yet;
  int64_t current_iteration_ = -1;  // 0-indexed; messages add 1
  bool first_iteration_complete_ = false;
  bool rerun_requested_ = false, checkpoint_requested_ = false, continue_requested_ = false;
  bool logged_sdc_enabled_ = false;
  bool restore_requested_ = false;
  int injection_rate_;
  Injected injection_type_;
  Injected injected_ = Injected::none;
  std::mt19937_64 rng_;
  std::mt19937_64 saved_rng_;
  int rank_;
  std::string node_;
  int device_;
  std::function<bool(bool)> reduce_any_;
  std::map<std::string, int> validation_counts_;
  std::optional<Call> failed_call_;
  double initial_result_ = 0;
  std::map<std::string, int> large_value_counts_;
  std::map<std::string, double> max_values_;
  std::map<Call, double> saved_results_;
  std::vector<std::string> stats_order_;  // first-seen order of the validation messages
  std::map<std::string, RerunQuickStats> stats_;
};

// Replays an iteration's micro-batches for a re-run: records what it reads from `inner` since the
// last begin(); after rewind() returns those again, in order.
class ReplayBatchSource : public BatchSource {
 public:
  explicit ReplayBatchSource(BatchSource* inner) : inner_(inner) {}
  bool next(MicroBatch& mb) override;
  void begin() {
    kept_.clear();
    pos_ = 0;
  }
  void rewind() { pos_ = 0; }

 private:
  BatchSource* inner_;
  std::vector<MicroBatch> kept_;
  size_t pos_ = 0;
};

}  // namespace mt

#include "engine/rerun_state_machine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "core/error.h"
#include "core/log.h"

namespace mt {

namespace {

constexpr double kMatch = 0.0;
constexpr double kMismatch = std::numeric_limits<double>::infinity();
constexpr int64_t kReportingIntervalIterations = 2;  // Megatron's REPORTING_INTERVAL_ITERATIONS

// Megatron's _compare_floats: 0 when equal (or both NaN), inf when only one is NaN or Inf, else
// the relative difference |a - b| / ((a + b) / 2).
double compare_floats(double a, double b) {
  if (a == b || (std::isnan(a) && std::isnan(b))) return kMatch;
  if (std::isnan(a) != std::isnan(b) || std::isinf(a) != std::isinf(b)) return kMismatch;
  return std::fabs((a - b) / (a + b) * 2);
}

// Python's f"{n:,}".
std::string thousands(int64_t n) {
  std::string s = std::to_string(n < 0 ? -n : n);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) s.insert(static_cast<size_t>(i), ",");
  return n < 0 ? "-" + s : s;
}

const char* injected_name(RerunStateMachine::Injected t) {
  switch (t) {
    case RerunStateMachine::Injected::correct_result: return "Expected result";
    case RerunStateMachine::Injected::transient_error: return "Transient error";
    case RerunStateMachine::Injected::persistent_error: return "Persistent error";
    default: return "none";
  }
}

}  // namespace

void RerunQuickStats::record(double d) {
  if (d == 0.0) {
    ++zero_count;
    return;
  }
  if (samples.size() < 100000) samples.push_back(d);
  else samples[static_cast<size_t>(zero_count + static_cast<int64_t>(samples.size())) % 100000] = d;
  if (d > max) max = d;
}

std::string RerunQuickStats::str() {
  std::sort(samples.begin(), samples.end());
  const int64_t z = zero_count, n = static_cast<int64_t>(samples.size());
  if (n == 0) return fmt::format("{} samples, all identical", thousands(z));
  const int64_t t = z + n;
  double s = 0;
  for (double v : samples) s += v;
  const double a = s / static_cast<double>(t);
  auto pct = [&](double p) -> std::string {
    const int64_t i = static_cast<int64_t>(static_cast<double>(t) * p) - z;
    return i >= 0 ? fmt::format("{:.3E}", samples[static_cast<size_t>(i)]) : std::string("0.0");
  };
  return fmt::format("{}/{} total/identical samples, rel. variability: avg= {:.3E}, p50= {}, p90= {}, p99= {}, "
                     "p99.9= {}, max: {:.3E}",
                     thousands(t), thousands(z), a, pct(0.5), pct(0.9), pct(0.99), pct(0.999), max);
}

RerunStateMachine::RerunStateMachine(Mode mode, int error_injection_rate, Injected error_injection_type, uint64_t seed,
                                     int rank, std::string node, int device, std::function<bool(bool)> reduce_any)
    : mode_(mode),
      injection_rate_(error_injection_rate),
      injection_type_(error_injection_type),
      rng_(seed),
      saved_rng_(seed),
      rank_(rank),
      node_(std::move(node)),
      device_(device),
      reduce_any_(std::move(reduce_any)) {
  static const char* names[] = {"RerunMode.DISABLED", "RerunMode.VALIDATE_RESULTS", "RerunMode.REPORT_DETERMINISM_STATS"};
  log::warn0("RerunStateMachine initialized in mode {}", names[static_cast<int>(mode)]);
}

RerunStateMachine::Mode RerunStateMachine::parse_mode(const std::string& s) {
  if (s == "disabled") return Mode::disabled;
  if (s == "validate_results") return Mode::validate_results;
  if (s == "report_stats") return Mode::report_stats;
  fail("--rerun-mode: unknown value '{}'", s);
}

RerunStateMachine::Injected RerunStateMachine::parse_injection(const std::string& s) {
  if (s == "correct_result") return Injected::correct_result;
  if (s == "transient_error") return Injected::transient_error;
  if (s == "persistent_error") return Injected::persistent_error;
  fail("--error-injection-type: unknown value '{}'", s);
}

void RerunStateMachine::save_state() { saved_rng_ = rng_; }
void RerunStateMachine::restore_state() {
  rng_ = saved_rng_;
  restore_requested_ = true;
}

bool RerunStateMachine::should_run_forward_backward(int64_t iteration0) {
  validation_counts_.clear();
  switch (state_) {
    case State::not_running_yet:
      current_iteration_ = iteration0;
      state_ = State::initial_run;
      if (mode_ == Mode::disabled) return true;
      save_state();
      rerun_requested_ = checkpoint_requested_ = continue_requested_ = false;
      return true;
    case State::initial_run: {
      if (mode_ == Mode::disabled) {
        state_ = State::not_running_yet;
        return false;
      }
      if (!reduce_any_(rerun_requested_)) {
        state_ = State::not_running_yet;
        return false;
      }
      if (mode_ == Mode::validate_results && rank_ == 0)
        log::warn("Need to rerun step to check reproducibility of initial result");
      state_ = State::rerunning_in_place;
      restore_state();
      return true;
    }
    case State::rerunning_in_place: {
      if (mode_ == Mode::report_stats) {
        state_ = State::not_running_yet;
        maybe_report_stats();
        saved_results_.clear();
        return false;
      }
      const bool will_continue = reduce_any_(continue_requested_);
      const bool will_checkpoint = reduce_any_(checkpoint_requested_);
      if (will_continue) {
        log::warn0("Continuing normal execution because failed validation was not fatal");
        state_ = State::not_running_yet;
        return false;
      }
      if (will_checkpoint) state_ = State::will_rerun_from_checkpoint;
      restore_state();
      return false;
    }
    case State::will_rerun_from_checkpoint: break;
  }
  fail("internal error: the rerun state machine was asked to run after deciding to exit");
}

RerunStateMachine::Decision RerunStateMachine::should_checkpoint_and_exit() {
  first_iteration_complete_ = true;
  if (mode_ != Mode::validate_results) return {};
  if (state_ == State::rerunning_in_place) {
    log::warn0("Exiting now. The job can be resumed from a previous checkpoint");
    return {false, true, kExitFailedOnResultValidation};
  }
  if (state_ == State::will_rerun_from_checkpoint) {
    log::warn0("Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun the last "
               "iteration and establish a diagnostic");
    return {true, true, kExitResumeToDisambiguate};
  }
  return {};
}

RerunStateMachine::Call RerunStateMachine::call_info(const std::string& message) {
  return Call{message, ++validation_counts_[message]};
}

bool RerunStateMachine::maybe_inject() {
  if (injection_rate_ <= 0 || injected_ != Injected::none) return false;
  const uint64_t rate = static_cast<uint64_t>(injection_rate_);
  if ((rng_() % rate + static_cast<uint64_t>(rank_)) % rate != 0) return false;
  injected_ = injection_type_;
  log::warn("Injecting error type {}", injected_name(injected_));
  return true;
}

double RerunStateMachine::maybe_miscompare(double initial, double result) {
  if (injected_ == Injected::none) return compare_floats(initial, result);
  // First re-run: an injected transient error does not reproduce (and is done with); the others do.
  if (injected_ == Injected::transient_error) {
    injected_ = Injected::none;
    return kMismatch;
  }
  return kMatch;
}

void RerunStateMachine::log_failure(const std::string& message, bool fatal) const {
  const std::string line = fmt::format("Rank {}, node {}, device {}, iteration #{}: {}!", rank_, node_, device_,
                                       current_iteration_ + 1, message);
  if (fatal) log::error(line);
  else log::warn("{}", line);
}

void RerunStateMachine::validate_result(double value, const std::function<bool(double)>& rejected,
                                        const std::string& message, double tolerance, bool fatal) {
  if (mode_ == Mode::disabled) {
    if (!rejected(value)) return;
    const std::string line = fmt::format("Rank {}, node {}, device {}, iteration {}: Unexpected result {} (message='{}')",
                                         rank_, node_, device_, current_iteration_ + 1, value, message);
    if (fatal) fail("{}", line);
    log::warn("{}", line);
    return;
  }
  MT_CHECK(state_ != State::not_running_yet, "validate_result outside of the forward-backward pass");
  const Call call = call_info(message);
  if (mode_ == Mode::report_stats) {
    if (state_ == State::initial_run) {
      rerun_requested_ = true;
      saved_results_[call] = value;
    } else if (state_ == State::rerunning_in_place) {
      auto it = saved_results_.find(call);
      MT_CHECK(it != saved_results_.end(), "Result from initial run missing");
      if (!stats_.count(message)) stats_order_.push_back(message);
      stats_[message].record(compare_floats(it->second, value));
    }
    return;
  }
  if (!logged_sdc_enabled_) {
    logged_sdc_enabled_ = true;
    log::warn0("Result validation enabled");
  }
  if (state_ == State::initial_run && !rerun_requested_) {
    // Not on a run's first iteration: a checkpoint may not be possible before a first step.
    if (!first_iteration_complete_) return;
    if (maybe_inject() || rejected(value)) {
      failed_call_ = call;
      initial_result_ = value;
      rerun_requested_ = true;
      log::error(fmt::format("Unexpected result {} on rank {} at iteration #{} invocation #{} (message='{}')", value,
                             rank_, current_iteration_ + 1, call.sequence, message));
    }
  } else if (state_ == State::rerunning_in_place && failed_call_ && call == *failed_call_) {
    const double comparison = maybe_miscompare(initial_result_, value);
    if (comparison > tolerance) {
      if (!fatal) continue_requested_ = true;
      log_failure(fmt::format("First rerun: unexpected result is not reproducible within the tolerance ({} != {})",
                              value, initial_result_),
                  fatal);
      log_failure("Possible transient error", fatal);
    } else {
      if (fatal) checkpoint_requested_ = true;
      else continue_requested_ = true;
      log_failure(fmt::format("First rerun: unexpected result is reproducible within the tolerance ({} = {}). Need "
                              "to rerun on a different GPU to verify correctness.",
                              value, initial_result_),
                  fatal);
    }
  }
}

bool RerunStateMachine::is_unexpectedly_large(double value, double threshold, const std::string& context,
                                              int num_samples) {
  value = std::fabs(value);
  if (std::isnan(value) || std::isinf(value)) return false;
  int& count = large_value_counts_[context];
  if (count < num_samples) {
    ++count;
    double& mx = max_values_[context];
    mx = std::max(mx, value);
    if (count == num_samples) log::warn("Max value for {}: {}", context, mx);
    return false;
  }
  return value >= max_values_[context] * threshold;
}

void RerunStateMachine::maybe_report_stats() {
  if (current_iteration_ % kReportingIntervalIterations != 0) return;
  // Every rank validates the same (reduced) values: rank 0's statistics are the run's.
  if (rank_ != 0) return;
  log::info("Stats on computation determinism in validation calls");
  for (const std::string& m : stats_order_) {
    log::info("  From validation call '{}':", m);
    log::info("    {}", stats_[m].str());
  }
}

bool ReplayBatchSource::next(MicroBatch& mb) {
  if (pos_ < kept_.size()) {
    mb = kept_[pos_++];
    return true;
  }
  if (!inner_ || !inner_->next(mb)) return false;
  kept_.push_back(mb);
  ++pos_;
  return true;
}

}  // namespace mt

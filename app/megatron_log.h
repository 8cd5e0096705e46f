// Megatron-LM's console output, character for character (megatron/training/training.py
// training_log and evaluate_and_print_results, megatron/core/timers.py): the per-iteration line,
// the validation block, the "(min, max) time across ranks (ms):" report.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/config.h"
#include "engine/reporter.h"

namespace mt {

// " [2026-08-22 15:22:22.123456]": local time with microseconds (Megatron HEAD's
// datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')).
std::string megatron_timestamp();

// The iteration line (no trailing newline). Fragments, each " <text> |", in Megatron's order:
//   [timestamp] iteration {:8d}/{:8d} | consumed samples: {:12d} | [skipped samples: {:12d} |]
//   elapsed time per iteration (ms): {:.1f} | [throughput per GPU (TFLOP/s/GPU): {:.1f} |]
//   [energy per GPU (J/iter/GPU): {:.1f} | power per GPU (W/GPU): {:.1f} |]
//   [learning rate: {:.6E} |] [decoupled learning rate: {:.6E} |] global batch size: {:5d} |
//   {loss}: {:.6E} | (each loss whose average is >= 0) loss scale: {:.1f} | [grad norm: {:.3f} |]
//   [num zeros: {} |] [params norm: {:.3f} |] number of skipped iterations: {:3d} |
//   number of nan iterations: {:3d} |
// Optional fields print when the engine filled them (it does so under their flags).
std::string format_iteration_line(const IterationStats& s, const std::string& timestamp);

// The validation block: three lines (dashes, text, dashes), joined with '\n'.
//   " validation loss at iteration N | lm loss value: {:.6E} | lm loss PPL: {:.6E} | "
// After training the prefix is "iteration N on validation set" / "iteration N on test set".
// PPL = exp(min(20, loss)).
std::string format_eval_block(const EvalStats& e);

// Timer report for --timing-log-level >= 1 (empty when there is nothing to report), as Megatron's
// Timers.log prints it for --timing-log-option minmax / max / all:
//   (min, max) time across ranks (ms):
//       forward-backward ...............................: (12.34, 12.56)
// Timer names come in Megatron's order (unknown ones after, alphabetically).
std::string format_timers(const IterationStats& s, const std::string& timing_log_option);

// The stats with the optional fields whose flags are off removed (--log-throughput,
// --log-params-norm, --log-num-zeros-in-grad): Megatron shows those only under their flags.
IterationStats with_logging_flags(const IterationStats& s, const LoggingConfig& cfg);

// Megatron's timer names in the order training_log lists them (timers_to_log; levels in
// engine/phase_timers.h). The report prints them in this order.
const std::vector<std::string>& megatron_timer_order();

// Prints the above to `sink` (default: stdout via mt::log). Construct it on the rank that prints
// (Megatron's print_rank_last: the last rank).
class MegatronLogReporter : public Reporter {
 public:
  using Sink = std::function<void(const std::string&)>;
  using Clock = std::function<std::string()>;
  explicit MegatronLogReporter(const LoggingConfig& cfg, Sink sink = {}, Clock timestamp = {});
  void on_iteration(const IterationStats& s) override;
  void on_eval(const EvalStats& e) override;

 private:
  LoggingConfig cfg_;
  Sink sink_;
  Clock timestamp_;
};

}  // namespace mt

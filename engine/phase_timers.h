// Per-phase timers with Megatron's names and --timing-log-level semantics (megatron/core/timers.py):
// each name belongs to a level; a timer above the run's level is a no-op that costs nothing, and
// an active one synchronizes the device at start and stop (a device phase's wall time needs it:
// this is what makes level 2 slower, as in Megatron). Times accumulate per name over a log
// interval.
//
// The engine's phases and where they are timed:
//   level 1  forward-backward (trainer), all-grads-sync and embedding-grads-all-reduce
//            (engine/dp_grad_sync.cpp, at the end of forward-backward as Megatron's
//            finalize_model_grads), optimizer and its sub-phases optimizer-clip-main-grad (gradient
//            statistics and the step's readback; with --fp16 this also is the inf check),
//            optimizer-count-zeros (--log-num-zeros-in-grad), optimizer-inner-step (the fused
//            Adam/SGD update, which also writes the model copy: there is no separate
//            optimizer-copy-main-to-model-params), params-all-gather (--use-distributed-optimizer)
//   level 2  batch-generator, forward-compute, backward-compute and the pipeline transfers
//            forward-recv ... forward-backward-send-forward-backward-recv (engine/pipeline_runner.cpp)
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace mt {

struct TimerName {
  const char* name;
  int level;
};

// Megatron's timers in the order training_log lists them (timers_to_log), with their levels.
const std::vector<TimerName>& megatron_timers();
// The level of a timer name (names Megatron does not list: 2).
int megatron_timer_level(std::string_view name);

// The name of one grouped pipeline transfer, as Megatron's p2p_communication names its calls:
// forward-send, forward-recv, backward-send, backward-recv, the four pairs
// (forward-send-backward-recv, ...), and forward-backward-send-forward-backward-recv otherwise.
const char* p2p_timer_name(bool send_activation, bool recv_activation, bool send_grad, bool recv_grad);

class PhaseTimers {
 public:
  using Sync = std::function<void()>;
  PhaseTimers(int level, Sync sync) : level_(level), sync_(std::move(sync)) {}

  int level() const { return level_; }
  bool active(const char* name) const { return level_ > 0 && megatron_timer_level(name) <= level_; }
  void start(const char* name);
  void stop(const char* name);
  // Accumulated ms per name since the last reset.
  const std::map<std::string, double>& elapsed_ms() const { return elapsed_ms_; }
  void reset() { elapsed_ms_.clear(); }

 private:
  using Clock = std::chrono::steady_clock;
  int level_;
  Sync sync_;
  std::map<std::string, double> elapsed_ms_;
  std::map<std::string, Clock::time_point> started_;
};

// A hook the engine's components call with (name, start): null when timing is off.
using TimerHook = std::function<void(const char* name, bool start)>;

// Calls hook(name, true) now and hook(name, false) at scope exit (nothing without a hook).
class ScopedTimer {
 public:
  ScopedTimer(const TimerHook& hook, const char* name) : hook_(hook), name_(name) {
    if (hook_) hook_(name_, true);
  }
  ~ScopedTimer() {
    if (hook_) hook_(name_, false);
  }
  ScopedTimer(const ScopedTimer&) = delete;
  ScopedTimer& operator=(const ScopedTimer&) = delete;

 private:
  const TimerHook& hook_;
  const char* name_;
};

}  // namespace mt

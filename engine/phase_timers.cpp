#include "engine/phase_timers.h"

#include "core/error.h"

namespace mt {

const std::vector<TimerName>& megatron_timers() {
  static const std::vector<TimerName> timers = {
      {"forward-backward", 1},
      {"forward-compute", 2},
      {"backward-compute", 2},
      {"batch-generator", 2},
      {"forward-recv", 2},
      {"forward-send", 2},
      {"backward-recv", 2},
      {"backward-send", 2},
      {"forward-send-forward-recv", 2},
      {"forward-send-backward-recv", 2},
      {"backward-send-forward-recv", 2},
      {"backward-send-backward-recv", 2},
      {"forward-backward-send-forward-backward-recv", 2},
      {"layernorm-grads-all-reduce", 1},
      {"embedding-grads-all-reduce", 1},
      {"all-grads-sync", 1},
      {"params-all-gather", 1},
      {"optimizer-copy-to-main-grad", 1},
      {"optimizer-unscale-and-check-inf", 1},
      {"optimizer-clip-main-grad", 1},
      {"optimizer-count-zeros", 1},
      {"optimizer-inner-step", 1},
      {"optimizer-copy-main-to-model-params", 1},
      {"optimizer", 1}};
  return timers;
}

int megatron_timer_level(std::string_view name) {
  for (const TimerName& t : megatron_timers())
    if (name == t.name) return t.level;
  return 2;
}

const char* p2p_timer_name(bool send_activation, bool recv_activation, bool send_grad, bool recv_grad) {
  const int n = send_activation + recv_activation + send_grad + recv_grad;
  if (n == 1) {
    if (send_activation) return "forward-send";
    if (recv_activation) return "forward-recv";
    if (send_grad) return "backward-send";
    return "backward-recv";
  }
  if (n == 2) {
    if (send_activation && recv_grad) return "forward-send-backward-recv";
    if (send_grad && recv_activation) return "backward-send-forward-recv";
    if (send_activation && recv_activation) return "forward-send-forward-recv";
    if (send_grad && recv_grad) return "backward-send-backward-recv";
  }
  return "forward-backward-send-forward-backward-recv";
}

void PhaseTimers::start(const char* name) {
  if (!active(name)) return;
  if (sync_) sync_();
  started_[name] = Clock::now();
}

void PhaseTimers::stop(const char* name) {
  if (!active(name)) return;
  auto it = started_.find(name);
  MT_CHECK(it != started_.end(), "timer {} stopped without being started", name);
  if (sync_) sync_();
  elapsed_ms_[name] += std::chrono::duration<double, std::milli>(Clock::now() - it->second).count();
  started_.erase(it);
}

}  // namespace mt

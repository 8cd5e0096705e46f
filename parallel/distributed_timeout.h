// How long any blocking distributed wait may take before megatrain gives up with an error naming the
// group and the operation (--distributed-timeout-minutes, Megatron's default 10 minutes).
//
// MEGATRAIN_DISTRIBUTED_TIMEOUT_SECONDS=<seconds> (a decimal number) overrides the flag. It exists
// for tests that must see a timeout fire within seconds; it is not a Megatron flag.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace mt {

using Millis = std::chrono::milliseconds;

Millis distributed_timeout(int timeout_minutes);

// The timeout that every communicator split from one world shares: copies share one value, so
// that --distributed-timeout-seconds-after-init changes it for all the run's groups at once
// (Communicator::set_timeout). Read by the waiting threads and the NCCL watchdog alike.
class SharedTimeout {
 public:
  explicit SharedTimeout(Millis t) : cell_(std::make_shared<Cell>()) { cell_->ms.store(t.count()); }
  Millis get() const { return Millis(cell_->ms.load(std::memory_order_relaxed)); }
  // The value after the first iteration (--distributed-timeout-seconds-after-init).
  void set_after_init(Millis t) const {
    cell_->ms.store(t.count(), std::memory_order_relaxed);
    cell_->after_init.store(true, std::memory_order_relaxed);
  }
  // The flag that sets the value in force, for error messages.
  const char* flag() const {
    return cell_->after_init.load(std::memory_order_relaxed) ? "--distributed-timeout-seconds-after-init"
                                                             : "--distributed-timeout-minutes";
  }

 private:
  struct Cell {
    std::atomic<int64_t> ms{0};
    std::atomic<bool> after_init{false};
  };
  std::shared_ptr<Cell> cell_;
};

// "10 min", "2.5 s", "300 ms": for error messages.
std::string format_duration(Millis d);

}  // namespace mt

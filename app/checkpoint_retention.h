// Megatron's --save-retain-interval: once a new checkpoint is committed (the tracker names it), the
// checkpoint the tracker named before is deleted unless its iteration is a multiple of the retain
// interval, so that the saves at those multiples and the latest one remain. Only rank 0 deletes,
// on a background thread (a checkpoint of many GB takes a while to remove), and never a symbolic
// link or the checkpoint just written.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>

namespace mt {

// The iteration `save_dir`'s tracker names, or nullopt (no tracker, "release", unreadable).
std::optional<int64_t> tracked_iteration(const std::string& save_dir);

class CheckpointRetention {
 public:
  // Inactive (every call a no-op) without an interval or on ranks other than 0. on_deleted is
  // called (on the background thread) with each iteration removed: the progress log.
  CheckpointRetention(std::string save_dir, std::optional<int> retain_interval, int rank,
                      std::function<void(int64_t)> on_deleted = {});
  ~CheckpointRetention();  // waits for a deletion in progress
  CheckpointRetention(const CheckpointRetention&) = delete;
  CheckpointRetention& operator=(const CheckpointRetention&) = delete;

  // `saved` was committed; `previous` is what the tracker named before its save began.
  void committed(std::optional<int64_t> previous, int64_t saved);
  // Waits for a deletion in progress (end of training; tests).
  void wait();

 private:
  std::string save_dir_;
  std::optional<int> interval_;
  bool active_ = false;
  std::function<void(int64_t)> on_deleted_;
  std::thread worker_;
};

}  // namespace mt

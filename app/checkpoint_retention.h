// Which checkpoints are deleted, and when:
// - Megatron's --save-retain-interval: once a new checkpoint is committed (the tracker names it),
//   the checkpoint the tracker named before is deleted unless its iteration is a multiple of the
//   retain interval, so that the saves at those multiples and the latest one remain.
// - Non-persistent checkpoints (--non-persistent-ckpt-type global): once one is committed, every
//   other iteration directory of the non-persistent directory goes (Megatron keeps only the newest;
//   it deletes before writing the next, megatrain after committing it, so at most one stays on disk
//   between saves and the last committed one is never missing).
// Only rank 0 deletes, on a background thread (a checkpoint of many GB takes a while to remove),
// never a symbolic link or the checkpoint just written.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace mt {

// The iteration `save_dir`'s tracker names, or nullopt (no tracker, "release", unreadable).
std::optional<int64_t> tracked_iteration(const std::string& save_dir);

// Deletes checkpoint directories on one background thread, one batch at a time.
class BackgroundRemover {
 public:
  ~BackgroundRemover();  // waits for a deletion in progress
  // Removes each (iteration, directory) after the batch before; on_deleted(iteration) after each
  // one (on the background thread). A failure is a warning naming `flag`, not fatal (as Megatron:
  // the new checkpoint is committed).
  void remove(std::vector<std::pair<int64_t, std::string>> dirs, std::string flag,
              std::function<void(int64_t)> on_deleted = {});
  void wait();

 private:
  std::thread worker_;
};

class CheckpointRetention {
 public:
  // Inactive (every call a no-op) without an interval or on ranks other than 0. on_deleted is
  // called (on the background thread) with each iteration removed: the progress log.
  CheckpointRetention(std::string save_dir, std::optional<int> retain_interval, int rank,
                      std::function<void(int64_t)> on_deleted = {});
  CheckpointRetention(const CheckpointRetention&) = delete;
  CheckpointRetention& operator=(const CheckpointRetention&) = delete;

  // `saved` was committed; `previous` is what the tracker named before its save began.
  void committed(std::optional<int64_t> previous, int64_t saved);
  // Waits for a deletion in progress (end of training; tests).
  void wait() { remover_.wait(); }

 private:
  std::string save_dir_;
  std::optional<int> interval_;
  bool active_ = false;
  std::function<void(int64_t)> on_deleted_;
  BackgroundRemover remover_;
};

class NonPersistentCleanup {
 public:
  // Inactive on ranks other than 0 or with an empty directory.
  NonPersistentCleanup(std::string dir, int rank);
  // `saved` was committed into the directory: the other iter_N directories there go.
  void committed(int64_t saved);
  void wait() { remover_.wait(); }

 private:
  std::string dir_;
  bool active_ = false;
  BackgroundRemover remover_;
};

}  // namespace mt

#include "app/checkpoint_retention.h"

#include <sys/stat.h>

#include <exception>

#include "checkpoint/checkpoint_io.h"
#include "checkpoint/file_io.h"
#include "core/log.h"

namespace mt {

std::optional<int64_t> tracked_iteration(const std::string& save_dir) {
  try {
    const std::optional<CheckpointLocation> loc = locate_checkpoint(save_dir);
    if (!loc || loc->release) return std::nullopt;
    return loc->iteration;
  } catch (const std::exception&) {
    return std::nullopt;  // an unreadable tracker or a missing directory: nothing to delete
  }
}

CheckpointRetention::CheckpointRetention(std::string save_dir, std::optional<int> retain_interval, int rank,
                                         std::function<void(int64_t)> on_deleted)
    : save_dir_(std::move(save_dir)),
      interval_(retain_interval),
      active_(retain_interval.has_value() && *retain_interval > 0 && rank == 0),
      on_deleted_(std::move(on_deleted)) {}

CheckpointRetention::~CheckpointRetention() { wait(); }

void CheckpointRetention::wait() {
  if (worker_.joinable()) worker_.join();
}

void CheckpointRetention::committed(std::optional<int64_t> previous, int64_t saved) {
  // Megatron: previous > 0, not the one just saved, and not a multiple of the retain interval.
  if (!active_ || !previous || *previous <= 0 || *previous == saved || *previous % *interval_ == 0) return;
  const int64_t it = *previous;
  const std::string dir = join_path(save_dir_, iteration_directory_name(it));
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) return;  // already gone
  if (S_ISLNK(st.st_mode)) {
    log::info("  skipping deleting checkpoint from iteration {:7d} at {} since it is a symbolic link", it, save_dir_);
    return;
  }
  wait();  // one deletion at a time
  worker_ = std::thread([this, it, dir] {
    try {
      remove_tree(dir);
      log::info("  successfully deleted checkpoint from iteration {:7d} at {}", it, save_dir_);
      if (on_deleted_) on_deleted_(it);
    } catch (const std::exception& e) {
      // As Megatron: a failed clean-up is reported, not fatal (the new checkpoint is committed).
      log::warn("--save-retain-interval: could not delete {}: {}", dir, e.what());
    }
  });
}

}  // namespace mt

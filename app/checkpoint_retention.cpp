#include "app/checkpoint_retention.h"

#include <sys/stat.h>

#include <cctype>
#include <climits>
#include <cstdint>
#include <exception>
#include <string_view>

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

namespace {

// A symbolic link is never deleted (Megatron's message for --save-retain-interval).
bool is_symlink(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
}

// "iter_0000123" -> 123; nullopt for any other name (.tmp / .old leftovers included).
std::optional<int64_t> iteration_of(const std::string& name) {
  constexpr std::string_view prefix = "iter_";
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  int64_t it = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(name[i])) || it > (INT64_MAX - 9) / 10) return std::nullopt;
    it = it * 10 + (name[i] - '0');
  }
  return it;
}

}  // namespace

BackgroundRemover::~BackgroundRemover() { wait(); }

void BackgroundRemover::wait() {
  if (worker_.joinable()) worker_.join();
}

void BackgroundRemover::remove(std::vector<std::pair<int64_t, std::string>> dirs, std::string flag,
                               std::function<void(int64_t)> on_deleted) {
  if (dirs.empty()) return;
  wait();  // one batch at a time
  worker_ = std::thread([dirs = std::move(dirs), flag = std::move(flag), on_deleted = std::move(on_deleted)] {
    for (const auto& [it, dir] : dirs) {
      try {
        remove_tree(dir);
        log::info("  successfully deleted checkpoint from iteration {:7d} at {}", it, parent_directory(dir));
        if (on_deleted) on_deleted(it);
      } catch (const std::exception& e) {
        // As Megatron: a failed clean-up is reported, not fatal (the new checkpoint is committed).
        log::warn("{}: could not delete {}: {}", flag, dir, e.what());
      }
    }
  });
}

void CheckpointRetention::committed(std::optional<int64_t> previous, int64_t saved) {
  // Megatron: previous > 0, not the one just saved, and not a multiple of the retain interval.
  if (!active_ || !previous || *previous <= 0 || *previous == saved || *previous % *interval_ == 0) return;
  const int64_t it = *previous;
  const std::string dir = join_path(save_dir_, iteration_directory_name(it));
  if (is_symlink(dir)) {
    log::info("  skipping deleting checkpoint from iteration {:7d} at {} since it is a symbolic link", it, save_dir_);
    return;
  }
  if (!path_exists(dir)) return;  // already gone
  remover_.remove({{it, dir}}, "--save-retain-interval", on_deleted_);
}

NonPersistentCleanup::NonPersistentCleanup(std::string dir, int rank) : dir_(std::move(dir)), active_(rank == 0 && !dir_.empty()) {}

void NonPersistentCleanup::committed(int64_t saved) {
  if (!active_) return;
  std::vector<std::pair<int64_t, std::string>> old;
  try {
    for (const std::string& name : list_directory(dir_)) {
      const std::optional<int64_t> it = iteration_of(name);
      const std::string path = join_path(dir_, name);
      if (!it || *it == saved || !is_directory(path)) continue;
      if (is_symlink(path)) {
        log::info("  skipping deleting non-persistent checkpoint {} since it is a symbolic link", path);
        continue;
      }
      old.emplace_back(*it, path);
    }
  } catch (const std::exception& e) {
    log::warn("--non-persistent-save-interval: could not list {} to delete older checkpoints: {}", dir_, e.what());
    return;
  }
  remover_.remove(std::move(old), "--non-persistent-save-interval");
}

}  // namespace mt

// Megatron's --log-progress: a job-by-job record in <save>/progress.txt that outlives restarts
// (megatron/training: append_to_progress_log, compute_throughputs_and_append_to_progress_log,
// get_start_time_from_progress_log). Rank 0 appends one line per event:
//   "%Y-%m-%d %H:%M:%S\tJob ID: {SLURM_JOB_ID}\t# GPUs: {world size}\t{message}\n"
// with the messages
//   Starting job
//   Saved checkpoint\tIteration: N\tJob throughput: {:.1f} TFLOP/s/GPU\tCumulative throughput:
//     {:.1f} TFLOP/s/GPU\tFloating-point operations: {:.2e}\tTokens (in billions): {:.2f}
//     ("Saving async checkpoint" in place of "Saved checkpoint" with --async-save)
//   Saved async checkpoint\tIteration: N          (when an asynchronous save is committed)
//   Deleted checkpoint\tIteration: N              (--save-retain-interval)
// Job throughput counts this job's FLOPs over the time since the process started; cumulative
// throughput counts from the first "Starting job" of the latest run of lines with this world size,
// with the FLOPs of the last committed save before it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace mt {

// What a progress file says about where the current stretch of jobs began.
struct ProgressStart {
  std::string timestamp;  // "%Y-%m-%d %H:%M:%S" of its first "Starting job"
  double flops = 0;       // the FLOPs of the last committed save before it
};
// Megatron's get_start_time_from_progress_log over the file's text: lines of another world size
// restart the search. Throws mt::Error naming `path` when no "Starting job" line of `world_size`
// is there (Megatron's assertion) or a line is malformed.
ProgressStart progress_start(const std::string& text, int world_size, const std::string& path);

class ProgressLog {
 public:
  using TimePoint = std::chrono::system_clock::time_point;
  // Disabled (every call a no-op) unless `save_dir` is set, `enabled`, and this is rank 0.
  // `job_id` is SLURM_JOB_ID (empty outside SLURM); `flops_at_start` is set once the checkpoint
  // to resume from is known (set_flops_at_start).
  ProgressLog(std::optional<std::string> save_dir, bool enabled, int rank, int world_size, std::string job_id);

  bool enabled() const { return enabled_; }
  const std::string& path() const { return path_; }
  // num_floating_point_operations_so_far when this job started (0, or the loaded checkpoint's).
  void set_flops_at_start(double flops) { flops_at_start_ = flops; }

  void job_started();
  // A checkpoint of `iteration` was written (or, async, scheduled): the throughput line.
  void checkpoint_saved(int64_t iteration, double flops_so_far, double tokens_so_far, bool async);
  void async_checkpoint_committed(int64_t iteration);
  void checkpoint_deleted(int64_t iteration);

  // For tests: the clock (default: system_clock::now) and the process start time.
  void set_clock(std::function<TimePoint()> now, TimePoint process_start);

 private:
  void append(const std::string& message);

  bool enabled_ = false;
  std::string path_, job_id_;
  int world_size_ = 1;
  double flops_at_start_ = 0;
  std::function<TimePoint()> now_;
  TimePoint process_start_;
};

// The timestamp format of progress.txt (local time, whole seconds).
std::string progress_timestamp(std::chrono::system_clock::time_point t);

}  // namespace mt

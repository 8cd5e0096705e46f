// TensorBoard event files written natively (no TensorFlow, no protobuf library):
//   file     <dir>/events.out.tfevents.<10-digit unix time>.<hostname>.<pid>.<counter>
//   record   uint64 length | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data)
//   data     protobuf Event{1: double wall_time, 2: int64 step, 3: string file_version | 5: Summary}
//            Summary{1: repeated Value}, Value{1: string tag, 2: float simple_value}
// The first event is file_version "brain.Event:2". A background thread does the file I/O through a
// bounded queue (--tensorboard-queue-size): add_scalar blocks only when the queue is full.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/config.h"
#include "engine/reporter.h"

namespace mt {

// Encoders (exposed for tests).
std::string encode_file_version_event(double wall_time);
std::string encode_scalar_event(double wall_time, int64_t step, const std::string& tag, float value);
std::string frame_tfrecord(const std::string& payload);

// A decoded event (the subset megatrain writes).
struct TensorBoardEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::optional<std::string> file_version;
  std::vector<std::pair<std::string, float>> scalars;  // (tag, simple_value)
};
// Reads an event file, checking both CRCs of every record; throws mt::Error naming the file, the
// record and the problem (truncated record, CRC mismatch, malformed protobuf).
std::vector<TensorBoardEvent> read_tensorboard_events(const std::string& path);

class TensorBoardWriter {
 public:
  // Creates `dir` if needed and opens a new event file in it.
  TensorBoardWriter(const std::string& dir, size_t queue_size);
  ~TensorBoardWriter();  // flushes and closes; a write error is reported on stderr
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  void add_scalar(const std::string& tag, double value, int64_t step);
  void add_scalar(const std::string& tag, double value, int64_t step, double wall_time);
  // Waits until every queued event is written and flushed to the OS; rethrows a write error.
  void flush();
  const std::string& path() const { return path_; }

 private:
  void run();

  std::string path_;
  size_t capacity_;
  std::FILE* file_ = nullptr;
  std::mutex mutex_;
  std::condition_variable not_empty_, not_full_, drained_;
  std::deque<std::string> queue_;  // framed records
  size_t in_flight_ = 0;           // records taken from the queue but not yet flushed
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

// Writes Megatron's TensorBoard tags (megatron/training/training.py training_log and
// evaluate_and_print_results) on the last rank:
//   every --tensorboard-log-interval iterations: learning-rate, skipped-train-samples, batch-size,
//     each loss key ("lm loss"), loss-scale (unless --no-log-loss-scale-to-tensorboard), world-size
//     (--log-world-size-to-tensorboard), grad-norm, num-zeros, params-norm, each also as
//     "<tag> vs samples" with step = consumed samples; mem-reserved-bytes, mem-allocated-bytes,
//     mem-max-allocated-bytes, mem-allocated-count (--log-memory-to-tensorboard);
//   at log intervals with --log-timers-to-tensorboard: iteration-time (seconds; not after the
//     first iteration's extra line), throughput (with --log-throughput), "<timer>-time" (max over
//     ranks, seconds);
//   evaluations: "<loss> validation", "<loss> validation vs samples", and with
//     --log-validation-ppl-to-tensorboard "<loss> validation ppl" (+ vs samples). Nothing for the
//     after-training evaluation when --skip-train is set (Megatron passes write_to_tensorboard=False).
// The optional fields follow their flags as on the log line (with_logging_flags).
class TensorBoardReporter : public Reporter {
 public:
  TensorBoardReporter(const LoggingConfig& logging, bool skip_train, int world_size);
  void on_iteration(const IterationStats& s) override;
  void on_eval(const EvalStats& e) override;
  void flush() override { writer_.flush(); }
  const std::string& path() const { return writer_.path(); }

 private:
  void both(const std::string& tag, double value, int64_t iteration, int64_t samples);

  LoggingConfig cfg_;
  bool skip_train_;
  int world_size_;
  TensorBoardWriter writer_;
};

}  // namespace mt

#include "app/progress_log.h"

#include <fmt/format.h>

#include <ctime>
#include <fstream>
#include <sstream>
#include <vector>

#include "checkpoint/file_io.h"
#include "core/error.h"
#include "core/log.h"

namespace mt {

namespace {

// Megatron's _TRAIN_START_TIME is taken when its training module is imported, at process start.
const std::chrono::system_clock::time_point kProcessStart = std::chrono::system_clock::now();

std::vector<std::string> split_tabs(const std::string& line) {
  std::vector<std::string> out;
  std::string field;
  std::istringstream in(line);
  while (std::getline(in, field, '\t')) out.push_back(field);
  return out;
}

// "Name: value" -> value (Megatron's string.split(': ')[1]).
std::string field_value(const std::vector<std::string>& tokens, size_t i, const std::string& path) {
  if (i >= tokens.size()) fail("{}: a line has {} fields, expected at least {}", path, tokens.size(), i + 1);
  const size_t at = tokens[i].find(": ");
  if (at == std::string::npos) fail("{}: field '{}' has no ': '", path, tokens[i]);
  std::string v = tokens[i].substr(at + 2);
  const size_t end = v.find(": ");
  return end == std::string::npos ? v : v.substr(0, end);
}

// A numeric field's value; throws mt::Error naming the file when it is not a number.
double number_field(const std::vector<std::string>& tokens, size_t i, const std::string& path) {
  const std::string v = field_value(tokens, i, path);
  try {
    size_t used = 0;
    const double d = std::stod(v, &used);
    if (used == v.size()) return d;
  } catch (const std::exception&) {
  }
  fail("{}: field '{}' is not a number", path, tokens[i]);
}

std::chrono::system_clock::time_point parse_timestamp(const std::string& s, const std::string& path) {
  std::tm tm{};
  const char* end = ::strptime(s.c_str(), "%Y-%m-%d %H:%M:%S", &tm);
  if (end == nullptr || *end != '\0') fail("{}: '{}' is not a %Y-%m-%d %H:%M:%S timestamp", path, s);
  tm.tm_isdst = -1;  // local time, as Megatron's datetime.now() wrote it
  return std::chrono::system_clock::from_time_t(std::mktime(&tm));
}

}  // namespace

std::string progress_timestamp(std::chrono::system_clock::time_point t) {
  const std::time_t tt = std::chrono::system_clock::to_time_t(t);
  std::tm tm;
  ::localtime_r(&tt, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

ProgressStart progress_start(const std::string& text, int world_size, const std::string& path) {
  std::optional<ProgressStart> start;
  double latest = 0;                  // FLOPs of the last committed save
  double async_flops = -1;            // of a scheduled asynchronous save not yet committed (-1: none)
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    if (line.empty()) continue;
    const std::vector<std::string> t = split_tabs(line);
    if (t.size() < 4) fail("{}: malformed line '{}' (expected timestamp, job ID, # GPUs, message)", path, line);
    const int gpus = static_cast<int>(number_field(t, 2, path));
    const std::string& message = t[3];
    if (message == "Saved checkpoint") latest = number_field(t, 7, path);
    if (message == "Saving async checkpoint") async_flops = number_field(t, 7, path);
    if (message == "Saved async checkpoint" && async_flops >= 0) {
      latest = async_flops;
      async_flops = -1;
    }
    if (gpus != world_size) {  // another world size: the search starts again after it
      start.reset();
      continue;
    }
    if (message == "Starting job" && !start) start = ProgressStart{t[0], latest};
  }
  if (!start) fail("{}: Should have seen at least one 'Starting job' entry with same world_size ({})", path, world_size);
  return *start;
}

ProgressLog::ProgressLog(std::optional<std::string> save_dir, bool enabled, int rank, int world_size, std::string job_id)
    : enabled_(enabled && save_dir.has_value() && rank == 0),
      path_(save_dir ? join_path(*save_dir, "progress.txt") : std::string()),
      job_id_(std::move(job_id)),
      world_size_(world_size),
      now_([] { return std::chrono::system_clock::now(); }),
      process_start_(kProcessStart) {}

void ProgressLog::set_clock(std::function<TimePoint()> now, TimePoint process_start) {
  now_ = std::move(now);
  process_start_ = process_start;
}

void ProgressLog::append(const std::string& message) {
  if (!enabled_) return;
  make_directories(parent_directory(path_));
  std::ofstream out(path_, std::ios::app);
  out << progress_timestamp(now_()) << "\tJob ID: " << job_id_ << "\t# GPUs: " << world_size_ << "\t" << message << "\n";
  out.flush();
  if (!out) log::warn("--log-progress: could not append to {}", path_);
}

void ProgressLog::job_started() { append("Starting job"); }

void ProgressLog::checkpoint_saved(int64_t iteration, double flops_so_far, double tokens_so_far, bool async) {
  if (!enabled_) return;
  const TimePoint now = now_();
  const double job_s = std::chrono::duration<double>(now - process_start_).count();
  const double job = job_s > 0 ? (flops_so_far - flops_at_start_) / (job_s * 1e12 * world_size_) : 0.0;
  // Megatron asserts on a file it cannot read back; the checkpoint is committed by now, so
  // megatrain warns and counts the cumulative throughput from this job's start instead.
  double cumulative = job;
  try {
    const ProgressStart start = progress_start(read_text_file(path_), world_size_, path_);
    const double cumulative_s = std::chrono::duration<double>(now - parse_timestamp(start.timestamp, path_)).count();
    if (cumulative_s > 0) cumulative = (flops_so_far - start.flops) / (cumulative_s * 1e12 * world_size_);
  } catch (const Error& e) {
    log::warn("--log-progress: {}; the cumulative throughput of this line counts from this job's start", e.what());
  }
  append(fmt::format("{}\tIteration: {}\tJob throughput: {:.1f} TFLOP/s/GPU\tCumulative throughput: {:.1f} TFLOP/s/GPU"
                     "\tFloating-point operations: {:.2e}\tTokens (in billions): {:.2f}",
                     async ? "Saving async checkpoint" : "Saved checkpoint", iteration, job, cumulative, flops_so_far,
                     tokens_so_far / 1e9));
}

void ProgressLog::async_checkpoint_committed(int64_t iteration) {
  append(fmt::format("Saved async checkpoint\tIteration: {}", iteration));
}

void ProgressLog::checkpoint_deleted(int64_t iteration) {
  append(fmt::format("Deleted checkpoint\tIteration: {}", iteration));
}

}  // namespace mt

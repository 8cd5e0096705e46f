#include "app/tensorboard_writer.h"

#include <fmt/format.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "app/megatron_log.h"
#include "core/crc32c.h"
#include "core/error.h"
#include "core/log.h"

namespace mt {
namespace {

double now_seconds() {
  timeval tv;
  ::gettimeofday(&tv, nullptr);
  return static_cast<double>(tv.tv_sec) + static_cast<double>(tv.tv_usec) * 1e-6;
}

// ---- protobuf wire format (just what Event/Summary need) ----
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7f) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}
void put_key(std::string& out, int field, int wire_type) { put_varint(out, (static_cast<uint64_t>(field) << 3) | wire_type); }
void put_fixed64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}
void put_fixed32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}
void put_double(std::string& out, int field, double d) {
  uint64_t bits;
  std::memcpy(&bits, &d, 8);
  put_key(out, field, 1);
  put_fixed64(out, bits);
}
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

std::atomic<int> g_file_counter{0};

}  // namespace

std::string encode_file_version_event(double wall_time) {
  std::string e;
  put_double(e, 1, wall_time);
  put_bytes(e, 3, "brain.Event:2");
  return e;
}

std::string encode_scalar_event(double wall_time, int64_t step, const std::string& tag, float value) {
  std::string v;  // Summary.Value
  put_bytes(v, 1, tag);
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  put_key(v, 2, 5);
  put_fixed32(v, bits);
  std::string summary;
  put_bytes(summary, 1, v);
  std::string e;
  put_double(e, 1, wall_time);
  if (step != 0) {  // proto3 omits default values
    put_key(e, 2, 0);
    put_varint(e, static_cast<uint64_t>(step));
  }
  put_bytes(e, 5, summary);
  return e;
}

std::string frame_tfrecord(const std::string& payload) {
  std::string out;
  std::string len;
  put_fixed64(len, payload.size());
  out += len;
  put_fixed32(out, crc32c_mask(crc32c(len.data(), 8)));
  out += payload;
  put_fixed32(out, crc32c_mask(crc32c(payload.data(), payload.size())));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Decoding

namespace {

struct Cursor {
  const unsigned char* p;
  const unsigned char* end;
  const std::string& where;

  bool done() const { return p >= end; }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p >= end) fail("{}: truncated varint", where);
      const unsigned char b = *p++;
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    fail("{}: varint too long", where);
  }
  uint64_t fixed(int n) {
    if (end - p < n) fail("{}: truncated fixed{} field", where, n * 8);
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
    p += n;
    return v;
  }
  Cursor sub() {
    const uint64_t n = varint();
    if (static_cast<uint64_t>(end - p) < n) fail("{}: truncated length-delimited field", where);
    Cursor c{p, p + n, where};
    p += n;
    return c;
  }
  void skip(int wire_type) {
    switch (wire_type) {
      case 0: varint(); break;
      case 1: fixed(8); break;
      case 2: sub(); break;
      case 5: fixed(4); break;
      default: fail("{}: unsupported protobuf wire type {}", where, wire_type);
    }
  }
};

TensorBoardEvent decode_event(const std::string& payload, const std::string& where) {
  TensorBoardEvent ev;
  Cursor c{reinterpret_cast<const unsigned char*>(payload.data()),
           reinterpret_cast<const unsigned char*>(payload.data()) + payload.size(), where};
  while (!c.done()) {
    const uint64_t key = c.varint();
    const int field = static_cast<int>(key >> 3), wt = static_cast<int>(key & 7);
    if (field == 1 && wt == 1) {
      const uint64_t bits = c.fixed(8);
      std::memcpy(&ev.wall_time, &bits, 8);
    } else if (field == 2 && wt == 0) {
      ev.step = static_cast<int64_t>(c.varint());
    } else if (field == 3 && wt == 2) {
      Cursor s = c.sub();
      ev.file_version = std::string(reinterpret_cast<const char*>(s.p), s.end - s.p);
    } else if (field == 5 && wt == 2) {
      Cursor summary = c.sub();
      while (!summary.done()) {
        const uint64_t sk = summary.varint();
        if ((sk >> 3) != 1 || (sk & 7) != 2) {
          summary.skip(static_cast<int>(sk & 7));
          continue;
        }
        Cursor value = summary.sub();
        std::string tag;
        std::optional<float> simple;
        while (!value.done()) {
          const uint64_t vk = value.varint();
          if ((vk >> 3) == 1 && (vk & 7) == 2) {
            Cursor t = value.sub();
            tag.assign(reinterpret_cast<const char*>(t.p), t.end - t.p);
          } else if ((vk >> 3) == 2 && (vk & 7) == 5) {
            const uint32_t bits = static_cast<uint32_t>(value.fixed(4));
            float f;
            std::memcpy(&f, &bits, 4);
            simple = f;
          } else {
            value.skip(static_cast<int>(vk & 7));
          }
        }
        if (simple) ev.scalars.emplace_back(tag, *simple);
      }
    } else {
      c.skip(wt);
    }
  }
  return ev;
}

uint64_t le(const std::string& s, size_t at, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + i]);
  return v;
}

}  // namespace

std::vector<TensorBoardEvent> read_tensorboard_events(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read TensorBoard event file {}", path);
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<TensorBoardEvent> events;
  size_t at = 0;
  for (int record = 0; at < data.size(); ++record) {
    const std::string where = fmt::format("{} record {} (byte {})", path, record, at);
    if (data.size() - at < 12) fail("{}: truncated record header", where);
    const uint64_t n = le(data, at, 8);
    if (crc32c_mask(crc32c(data.data() + at, 8)) != le(data, at + 8, 4)) fail("{}: length CRC mismatch", where);
    if (data.size() - at - 12 < n + 4) fail("{}: truncated record data", where);
    const std::string payload = data.substr(at + 12, n);
    if (crc32c_mask(crc32c(payload.data(), payload.size())) != le(data, at + 12 + n, 4))
      fail("{}: data CRC mismatch", where);
    events.push_back(decode_event(payload, where));
    at += 12 + n + 4;
  }
  return events;
}

// ---------------------------------------------------------------------------------------------
// Writer

TensorBoardWriter::TensorBoardWriter(const std::string& dir, size_t queue_size) : capacity_(std::max<size_t>(queue_size, 1)) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) fail("TensorBoard event directory {}: cannot create it: {}", dir, ec.message());
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  const double t = now_seconds();
  path_ = fmt::format("{}/events.out.tfevents.{:010d}.{}.{}.{}", dir, static_cast<int64_t>(t), host,
                      static_cast<int>(::getpid()), g_file_counter++);
  file_ = std::fopen(path_.c_str(), "wb");
  if (!file_) fail("TensorBoard event directory {}: cannot create {}: {}", dir, path_, std::strerror(errno));
  const std::string first = frame_tfrecord(encode_file_version_event(t));
  if (std::fwrite(first.data(), 1, first.size(), file_) != first.size() || std::fflush(file_) != 0) {
    std::fclose(file_);
    fail("cannot write TensorBoard event file {}: {}", path_, std::strerror(errno));
  }
  thread_ = std::thread([this] { run(); });
}

TensorBoardWriter::~TensorBoardWriter() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  not_empty_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (error_) {
    try {
      std::rethrow_exception(error_);
    } catch (const std::exception& e) {
      log::error(fmt::format("TensorBoard events were lost: {}", e.what()));
    }
  }
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  add_scalar(tag, value, step, now_seconds());
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step, double wall_time) {
  std::string record = frame_tfrecord(encode_scalar_event(wall_time, step, tag, static_cast<float>(value)));
  std::unique_lock<std::mutex> lock(mutex_);
  if (error_) std::rethrow_exception(error_);
  not_full_.wait(lock, [&] { return queue_.size() < capacity_ || error_; });
  if (error_) std::rethrow_exception(error_);
  queue_.push_back(std::move(record));
  not_empty_.notify_one();
}

void TensorBoardWriter::flush() {
  std::unique_lock<std::mutex> lock(mutex_);
  drained_.wait(lock, [&] { return (queue_.empty() && in_flight_ == 0) || error_; });
  if (error_) std::rethrow_exception(error_);
}

void TensorBoardWriter::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    not_empty_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty() && stop_) break;
    std::deque<std::string> batch;
    batch.swap(queue_);
    in_flight_ = batch.size();
    not_full_.notify_all();
    lock.unlock();
    std::exception_ptr err;
    for (const std::string& r : batch) {
      if (std::fwrite(r.data(), 1, r.size(), file_) != r.size()) {
        err = std::make_exception_ptr(Error(fmt::format("writing TensorBoard event file {}: {}", path_, std::strerror(errno))));
        break;
      }
    }
    // Flush whenever the queue runs dry, so that TensorBoard sees events promptly.
    if (!err && std::fflush(file_) != 0)
      err = std::make_exception_ptr(Error(fmt::format("writing TensorBoard event file {}: {}", path_, std::strerror(errno))));
    lock.lock();
    in_flight_ = 0;
    if (err && !error_) error_ = err;
    not_full_.notify_all();
    drained_.notify_all();
    if (error_) break;
  }
  drained_.notify_all();
}

// ---------------------------------------------------------------------------------------------
// Reporter

TensorBoardReporter::TensorBoardReporter(const LoggingConfig& logging, bool skip_train, int world_size)
    : cfg_(logging),
      skip_train_(skip_train),
      world_size_(world_size),
      writer_(*logging.tensorboard_dir, static_cast<size_t>(std::max(1, logging.tensorboard_queue_size))) {}

void TensorBoardReporter::both(const std::string& tag, double value, int64_t iteration, int64_t samples) {
  writer_.add_scalar(tag, value, iteration);
  writer_.add_scalar(tag + " vs samples", value, samples);
}

void TensorBoardReporter::on_iteration(const IterationStats& stats) {
  const IterationStats s = with_logging_flags(stats, cfg_);
  const int64_t it = s.iteration, samples = s.consumed_samples;
  if (cfg_.tensorboard_log_interval > 0 && it % cfg_.tensorboard_log_interval == 0) {
    if (s.learning_rate) both("learning-rate", *s.learning_rate, it, samples);
    if (s.decoupled_learning_rate) writer_.add_scalar("decoupled-learning-rate", *s.decoupled_learning_rate, it);
    if (s.skipped_samples > 0) writer_.add_scalar("skipped-train-samples", static_cast<double>(s.skipped_samples), it);
    both("batch-size", static_cast<double>(s.global_batch_size), it, samples);
    const auto& losses = s.iteration_losses.empty() ? s.losses : s.iteration_losses;
    for (const auto& [key, value] : losses) both(key, value, it, samples);
    if (cfg_.log_loss_scale_to_tensorboard) both("loss-scale", s.loss_scale, it, samples);
    if (cfg_.log_world_size_to_tensorboard) both("world-size", static_cast<double>(world_size_), it, samples);
    if (s.grad_norm) both("grad-norm", *s.grad_norm, it, samples);
    if (s.num_zeros) both("num-zeros", static_cast<double>(*s.num_zeros), it, samples);
    if (s.params_norm) both("params-norm", *s.params_norm, it, samples);
    if (cfg_.log_memory_to_tensorboard) {
      if (s.memory_reserved_bytes) writer_.add_scalar("mem-reserved-bytes", *s.memory_reserved_bytes, it);
      if (s.memory_allocated_bytes) writer_.add_scalar("mem-allocated-bytes", *s.memory_allocated_bytes, it);
      if (s.memory_peak_bytes) writer_.add_scalar("mem-max-allocated-bytes", *s.memory_peak_bytes, it);
      if (s.memory_allocated_count) writer_.add_scalar("mem-allocated-count", *s.memory_allocated_count, it);
    }
  }
  // Megatron's MoE and MTP trackers write every iteration, outside the TensorBoard interval.
  for (const auto& [tag, value] : s.tracker_scalars) writer_.add_scalar(tag, value, it);
  // Megatron writes these at log lines whenever there is a writer (not only with timers).
  if (s.interval_end && s.energy_per_gpu_j) writer_.add_scalar("iter-energy/gpu", *s.energy_per_gpu_j, it);
  if (s.interval_end && s.power_per_gpu_w) writer_.add_scalar("power/gpu", *s.power_per_gpu_w, it);
  if (s.interval_end && cfg_.log_timers_to_tensorboard) {
    if (!s.is_first_iteration) writer_.add_scalar("iteration-time", s.elapsed_ms_per_iteration / 1000.0, it);
    if (s.tflops_per_gpu) writer_.add_scalar("throughput", *s.tflops_per_gpu, it);
    // Timers.write: the max over ranks, normalized by the log interval, in seconds.
    for (const auto& [name, mm] : s.timers_ms)
      if (mm.second > 0) writer_.add_scalar(name + "-time", mm.second / 1000.0, it);
  }
}

void TensorBoardReporter::on_eval(const EvalStats& e) {
  if (e.after_training && skip_train_) return;
  for (const auto& [key, value] : e.losses) {
    both(key + " validation", value, e.iteration, e.consumed_train_samples);
    if (cfg_.log_validation_ppl_to_tensorboard)
      both(key + " validation ppl", std::exp(std::min(20.0, value)), e.iteration, e.consumed_train_samples);
  }
}

}  // namespace mt

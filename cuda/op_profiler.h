// OpProfiler: GPU time per backend op, for finding where a training step spends its time.
// Off unless MEGATRAIN_PROFILE_OPS=<n> is set: then, after the n-th optimizer step (n warm-up
// iterations), every op of CudaBackend is bracketed by two CUDA events on the stream, and when the
// backend is destroyed a table goes to stderr: per op and shape, calls, total and mean GPU time.
// Events only mark the stream (no synchronization), except that every few thousand ops the
// profiler waits for the stream to read and recycle its events. For measurements, not production.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace mt::cuda {

class OpProfiler {
 public:
  // Reads MEGATRAIN_PROFILE_OPS; disabled (and free) without it.
  explicit OpProfiler(cudaStream_t stream);
  ~OpProfiler();
  OpProfiler(const OpProfiler&) = delete;
  OpProfiler& operator=(const OpProfiler&) = delete;

  bool enabled() const { return enabled_; }
  bool active() const { return enabled_ && steps_ >= skip_steps_; }
  void step_done() { ++steps_; }  // called once per optimizer step

  class Scope {
   public:
    Scope() = default;
    Scope(OpProfiler* p, std::string label);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    OpProfiler* p_ = nullptr;
    int index_ = -1;
  };
  Scope scope(std::string label) { return active() ? Scope(this, std::move(label)) : Scope(); }

  // The table (empty when nothing was profiled). Waits for the stream.
  std::string report();

 private:
  struct Pending {
    std::string label;
    cudaEvent_t start = nullptr, stop = nullptr;
    std::chrono::steady_clock::time_point host_start;
    double host_us = 0;  // the host's time inside the op (its launches and bookkeeping)
  };
  struct Total {
    double ms = 0;        // GPU time between the op's events
    long long calls = 0;
    double host_us = 0;   // host time inside the op
    double gap_ms = 0;    // GPU time since the previous op's end (idle, or unprofiled work)
  };
  int begin(std::string label);
  void end(int index);
  void drain();
  cudaEvent_t event();

  cudaStream_t stream_;
  bool enabled_ = false;
  int skip_steps_ = 0;
  int steps_ = 0;
  std::vector<Pending> pending_;
  std::vector<cudaEvent_t> free_;
  std::map<std::string, Total> totals_;
};

}  // namespace mt::cuda

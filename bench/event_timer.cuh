// What the single-GPU kernel benchmarks (bench_fp8_gemm, bench_fp8_cast) share: the `--reps N
// --only SUBSTRING` command line, the GPU check, and the event timer.
//
// Timing method: 5 warm-up calls, then `reps` calls queued behind a GPU-side sleep (so that the host
// has queued every call before the first one runs and launch gaps do not count), CUDA events
// between consecutive calls, median reported.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cuda/cuda_check.h"

namespace mt::bench {

struct KernelBenchArgs {
  int reps = 20;
  std::string only;  // run only the cases whose name contains this
};

// Parses `--reps N --only SUBSTRING`; on anything else (or N < 1) prints the usage of `program` and
// returns false.
inline bool parse_kernel_bench_args(int argc, char** argv, const char* program, KernelBenchArgs& args) {
  bool ok = true;
  for (int i = 1; ok && i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) args.reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) args.only = argv[++i];
    else ok = false;
  }
  if (!ok || args.reps <= 0) std::fprintf(stderr, "usage: %s [--reps N (N >= 1)] [--only SUBSTRING]\n", program);
  return ok && args.reps > 0;
}

// False (after a SKIPPED line, exit status 77 by convention) where no CUDA GPU is visible.
inline bool have_gpu() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("SKIPPED: no CUDA GPU visible\n");
    return false;
  }
  return true;
}

namespace detail {
static __global__ void gpu_sleep_kernel(long long ns) {
  const long long start = clock64();
  while (clock64() - start < ns * 2) {
  }
}
}  // namespace detail

class EventTimer {
 public:
  EventTimer(cudaStream_t s, int reps) : s_(s), reps_(reps), events_(static_cast<size_t>(reps) + 1) {
    for (auto& e : events_) MT_CUDA_CHECK(cudaEventCreate(&e));
  }
  ~EventTimer() {
    for (auto& e : events_) cudaEventDestroy(e);
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  // Median microseconds of one call of f (f enqueues its work on the timer's stream).
  double median_us(const std::function<void()>& f) {
    for (int i = 0; i < 5; ++i) f();
    detail::gpu_sleep_kernel<<<1, 1, 0, s_>>>(5'000'000);  // 5 ms: the host queues every call meanwhile
    MT_CUDA_CHECK(cudaEventRecord(events_[0], s_));
    for (int i = 0; i < reps_; ++i) {
      f();
      MT_CUDA_CHECK(cudaEventRecord(events_[i + 1], s_));
    }
    MT_CUDA_CHECK(cudaEventSynchronize(events_.back()));
    std::vector<float> ms(static_cast<size_t>(reps_));
    for (int i = 0; i < reps_; ++i) MT_CUDA_CHECK(cudaEventElapsedTime(&ms[i], events_[i], events_[i + 1]));
    std::sort(ms.begin(), ms.end());
    return 1000.0 * ms[ms.size() / 2];
  }

 private:
  cudaStream_t s_;
  int reps_;
  std::vector<cudaEvent_t> events_;
};

}  // namespace mt::bench

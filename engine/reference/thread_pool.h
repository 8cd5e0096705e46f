// ThreadPool: a few worker threads for the reference backend's row loops.
//
// parallel_for splits [0, n) into one contiguous block per thread. Every op that uses it computes
// each output element from its own inputs only (reductions run over a fixed order inside one
// element), so results never depend on the number of threads.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mt::reference {

class ThreadPool {
 public:
  // num_threads <= 0: the hardware concurrency (at least 1).
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }  // workers + the caller

  // Calls fn(begin, end, thread_index) on disjoint blocks covering [0, n). Blocks smaller than
  // min_block run on fewer threads; small loops run inline on the caller.
  void parallel_for(int64_t n, int64_t min_block,
                    const std::function<void(int64_t, int64_t, int)>& fn);

 private:
  void worker_loop(int index);

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(int64_t, int64_t, int)>* job_ = nullptr;
  int64_t job_n_ = 0;
  int job_threads_ = 0;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

}  // namespace mt::reference

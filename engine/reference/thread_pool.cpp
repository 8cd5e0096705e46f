#include "engine/reference/thread_pool.h"

#include <algorithm>

namespace mt::reference {

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

static void block_range(int64_t n, int parts, int index, int64_t& begin, int64_t& end) {
  const int64_t base = n / parts, extra = n % parts;
  begin = index * base + std::min<int64_t>(index, extra);
  end = begin + base + (index < extra ? 1 : 0);
}

void ThreadPool::parallel_for(int64_t n, int64_t min_block,
                              const std::function<void(int64_t, int64_t, int)>& fn) {
  if (n <= 0) return;
  const int64_t by_size = std::max<int64_t>(1, n / std::max<int64_t>(1, min_block));
  const int threads = static_cast<int>(std::min<int64_t>(size(), by_size));
  if (threads <= 1) {
    fn(0, n, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &fn;
    job_n_ = n;
    job_threads_ = threads;
    pending_ = threads - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  int64_t begin, end;
  block_range(n, threads, 0, begin, end);
  fn(begin, end, 0);
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [this] { return pending_ == 0; });
  job_ = nullptr;
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t, int)>* job;
    int64_t n;
    int threads;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      n = job_n_;
      threads = job_threads_;
    }
    if (index < threads) {
      int64_t begin, end;
      block_range(n, threads, index, begin, end);
      (*job)(begin, end, index);
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

}  // namespace mt::reference

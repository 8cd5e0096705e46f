#include "cuda/op_profiler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>

#include "cuda/cuda_check.h"

namespace mt::cuda {

namespace {
constexpr size_t kMaxPending = 8192;  // ops between waits for the stream
}

OpProfiler::OpProfiler(cudaStream_t stream) : stream_(stream) {
  if (const char* v = std::getenv("MEGATRAIN_PROFILE_OPS")) {
    enabled_ = true;
    skip_steps_ = std::max(0, std::atoi(v));
  }
}

OpProfiler::~OpProfiler() {
  for (auto& p : pending_) {
    if (p.start) cudaEventDestroy(p.start);
    if (p.stop) cudaEventDestroy(p.stop);
  }
  for (cudaEvent_t e : free_) cudaEventDestroy(e);
}

cudaEvent_t OpProfiler::event() {
  if (!free_.empty()) {
    cudaEvent_t e = free_.back();
    free_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  MT_CUDA_CHECK(cudaEventCreate(&e));
  return e;
}

int OpProfiler::begin(std::string label) {
  if (pending_.size() >= kMaxPending) drain();
  Pending p;
  p.label = std::move(label);
  p.start = event();
  p.stop = event();
  MT_CUDA_CHECK(cudaEventRecord(p.start, stream_));
  p.host_start = std::chrono::steady_clock::now();
  pending_.push_back(std::move(p));
  return static_cast<int>(pending_.size()) - 1;
}

void OpProfiler::end(int index) {
  Pending& p = pending_[static_cast<size_t>(index)];
  p.host_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - p.host_start).count();
  MT_CUDA_CHECK(cudaEventRecord(p.stop, stream_));
}

void OpProfiler::drain() {
  MT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (size_t i = 0; i < pending_.size(); ++i) {
    const Pending& p = pending_[i];
    float ms = 0, gap = 0;
    MT_CUDA_CHECK(cudaEventElapsedTime(&ms, p.start, p.stop));
    if (i > 0) MT_CUDA_CHECK(cudaEventElapsedTime(&gap, pending_[i - 1].stop, p.start));
    Total& t = totals_[p.label];
    t.ms += ms;
    t.calls += 1;
    t.host_us += p.host_us;
    t.gap_ms += gap;
  }
  for (const Pending& p : pending_) {
    free_.push_back(p.start);
    free_.push_back(p.stop);
  }
  pending_.clear();
}

OpProfiler::Scope::Scope(OpProfiler* p, std::string label) : p_(p), index_(p->begin(std::move(label))) {}
OpProfiler::Scope::~Scope() {
  if (p_) p_->end(index_);
}

std::string OpProfiler::report() {
  if (!enabled_) return "";
  drain();
  if (totals_.empty()) return "";
  std::vector<std::pair<std::string, Total>> rows(totals_.begin(), totals_.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
  double all = 0, gaps = 0;
  for (const auto& r : rows) all += r.second.ms, gaps += r.second.gap_ms;
  const double steps = std::max(1, steps_ - skip_steps_);
  std::string s = fmt::format("[megatrain] op profile: {} steps after {} warm-up; GPU ms per step by op (shape)\n",
                              steps_ - skip_steps_, skip_steps_);
  s += fmt::format("  {:>9} {:>6} {:>9} {:>7} {:>12} {:>12}  {}\n", "ms/step", "%", "us/call", "calls",
                   "host us/call", "gap us/call", "op");
  for (const auto& [label, t] : rows)
    s += fmt::format("  {:9.3f} {:6.2f} {:9.1f} {:7} {:12.1f} {:12.1f}  {}\n", t.ms / steps, 100.0 * t.ms / all,
                     1000.0 * t.ms / t.calls, t.calls, t.host_us / t.calls, 1000.0 * t.gap_ms / t.calls, label);
  s += fmt::format("  {:9.3f} total of the ops, {:.3f} ms per step between them\n", all / steps, gaps / steps);
  return s;
}

}  // namespace mt::cuda

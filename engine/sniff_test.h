// --gpu-sniff-test-interval N (megatrain's, beside Megatron-LM's straggler detector): every N
// iterations, outside the timed interval, every rank runs three short probes: a square GEMM in the
// compute dtype (4096 on a GPU, 64 on the CPU; ten times), an all-gather over the world and a ring
// exchange (send to the next rank, receive from the previous one) of 1M elements (4096 on the CPU),
// each timed on the host around a synchronize after a barrier. The times are gathered to every rank
// and rank 0 logs, per probe, the mean and standard deviation over the ranks and the ranks slower
// than one standard deviation above the mean: a slow GPU or link before it slows a whole job. The
// probes' buffers are allocated at set-up.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mt {

class Backend;
struct Config;
struct ParallelState;

// Per rank: GEMM, all-gather, send/receive milliseconds.
using SniffTimes = std::array<double, 3>;

// Rank 0's report for every rank's times (index = rank): one line per probe.
std::vector<std::string> sniff_lines(int64_t iteration, const std::vector<SniffTimes>& ranks);

class GpuSniffTest {
 public:
  GpuSniffTest(const Config& cfg, ParallelState& ps, Backend& be, DType compute);
  ~GpuSniffTest();
  GpuSniffTest(const GpuSniffTest&) = delete;
  GpuSniffTest& operator=(const GpuSniffTest&) = delete;

  // Every rank: the probes, gathered (returned by rank); rank 0 logs sniff_lines.
  std::vector<SniffTimes> run(int64_t iteration);
  std::function<void()> inside_gemm;  // a test's delay inside the timed GEMMs (MEGATRAIN_DEBUG_FAULT)

 private:
  ParallelState& ps_;
  Backend& be_;
  std::vector<void*> blocks_;
  Tensor a_, b_, c_, send_, recv_, gathered_, mine_, all_;
};

}  // namespace mt

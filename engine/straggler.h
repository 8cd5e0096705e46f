// --log-straggler: Megatron-LM's StragglerDetector (megatron/core/utils.py, reported from
// training.py every --log-interval iterations). Each rank times its forward passes on the device
// (Megatron times the model call of each forward step) and its micro-batch fetches on the host
// (get_batch: the interval's longest), reads its GPU's temperature, power, utilization and SM clock
// (NVML, at the report), and estimates its throughput as Megatron does: the interval's model FLOPs
// per iteration / (forward ms per iteration x 1e9 x world size) / 3 (the forward is a third of the
// work). The samples are gathered to every rank over the world; rank 0 logs Megatron's line with
// the smallest and largest of each and their ranks, and with --straggler-minmax-count N (1 < N <
// world) the N ranks of lowest and highest throughput.
//
// Differences from Megatron-LM: power in watts (Megatron prints torch.cuda.power_draw's milliwatts
// under a W label); no runtime toggle server (--straggler-ctrlr-port), so
// --disable-straggler-on-startup leaves the detector off for the whole run, as Megatron's does
// until someone toggles it. Nothing is allocated after set-up; the forwards' device times are read
// after each step's own read back, so timing adds no synchronization.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mt {

class Backend;
struct Config;
struct ParallelState;

struct GpuReadings {
  double temp_c = 0, power_w = 0, util_pct = 0, clock_mhz = 0;
};

// One rank's figures for a report interval.
struct StragglerSample {
  double time_ms = 0;   // forward passes per iteration (device time)
  double batch_ms = 0;  // the longest micro-batch fetch of the interval (host time)
  double temp_c = 0, power_w = 0, util_pct = 0, clock_mhz = 0;
  double tflops = 0;    // estimated throughput (see above)
};

// Megatron's report lines for every rank's samples (index = rank): the min/max line, and with
// 1 < minmax_count < ranks the bottom and top lines. `now` is the timestamp ("2026-12-03 17:00:00").
std::vector<std::string> straggler_lines(const std::vector<StragglerSample>& ranks, int minmax_count,
                                         const std::string& now);

class StragglerDetector {
 public:
  // forwards_per_step: the most forward passes a step runs on this rank (micro-batches x chunks).
  StragglerDetector(const Config& cfg, ParallelState& ps, Backend& be, int forwards_per_step);
  ~StragglerDetector();
  StragglerDetector(const StragglerDetector&) = delete;
  StragglerDetector& operator=(const StragglerDetector&) = delete;

  bool enabled() const { return enabled_; }
  // Around each training forward pass and each micro-batch fetch.
  void forward_begin();
  void forward_end();
  void batch_begin();
  void batch_end();
  // After the step's read back (its forwards have completed): adds their device times.
  void step_done();
  // Every --log-interval iterations, on every rank: interval_flops is the interval's model FLOPs
  // (all ranks), iterations its length. Gathers every rank's sample (returned, by rank) and rank 0
  // logs Megatron's lines; nothing when disabled or without FLOPs.
  std::vector<StragglerSample> report(double interval_flops, int iterations);

  std::function<GpuReadings()> readings;  // this rank's GPU (none: zeros)
  std::function<void()> inside_forward;   // a test's delay inside the timed forward (MEGATRAIN_DEBUG_FAULT)

 private:
  ParallelState& ps_;
  Backend& be_;
  bool enabled_ = false;
  int minmax_count_ = 1;
  int max_spans_ = 0, spans_ = 0;
  double forward_ms_ = 0, batch_ms_ = 0;
  std::chrono::steady_clock::time_point batch_start_;
  void* buffer_ = nullptr;  // this rank's sample, then every rank's (float32, 8 per rank)
  Tensor mine_, all_;
};

}  // namespace mt

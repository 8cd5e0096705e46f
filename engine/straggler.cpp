#include "engine/straggler.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "core/config.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/backend.h"
#include "parallel/communicator.h"
#include "parallel/parallel_state.h"

namespace mt {

namespace {

constexpr int kFields = 8;  // time, batch, temp, power, util, clock, tflops, (padding)

// Megatron's _ValueWithRank: "{value:.2f}{unit}/{rank}".
std::string with_rank(double v, int rank, const char* unit) { return fmt::format("{:.2f}{}/{}", v, unit, rank); }

}  // namespace

std::vector<std::string> straggler_lines(const std::vector<StragglerSample>& ranks, int minmax_count,
                                         const std::string& now) {
  MT_CHECK(!ranks.empty(), "straggler report without samples");
  const int W = static_cast<int>(ranks.size());
  // Min and max of one field with its rank (the first rank on ties, as Python's min/max).
  auto extremes = [&](double StragglerSample::*f, const char* unit) {
    int lo = 0, hi = 0;
    for (int r = 1; r < W; ++r) {
      if (ranks[static_cast<size_t>(r)].*f < ranks[static_cast<size_t>(lo)].*f) lo = r;
      if (ranks[static_cast<size_t>(r)].*f > ranks[static_cast<size_t>(hi)].*f) hi = r;
    }
    return std::pair{with_rank(ranks[static_cast<size_t>(lo)].*f, lo, unit),
                     with_rank(ranks[static_cast<size_t>(hi)].*f, hi, unit)};
  };
  // Ranks by estimated throughput, ascending (a stable sort: Python's sorted).
  std::vector<int> order(static_cast<size_t>(W));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return ranks[static_cast<size_t>(a)].tflops < ranks[static_cast<size_t>(b)].tflops; });
  const auto [mn_t, mx_t] = extremes(&StragglerSample::time_ms, "ms");
  const auto [mn_p, mx_p] = extremes(&StragglerSample::power_w, "W");
  const auto [mn_c, mx_c] = extremes(&StragglerSample::temp_c, "C");
  const auto [mn_u, mx_u] = extremes(&StragglerSample::util_pct, "%");
  const auto [mn_k, mx_k] = extremes(&StragglerSample::clock_mhz, "MHz");
  const auto [mn_b, mx_b] = extremes(&StragglerSample::batch_ms, "ms");
  const StragglerSample& slow = ranks[static_cast<size_t>(order.front())];
  const StragglerSample& fast = ranks[static_cast<size_t>(order.back())];
  std::vector<std::string> out;
  out.push_back(fmt::format(
      "[{}] | MnRtt/Rnk: {} | MxRtt/Rnk: {} | MnPwr/Rnk: {} | MxPwr/Rnk: {} | MnTmp/Rnk: {} | MxTmp/Rnk: {} | "
      "MnUtl/Rnk: {} | MxUtl/Rnk: {} | MnClk/Rnk: {} | MxClk/Rnk: {} | MnDRtt/Rnk: {} | MxDRtt/Rnk: {} | "
      "MnEtpt/Rnk: {:.2f}TF/{} | MxEtpt/Rnk: {:.2f}TF/{}",
      now, mn_t, mx_t, mn_p, mx_p, mn_c, mx_c, mn_u, mx_u, mn_k, mx_k, mn_b, mx_b, slow.tflops, order.front(),
      fast.tflops, order.back()));
  if (minmax_count > 1 && minmax_count < W) {
    std::string bottom = fmt::format("^^^^ Bottom {} Ranks with lowest  Etpt(TF):", minmax_count);
    std::string top = fmt::format("^^^^ Top    {} Ranks with highest Etpt(TF):", minmax_count);
    for (int i = 0; i < minmax_count; ++i) {
      const int b = order[static_cast<size_t>(i)], t = order[static_cast<size_t>(W - minmax_count + i)];
      bottom += " " + with_rank(ranks[static_cast<size_t>(b)].tflops, b, "TF") + ",";
      top += " " + with_rank(ranks[static_cast<size_t>(t)].tflops, t, "TF") + ",";
    }
    out.push_back(bottom);
    out.push_back(top);
  }
  return out;
}

StragglerDetector::StragglerDetector(const Config& cfg, ParallelState& ps, Backend& be, int forwards_per_step)
    : ps_(ps), be_(be) {
  enabled_ = cfg.logging.log_straggler && !cfg.logging.disable_straggler_on_startup;
  minmax_count_ = cfg.logging.straggler_minmax_count;
  if (!enabled_) return;
  max_spans_ = std::max(1, forwards_per_step);
  be_.reserve_time_marks(2 * max_spans_);
  const int W = ps_.world_size;
  buffer_ = be_.allocate(static_cast<size_t>(kFields) * static_cast<size_t>(W + 1) * sizeof(float));
  mine_ = Tensor(buffer_, DType::f32, be_.device(), {kFields});
  all_ = Tensor(static_cast<char*>(buffer_) + kFields * sizeof(float), DType::f32, be_.device(), {int64_t{kFields} * W});
}

StragglerDetector::~StragglerDetector() {
  if (buffer_) be_.deallocate(buffer_);
}

void StragglerDetector::forward_begin() {
  if (!enabled_) return;
  MT_CHECK(spans_ < max_spans_, "more than {} timed forward passes in a step", max_spans_);
  be_.record_time_mark(2 * spans_);
}

void StragglerDetector::forward_end() {
  if (!enabled_) return;
  if (inside_forward) inside_forward();
  be_.record_time_mark(2 * spans_ + 1);
  ++spans_;
}

void StragglerDetector::batch_begin() {
  if (enabled_) batch_start_ = std::chrono::steady_clock::now();
}

void StragglerDetector::batch_end() {
  if (!enabled_) return;
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - batch_start_).count();
  batch_ms_ = std::max(batch_ms_, ms);  // (Megatron: the longest, data loading prefetches)
}

void StragglerDetector::step_done() {
  if (!enabled_) return;
  for (int i = 0; i < spans_; ++i) forward_ms_ += be_.time_between_marks_ms(2 * i, 2 * i + 1);
  spans_ = 0;
}

std::vector<StragglerSample> StragglerDetector::report(double interval_flops, int iterations) {
  if (!enabled_ || interval_flops <= 0 || iterations <= 0) return {};
  StragglerSample s;
  s.time_ms = forward_ms_ / iterations;
  s.batch_ms = batch_ms_;
  if (readings) {
    const GpuReadings g = readings();
    s.temp_c = g.temp_c;
    s.power_w = g.power_w;
    s.util_pct = g.util_pct;
    s.clock_mhz = g.clock_mhz;
  }
  const int W = ps_.world_size;
  // Megatron: per-iteration FLOPs / (ms x 1e9 x world) is this rank's TFLOP/s; / 3 for forward-only timing.
  s.tflops = s.time_ms > 0 ? interval_flops / iterations / (s.time_ms * 1e9 * W) / 3.0 : 0.0;
  forward_ms_ = batch_ms_ = 0;
  const float mine[kFields] = {static_cast<float>(s.time_ms), static_cast<float>(s.batch_ms),
                               static_cast<float>(s.temp_c),  static_cast<float>(s.power_w),
                               static_cast<float>(s.util_pct), static_cast<float>(s.clock_mhz),
                               static_cast<float>(s.tflops),  0.0f};
  be_.copy_from_host(mine_, mine);
  std::vector<float> all(static_cast<size_t>(kFields) * static_cast<size_t>(W));
  if (W > 1) {
    ps_.world->all_gather(all_, mine_);
    be_.copy_to_host(all.data(), all_);
  } else {
    std::copy(mine, mine + kFields, all.begin());
  }
  std::vector<StragglerSample> out(static_cast<size_t>(W));
  for (int r = 0; r < W; ++r) {
    const float* f = all.data() + static_cast<size_t>(r) * kFields;
    out[static_cast<size_t>(r)] = StragglerSample{f[0], f[1], f[2], f[3], f[4], f[5], f[6]};
  }
  if (ps_.rank == 0) {
    const auto t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
    std::tm tm{};
    localtime_r(&t, &tm);
    char now[32];
    std::strftime(now, sizeof(now), "%Y-%m-%d %H:%M:%S", &tm);
    for (const std::string& line : straggler_lines(out, minmax_count_, now)) log::info("{}", line);
  }
  return out;
}

}  // namespace mt

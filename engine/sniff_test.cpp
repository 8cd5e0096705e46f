#include "engine/sniff_test.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>

#include "core/config.h"
#include "core/log.h"
#include "engine/backend.h"
#include "parallel/communicator.h"
#include "parallel/parallel_state.h"

namespace mt {

std::vector<std::string> sniff_lines(int64_t iteration, const std::vector<SniffTimes>& ranks) {
  static const char* const kProbes[] = {"GEMM", "all-gather", "send/receive"};
  std::vector<std::string> out;
  const double n = static_cast<double>(ranks.size());
  for (size_t k = 0; k < 3; ++k) {
    double mean = 0, var = 0;
    for (const SniffTimes& t : ranks) mean += t[k] / n;
    for (const SniffTimes& t : ranks) var += (t[k] - mean) * (t[k] - mean) / n;
    const double sd = std::sqrt(var);
    std::string slow;
    for (size_t r = 0; r < ranks.size(); ++r)
      if (ranks[r][k] > mean + sd && sd > 0) slow += fmt::format("{}{} ({:.3f} ms)", slow.empty() ? "" : ", ", r, ranks[r][k]);
    out.push_back(fmt::format("gpu sniff test at iteration {}: {} mean {:.3f} ms, std {:.3f} ms over {} ranks; slower "
                              "than mean + std: {}",
                              iteration, kProbes[k], mean, sd, ranks.size(), slow.empty() ? "none" : slow));
  }
  return out;
}

GpuSniffTest::GpuSniffTest(const Config& cfg, ParallelState& ps, Backend& be, DType compute) : ps_(ps), be_(be) {
  const bool gpu = cfg.train.device == DeviceKind::gpu;
  const int64_t d = gpu ? 4096 : 64, m = gpu ? int64_t{1} << 20 : 4096;
  const int64_t W = ps_.world_size;
  auto take = [&](DType t, int64_t n) {
    void* p = be_.allocate(static_cast<size_t>(n) * dtype_size(t));
    blocks_.push_back(p);
    return Tensor(p, t, be_.device(), {n});
  };
  a_ = take(compute, d * d).view({d, d});
  b_ = take(compute, d * d).view({d, d});
  c_ = take(compute, d * d).view({d, d});
  send_ = take(compute, m);
  recv_ = take(compute, m);
  gathered_ = take(compute, m * W);
  mine_ = take(DType::f32, 4);
  all_ = take(DType::f32, 4 * W);
  be_.fill(a_, 0.01);
  be_.fill(b_, 0.02);
  be_.fill(send_, 1.0);
}

GpuSniffTest::~GpuSniffTest() {
  for (void* p : blocks_) be_.deallocate(p);
}

std::vector<SniffTimes> GpuSniffTest::run(int64_t iteration) {
  using Clock = std::chrono::steady_clock;
  Communicator& world = *ps_.world;
  const int W = ps_.world_size, r = ps_.rank;
  // One probe: every rank starts together, then the host time to the probe's end on the device.
  auto timed = [&](const std::function<void()>& probe) {
    be_.synchronize();
    if (W > 1) world.barrier();
    const auto t0 = Clock::now();
    probe();
    be_.synchronize();
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  };
  SniffTimes t{};
  t[0] = timed([&] {
    for (int i = 0; i < 10; ++i) be_.linear_forward(c_, a_, b_, Tensor(), Activation::none, Tensor());
    if (inside_gemm) inside_gemm();
  });
  t[1] = W > 1 ? timed([&] { world.all_gather(gathered_, send_); }) : 0.0;
  t[2] = W > 1 ? timed([&] {
    world.group_start();
    world.send(send_, (r + 1) % W);
    world.recv(recv_, (r + W - 1) % W);
    world.group_end();
  })
               : 0.0;
  const float mine[4] = {static_cast<float>(t[0]), static_cast<float>(t[1]), static_cast<float>(t[2]), 0.0f};
  be_.copy_from_host(mine_, mine);
  std::vector<float> all(static_cast<size_t>(4 * W));
  if (W > 1) {
    world.all_gather(all_, mine_);
    be_.copy_to_host(all.data(), all_);
  } else {
    std::copy(mine, mine + 4, all.begin());
  }
  std::vector<SniffTimes> out(static_cast<size_t>(W));
  for (int k = 0; k < W; ++k)
    out[static_cast<size_t>(k)] = {all[static_cast<size_t>(4 * k)], all[static_cast<size_t>(4 * k + 1)],
                                   all[static_cast<size_t>(4 * k + 2)]};
  if (r == 0)
    for (const std::string& line : sniff_lines(iteration, out)) log::info("{}", line);
  return out;
}

}  // namespace mt

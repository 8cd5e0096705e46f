// --log-energy's meter on a real GPU: NVML's counter for the device the tests run on rises while
// the GPU computes, at a power an H100/H200-class board can draw.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>

#include "app/energy_meter.h"
#include "gpu_test_util.h"

using namespace mt;
using namespace mt::gputest;

TEST_CASE("EnergyMeter: the GPU's energy counter rises at a plausible power under load", "[gpu][energy]") {
  char bus_id[64] = {};
  REQUIRE(cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, 0) == cudaSuccess);
  EnergyMeter meter(bus_id);
  const int64_t n = 4096;
  Buf x(dev(), DType::bf16, {n, n}), w(dev(), DType::bf16, {n, n}), y(dev(), DType::bf16, {n, n});
  dev().fill(x.t, 0.01);
  dev().fill(w.t, 0.02);
  dev().synchronize();
  const double e0 = meter.joules();
  const auto t0 = std::chrono::steady_clock::now();
  double seconds = 0;
  while (seconds < 2.0) {  // NVML's counter moves in steps of tens of milliseconds
    for (int i = 0; i < 50; ++i) dev().linear_forward(y.t, x.t, w.t, Tensor(), Activation::none, Tensor());
    dev().synchronize();
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const double joules = meter.joules() - e0;
  const double watts = joules / seconds;
  INFO("GPU " << bus_id << ": " << joules << " J over " << seconds << " s = " << watts << " W");
  CHECK(joules > 0);
  CHECK(watts > 50.0);    // a busy H100/H200 draws hundreds of watts
  CHECK(watts < 1500.0);  // and no board draws this much
  CHECK_THROWS_WITH(EnergyMeter("0000:ff:1f.7"), Catch::Contains("NVML does not know the GPU"));
  // What one read costs the training loop (it reads once per step): printed for bench/RESULTS.md.
  const auto r0 = std::chrono::steady_clock::now();
  double sink = 0;
  for (int i = 0; i < 200; ++i) sink += meter.joules();
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - r0).count() / 200;
  std::printf("EnergyMeter: %.1f W under load; one read %.1f us\n", watts, us);
  CHECK(sink > 0);
}

// Collective bandwidth through megatrain's NCCL communicator (the path training uses: TCP
// rendezvous, non-blocking init, watchdog tracking), one process per GPU.
//
// Usage: nccl_bandwidth [--nproc N] [--min-mb 1] [--max-mb 1024] [--iters 20]
//   Without RANK in the environment it starts N workers (default 2) through the workstation
//   launcher; with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT it is one worker.
// Prints, on rank 0, one row per (operation, size): time per call and nccl-tests' bandwidths
//   algbw = bytes / time   (bytes = the full buffer: all-reduce data, reduce-scatter input,
//                           all-gather output)
//   busbw = algbw * 2(n-1)/n for all-reduce, algbw * (n-1)/n for reduce-scatter and all-gather
// Times are the slowest rank's mean over the timed iterations (after 5 warm-up calls).

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "parallel/gpu_worker_program.h"
#include "parallel/nccl_communicator.h"
#include "parallel/tcp_rendezvous.h"

using namespace mt;

namespace {

void cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("{}: {}", what, cudaGetErrorString(e));
}

struct Options {
  int nproc = 2;
  int64_t min_mb = 1, max_mb = 1024;
  int iters = 20;
};

int worker(const Options& o) {
  const WorkerPlace place = worker_place();
  const int rank = place.rank, n = place.world_size, device = place.device;
  try {
    cuda(cudaSetDevice(device), "cudaSetDevice");
    cudaStream_t stream;
    cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    const Millis timeout = distributed_timeout(10);
    TcpRendezvous rv(place.master_addr, place.master_port, rank, n, timeout);
    auto world = make_nccl_world_communicator(rv, device, stream, timeout);

    const int64_t max_bytes = o.max_mb << 20;
    void *a = nullptr, *b = nullptr;
    cuda(cudaMalloc(&a, max_bytes), "cudaMalloc");
    cuda(cudaMalloc(&b, max_bytes), "cudaMalloc");
    cuda(cudaMemset(a, 0, max_bytes), "cudaMemset");
    cuda(cudaMemset(b, 0, max_bytes), "cudaMemset");
    cudaEvent_t start, stop;
    cuda(cudaEventCreate(&start), "cudaEventCreate");
    cuda(cudaEventCreate(&stop), "cudaEventCreate");

    struct Case {
      const char* op;
      DType dtype;
    };
    const Case cases[] = {{"all_reduce", DType::f32}, {"all_reduce", DType::bf16}, {"reduce_scatter", DType::f32},
                          {"all_gather", DType::bf16}};
    if (rank == 0) {
      std::printf("NCCL collectives over %d ranks (megatrain communicator), %d timed iterations\n", n, o.iters);
      std::printf("%-15s %-9s %12s %12s %12s %12s %12s\n", "operation", "dtype", "bytes", "time_us", "algbw_GB/s",
                  "busbw_GB/s", "host_us");
    }
    for (const Case& c : cases) {
      for (int64_t bytes = o.min_mb << 20; bytes <= max_bytes; bytes *= 2) {
        const int64_t elems = bytes / static_cast<int64_t>(dtype_size(c.dtype));
        const int64_t shard = elems / n;
        auto run = [&] {
          Tensor full(a, c.dtype, Device::cuda, {shard * n});
          Tensor part(b, c.dtype, Device::cuda, {shard});
          if (std::strcmp(c.op, "all_reduce") == 0) world->all_reduce(full);
          else if (std::strcmp(c.op, "reduce_scatter") == 0) world->reduce_scatter(part, full);
          else world->all_gather(full, part);
        };
        for (int i = 0; i < 5; ++i) run();
        cuda(cudaEventRecord(start, stream), "cudaEventRecord");
        const int iters = bytes >= (int64_t{256} << 20) ? std::max(5, o.iters / 4) : o.iters;
        // host_us: how long the host takes to enqueue one collective (the GPU time is time_us).
        const auto host_start = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) run();
        const double host_us =
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - host_start).count() / iters;
        cuda(cudaEventRecord(stop, stream), "cudaEventRecord");
        cuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
        float ms = 0;
        cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
        double us = 1000.0 * ms / iters;
        for (const auto& t : rv.all_gather(fmt::format("{}", us))) us = std::max(us, std::atof(t.c_str()));
        const double moved = static_cast<double>(shard * n) * dtype_size(c.dtype);
        const double algbw = moved / (us * 1e-6) / 1e9;
        const double factor = std::strcmp(c.op, "all_reduce") == 0 ? 2.0 * (n - 1) / n : double(n - 1) / n;
        if (rank == 0)
          std::printf("%-15s %-9s %12.0f %12.1f %12.2f %12.2f %12.1f\n", c.op, std::string(dtype_name(c.dtype)).c_str(),
                      moved, us, algbw, algbw * factor, host_us);
      }
    }
    std::fflush(stdout);
    world.reset();
    cudaFree(a);
    cudaFree(b);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "[rank %d] error: %s\n", rank, e.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const long v = std::atol(argv[i + 1]);
    if (k == "--nproc") o.nproc = static_cast<int>(v);
    else if (k == "--min-mb") o.min_mb = v;
    else if (k == "--max-mb") o.max_mb = v;
    else if (k == "--iters") o.iters = static_cast<int>(v);
    else {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
  }
  if (is_worker()) return worker(o);
  return launch_self("nccl_bandwidth", o.nproc, argc, argv);
}

// Can a tensor-parallel collective run beside a GEMM? Two ranks, one GPU each, raw NCCL.
//
// Usage: bench_tp_overlap [--mb 64] [--iters 20]   (starts 2 workers through the workstation launcher)
//
// Times, on each rank (rank 0 prints, the slowest rank's figures):
//   all-gather (bf16, --mb MiB gathered) and reduce-scatter (bf16, --mb MiB in) alone, NCCL's kernels;
//   the all-gather through NCCL's copy engines (a communicator with NCCL_CTA_POLICY_ZERO and buffers
//     from ncclMemAlloc registered as a symmetric window: NCCL 2.28 then moves all-gathers with the
//     copy engines and no SMs);
//   a GEMM alone (TP=2 gpt-1.3b fc1 input gradient: 16384 x 2048 x 4096, bf16), with all SMs and
//     with SM_COUNT_TARGET = SMs - 16 and - 32;
//   each collective launched first on a second stream, then the GEMM: the time until both are done.
// Perfect overlap is max(GEMM, collective); none is their sum.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include "core/error.h"
#include "core/log.h"
#include "cuda/gemm_cublaslt.h"
#include "parallel/distributed_timeout.h"
#include "parallel/gpu_worker_program.h"
#include "parallel/tcp_rendezvous.h"

namespace mt {
namespace {

void cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("{}: {}", what, cudaGetErrorString(e));
}
void nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) fail("{}: {}", what, ncclGetErrorString(r));
}

struct Options {
  int64_t mb = 64;
  int iters = 20;
};

ncclComm_t make_comm(TcpRendezvous& rv, int cta_policy) {
  ncclUniqueId id{};
  std::string blob;
  if (rv.rank() == 0) {
    nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    blob.assign(reinterpret_cast<const char*>(&id), sizeof(id));
  }
  blob = rv.broadcast(blob);
  std::memcpy(&id, blob.data(), sizeof(id));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.CTAPolicy = cta_policy;
  ncclComm_t comm = nullptr;
  nccl(ncclCommInitRankConfig(&comm, rv.world_size(), id, rv.rank(), &config), "ncclCommInitRankConfig");
  return comm;
}

int worker(const Options& o) {
  const WorkerPlace place = worker_place();
  const int rank = place.rank, n = place.world_size, device = place.device;
  try {
    cuda(cudaSetDevice(device), "cudaSetDevice");
    int sms = 0;
    cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
    cudaStream_t compute, comm_stream;
    cuda(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), "cudaStreamCreate");
    cuda(cudaStreamCreateWithFlags(&comm_stream, cudaStreamNonBlocking), "cudaStreamCreate");
    TcpRendezvous rv(place.master_addr, place.master_port, rank, n, distributed_timeout(10));
    ncclComm_t kernel_comm = make_comm(rv, NCCL_CTA_POLICY_DEFAULT);
    ncclComm_t ce_comm = make_comm(rv, NCCL_CTA_POLICY_ZERO);

    const size_t full = static_cast<size_t>(o.mb) << 20, part = full / n;
    void *a = nullptr, *b = nullptr, *sym = nullptr;
    cuda(cudaMalloc(&a, full), "cudaMalloc");
    cuda(cudaMalloc(&b, full), "cudaMalloc");
    cuda(cudaMemset(a, 0, full), "cudaMemset");
    cuda(cudaMemset(b, 0, full), "cudaMemset");
    nccl(ncclMemAlloc(&sym, 2 * full), "ncclMemAlloc");
    cuda(cudaMemset(sym, 0, 2 * full), "cudaMemset");
    ncclWindow_t win = nullptr;
    nccl(ncclCommWindowRegister(ce_comm, sym, 2 * full, &win, NCCL_WIN_COLL_SYMMETRIC), "ncclCommWindowRegister");
    void* sym_part = static_cast<char*>(sym) + full;

    // GEMM: column-major D[m, n] = A[m, k] B[k, n], bf16 in/out (the TP=2 fc1 input gradient's size).
    const int64_t gm = 2048, gn = 16384, gk = 4096;
    void *ga, *gb, *gd;
    cuda(cudaMalloc(&ga, gm * gk * 2), "cudaMalloc");
    cuda(cudaMalloc(&gb, gk * gn * 2), "cudaMalloc");
    cuda(cudaMalloc(&gd, gm * gn * 2), "cudaMalloc");
    cuda(cudaMemset(ga, 0x11, gm * gk * 2), "cudaMemset");
    cuda(cudaMemset(gb, 0x11, gk * gn * 2), "cudaMemset");
    cuda::GemmRunner gemm(compute, size_t{32} << 20);
    cuda::GemmCall call;
    call.m = gm;
    call.n = gn;
    call.k = gk;
    call.a = ga;
    call.lda = gm;
    call.b = gb;
    call.ldb = gk;
    call.d = gd;
    call.ldd = gm;
    auto run_gemm = [&] { gemm.run(call, "bench GEMM"); };

    auto ag_kernel = [&] {
      nccl(ncclAllGather(b, a, part / 2, ncclBfloat16, kernel_comm, comm_stream), "all_gather");
    };
    auto rs_kernel = [&] {
      nccl(ncclReduceScatter(a, b, part / 2, ncclBfloat16, ncclSum, kernel_comm, comm_stream), "reduce_scatter");
    };
    auto ag_ce = [&] {
      nccl(ncclAllGather(sym_part, sym, part / 2, ncclBfloat16, ce_comm, comm_stream), "all_gather (CE)");
    };

    cudaEvent_t start, stop, fork, join;
    cuda(cudaEventCreate(&start), "event");
    cuda(cudaEventCreate(&stop), "event");
    cuda(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming), "event");
    cuda(cudaEventCreateWithFlags(&join, cudaEventDisableTiming), "event");
    // Times `iters` repetitions of: the collective (if any) on comm_stream, then the GEMM (if any)
    // on compute, both after the previous repetition; the slowest rank's mean in microseconds.
    auto time = [&](const std::function<void()>& coll, bool with_gemm, int sm_target) {
      call.alpha = 1.0f;
      gemm.sm_count_target = sm_target;
      auto once = [&] {
        cuda(cudaEventRecord(fork, compute), "record");
        cuda(cudaStreamWaitEvent(comm_stream, fork, 0), "wait");
        if (coll) coll();
        if (with_gemm) run_gemm();
        cuda(cudaEventRecord(join, comm_stream), "record");
        cuda(cudaStreamWaitEvent(compute, join, 0), "wait");
      };
      for (int i = 0; i < 3; ++i) once();
      cuda(cudaStreamSynchronize(compute), "sync");
      rv.barrier();
      cuda(cudaEventRecord(start, compute), "record");
      for (int i = 0; i < o.iters; ++i) once();
      cuda(cudaEventRecord(stop, compute), "record");
      cuda(cudaEventSynchronize(stop), "sync");
      float ms = 0;
      cuda(cudaEventElapsedTime(&ms, start, stop), "elapsed");
      double us = 1000.0 * ms / o.iters;
      for (const auto& t : rv.all_gather(fmt::format("{}", us))) us = std::max(us, std::atof(t.c_str()));
      return us;
    };

    const double gemm_all = time(nullptr, true, 0);
    const double gemm_16 = time(nullptr, true, sms - 16);
    const double gemm_32 = time(nullptr, true, sms - 32);
    const double ag_k = time(ag_kernel, false, 0), rs_k = time(rs_kernel, false, 0), ag_c = time(ag_ce, false, 0);
    struct Row {
      const char* name;
      double coll;
      std::function<void()> f;
    };
    const Row rows[] = {{"all-gather, NCCL kernels", ag_k, ag_kernel},
                        {"reduce-scatter, NCCL kernels", rs_k, rs_kernel},
                        {"all-gather, copy engines", ag_c, ag_ce}};
    if (rank == 0) {
      std::printf("%d ranks, %d SMs, collective %lld MiB bf16, GEMM %lld x %lld x %lld bf16, %d iterations\n", n, sms,
                  static_cast<long long>(o.mb), static_cast<long long>(gn), static_cast<long long>(gm),
                  static_cast<long long>(gk), o.iters);
      std::printf("GEMM alone: all SMs %.1f us, %d SMs %.1f us, %d SMs %.1f us\n", gemm_all, sms - 16, gemm_16,
                  sms - 32, gemm_32);
      std::printf("%-30s %10s %14s %14s %14s\n", "collective", "alone_us", "+GEMM_all_us", "+GEMM_-16_us",
                  "+GEMM_-32_us");
    }
    for (const Row& r : rows) {
      const double t0 = time(r.f, true, 0), t16 = time(r.f, true, sms - 16), t32 = time(r.f, true, sms - 32);
      if (rank == 0) std::printf("%-30s %10.1f %14.1f %14.1f %14.1f\n", r.name, r.coll, t0, t16, t32);
    }
    std::fflush(stdout);
    cuda(cudaDeviceSynchronize(), "sync");
    ncclCommWindowDeregister(ce_comm, win);
    ncclCommDestroy(ce_comm);
    ncclCommDestroy(kernel_comm);
    ncclMemFree(sym);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "[rank %d] error: %s\n", rank, e.what());
    return 1;
  }
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  using namespace mt;  // (after the CUDA headers: mt::log would hide ::log there)
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const long v = std::atol(argv[i + 1]);
    if (k == "--mb") o.mb = v;
    else if (k == "--iters") o.iters = static_cast<int>(v);
    else {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
  }
  if (is_worker()) return worker(o);
  return launch_self("bench_tp_overlap", 2, argc, argv);
}

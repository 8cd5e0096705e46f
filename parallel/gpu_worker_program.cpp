#include "parallel/gpu_worker_program.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "core/log.h"
#include "parallel/launcher.h"

#if MEGATRAIN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace mt {

bool is_worker() { return std::getenv("RANK") != nullptr; }

WorkerPlace worker_place() {
  auto get = [](const char* name) { return std::getenv(name); };
  WorkerPlace p;
  p.rank = std::atoi(get("RANK"));
  p.world_size = get("WORLD_SIZE") ? std::atoi(get("WORLD_SIZE")) : 1;
  p.device = get("LOCAL_RANK") ? std::atoi(get("LOCAL_RANK")) : p.rank;
  p.master_addr = get("MASTER_ADDR") ? get("MASTER_ADDR") : "127.0.0.1";
  if (get("MASTER_PORT")) p.master_port = std::atoi(get("MASTER_PORT"));
  log::set_rank(p.rank, p.world_size);
  return p;
}

int count_gpus_in_child() {
#if MEGATRAIN_WITH_CUDA
  const pid_t pid = fork();
  if (pid == 0) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    _exit(std::min(n, 100));
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 0;
#else
  return 0;
#endif
}

int launch_self(const char* program, int nproc, int argc, char** argv) {
  const int gpus = count_gpus_in_child();
  if (gpus < nproc) {
    std::printf("skipped: %s needs %d GPUs, %d visible\n", program, nproc, gpus);
    return 77;
  }
  WorkerLaunch l;
  l.nproc = nproc;
  l.executable = "/proc/self/exe";
  for (int i = 0; i < argc; ++i) l.argv.emplace_back(argv[i]);
  l.grace = launcher_grace_period();
  try {
    return run_workers(l);
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

}  // namespace mt

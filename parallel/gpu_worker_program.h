// For small multi-process GPU programs (the NCCL tests and benchmarks): one binary that, started
// without RANK in its environment, launches N copies of itself through the workstation launcher
// (parallel/launcher.h), and in each copy reads its place from the launcher's variables.
#pragma once

#include <string>

namespace mt {

// RANK, WORLD_SIZE, LOCAL_RANK (the device; RANK without it), MASTER_ADDR (127.0.0.1) and
// MASTER_PORT (29500) of a worker; also sets the log's rank.
struct WorkerPlace {
  int rank = 0, world_size = 1, device = 0;
  std::string master_addr;
  int master_port = 29500;
};
WorkerPlace worker_place();

// True in a worker (RANK is set).
bool is_worker();

// cudaGetDeviceCount in a forked child: the launcher must fork before CUDA initializes in the parent.
// 0 without CUDA.
int count_gpus_in_child();

// Runs `nproc` workers of this executable with these arguments and returns the launcher's exit
// status; if fewer than `nproc` GPUs are visible, prints "skipped: <program> needs ..." and
// returns 77 (CTest's skip code).
int launch_self(const char* program, int nproc, int argc, char** argv);

}  // namespace mt

// The workstation launcher: a bare `megatrain ...` with no launcher environment and several local
// GPUs (or --nproc-per-node N) becomes the parent of N worker processes, as `torchrun
// --nproc-per-node N` would make them:
//   * each worker is this same executable with the same arguments and RANK, LOCAL_RANK, WORLD_SIZE,
//     LOCAL_WORLD_SIZE, GROUP_RANK=0, MASTER_ADDR=127.0.0.1 and MASTER_PORT (MASTER_PORT from the
//     environment if set, else a port that was free) in its environment, plus NCCL_NVLS_ENABLE=0
//     unless the user set it (see parallel/nccl_communicator.h for why);
//   * SIGINT, SIGTERM and SIGHUP sent to the parent are forwarded to every worker;
//   * if a worker fails (non-zero exit or killed by a signal), the others get SIGTERM, then SIGKILL
//     after a grace period (MEGATRAIN_LAUNCHER_GRACE_SECONDS, default 10), and the parent exits
//     non-zero with a message naming the rank and its exit status or signal;
//   * each worker runs in its own process group and is killed if the parent dies (PR_SET_PDEATHSIG),
//     so no worker outlives the launcher.
// The parent itself does no training and touches no GPU.
//
// Where to call it: in main(), right after the command line is parsed and validated (so that bad
// flags fail once, in the parent) and BEFORE anything that starts threads, initializes CUDA or MPI,
// or opens files other processes share (logs, TensorBoard, checkpoints): fork() must happen in a
// single-threaded process with no CUDA context.
//
//   Config cfg = parse_config(args, env);
//   if (int rc = launch_workers_or_continue(cfg, argc, argv); rc != kContinueInThisProcess) return rc;
//   ... this process is a worker (or the only process): train ...
//
// --device cpu with several ranks is not launched here: the reference backend communicates through
// MPI, so it needs `mpirun -np N megatrain --device cpu ...`; asking for it bare is an error saying so.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace mt {

struct Config;

constexpr int kContinueInThisProcess = -1;

// kContinueInThisProcess when this process should go on (it is a worker, or the run has one
// process); otherwise the exit status main() must return (this process was the launcher).
int launch_workers_or_continue(const Config& cfg, int argc, char** argv);

struct WorkerLaunch {
  int nproc = 1;
  std::string executable;          // path to exec (the launcher uses /proc/self/exe)
  std::vector<std::string> argv;   // argv[0] included
  std::string master_addr = "127.0.0.1";
  int master_port = 0;             // 0: pick a free port
  std::chrono::milliseconds grace{10000};
};

// Starts and supervises the workers; returns the launcher's exit status (0 when all workers exited
// 0; the failed worker's exit status, or 128 + its signal; 128 + the signal that stopped the run).
int run_workers(const WorkerLaunch& launch);

// The grace period between SIGTERM and SIGKILL: MEGATRAIN_LAUNCHER_GRACE_SECONDS or 10 s.
std::chrono::milliseconds launcher_grace_period();

// Sets NCCL_NVLS_ENABLE=0 in this process's environment unless the user set it.
void disable_nvlink_multicast_unless_set();

}  // namespace mt

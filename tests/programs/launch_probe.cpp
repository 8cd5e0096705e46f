// A stand-in for megatrain under the workstation launcher (tests/launcher_test.cpp runs it).
// Usage: launch_probe <nproc> <behaviour> [arguments]
//   ok               every worker prints its launch environment and exits 0
//   crash R          worker R aborts (SIGABRT) after 300 ms; the others sleep
//   exit R CODE      worker R exits with CODE after 300 ms; the others sleep
//   hang             every worker sleeps (the test signals the launcher)
//   ignore-term      every worker ignores SIGTERM and sleeps (the launcher must SIGKILL)
//   cpu              asks for --device cpu with several ranks (must be refused)
// Workers write their pid to $PROBE_DIR/pid.<rank> when PROBE_DIR is set.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include "core/config.h"
#include "core/error.h"
#include "parallel/launcher.h"

using namespace mt;

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: launch_probe <nproc> <behaviour> [args]\n");
    return 2;
  }
  const std::string behaviour = argv[2];
  Config cfg;
  if (const char* r = std::getenv("RANK")) {
    cfg.parallel.launcher = Launcher::torchrun;  // what the CLI reports for a launched worker
    cfg.parallel.rank = std::atoi(r);
    cfg.parallel.world_size = std::atoi(std::getenv("WORLD_SIZE"));
  } else {
    cfg.parallel.launcher = Launcher::workstation;
    cfg.parallel.world_size = std::atoi(argv[1]);
    if (const char* port = std::getenv("MASTER_PORT")) cfg.parallel.master_port = std::atoi(port);  // as the CLI does
  }
  if (behaviour == "cpu") cfg.train.device = DeviceKind::cpu;
  try {
    const int rc = launch_workers_or_continue(cfg, argc, argv);
    if (rc != kContinueInThisProcess) return rc;
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }

  const int rank = cfg.parallel.rank;
  if (const char* dir = std::getenv("PROBE_DIR")) {
    const std::string path = std::string(dir) + "/pid." + std::to_string(rank);
    std::ofstream(path + ".tmp") << getpid() << "\n";
    std::rename((path + ".tmp").c_str(), path.c_str());
  }
  auto env = [](const char* k) { const char* v = std::getenv(k); return v ? v : "-"; };
  if (behaviour == "ok") {
    std::printf("worker RANK=%s LOCAL_RANK=%s WORLD_SIZE=%s LOCAL_WORLD_SIZE=%s MASTER=%s:%s NVLS=%s own_pgid=%d\n",
                env("RANK"), env("LOCAL_RANK"), env("WORLD_SIZE"), env("LOCAL_WORLD_SIZE"), env("MASTER_ADDR"),
                env("MASTER_PORT"), env("NCCL_NVLS_ENABLE"), getpgid(0) == getpid());
    return 0;
  }
  const int target = argc > 3 ? std::atoi(argv[3]) : -1;
  if (behaviour == "ignore-term") signal(SIGTERM, SIG_IGN);
  if (rank == target) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    if (behaviour == "crash") std::abort();
    if (behaviour == "exit") return std::atoi(argv[4]);
  }
  std::this_thread::sleep_for(std::chrono::seconds(60));
  return 0;
}

#include "parallel/launcher.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "core/config.h"
#include "core/error.h"
#include "parallel/tcp_rendezvous.h"

extern char** environ;

namespace mt {
namespace {

using Clock = std::chrono::steady_clock;

void say(const std::string& line) {
  const std::string text = "[launcher] " + line + "\n";
  (void)!::write(STDERR_FILENO, text.data(), text.size());
}

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  const char* desc = strsignal(sig);
  return fmt::format("SIG{} ({})", abbrev ? abbrev : std::to_string(sig).c_str(), desc ? desc : "?");
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return fmt::format("was killed by signal {}{}", signal_name(WTERMSIG(status)),
                       WCOREDUMP(status) ? ", core dumped" : "");
  return fmt::format("ended with wait status {}", status);
}

int exit_code_for(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

struct Worker {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
};

// The environment of worker `rank`: ours, with the launcher's variables replaced.
std::vector<std::string> worker_environment(const WorkerLaunch& l, int rank, int port) {
  const std::vector<std::pair<std::string, std::string>> set = {
      {"RANK", std::to_string(rank)},
      {"LOCAL_RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(l.nproc)},
      {"LOCAL_WORLD_SIZE", std::to_string(l.nproc)},
      {"GROUP_RANK", "0"},
      {"MASTER_ADDR", l.master_addr},
      {"MASTER_PORT", std::to_string(port)},
      {"MEGATRAIN_LAUNCHED_BY", "workstation"},
  };
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    bool replaced = false;
    for (const auto& [k, v] : set) replaced |= key == k;
    if (!replaced) env.push_back(kv);
  }
  for (const auto& [k, v] : set) env.push_back(k + "=" + v);
  return env;
}

std::vector<char*> c_strings(std::vector<std::string>& v) {
  std::vector<char*> out;
  for (auto& s : v) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

void signal_all(std::vector<Worker>& workers, int sig) {
  for (const auto& w : workers)
    if (w.running) ::kill(-w.pid, sig);  // the worker's whole process group
}

}  // namespace

std::chrono::milliseconds launcher_grace_period() {
  if (const char* s = std::getenv("MEGATRAIN_LAUNCHER_GRACE_SECONDS"); s && *s) {
    char* end = nullptr;
    const double sec = std::strtod(s, &end);
    if (end == s || *end || !(sec >= 0)) fail("MEGATRAIN_LAUNCHER_GRACE_SECONDS='{}' is not a number of seconds", s);
    return std::chrono::milliseconds(static_cast<int64_t>(sec * 1000));
  }
  return std::chrono::seconds(10);
}

void disable_nvlink_multicast_unless_set() {
  // NVLink SHARP (multicast) collectives: on shared GPU hosts a program using them can take the
  // host's GPUs out of service; megatrain's collectives do not need them. A user who wants them
  // sets NCCL_NVLS_ENABLE=1 explicitly.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
}

int run_workers(const WorkerLaunch& l) {
  MT_CHECK(l.nproc >= 1 && !l.argv.empty(), "bad worker launch");
  disable_nvlink_multicast_unless_set();
  const int port = l.master_port > 0 ? l.master_port : pick_free_tcp_port();

  // Signals are taken synchronously (sigtimedwait) so that forwarding and reaping happen in one
  // loop; workers get the original mask back before exec.
  sigset_t watched, original;
  sigemptyset(&watched);
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaddset(&watched, s);
  sigprocmask(SIG_BLOCK, &watched, &original);

  const pid_t parent = getpid();
  std::vector<Worker> workers(l.nproc);
  say(fmt::format("starting {} workers (ranks 0..{}) of {}, rendezvous {}:{}", l.nproc, l.nproc - 1,
                  l.executable, l.master_addr, port));
  for (int r = 0; r < l.nproc; ++r) {
    std::vector<std::string> env = worker_environment(l, r, port);
    std::vector<std::string> args = l.argv;
    std::vector<char*> envp = c_strings(env), argvp = c_strings(args);
    const pid_t pid = fork();
    if (pid < 0) {
      const std::string why = std::strerror(errno);
      workers.resize(r);
      for (auto& w : workers) w.running = true;
      signal_all(workers, SIGKILL);
      while (wait(nullptr) > 0) {
      }
      sigprocmask(SIG_SETMASK, &original, nullptr);
      fail("cannot start worker rank {}: fork failed: {}", r, why);
    }
    if (pid == 0) {
      // Worker: own process group (signals reach it only through the launcher, and it can be
      // killed with everything it started), dies with the launcher, original signal mask.
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);  // the launcher died before prctl took effect
      for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) signal(s, SIG_DFL);
      sigprocmask(SIG_SETMASK, &original, nullptr);
      execve(l.executable.c_str(), argvp.data(), envp.data());
      const std::string msg = fmt::format("[launcher] cannot execute {}: {}\n", l.executable, std::strerror(errno));
      (void)!::write(STDERR_FILENO, msg.data(), msg.size());
      _exit(127);
    }
    setpgid(pid, pid);  // also from the parent, so that signal_all never races the child's setpgid
    workers[r] = {r, pid, true};
  }

  int alive = l.nproc;
  int result = 0;
  bool stopping = false;
  Clock::time_point kill_at{};
  bool killed = false;
  while (alive > 0) {
    timespec wait_for{0, 100 * 1000 * 1000};
    siginfo_t info;
    const int sig = sigtimedwait(&watched, &info, &wait_for);
    if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP) {
      say(fmt::format("received {}: forwarding it to the workers", signal_name(sig)));
      signal_all(workers, sig);
      if (!stopping) {
        stopping = true;
        result = 128 + sig;
        kill_at = Clock::now() + l.grace;
      }
    }
    // Reap every worker that ended.
    int status = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
      for (auto& w : workers) {
        if (w.pid != pid || !w.running) continue;
        w.running = false;
        --alive;
        const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        if (failed && !stopping) {
          stopping = true;
          result = exit_code_for(status);
          if (result == 0) result = 1;
          say(fmt::format("error: worker rank {} (pid {}) {}; stopping the other {} worker(s)", w.rank, w.pid,
                          describe_status(status), alive));
          signal_all(workers, SIGTERM);
          kill_at = Clock::now() + l.grace;
        } else if (failed && !killed) {
          say(fmt::format("worker rank {} (pid {}) {}", w.rank, w.pid, describe_status(status)));
        }
      }
    }
    if (stopping && !killed && alive > 0 && Clock::now() >= kill_at) {
      say(fmt::format("{} worker(s) still running {} ms after SIGTERM: sending SIGKILL", alive,
                      std::chrono::duration_cast<std::chrono::milliseconds>(l.grace).count()));
      signal_all(workers, SIGKILL);
      killed = true;
    }
  }
  sigprocmask(SIG_SETMASK, &original, nullptr);
  if (result != 0) say(fmt::format("exiting with status {}", result));
  return result;
}

int launch_workers_or_continue(const Config& cfg, int argc, char** argv) {
  const ParallelConfig& p = cfg.parallel;
  if (p.launcher != Launcher::workstation || p.world_size <= 1) {
    // A worker, a launcher-started process, or a single process. Keep NVLink multicast off for
    // processes started by torchrun/mpirun/srun as well.
    disable_nvlink_multicast_unless_set();
    return kContinueInThisProcess;
  }
  if (cfg.train.device == DeviceKind::cpu)
    fail("--device cpu with {} ranks: the reference backend communicates through MPI, so start it with "
         "`mpirun -np {} megatrain --device cpu ...` instead of --nproc-per-node",
         p.world_size, p.world_size);
  char exe[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0) fail("cannot find megatrain's own executable (/proc/self/exe) to start the workers");
  exe[n] = '\0';

  WorkerLaunch l;
  l.nproc = p.world_size;
  l.executable = exe;
  for (int i = 0; i < argc; ++i) l.argv.emplace_back(argv[i]);
  l.master_addr = "127.0.0.1";
  if (const char* port = std::getenv("MASTER_PORT"); port && *port) l.master_port = p.master_port;
  l.grace = launcher_grace_period();
  return run_workers(l);
}

}  // namespace mt

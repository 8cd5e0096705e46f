// The workstation launcher, exercised through tests/programs/launch_probe.cpp: worker environment,
// supervision (a crashing or failing worker stops the others, the exit status names it), signal
// forwarding and the SIGKILL fallback, all within seconds.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

struct Finished {
  int status = 0;   // wait status of the launcher
  std::string output;
  std::chrono::milliseconds elapsed{};
};

// Starts launch_probe with args (PROBE_DIR set) and returns its pid plus a pipe carrying its output.
struct Probe {
  pid_t pid = -1;
  int out_fd = -1;
  std::chrono::steady_clock::time_point start;
  fs::path dir;

  explicit Probe(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
    dir = fs::temp_directory_path() / ("launch_probe_" + std::to_string(getpid()) + "_" + std::to_string(counter()++));
    fs::remove_all(dir);
    fs::create_directories(dir);
    int fds[2];
    REQUIRE(pipe(fds) == 0);
    start = std::chrono::steady_clock::now();
    pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      dup2(fds[1], 1);
      dup2(fds[1], 2);
      close(fds[0]);
      setenv("PROBE_DIR", dir.c_str(), 1);
      unsetenv("RANK");
      unsetenv("MASTER_PORT");
      for (const auto& kv : env) putenv(const_cast<char*>(strdup(kv.c_str())));
      std::vector<char*> argv{const_cast<char*>(MEGATRAIN_PROGRAM_LAUNCH_PROBE)};
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(fds[1]);
    out_fd = fds[0];
  }
  ~Probe() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    if (out_fd >= 0) close(out_fd);
    fs::remove_all(dir);
  }
  static int& counter() {
    static int c = 0;
    return c;
  }

  // Waits (at most `limit`) for the launcher to exit; kills it if it does not (a hang).
  Finished wait(std::chrono::seconds limit = 30s) {
    Finished f;
    std::string out;
    char buf[4096];
    const auto deadline = start + limit;
    int status = 0;
    bool done = false;
    while (!done) {
      fd_set set;
      FD_ZERO(&set);
      FD_SET(out_fd, &set);
      timeval tv{0, 50000};
      if (select(out_fd + 1, &set, nullptr, nullptr, &tv) > 0) {
        const ssize_t n = read(out_fd, buf, sizeof(buf));
        if (n > 0) out.append(buf, static_cast<size_t>(n));
      }
      if (waitpid(pid, &status, WNOHANG) == pid) done = true;
      if (!done && std::chrono::steady_clock::now() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        out += "\n<test: launcher killed after the time limit>";
        done = true;
      }
    }
    ssize_t n;
    while ((n = read(out_fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
    pid = -1;
    f.status = status;
    f.output = out;
    f.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    return f;
  }

  std::vector<pid_t> worker_pids(int n, std::chrono::milliseconds within = 10s) {
    const auto deadline = std::chrono::steady_clock::now() + within;
    std::vector<pid_t> pids;
    while (std::chrono::steady_clock::now() < deadline) {
      pids.clear();
      for (int r = 0; r < n; ++r) {
        std::ifstream in(dir / ("pid." + std::to_string(r)));
        pid_t p = 0;
        if (in >> p) pids.push_back(p);
      }
      if (static_cast<int>(pids.size()) == n) return pids;
      std::this_thread::sleep_for(20ms);
    }
    return pids;
  }
};

// Gone: no such process, or a zombie (dead; an orphan waits for init to reap it).
bool process_gone(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const auto close_paren = line.rfind(')');
  return close_paren != std::string::npos && close_paren + 2 < line.size() && line[close_paren + 2] == 'Z';
}

int exit_status(const Finished& f) { return WIFEXITED(f.status) ? WEXITSTATUS(f.status) : -1; }

}  // namespace

TEST_CASE("launcher starts one worker per rank with torchrun's environment", "[launcher]") {
  Probe p({"3", "ok"});
  const Finished f = p.wait();
  INFO(f.output);
  CHECK(exit_status(f) == 0);
  std::set<std::string> ports;
  for (int r = 0; r < 3; ++r) {
    const std::string want = "worker RANK=" + std::to_string(r) + " LOCAL_RANK=" + std::to_string(r) +
                             " WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 MASTER=127.0.0.1:";
    const auto at = f.output.find(want);
    REQUIRE(at != std::string::npos);
    const auto colon = at + want.size();
    ports.insert(f.output.substr(colon, f.output.find(' ', colon) - colon));
  }
  CHECK(ports.size() == 1);  // one rendezvous port for all
  CHECK(std::stoi(*ports.begin()) > 0);
  CHECK(f.output.find("NVLS=0 own_pgid=1") != std::string::npos);
}

TEST_CASE("launcher keeps a user's MASTER_PORT and NCCL_NVLS_ENABLE", "[launcher]") {
  Probe p({"2", "ok"}, {"MASTER_PORT=29777", "NCCL_NVLS_ENABLE=1"});
  const Finished f = p.wait();
  INFO(f.output);
  CHECK(exit_status(f) == 0);
  CHECK(f.output.find("MASTER=127.0.0.1:29777 NVLS=1") != std::string::npos);
}

TEST_CASE("a crashing worker stops the others and the launcher names it", "[launcher]") {
  Probe p({"3", "crash", "1"});
  const auto pids = p.worker_pids(3);
  REQUIRE(pids.size() == 3);
  const Finished f = p.wait();
  INFO(f.output);
  CHECK(exit_status(f) == 128 + SIGABRT);
  CHECK_THAT(f.output, Catch::Contains("worker rank 1") && Catch::Contains("killed by signal SIGABRT") &&
                           Catch::Contains("stopping the other 2 worker(s)"));
  CHECK(f.elapsed < 10s);  // the others sleep 60 s: they were stopped, not waited for
  for (pid_t pid : pids) CHECK(process_gone(pid));
}

TEST_CASE("a worker's non-zero exit becomes the launcher's exit status", "[launcher]") {
  Probe p({"3", "exit", "2", "3"});
  const Finished f = p.wait();
  INFO(f.output);
  CHECK(exit_status(f) == 3);
  CHECK_THAT(f.output, Catch::Contains("worker rank 2") && Catch::Contains("exited with status 3"));
  CHECK(f.elapsed < 10s);
}

TEST_CASE("SIGTERM to the launcher reaches every worker", "[launcher]") {
  Probe p({"2", "hang"});
  const auto pids = p.worker_pids(2);
  REQUIRE(pids.size() == 2);
  kill(p.pid, SIGTERM);
  const Finished f = p.wait();
  INFO(f.output);
  CHECK(exit_status(f) == 128 + SIGTERM);
  CHECK_THAT(f.output, Catch::Contains("received SIGTERM"));
  CHECK(f.elapsed < 10s);
  for (pid_t pid : pids) CHECK(process_gone(pid));
}

TEST_CASE("workers that ignore SIGTERM are killed after the grace period", "[launcher]") {
  Probe p({"2", "ignore-term"}, {"MEGATRAIN_LAUNCHER_GRACE_SECONDS=1"});
  const auto pids = p.worker_pids(2);
  REQUIRE(pids.size() == 2);
  kill(p.pid, SIGTERM);
  const Finished f = p.wait();
  INFO(f.output);
  CHECK(exit_status(f) == 128 + SIGTERM);
  CHECK_THAT(f.output, Catch::Contains("sending SIGKILL"));
  CHECK(f.elapsed < 10s);
  for (pid_t pid : pids) CHECK(process_gone(pid));
}

TEST_CASE("killing the launcher outright takes the workers with it", "[launcher]") {
  Probe p({"2", "hang"});
  const auto pids = p.worker_pids(2);
  REQUIRE(pids.size() == 2);
  kill(p.pid, SIGKILL);
  p.wait();
  // PR_SET_PDEATHSIG: the kernel kills the orphans; give it a moment.
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  bool gone = false;
  while (!gone && std::chrono::steady_clock::now() < deadline) {
    gone = process_gone(pids[0]) && process_gone(pids[1]);
    std::this_thread::sleep_for(20ms);
  }
  CHECK(gone);
}

TEST_CASE("several CPU ranks without mpirun are refused with the command to use", "[launcher]") {
  Probe p({"4", "cpu"});
  const Finished f = p.wait();
  CHECK(exit_status(f) == 1);
  CHECK_THAT(f.output, Catch::Contains("mpirun -np 4 megatrain --device cpu"));
}

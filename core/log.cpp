#include "core/log.h"

#include <cstdio>
#include <mutex>

namespace mt::log {
namespace {
int g_rank = 0;
int g_world = 1;
bool g_quiet = false;
std::mutex g_mutex;
}  // namespace

void set_rank(int r, int w) {
  g_rank = r;
  g_world = w;
}
int rank() { return g_rank; }
int world_size() { return g_world; }
void set_quiet(bool q) { g_quiet = q; }

void write_stdout(const std::string& line) {
  if (g_quiet) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

void write_stderr(const std::string& line) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fputc('\n', stderr);
  std::fflush(stderr);
}

void error(const std::string& message) { write_stderr(fmt::format("[rank {}] error: {}", g_rank, message)); }

}  // namespace mt::log

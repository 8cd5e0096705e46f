#include "core/log.h"

#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace mt::log {
namespace {
int g_rank = 0;
int g_world = 1;
bool g_quiet = false;
bool g_info_to_stderr = false;
std::mutex g_mutex;
}  // namespace

void set_rank(int r, int w) {
  g_rank = r;
  g_world = w;
}
int rank() { return g_rank; }
int world_size() { return g_world; }
void set_quiet(bool q) { g_quiet = q; }
void set_info_to_stderr(bool e) { g_info_to_stderr = e; }

void write_stdout(const std::string& line) {
  if (g_quiet) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  FILE* out = g_info_to_stderr ? stderr : stdout;
  std::fwrite(line.data(), 1, line.size(), out);
  std::fputc('\n', out);
  std::fflush(out);
}

void write_stderr(const std::string& line) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fputc('\n', stderr);
  std::fflush(stderr);
}

void error(const std::string& message) { write_stderr(fmt::format("[rank {}] error: {}", g_rank, message)); }

}  // namespace mt::log

namespace mt::log {

std::chrono::milliseconds progress_interval() {
  // Read each time (rarely called: once per report or wait) so that tests can set it.
  const char* env = std::getenv("MEGATRAIN_PROGRESS_SECONDS");
  if (env && *env) {
    char* end = nullptr;
    const double s = std::strtod(env, &end);
    if (end && *end == '\0' && s >= 0) return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
  }
  return std::chrono::milliseconds(5000);
}

}  // namespace mt::log

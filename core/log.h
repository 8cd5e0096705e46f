// Logging. Informational lines go to stdout from one rank (rank 0, or the last rank for
// Megatron's per-iteration line); warnings and errors go to stderr from any rank, prefixed with it.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <string>

namespace mt::log {

// Set once at start-up, after the rank is known.
void set_rank(int rank, int world_size);
int rank();
int world_size();
void set_quiet(bool quiet);
// Informational lines to stderr instead (for subcommands whose stdout is their data).
void set_info_to_stderr(bool to_stderr);

void write_stdout(const std::string& line);
void write_stderr(const std::string& line);

// Printed by rank 0 only.
template <typename... Args>
void info(fmt::format_string<Args...> f, Args&&... args) {
  if (rank() == 0) write_stdout(fmt::format(f, std::forward<Args>(args)...));
}
// Printed by the last rank only (Megatron's print_rank_last: the iteration log line).
template <typename... Args>
void info_last(fmt::format_string<Args...> f, Args&&... args) {
  if (rank() == world_size() - 1) write_stdout(fmt::format(f, std::forward<Args>(args)...));
}
// Printed by every rank, on stderr, prefixed "[rank N] warning: ".
template <typename... Args>
void warn(fmt::format_string<Args...> f, Args&&... args) {
  write_stderr(fmt::format("[rank {}] warning: {}", rank(), fmt::format(f, std::forward<Args>(args)...)));
}
// Printed by rank 0 only, on stderr.
template <typename... Args>
void warn0(fmt::format_string<Args...> f, Args&&... args) {
  if (rank() == 0) warn(f, std::forward<Args>(args)...);
}
// Printed by rank 0 only, on stderr, prefixed "[rank 0] note: " (e.g. a flag with no effect).
template <typename... Args>
void note0(fmt::format_string<Args...> f, Args&&... args) {
  if (rank() == 0)
    write_stderr(fmt::format("[rank {}] note: {}", rank(), fmt::format(f, std::forward<Args>(args)...)));
}
void error(const std::string& message);  // "[rank N] error: message" on stderr

// How often a long wait or load reports its progress (the TCP rendezvous, checkpoint loading, a
// step waiting for the batch loader): 5 s, or MEGATRAIN_PROGRESS_SECONDS (tests set it small).
// Waiting loops use at least 10 ms (wait_progress_interval) so that 0 cannot make them spin.
std::chrono::milliseconds progress_interval();
inline std::chrono::milliseconds wait_progress_interval() {
  return std::max(progress_interval(), std::chrono::milliseconds(10));
}

}  // namespace mt::log

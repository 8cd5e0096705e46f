// The signals --exit-signal names (Python's signal.Signals spellings), one table for the flag's
// choices and the trainer's handler.
#pragma once

#include <csignal>
#include <string>
#include <utility>
#include <vector>

namespace mt {

inline const std::vector<std::pair<std::string, int>>& exit_signals() {
  static const std::vector<std::pair<std::string, int>> table = {
      {"SIGTERM", SIGTERM}, {"SIGINT", SIGINT},   {"SIGHUP", SIGHUP},   {"SIGUSR1", SIGUSR1},
      {"SIGUSR2", SIGUSR2}, {"SIGQUIT", SIGQUIT}, {"SIGALRM", SIGALRM}};
  return table;
}

}  // namespace mt

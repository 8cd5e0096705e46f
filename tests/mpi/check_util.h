// What the MPI check programs (tests/mpi/*_check.cpp) share: a failed check counted and printed,
// and a command run with its output in a log file (printed when it fails).
#pragma once

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>

namespace mt_check {

inline int failures = 0;

inline void check(bool ok, const std::string& what) {
  if (ok) return;
  std::cout << "FAIL: " << what << "\n";
  ++failures;
}

inline int run(const std::string& cmd, const std::string& log) {
  std::cout << "$ " << cmd << "\n" << std::flush;
  const int rc = std::system((cmd + " > " + log + " 2>&1").c_str());
  if (rc != 0) {
    std::ifstream in(log);
    std::cout << in.rdbuf() << "\n(exit status " << rc << ")\n";
  }
  return rc;
}

}  // namespace mt_check

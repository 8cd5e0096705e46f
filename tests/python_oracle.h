// Runs the Python oracles under tests/oracles/ with the checkout's .venv/bin/python (installed by
// scripts/install-deps.sh; MEGATRAIN_PYTHON overrides it). Where no such Python with numpy exists
// the caller skips visibly: python_or_skip() prints a WARN line and returns nullopt.
#pragma once

#include <optional>
#include <string>

namespace mt::oracle {

// The interpreter to run oracles with, or nullopt (after printing why) when there is none.
std::optional<std::string> python_or_skip(const char* test_name);

// Runs a shell command, returns its stdout; fails the test (throws) when it exits non-zero.
std::string run_capture(const std::string& command);

// Single-quotes a string for /bin/sh.
std::string shell_quote(const std::string& s);

// A fresh empty directory under the system temp dir, removed when the object dies.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace mt::oracle

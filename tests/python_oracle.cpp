#include "tests/python_oracle.h"

#include "tests/skip.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <stdexcept>

namespace mt::oracle {

std::optional<std::string> python_or_skip(const char* test_name) {
  std::string python;
  if (const char* env = std::getenv("MEGATRAIN_PYTHON"); env && *env) {
    python = env;
  } else {
    python = std::string(MEGATRAIN_SOURCE_DIR) + "/.venv/bin/python";
  }
  if (!std::filesystem::exists(python)) {
    mt::test::report_skip(std::string(test_name) + ": no Python oracle interpreter at " + python +
                          " (run scripts/install-deps.sh)");
    return std::nullopt;
  }
  const std::string probe = shell_quote(python) + " -c 'import numpy' > /dev/null 2>&1";
  if (std::system(probe.c_str()) != 0) {
    mt::test::report_skip(std::string(test_name) + ": " + python + " cannot import numpy (run scripts/install-deps.sh)");
    return std::nullopt;
  }
  return python;
}

std::string run_capture(const std::string& command) {
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) throw std::runtime_error("cannot run: " + command);
  std::string out;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  const int status = pclose(pipe);
  if (status != 0) throw std::runtime_error("command failed (status " + std::to_string(status) + "): " + command);
  return out;
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') out += "'\\''";
    else out += c;
  }
  return out + "'";
}

TempDir::TempDir() {
  std::random_device rd;
  const auto base = std::filesystem::temp_directory_path();
  for (int attempt = 0; attempt < 100; ++attempt) {
    const auto candidate = base / ("megatrain_test_" + std::to_string(rd()));
    if (std::filesystem::create_directory(candidate)) {
      path_ = candidate.string();
      return;
    }
  }
  throw std::runtime_error("cannot create a temporary directory");
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

}  // namespace mt::oracle

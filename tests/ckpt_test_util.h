// Helpers shared by the checkpoint and observability tests: temporary directories, running a
// command, finding the checkout's Python (the tests' oracle for safetensors and TensorBoard).
#pragma once

#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace mt_test {

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/megatrain_test_XXXXXX";
    const char* p = ::mkdtemp(tmpl);
    if (!p) throw std::runtime_error("mkdtemp failed");
    path_ = p;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Runs `cmd` through the shell; returns its exit status and fills `output` (stdout + stderr).
inline int run_command(const std::string& cmd, std::string* output = nullptr) {
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = ::pclose(p);
  if (output) *output = out;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The checkout's .venv/bin/python (scripts/install-deps.sh makes it) when it can import `modules`
// (space-separated); nullopt otherwise, with the reason in *why.
inline std::optional<std::string> find_test_python(const std::string& modules, std::string* why) {
  const std::string py = std::string(MEGATRAIN_SOURCE_DIR) + "/.venv/bin/python";
  if (::access(py.c_str(), X_OK) != 0) {
    *why = py + " does not exist (run scripts/install-deps.sh)";
    return std::nullopt;
  }
  std::string imports;
  for (size_t i = 0, j; i < modules.size(); i = j + 1) {
    j = modules.find(' ', i);
    if (j == std::string::npos) j = modules.size();
    if (j > i) imports += "import " + modules.substr(i, j - i) + ";";
  }
  std::string out;
  if (run_command(py + " -c '" + imports + "'", &out) != 0) {
    *why = py + " cannot import " + modules + ": " + out;
    return std::nullopt;
  }
  return py;
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// (loss, gradient norm) of each Megatron-format iteration line of a training log.
inline std::vector<std::pair<double, double>> losses_and_norms(const std::string& log) {
  static const std::regex line(R"(iteration\s+\d+/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+) \|.*?grad norm: ([0-9.]+))");
  std::vector<std::pair<double, double>> out;
  std::istringstream in(log);
  std::string l;
  std::smatch m;
  while (std::getline(in, l))
    if (std::regex_search(l, m, line)) out.emplace_back(std::stod(m[1]), std::stod(m[2]));
  return out;
}

}  // namespace mt_test

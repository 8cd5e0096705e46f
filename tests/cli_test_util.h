// Helpers for the CLI/planner tests: a small valid flag set, parsing with a launcher environment,
// capturing errors, tiny indexed datasets on disk, and running the real binary.
#pragma once

#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "app/cli.h"
#include "app/cli_internal.h"
#include "core/error.h"
#include "tests/skip.h"

namespace mt::test {

using Args = std::vector<std::string>;

// Splits on spaces (no quoting: tests needing spaces build the vector themselves).
inline Args words(const std::string& s) {
  Args out;
  std::istringstream in(s);
  std::string w;
  while (in >> w) out.push_back(w);
  return out;
}

inline Args operator+(Args a, const Args& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A small valid GPT: 2 layers, h 64, 4 heads, s 32, NullTokenizer 1000, mock data.
inline Args small_gpt() {
  return words(
      "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
      "--micro-batch-size 2 --lr 1e-3 --train-iters 10 --mock-data --tokenizer-type NullTokenizer --vocab-size 1000");
}

// torchrun-style environment for rank 0 of `world` processes on one node.
inline Environment torchrun_env(int world) {
  return {{"RANK", "0"}, {"WORLD_SIZE", std::to_string(world)}, {"LOCAL_RANK", "0"},
          {"LOCAL_WORLD_SIZE", std::to_string(world)}};
}

// parse_config with the setup messages collected (not printed) unless `messages` is given.
inline Config parse_env(const Args& args, const Environment& env, std::vector<SetupMessage>* messages = nullptr) {
  std::vector<SetupMessage> sink;
  return parse_config(args, env, messages ? messages : &sink);
}

inline Config parse(const Args& args, int world = 1, std::vector<SetupMessage>* messages = nullptr) {
  return parse_env(args, torchrun_env(world), messages);
}

// The error message parse_config throws (a failed CHECK when it does not throw).
inline std::string parse_error(const Args& args, int world = 1) {
  try {
    parse(args, world);
  } catch (const Error& e) {
    return e.what();
  }
  FAIL_CHECK("expected an error from: megatrain " << [&] {
    std::string s;
    for (const auto& a : args) s += a + " ";
    return s;
  }());
  return "";
}

// The Unsupported error (a feature megatrain does not build yet) that parsing args raises.
inline std::string unsupported_error(const Args& args, int world = 1) {
  try {
    parse(args, world);
  } catch (const Unsupported& u) {
    return u.what();
  } catch (const Error& e) {
    FAIL_CHECK("expected Unsupported, got: " << e.what());
    return "";
  }
  FAIL_CHECK("expected Unsupported");
  return "";
}

inline bool has_message(const std::vector<SetupMessage>& ms, SetupMessage::Kind kind, const std::string& text) {
  for (const auto& m : ms)
    if (m.kind == kind && m.text.find(text) != std::string::npos) return true;
  return false;
}

// A fresh directory under the system temp dir, removed at scope exit.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "megatrain-test-XXXXXX").string();
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string str(const std::string& name) const { return (path / name).string(); }
};

// Writes <prefix>.bin/.idx: `docs` documents of `len` uint16 tokens (Megatron's MMIDIDX v1).
inline void write_dataset(const std::string& prefix, int docs = 4, int len = 50) {
  std::ofstream bin(prefix + ".bin", std::ios::binary);
  for (int d = 0; d < docs; ++d)
    for (int i = 0; i < len; ++i) {
      const uint16_t t = static_cast<uint16_t>((d * 31 + i) % 1000);
      bin.write(reinterpret_cast<const char*>(&t), 2);
    }
  std::ofstream idx(prefix + ".idx", std::ios::binary);
  auto u64 = [&](uint64_t v) { idx.write(reinterpret_cast<const char*>(&v), 8); };
  idx.write("MMIDIDX\x00\x00", 9);
  u64(1);
  const char dtype = 8;  // uint16
  idx.write(&dtype, 1);
  u64(static_cast<uint64_t>(docs));
  u64(static_cast<uint64_t>(docs + 1));
  for (int d = 0; d < docs; ++d) {
    const int32_t l = len;
    idx.write(reinterpret_cast<const char*>(&l), 4);
  }
  for (int d = 0; d < docs; ++d) {
    const int64_t p = static_cast<int64_t>(d) * len * 2;
    idx.write(reinterpret_cast<const char*>(&p), 8);
  }
  for (int d = 0; d <= docs; ++d) {
    const int64_t v = d;
    idx.write(reinterpret_cast<const char*>(&v), 8);
  }
}

// The shared test data (GPT-2 vocabulary, tokenizer.json files); empty when absent.
inline std::string shared_data() {
  for (const char* p : {"../shared/data", MEGATRAIN_SOURCE_DIR "/../shared/data"})
    if (std::filesystem::is_directory(p)) return std::filesystem::canonical(p).string();
  return "";
}

#define MT_REQUIRE_SHARED_DATA(dir)                                                      \
  const std::string dir = ::mt::test::shared_data();                                     \
  if (dir.empty()) {                                                                     \
    MT_SKIP("../shared/data (GPT-2 vocabulary, tokenizers) is not present");            \
  }

struct RunResult {
  int exit_code = -1;
  std::string out, err;
};

inline std::string shell_quote(const std::string& s) {
  std::string q(1, '\'');
  for (char c : s) {
    if (c == '\'') q.append("'\\''");
    else q.push_back(c);
  }
  q.push_back('\'');
  return q;
}

// Runs the megatrain binary with `shell_args`, already shell-quoted words (and `env_prefix`, e.g.
// "WORLD_SIZE=2 RANK=1").
inline RunResult run_binary_shell(const std::string& shell_args, const std::string& env_prefix = "") {
  TempDir dir;
  // Launcher variables of the environment running the tests must not leak into the binary.
  std::string cmd("env -u RANK -u WORLD_SIZE -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE -u PMI_RANK -u PMI_SIZE "
                  "-u SLURM_PROCID -u SLURM_STEP_NUM_TASKS ");
  cmd.append(env_prefix).append(" ").append(shell_quote(MEGATRAIN_BINARY)).append(" ").append(shell_args);
  cmd.append(" >").append(dir.str("out")).append(" 2>").append(dir.str("err"));
  const int status = std::system(cmd.c_str());
  RunResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  auto slurp = [](const std::string& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  r.out = slurp(dir.str("out"));
  r.err = slurp(dir.str("err"));
  return r;
}

// Runs the megatrain binary with `args` (and `env_prefix`).
inline RunResult run_binary(const Args& args, const std::string& env_prefix = "") {
  std::string words;
  for (const auto& a : args) words.append(" ").append(shell_quote(a));
  return run_binary_shell(words, env_prefix);
}

}  // namespace mt::test

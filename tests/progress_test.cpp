// Long waits and loads say what they are doing: the TCP rendezvous names the ranks it
// waits for, checkpoint loading counts tensors. MEGATRAIN_PROGRESS_SECONDS makes the reports come
// at once instead of every 5 s.
#include <catch2/catch.hpp>
#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include "ckpt_test_util.h"
#include "core/error.h"
#include "parallel/tcp_rendezvous.h"

using namespace mt;
using mt_test::TempDir;

namespace {

// Runs fn with file descriptor 2 redirected to a file; returns what was written there.
template <typename Fn>
std::string capture_stderr(Fn fn) {
  TempDir dir;
  const std::string path = dir / "stderr.txt";
  std::fflush(stderr);
  const int saved = ::dup(2);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  REQUIRE(saved >= 0);
  REQUIRE(fd >= 0);
  ::dup2(fd, 2);
  ::close(fd);
  try {
    fn();
  } catch (...) {
    std::fflush(stderr);
    ::dup2(saved, 2);
    ::close(saved);
    throw;
  }
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("progress: the TCP rendezvous says which ranks it waits for", "[progress][rendezvous]") {
  ::setenv("MEGATRAIN_PROGRESS_SECONDS", "0.05", 1);
  const int port = pick_free_tcp_port();
  std::string error;
  const std::string rank0 = capture_stderr([&] {
    try {
      TcpRendezvous r("127.0.0.1", port, 0, 3, Millis(400));
    } catch (const Error& e) {
      error = e.what();
    }
  });
  INFO(rank0);
  CHECK_THAT(error, Catch::Contains("only 1 of 3 ranks arrived"));  // nobody came: it still times out
  CHECK(std::regex_search(rank0, std::regex(R"(\[rank 0\] rendezvous: waiting for 2 of 3 ranks at 127\.0\.0\.1:)" +
                                            std::to_string(port) + R"( \(\d+ s of [^;]+; missing ranks \[1, 2\]\))")));
  const std::string rank1 = capture_stderr([&] {
    try {
      TcpRendezvous r("127.0.0.1", port, 1, 3, Millis(400));
    } catch (const Error&) {
    }
  });
  INFO(rank1);
  CHECK_THAT(rank1, Catch::Contains("[rank 1] rendezvous: waiting for rank 0 at 127.0.0.1:" + std::to_string(port)));
  ::unsetenv("MEGATRAIN_PROGRESS_SECONDS");
}

TEST_CASE("progress: checkpoint loading counts the tensors it read", "[progress][binary]") {
  TempDir dir;
  const std::string run = std::string(MEGATRAIN_BINARY) +
                          " --device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 64 --num-layers 2 "
                          "--hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
                          "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --eval-iters 0 --log-interval 1 --save " +
                          dir.path() + " --save-interval 2";
  std::string out;
  REQUIRE(mt_test::run_command(run + " --train-iters 4 --exit-interval 2", &out) == 0);
  REQUIRE(mt_test::run_command("MEGATRAIN_PROGRESS_SECONDS=0 " + run + " --train-iters 4 --load " + dir.path(), &out) == 0);
  INFO(out);
  // Adam: the weights, then both moments of each of the model's tensors; the last read ends the
  // load without a line.
  std::smatch m;
  REQUIRE(std::regex_search(out, m, std::regex(R"(  loading checkpoint from (\S+) \((\d+) of (\d+) tensors, \d+\.\d\d GiB in \d+ s, [0-9.]+ MiB/s\))")));
  CHECK(m[1].str().find(dir.path()) == 0);
  CHECK(std::stoi(m[2]) == 1);
  const int total = std::stoi(m[3]);
  CHECK(total % 3 == 0);
  CHECK_THAT(out, Catch::Contains("(" + std::to_string(total - 1) + " of " + std::to_string(total) + " tensors"));
  CHECK_THAT(out, Catch::Contains("successfully loaded checkpoint"));
}

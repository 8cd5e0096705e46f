// --log-progress's progress.txt (Megatron's format and throughput arithmetic) and
// --save-retain-interval's deletions, as units; tests/training_checkpoint_binary_test.cpp runs both
// through the binary.
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "app/checkpoint_retention.h"
#include "app/progress_log.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/file_io.h"
#include "ckpt_test_util.h"
#include "core/error.h"

using namespace mt;
using mt_test::TempDir;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

std::vector<std::string> tabs(const std::string& line) {
  std::vector<std::string> out;
  std::istringstream in(line);
  for (std::string f; std::getline(in, f, '\t');) out.push_back(f);
  return out;
}

// A checkpoint directory with the tracker naming `tracked`.
void make_checkpoints(const std::string& dir, std::initializer_list<int64_t> iterations, int64_t tracked) {
  for (int64_t it : iterations) {
    fs::create_directories(join_path(dir, iteration_directory_name(it)));
    std::ofstream(join_path(join_path(dir, iteration_directory_name(it)), "manifest.json")) << "{}";
  }
  std::ofstream(checkpoint_tracker_path(dir)) << tracked;
}

}  // namespace

TEST_CASE("progress.txt: Megatron's lines, job and cumulative throughput", "[progress]") {
  TempDir tmp;
  using Clock = std::chrono::system_clock;
  const Clock::time_point t0 = Clock::from_time_t(1'800'000'000);
  Clock::time_point now = t0 + std::chrono::seconds(10);
  ProgressLog log(tmp.path(), true, 0, 4, "12345");
  log.set_clock([&] { return now; }, t0);
  log.set_flops_at_start(1e15);
  log.job_started();
  now = t0 + std::chrono::seconds(110);  // 100 s after "Starting job", 110 s after the process began
  log.checkpoint_saved(50, 1e15 + 4.4e16, 50 * 8 * 2048.0, false);
  now += std::chrono::seconds(5);
  log.checkpoint_deleted(25);
  const auto lines = lines_of(tmp / "progress.txt");
  REQUIRE(lines.size() == 3);
  const auto start = tabs(lines[0]);
  REQUIRE(start.size() == 4);
  CHECK(start[0] == progress_timestamp(t0 + std::chrono::seconds(10)));
  CHECK(start[0].size() == 19);  // %Y-%m-%d %H:%M:%S
  CHECK(start[1] == "Job ID: 12345");
  CHECK(start[2] == "# GPUs: 4");
  CHECK(start[3] == "Starting job");
  const auto saved = tabs(lines[1]);
  REQUIRE(saved.size() == 9);
  CHECK(saved[3] == "Saved checkpoint");
  CHECK(saved[4] == "Iteration: 50");
  // Job: 4.4e16 FLOPs of this job over 110 s x 4 GPUs = 100.0 TFLOP/s/GPU; cumulative: over the
  // 100 s since "Starting job", from the FLOPs of the last save before it (none: 0).
  CHECK(saved[5] == "Job throughput: 100.0 TFLOP/s/GPU");
  CHECK(saved[6] == "Cumulative throughput: 112.5 TFLOP/s/GPU");
  CHECK(saved[7] == "Floating-point operations: 4.50e+16");
  CHECK(saved[8] == "Tokens (in billions): 0.00");
  CHECK(tabs(lines[2]) ==
        std::vector<std::string>{progress_timestamp(now), "Job ID: 12345", "# GPUs: 4", "Deleted checkpoint",
                                 "Iteration: 25"});
}

TEST_CASE("progress.txt: a file that lost its Starting job line still gets the save's line", "[progress]") {
  TempDir tmp;
  ProgressLog log(tmp.path(), true, 0, 1, "");
  log.job_started();
  std::ofstream(tmp / "progress.txt") << "edited by hand\n";  // no "Starting job" any more
  log.checkpoint_saved(3, 1e12, 1e6, false);
  const auto lines = lines_of(tmp / "progress.txt");
  REQUIRE(lines.size() == 2);
  const auto f = tabs(lines[1]);
  REQUIRE(f.size() == 9);
  CHECK(f[3] == "Saved checkpoint");
  // The cumulative throughput falls back to this job's.
  CHECK(f[5].substr(std::string("Job throughput: ").size()) ==
        f[6].substr(std::string("Cumulative throughput: ").size()));
}

TEST_CASE("progress.txt: async saves, other ranks and no --save write nothing extra", "[progress]") {
  TempDir tmp;
  ProgressLog log(tmp.path(), true, 0, 2, "");
  log.job_started();
  log.checkpoint_saved(10, 2e12, 3e9, true);
  log.async_checkpoint_committed(10);
  const auto lines = lines_of(tmp / "progress.txt");
  REQUIRE(lines.size() == 3);
  CHECK(tabs(lines[1])[1] == "Job ID: ");  // SLURM_JOB_ID unset: empty, as Megatron
  CHECK(tabs(lines[1])[3] == "Saving async checkpoint");
  CHECK(tabs(lines[1])[8] == "Tokens (in billions): 3.00");
  CHECK(tabs(lines[2]) == std::vector<std::string>{tabs(lines[2])[0], "Job ID: ", "# GPUs: 2", "Saved async checkpoint",
                                                   "Iteration: 10"});
  for (ProgressLog quiet : {ProgressLog(tmp / "other", true, 1, 2, ""), ProgressLog(std::nullopt, true, 0, 2, ""),
                            ProgressLog(tmp / "off", false, 0, 2, "")}) {
    CHECK_FALSE(quiet.enabled());
    quiet.job_started();
    quiet.checkpoint_saved(1, 1, 1, false);
  }
  CHECK_FALSE(fs::exists(tmp / "other"));
  CHECK_FALSE(fs::exists(tmp / "off"));
}

TEST_CASE("progress.txt: where cumulative throughput starts (Megatron's search)", "[progress]") {
  auto line = [](const std::string& ts, int gpus, const std::string& msg) {
    return ts + "\tJob ID: 7\t# GPUs: " + std::to_string(gpus) + "\t" + msg + "\n";
  };
  auto saved = [&](const std::string& ts, int gpus, double flops, const char* kind = "Saved checkpoint") {
    return line(ts, gpus,
                fmt::format("{}\tIteration: 1\tJob throughput: 1.0 TFLOP/s/GPU\tCumulative throughput: 1.0 "
                            "TFLOP/s/GPU\tFloating-point operations: {:.2e}\tTokens (in billions): 0.10",
                            kind, flops));
  };
  // First job on 8 GPUs, then two on 16: the start is the first 16-GPU job, with the FLOPs of the
  // last save before it (even though the 8-GPU lines came first).
  std::string text = line("2026-01-01 00:00:00", 8, "Starting job") + saved("2026-01-01 01:00:00", 8, 1e18) +
                     line("2026-01-02 00:00:00", 16, "Starting job") + saved("2026-01-02 01:00:00", 16, 3e18) +
                     line("2026-01-03 00:00:00", 16, "Starting job");
  ProgressStart s = progress_start(text, 16, "p");
  CHECK(s.timestamp == "2026-01-02 00:00:00");
  CHECK(s.flops == 1e18);
  // Back on 8 GPUs: the search restarts after the 16-GPU lines.
  text += line("2026-01-04 00:00:00", 8, "Starting job");
  s = progress_start(text, 8, "p");
  CHECK(s.timestamp == "2026-01-04 00:00:00");
  CHECK(s.flops == 3e18);
  // An asynchronous save counts once it is committed.
  std::string async = line("2026-01-01 00:00:00", 2, "Starting job") +
                      saved("2026-01-01 01:00:00", 2, 5e17, "Saving async checkpoint") +
                      line("2026-01-01 02:00:00", 2, "Starting job");
  CHECK(progress_start(async, 2, "p").flops == 0);
  async += line("2026-01-01 01:30:00", 2, "Saved async checkpoint\tIteration: 1");
  async += line("2026-01-01 03:00:00", 4, "Starting job");
  async += line("2026-01-01 04:00:00", 2, "Starting job");
  CHECK(progress_start(async, 2, "p").flops == 5e17);
  CHECK(progress_start(async, 2, "p").timestamp == "2026-01-01 04:00:00");
  // No job of this world size: Megatron's assertion, naming the file.
  CHECK_THROWS_WITH(progress_start(text, 4, "/x/progress.txt"),
                    Catch::Contains("/x/progress.txt") && Catch::Contains("'Starting job' entry with same world_size"));
  CHECK_THROWS_WITH(progress_start("garbage\n", 4, "p"), Catch::Contains("malformed"));
  CHECK_THROWS_WITH(progress_start("2026-01-01 00:00:00\tJob ID: \t# GPUs: x\tStarting job\n", 4, "p"),
                    Catch::Contains("field '# GPUs: x' is not a number"));
}

TEST_CASE("checkpoint retention: the previous checkpoint goes unless retained", "[progress][retain]") {
  TempDir tmp;
  const std::string dir = tmp.path();
  make_checkpoints(dir, {5, 10, 15, 20}, 20);
  CHECK(tracked_iteration(dir) == 20);
  std::vector<int64_t> deleted;
  {
    CheckpointRetention r(dir, 10, 0, [&](int64_t it) { deleted.push_back(it); });
    r.committed(15, 20);  // 15 is not a multiple of 10: deleted
    r.wait();
    r.committed(10, 20);  // a multiple of 10: kept
    r.committed(20, 20);  // the checkpoint just saved: kept
    r.committed(std::nullopt, 20);
    r.committed(0, 20);
    r.wait();
  }
  CHECK(deleted == std::vector<int64_t>{15});
  CHECK_FALSE(fs::exists(join_path(dir, "iter_0000015")));
  for (const char* kept : {"iter_0000005", "iter_0000010", "iter_0000020"}) CHECK(fs::exists(join_path(dir, kept)));
  // A symbolic link is left alone (Megatron's rule), and so is everything on other ranks.
  fs::create_directory_symlink(join_path(dir, "iter_0000010"), join_path(dir, "iter_0000025"));
  CheckpointRetention(dir, 10, 0).committed(25, 30);
  CHECK(fs::is_symlink(join_path(dir, "iter_0000025")));
  CHECK(fs::exists(join_path(dir, "iter_0000010")));
  CheckpointRetention(dir, 10, 1).committed(5, 30);
  CheckpointRetention(dir, std::nullopt, 0).committed(5, 30);
  CHECK(fs::exists(join_path(dir, "iter_0000005")));
  // The tracker's iteration: none without one, none for a release checkpoint.
  CHECK_FALSE(tracked_iteration(tmp / "none").has_value());
  std::ofstream(checkpoint_tracker_path(dir)) << "release";
  CHECK_FALSE(tracked_iteration(dir).has_value());
}

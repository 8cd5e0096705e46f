// Megatron's checkpoint-management flags through the megatrain binary on the CPU:
// --save-retain-interval with --log-progress, --override-ckpt-iteration, --pretrained-checkpoint,
// --no-initialization and --use-checkpoint-args.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "ckpt_test_util.h"
#include "training_binary_util.h"

using mt_test::read_bytes;
using mt_test::TempDir;
using namespace mt_test::training_binary;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> iteration_dirs(const std::string& save) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(save))
    if (e.is_directory()) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

// The message (4th tab-separated field) of every progress.txt line.
std::vector<std::string> progress_messages(const std::string& save) {
  std::vector<std::string> out;
  std::istringstream in(read_bytes(save + "/progress.txt"));
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> f;
    std::istringstream fields(line);
    for (std::string x; std::getline(fields, x, '\t');) f.push_back(x);
    REQUIRE(f.size() >= 4);
    out.push_back(f.size() > 4 ? f[3] + " " + f[4] : f[3]);
  }
  return out;
}

std::map<int64_t, double> field(const std::string& jsonl, const char* name) {
  std::map<int64_t, double> out;
  for (const auto& [it, r] : read_metrics(jsonl).iterations) out[it] = r.at(name).get<double>();
  return out;
}
std::map<int64_t, double> losses(const std::string& jsonl) { return field(jsonl, "lm_loss"); }

// A resumed run trains as the straight one from `first` on: the same gradient norm at every
// iteration and the same loss at the first one (the next log line averages the first two
// iterations: Megatron does not reset the log interval's sums after a run's first iteration).
void check_same_training(const std::string& resumed, const std::string& straight, int64_t first, size_t iterations) {
  const auto norms = field(resumed, "grad_norm"), straight_norms = field(straight, "grad_norm");
  REQUIRE(norms.size() == iterations);
  CHECK(norms.begin()->first == first);
  for (const auto& [it, n] : norms) CHECK(n == straight_norms.at(it));
  CHECK(losses(resumed).at(first) == losses(straight).at(first));
}

}  // namespace

TEST_CASE("binary: --save-retain-interval keeps multiples and the latest, --log-progress records it", "[ckpt-train][binary][retain]") {
  TempDir dir;
  const std::string save = dir / "ck";
  const std::string run = kGpt + " --save " + save + " --save-interval 2 --save-retain-interval 6 --log-progress";
  require_ok(megatrain(run + " --train-iters 10"));
  CHECK(iteration_dirs(save) == std::vector<std::string>{"iter_0000006", "iter_0000010"});
  // The resumed job deletes iteration 10 once 12 is committed; 12 is a multiple of 6 and stays.
  const Result resumed =
      megatrain(run + " --train-iters 14 --load " + save + " --async-save --override-opt-param-scheduler");
  require_ok(resumed);
  CHECK(resumed.out.find("successfully deleted checkpoint from iteration      10 at " + save) != std::string::npos);
  CHECK(iteration_dirs(save) == std::vector<std::string>{"iter_0000006", "iter_0000012", "iter_0000014"});
  CHECK(tracker(save) == "14");
  const std::vector<std::string> m = progress_messages(save);
  // Deletions run on a background thread: their lines may come before or after the next save's.
  std::vector<std::string> sorted = m;
  std::sort(sorted.begin(), sorted.end());
  const std::vector<std::string> expected = {
      "Deleted checkpoint Iteration: 10",    "Deleted checkpoint Iteration: 2",
      "Deleted checkpoint Iteration: 4",     "Deleted checkpoint Iteration: 8",
      "Saved async checkpoint Iteration: 12",
      "Saved async checkpoint Iteration: 14", "Saved checkpoint Iteration: 10",
      "Saved checkpoint Iteration: 2",       "Saved checkpoint Iteration: 4",
      "Saved checkpoint Iteration: 6",       "Saved checkpoint Iteration: 8",
      "Saving async checkpoint Iteration: 12", "Saving async checkpoint Iteration: 14",
      "Starting job",                        "Starting job"};
  CHECK(sorted == expected);
  CHECK(m.front() == "Starting job");
}

TEST_CASE("binary: --override-ckpt-iteration, --pretrained-checkpoint, --no-initialization", "[ckpt-train][binary]") {
  TempDir dir;
  const std::string ck = dir / "ck";
  const std::string run = kGpt + " --train-iters 8 --lr-warmup-iters 2";
  require_ok(megatrain(run + " --save " + ck + " --save-interval 4"));
  auto metrics = [&](const std::string& name) { return " --metrics-jsonl " + (dir / name); };

  // A resume from iteration 4, with and without drawing the initial weights: the same run.
  require_ok(megatrain(run + " --load " + ck + " --ckpt-step 4" + metrics("resume.jsonl")));
  require_ok(megatrain(run + " --load " + ck + " --ckpt-step 4 --no-initialization" + metrics("noinit.jsonl")));
  const auto resume = losses(dir / "resume.jsonl");
  REQUIRE(resume.size() == 4);
  CHECK(resume == losses(dir / "noinit.jsonl"));

  // The latest checkpoint (8) resumed as if it were iteration 4: iterations 5-8 again, with the
  // data of samples 16 on, from iteration 8's weights.
  const Result over = megatrain(run + " --load " + ck + " --override-ckpt-iteration 4" + metrics("over.jsonl"));
  require_ok(over);
  CHECK(over.out.find("--override-ckpt-iteration: start at iteration 4 (consumed_train_samples 16)") != std::string::npos);
  const Metrics mo = read_metrics(dir / "over.jsonl");
  REQUIRE(mo.iterations.size() == 4);
  CHECK(mo.iterations.begin()->first == 5);
  CHECK(mo.iterations.at(5).at("consumed_samples") == 20);
  CHECK(losses(dir / "over.jsonl").at(5) != resume.at(5));  // other weights, the same batch

  // --pretrained-checkpoint when --load has none: a finetune of the latest checkpoint.
  require_ok(megatrain(run + " --load " + ck + " --finetune" + metrics("finetune.jsonl")));
  const Result pre = megatrain(run + " --load " + (dir / "empty") + " --pretrained-checkpoint " + ck + metrics("pre.jsonl"));
  require_ok(pre);
  CHECK(pre.out.find("attempting to finetune with checkpoint in " + ck) != std::string::npos);
  CHECK(losses(dir / "pre.jsonl") == losses(dir / "finetune.jsonl"));
  CHECK(read_metrics(dir / "pre.jsonl").iterations.begin()->first == 1);
  // --load wins when it has a checkpoint.
  require_ok(megatrain(run + " --load " + ck + " --ckpt-step 4 --pretrained-checkpoint " + (dir / "none") +
                       metrics("both.jsonl")));
  CHECK(losses(dir / "both.jsonl") == resume);

  // Refusals: nothing to load, or nothing to override.
  Result r = megatrain(run + " --load " + (dir / "empty") + " --no-initialization");
  CHECK(r.code != 0);
  CHECK(r.out.find("--no-initialization: --load " + (dir / "empty") + " holds no checkpoint") != std::string::npos);
  r = megatrain(run + " --load " + (dir / "empty") + " --pretrained-checkpoint " + (dir / "none"));
  CHECK(r.code != 0);
  CHECK(r.out.find("No checkpoint found in load directory or pretrained directory") != std::string::npos);
  r = megatrain(run + " --load " + (dir / "empty") + " --pretrained-checkpoint " + ck + " --override-ckpt-iteration 2");
  CHECK(r.code != 0);
  CHECK(r.out.find("loads as a finetune") != std::string::npos);
}

TEST_CASE("binary: --use-checkpoint-args rebuilds the model from the checkpoint's arguments", "[ckpt-train][binary]") {
  TempDir dir;
  const std::string ck = dir / "ck";
  const std::string train = " --train-iters 6 --lr-warmup-iters 2";
  require_ok(megatrain(kLlama + train + " --save " + ck + " --save-interval 3"));
  require_ok(megatrain(kLlama + train + " --load " + ck + " --ckpt-step 3 --metrics-jsonl " + (dir / "full.jsonl")));
  // No model flags at all, and a dropout the checkpoint's overrides (Megatron forces it).
  const std::string bare = "--device cpu --mock-data --vocab-size 64 --micro-batch-size 2 --global-batch-size 4 "
                           "--lr 1e-2 --min-lr 1e-3 --lr-decay-style cosine --seed 7 --log-interval 1 --hidden-dropout 0.5";
  const Result r = megatrain(bare + train + " --load " + ck + " --ckpt-step 3 --use-checkpoint-args --metrics-jsonl " +
                             (dir / "args.jsonl"));
  require_ok(r);
  for (const char* line : {"Setting num_layers to 2 from checkpoint", "Setting normalization to RMSNorm from checkpoint",
                           "Setting hidden_dropout to 0.1 from checkpoint", "Setting add_bias_linear to False from checkpoint",
                           "Setting tokenizer_type to NullTokenizer from checkpoint"})
    CHECK(r.out.find(line) != std::string::npos);
  const auto full = losses(dir / "full.jsonl");
  REQUIRE(full.size() == 3);
  CHECK(losses(dir / "args.jsonl") == full);
  // A size given on the command line is kept (Megatron fills only what is missing), so the
  // checkpoint no longer fits and says which flag differs.
  const Result three = megatrain(bare + train + " --load " + ck + " --use-checkpoint-args --num-layers 3");
  CHECK(three.code != 0);
  CHECK(three.out.find("--num-layers is 2 in the checkpoint but 3 in this run") != std::string::npos);
  // An empty --load leaves the command line as it is (then the model flags are missing).
  const Result none = megatrain(bare + train + " --load " + (dir / "empty") + " --use-checkpoint-args");
  CHECK(none.code != 0);
  CHECK(none.out.find("--num-layers is required") != std::string::npos);
}

TEST_CASE("binary: non-persistent checkpoints are saved apart, only the newest kept, and resumed from when newer",
          "[ckpt-train][binary][non-persistent]") {
  TempDir dir;
  const std::string ck = dir / "ck", np = ck + "/non_persistent";
  const std::string run = kGpt + " --train-iters 10 --lr-warmup-iters 2";
  const std::string flags = " --save " + ck + " --save-interval 4 --non-persistent-save-interval 3 "
                            "--non-persistent-ckpt-type global --log-progress";
  auto metrics = [&](const std::string& name) { return " --metrics-jsonl " + (dir / name); };
  require_ok(megatrain(run + metrics("straight.jsonl")));
  REQUIRE(losses(dir / "straight.jsonl").size() == 10);

  // Non-persistent saves at 3 and 6 (4 is a persistent one); the exit at 6 saves nothing more, as
  // iteration 6 was just saved (non-persistently).
  require_ok(megatrain(run + flags + " --exit-interval 6"));
  CHECK(tracker(ck) == "4");
  CHECK(tracker(np) == "6");
  CHECK(iteration_dirs(np) == std::vector<std::string>{"iter_0000006"});  // 3 deleted once 6 was committed
  CHECK(iteration_dirs(ck) == std::vector<std::string>{"iter_0000004", "non_persistent"});
  // The progress log leaves non-persistent saves out (as Megatron).
  CHECK(progress_messages(ck) == std::vector<std::string>{"Starting job", "Saved checkpoint Iteration: 4"});

  // The resumed job loads iteration 6 (newer than --load's 4) and trains as the straight run;
  // asynchronously saved, non-persistent 9 replaces 6.
  const Result resumed = megatrain(run + flags + " --load " + ck + " --async-save" + metrics("resumed.jsonl"));
  require_ok(resumed);
  CHECK(resumed.out.find("Loading from a non-persistent checkpoint (non-persistent iter 6)") != std::string::npos);
  check_same_training(dir / "resumed.jsonl", dir / "straight.jsonl", 7, 4);
  CHECK(tracker(np) == "9");
  CHECK(iteration_dirs(np) == std::vector<std::string>{"iter_0000009"});
  CHECK(tracker(ck) == "10");
  // Now --load's 10 is the newer: it is loaded, with Megatron's warning.
  const Result older =
      megatrain(kGpt + " --train-iters 12 --lr-warmup-iters 2 --override-opt-param-scheduler" + flags + " --load " + ck);
  require_ok(older);
  CHECK(older.out.find("WARNING: non-persistent checkpoints are older than persistent checkpoint") != std::string::npos);
  CHECK(older.out.find(" loading checkpoint from " + ck + " at iteration 10") != std::string::npos);
  // --ckpt-step names the checkpoint to load (Megatron would still compare it with the
  // non-persistent one).
  const Result step = megatrain(run + flags + " --load " + ck + " --ckpt-step 4");
  require_ok(step);
  CHECK(step.out.find("--ckpt-step 4: loading that checkpoint of --load, not a non-persistent one") != std::string::npos);
}

TEST_CASE("binary: --non-persistent-global-ckpt-dir, with --use-checkpoint-args, and the refusals", "[ckpt-train][binary][non-persistent]") {
  TempDir dir;
  const std::string ck = dir / "ck", global = dir / "scratch";
  const std::string train = " --train-iters 6 --lr-warmup-iters 2";
  const std::string np = " --non-persistent-ckpt-type global --non-persistent-global-ckpt-dir " + global;
  require_ok(megatrain(kLlama + train + " --metrics-jsonl " + (dir / "straight.jsonl")));
  // Only a non-persistent checkpoint (iteration 3), in the given directory: --load has none.
  require_ok(megatrain(kLlama + train + " --save " + ck + " --save-interval 100 --non-persistent-save-interval 3" + np +
                       " --exit-interval 3"));
  CHECK(!fs::exists(ck + "/latest_checkpointed_iteration.txt"));
  CHECK(tracker(global) == "3");
  // The resumed job takes its model from that checkpoint's arguments too.
  const Result r = megatrain(kCommon + train + " --load " + ck + np + " --use-checkpoint-args --metrics-jsonl " +
                             (dir / "resumed.jsonl"));
  require_ok(r);
  CHECK(r.out.find("Setting num_layers to 2 from checkpoint") != std::string::npos);
  CHECK(r.out.find("Loading from a non-persistent checkpoint (non-persistent iter 3)") != std::string::npos);
  check_same_training(dir / "resumed.jsonl", dir / "straight.jsonl", 4, 3);

  // Refusals and warnings.
  const std::string save = " --save " + ck + " --save-interval 4";
  Result bad = megatrain(kGpt + train + save + " --non-persistent-save-interval 3");
  CHECK(bad.code != 0);
  CHECK(bad.out.find("--non-persistent-save-interval needs --non-persistent-ckpt-type global") != std::string::npos);
  bad = megatrain(kGpt + train + save + " --non-persistent-save-interval 0 --non-persistent-ckpt-type global");
  CHECK(bad.code != 0);
  CHECK(bad.out.find("--non-persistent-save-interval must be > 0") != std::string::npos);
  bad = megatrain(kGpt + train + save + " --non-persistent-save-interval 3 --non-persistent-ckpt-type local");
  CHECK(bad.code != 0);
  CHECK(bad.out.find("megatrain does not support --non-persistent-ckpt-type local") != std::string::npos);
  bad = megatrain(kGpt + train + save + " --non-persistent-ckpt-type global --non-persistent-save-interval 3 "
                  "--non-persistent-global-ckpt-dir " + ck + "/");
  CHECK(bad.code != 0);
  CHECK(bad.out.find("is --save's directory") != std::string::npos);
  const Result warn = megatrain(kGpt + train + " --non-persistent-global-ckpt-dir " + global);
  require_ok(warn);
  CHECK(warn.out.find("--non-persistent-global-ckpt-dir has no effect without --non-persistent-ckpt-type global") !=
        std::string::npos);
}

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

std::map<int64_t, double> losses(const std::string& jsonl) {
  std::map<int64_t, double> out;
  for (const auto& [it, r] : read_metrics(jsonl).iterations) out[it] = r.at("lm_loss").get<double>();
  return out;
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

// Checkpointing through the megatrain binary on the CPU (reference backend): bit-exact resume in a
// new process, Megatron's load flags, refusals of bad checkpoints, SIGTERM, --exit-interval, async
// saves, a save that fails, and the reporters' files of a real run.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "app/tensorboard_writer.h"
#include "checkpoint/file_io.h"
#include "ckpt_test_util.h"
#include "training_binary_util.h"

using mt_test::read_bytes;
using mt_test::run_command;
using mt_test::TempDir;
using namespace mt_test::training_binary;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// Every shard file of two iteration directories, byte for byte.
void require_same_shards(const std::string& a, const std::string& b) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(a))
    if (e.path().extension() == ".safetensors") names.push_back(e.path().filename());
  REQUIRE(names.size() >= 2);  // model and optimizer files at least
  for (const auto& n : names) {
    INFO(a << "/" << n << " vs " << b << "/" << n);
    REQUIRE(fs::exists(b + "/" + n));
    CHECK(read_bytes(a + "/" + n) == read_bytes(b + "/" + n));
  }
  const json ma = json::parse(read_bytes(a + "/manifest.json")), mb = json::parse(read_bytes(b + "/manifest.json"));
  CHECK(ma.at("tensors") == mb.at("tensors"));
}

double value(const json& record, const char* key) { return record.at(key).get<double>(); }

// Straight 20 iterations vs 10 (stopped by --exit-interval, saved) + 10 in a new process.
void check_bit_exact_resume(const std::string& model, const std::string& extra) {
  TempDir dir;
  const std::string a = dir / "a", b = dir / "b";
  const std::string run = model + " " + extra + " --train-iters 20 --save-interval 10 --lr-warmup-iters 3";
  require_ok(megatrain(run + " --save " + a + " --metrics-jsonl " + (dir / "a.jsonl")));
  const Result first = megatrain(run + " --save " + b + " --exit-interval 10 --metrics-jsonl " + (dir / "b1.jsonl"));
  require_ok(first);
  CHECK(tracker(b) == "10");
  CHECK(first.out.find("exiting program at iteration 10") != std::string::npos);
  require_ok(megatrain(run + " --save " + b + " --load " + b + " --metrics-jsonl " + (dir / "b2.jsonl")));
  CHECK(tracker(b) == "20");

  const Metrics ma = read_metrics(dir / "a.jsonl"), mb = read_metrics(dir / "b2.jsonl");
  REQUIRE(ma.iterations.size() == 20);
  REQUIRE(mb.iterations.size() == 10);
  REQUIRE(mb.iterations.begin()->first == 11);
  CHECK(mb.iterations.at(11).at("consumed_samples") == 44);
  for (int64_t it = 11; it <= 20; ++it) {
    INFO("iteration " << it);
    const json &x = ma.iterations.at(it), &y = mb.iterations.at(it);
    CHECK(value(x, "grad_norm") == value(y, "grad_norm"));
    CHECK(value(x, "learning_rate") == value(y, "learning_rate"));
    // The log line averages over its interval; the resumed run's first line (11) does not reset
    // it (Megatron HEAD's first-iteration line), so 12 averages 11 and 12 there.
    if (it == 12)
      CHECK(value(y, "lm_loss") == (value(ma.iterations.at(11), "lm_loss") + value(x, "lm_loss")) / 2);
    else
      CHECK(value(x, "lm_loss") == value(y, "lm_loss"));
  }
  // Evaluations after the resume read the validation data where the first run left it.
  std::vector<json> ea, eb;
  for (const json& e : ma.evaluations)
    if (e.at("iteration").get<int64_t>() > 10) ea.push_back(e);
  eb = mb.evaluations;
  REQUIRE(ea.size() == eb.size());
  for (size_t i = 0; i < ea.size(); ++i) CHECK(value(ea[i], "lm_loss") == value(eb[i], "lm_loss"));
  require_same_shards(a + "/iter_0000020", b + "/iter_0000020");
}

}  // namespace

TEST_CASE("binary: resume in a new process is bit-exact (GPT, dropout, evaluation)", "[ckpt-train][binary][resume]") {
  check_bit_exact_resume(kGpt, "--eval-interval 5 --eval-iters 2");
}

TEST_CASE("binary: resume in a new process is bit-exact (Llama: GQA, SwiGLU, RoPE, untied, dropout)", "[ckpt-train][binary][resume]") {
  check_bit_exact_resume(kLlama, "--eval-iters 0");
}

TEST_CASE("binary: --finetune, --no-load-optim and --no-load-rng follow Megatron", "[ckpt-train][binary]") {
  TempDir dir;
  const std::string a = dir / "a";
  const std::string gpt = kGpt + " --lr-warmup-iters 3";
  require_ok(megatrain(gpt + " --train-iters 20 --save-interval 10 --save " + a + " --eval-iters 0 --metrics-jsonl " +
                       (dir / "a.jsonl")));
  const Metrics ma = read_metrics(dir / "a.jsonl");
  const std::string from10 = " --eval-iters 0 --load " + a + " --ckpt-step 10";

  SECTION("--finetune: weights only, iteration and consumed samples start at 0") {
    require_ok(megatrain(gpt + " --train-iters 20 --exit-interval 2" + from10 + " --finetune --metrics-jsonl " +
                         (dir / "f.jsonl")));
    const Metrics m = read_metrics(dir / "f.jsonl");
    REQUIRE(m.iterations.begin()->first == 1);
    CHECK(m.iterations.at(1).at("consumed_samples") == 4);
    CHECK(value(m.iterations.at(1), "learning_rate") == value(ma.iterations.at(1), "learning_rate"));
    CHECK(value(m.iterations.at(1), "lm_loss") != value(ma.iterations.at(1), "lm_loss"));  // trained weights
  }
  SECTION("--no-load-optim: progress restored, optimizer and scheduler start afresh") {
    require_ok(megatrain(gpt + " --train-iters 20 --exit-interval 13" + from10 + " --no-load-optim --metrics-jsonl " +
                         (dir / "o.jsonl")));
    const Metrics m = read_metrics(dir / "o.jsonl");
    REQUIRE(m.iterations.begin()->first == 11);
    CHECK(m.iterations.at(11).at("consumed_samples") == 44);
    // The scheduler restarted at step 0: after one step its LR is the first iteration's.
    CHECK(value(m.iterations.at(11), "learning_rate") == value(ma.iterations.at(1), "learning_rate"));
    // Same weights, data and dropout masks: iteration 11's loss is the straight run's; the fresh
    // Adam state then moves the weights elsewhere.
    CHECK(value(m.iterations.at(11), "lm_loss") == value(ma.iterations.at(11), "lm_loss"));
    CHECK(value(m.iterations.at(13), "lm_loss") != value(ma.iterations.at(13), "lm_loss"));
  }
  SECTION("--no-load-rng: the dropout masks restart from the seed") {
    require_ok(megatrain(gpt + " --train-iters 20 --exit-interval 11" + from10 + " --no-load-rng --metrics-jsonl " +
                         (dir / "r.jsonl")));
    const Metrics m = read_metrics(dir / "r.jsonl");
    REQUIRE(m.iterations.begin()->first == 11);
    CHECK(value(m.iterations.at(11), "learning_rate") == value(ma.iterations.at(11), "learning_rate"));
    CHECK(value(m.iterations.at(11), "lm_loss") != value(ma.iterations.at(11), "lm_loss"));
  }
}

TEST_CASE("binary: a checkpoint without optimizer or RNG state needs --no-load-optim / --no-load-rng", "[ckpt-train][binary]") {
  TempDir dir;
  const std::string c = dir / "c";
  require_ok(megatrain(kGpt + " --train-iters 2 --save-interval 2 --eval-iters 0 --no-save-optim --no-save-rng --save " + c));
  CHECK_FALSE(fs::exists(c + "/iter_0000002/rank_00000-optim.safetensors"));
  const std::string load = kGpt + " --train-iters 3 --eval-iters 0 --load " + c;
  Result r = megatrain(load);
  CHECK(r.code == 1);
  CHECK(r.out.find("holds no optimizer state (saved with --no-save-optim?): pass --no-load-optim") != std::string::npos);
  r = megatrain(load + " --no-load-optim");
  CHECK(r.code == 1);
  CHECK(r.out.find("holds no RNG state (saved with --no-save-rng?): pass --no-load-rng") != std::string::npos);
  require_ok(megatrain(load + " --no-load-optim --no-load-rng --metrics-jsonl " + (dir / "m.jsonl")));
  CHECK(read_metrics(dir / "m.jsonl").iterations.begin()->first == 3);
}

TEST_CASE("binary: --ckpt-step, and a missing checkpoint with and without --exit-on-missing-checkpoint", "[ckpt-train][binary]") {
  TempDir dir;
  const std::string a = dir / "a";
  require_ok(megatrain(kGpt + " --train-iters 4 --save-interval 2 --eval-iters 0 --save " + a));
  CHECK(tracker(a) == "4");
  require_ok(megatrain(kGpt + " --train-iters 4 --eval-iters 0 --load " + a + " --ckpt-step 2 --metrics-jsonl " +
                       (dir / "m.jsonl")));
  CHECK(read_metrics(dir / "m.jsonl").iterations.begin()->first == 3);
  Result r = megatrain(kGpt + " --train-iters 4 --eval-iters 0 --load " + a + " --ckpt-step 3");
  CHECK(r.code == 1);
  CHECK(r.out.find("--ckpt-step 3: checkpoint directory " + a + "/iter_0000003 does not exist") != std::string::npos);

  const std::string empty = dir / "empty";
  fs::create_directories(empty);
  r = megatrain(kGpt + " --train-iters 1 --eval-iters 0 --load " + empty);
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK(r.out.find("could not find the metadata file " + empty + "/latest_checkpointed_iteration.txt") != std::string::npos);
  CHECK(r.out.find("will not load any checkpoints and will start from random") != std::string::npos);
  r = megatrain(kGpt + " --train-iters 1 --eval-iters 0 --load " + empty + " --exit-on-missing-checkpoint");
  CHECK(r.code == 1);
  CHECK(r.out.find("--exit-on-missing-checkpoint is set but no checkpoint was found") != std::string::npos);
}

TEST_CASE("binary: corrupt, truncated and mismatched checkpoints are refused naming the file", "[ckpt-train][binary][errors]") {
  TempDir dir;
  const std::string a = dir / "a", it = a + "/iter_0000002";
  require_ok(megatrain(kGpt + " --train-iters 4 --exit-interval 2 --save-interval 2 --eval-iters 0 --save " + a));
  // (The same --train-iters: another one changes the LR schedule, which a resume refuses as Megatron does.)
  const std::string load = " --train-iters 4 --exit-interval 3 --eval-iters 0 --load " + a;

  Result r = megatrain(kCommon + " --num-layers 2 --hidden-size 64 --num-attention-heads 4" + load);
  CHECK(r.code == 1);
  CHECK(r.out.find("checkpoint " + it + "/manifest.json was saved for another model: --hidden-size is 32 in the "
                   "checkpoint but 64 in this run") != std::string::npos);
  r = megatrain(kCommon + " --num-layers 3 --hidden-size 32 --num-attention-heads 4" + load);
  CHECK(r.code == 1);
  CHECK(r.out.find("--num-layers is 2 in the checkpoint but 3 in this run") != std::string::npos);

  const std::string model_file = it + "/rank_00000-model.safetensors";
  const std::string original = read_bytes(model_file);
  {
    std::string bad = original;
    bad[bad.size() - 5] ^= 0x10;  // inside the last tensor's data
    mt_test::write_text(model_file, bad);
  }
  r = megatrain(kGpt + load);
  CHECK(r.code == 1);
  CHECK(r.out.find("checksum mismatch in " + model_file) != std::string::npos);
  mt_test::write_text(model_file, original);
  require_ok(megatrain(kGpt + load));

  const std::string optim_file = it + "/rank_00000-optim.safetensors";
  const std::string optim = read_bytes(optim_file);
  mt_test::write_text(optim_file, optim.substr(0, optim.size() - 4));
  r = megatrain(kGpt + load);
  CHECK(r.code == 1);
  CHECK(r.out.find("shard file " + optim_file + " has " + std::to_string(optim.size() - 4) + " bytes, the manifest "
                   "records " + std::to_string(optim.size()) + " (truncated)") != std::string::npos);
  // Weights-only loads do not read the optimizer file, but the checkpoint is still refused whole.
  r = megatrain(kGpt + load + " --finetune");
  CHECK(r.code == 1);
}

// A run with `flags` (and --save, --metrics-jsonl) sent `sig` after a few iterations: its exit
// status, output, save directory and metrics file.
struct Preempted {
  int status = 0;
  std::string out, save, metrics;
};
static Preempted preempt(const TempDir& dir, const std::string& flags, int sig) {
  Preempted p;
  p.save = dir / "s";
  p.metrics = dir / "m.jsonl";
  const std::string log = dir / "out.txt";
  std::vector<std::string> args = {MEGATRAIN_BINARY};
  std::istringstream words(kGpt + " --train-iters 1000000 --save-interval 1000000 --eval-iters 0 --save " + p.save +
                           " --metrics-jsonl " + p.metrics + " " + flags);
  for (std::string w; words >> w;) args.push_back(w);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  // Wait for a few iterations, then preempt.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline && read_metrics(p.metrics).iterations.size() < 3)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  REQUIRE(::kill(pid, sig) == 0);
  REQUIRE(::waitpid(pid, &p.status, 0) == pid);
  p.out = read_bytes(log);
  return p;
}

// --exit-signal-handler (and `extra` flags) preempted by `sig`: the run finishes the step, saves,
// says so with the signal's name and exits 0.
static void check_signal_exit(const std::string& extra, int sig, const std::string& sig_name) {
  TempDir dir;
  const Preempted p = preempt(dir, "--exit-signal-handler" + extra, sig);
  INFO(p.out);
  REQUIRE(WIFEXITED(p.status));
  CHECK(WEXITSTATUS(p.status) == 0);
  const std::string key = "exiting program at iteration ";
  const size_t at = p.out.find(key);
  REQUIRE(at != std::string::npos);
  const int64_t stopped = std::stoll(p.out.substr(at + key.size()));
  CHECK(stopped >= 3);
  CHECK(tracker(p.save) == std::to_string(stopped));
  CHECK(read_metrics(p.metrics).iterations.rbegin()->first == stopped);
  char name[32];
  std::snprintf(name, sizeof name, "/iter_%07lld", static_cast<long long>(stopped));
  CHECK(fs::exists(p.save + name + "/manifest.json"));
  CHECK_THAT(p.out, Catch::Contains(" on " + sig_name));
}

TEST_CASE("binary: SIGTERM with --exit-signal-handler finishes the step, saves and exits 0", "[ckpt-train][binary][signal]") {
  check_signal_exit("", SIGTERM, "SIGTERM");
}

// --exit-signal names the signal caught instead (SIGUSR1, which would otherwise kill the process).
TEST_CASE("binary: --exit-signal SIGUSR1 with --exit-signal-handler saves and exits 0 on SIGUSR1", "[ckpt-train][binary][signal]") {
  check_signal_exit(" --exit-signal SIGUSR1", SIGUSR1, "SIGUSR1");
}

// --exit-signal-handler-for-training: SIGINT (or SIGTERM, also beside --exit-signal-handler, whose
// handler it replaces as in Megatron-LM) stops the run after its step with Megatron-LM's line, no
// checkpoint and exit status 0.
TEST_CASE("binary: --exit-signal-handler-for-training shuts down on SIGINT and SIGTERM without saving", "[ckpt-train][binary][signal]") {
  for (const auto& [flags, sig] : std::vector<std::pair<std::string, int>>{
           {"--exit-signal-handler-for-training", SIGINT},
           {"--exit-signal-handler --exit-signal-handler-for-training", SIGTERM}}) {
    TempDir dir;
    const Preempted p = preempt(dir, flags, sig);
    INFO(flags << "\n" << p.out);
    REQUIRE(WIFEXITED(p.status));
    CHECK(WEXITSTATUS(p.status) == 0);
    CHECK_THAT(p.out, Catch::Contains("Termination requested. Performing orderly shutdown."));
    CHECK_FALSE(fs::exists(p.save + "/latest_checkpointed_iteration.txt"));
    CHECK(read_metrics(p.metrics).iterations.size() >= 3);
  }
}

TEST_CASE("binary: --exit-interval saves before exiting and skips the final evaluation", "[ckpt-train][binary]") {
  TempDir dir;
  const std::string s = dir / "s";
  const Result r = megatrain(kGpt + " --train-iters 20 --save-interval 5 --exit-interval 7 --eval-interval 100 "
                                    "--eval-iters 1 --save " + s);
  require_ok(r);
  CHECK(tracker(s) == "7");
  CHECK(fs::exists(s + "/iter_0000005/manifest.json"));
  CHECK(fs::exists(s + "/iter_0000007/manifest.json"));
  CHECK(r.out.find("on validation set") == std::string::npos);
  // Without an early exit the last iteration is saved even off the interval (Megatron's pretrain).
  const std::string t = dir / "t";
  require_ok(megatrain(kGpt + " --train-iters 7 --save-interval 5 --eval-iters 0 --save " + t));
  CHECK(tracker(t) == "7");
}

TEST_CASE("binary: --async-save writes the same checkpoints as a synchronous save", "[ckpt-train][binary][async]") {
  TempDir dir;
  const std::string sync = dir / "sync", async = dir / "async";
  const std::string run = kLlama + " --train-iters 6 --save-interval 2 --eval-iters 0";
  require_ok(megatrain(run + " --save " + sync));
  const Result r = megatrain(run + " --async-save --save " + async);
  require_ok(r);
  CHECK(r.out.find("scheduled an asynchronous save of iteration       2") != std::string::npos);
  CHECK(r.out.find("successfully saved checkpoint from iteration       6") != std::string::npos);
  CHECK(tracker(async) == "6");
  for (const char* it : {"/iter_0000002", "/iter_0000004", "/iter_0000006"}) require_same_shards(sync + it, async + it);
  for (const auto& e : fs::directory_iterator(async))
    CHECK(e.path().extension() != ".tmp");  // every save committed
}

TEST_CASE("binary: a save that fails stops with a clear error and the previous checkpoint stays loadable", "[ckpt-train][binary][errors]") {
  for (const bool async : {false, true}) {
    INFO((async ? "asynchronous" : "synchronous") << " save");
    TempDir dir;
    const std::string s = dir / "s";
    fs::create_directories(s);
    // Something that is not a directory where the save of iteration 4 must write: the save fails
    // as a full or read-only disk would make it fail (root ignores permissions, so this is used).
    mt_test::write_text(s + "/iter_0000004.tmp", "in the way");
    const Result r = megatrain(kGpt + " --train-iters 6 --save-interval 2 --eval-iters 0 --save " + s +
                               (async ? " --async-save" : ""));
    INFO(r.out);
    CHECK(r.code == 1);
    CHECK(r.out.find("iteration 4 to " + s + " failed: cannot create directory " + s + "/iter_0000004.tmp") !=
          std::string::npos);
    CHECK(r.out.find("(the checkpoint of iteration 2 remains the latest, unchanged)") != std::string::npos);
    CHECK(tracker(s) == "2");
    fs::remove_all(s + "/iter_0000004.tmp");
    require_ok(megatrain(kGpt + " --train-iters 6 --exit-interval 3 --eval-iters 0 --load " + s + " --metrics-jsonl " +
                         (dir / "m.jsonl")));
    CHECK(read_metrics(dir / "m.jsonl").iterations.begin()->first == 3);
  }
}

TEST_CASE("binary: a CPU run writes TensorBoard events and JSON lines for its log and evaluation intervals", "[ckpt-train][binary][obs]") {
  TempDir dir;
  const std::string tb = dir / "tb", jl = dir / "m.jsonl";
  const Result r = megatrain(kGpt + " --train-iters 10 --log-interval 5 --eval-interval 5 --eval-iters 1 "
                                    "--tensorboard-dir " + tb + " --log-memory-to-tensorboard --metrics-jsonl " + jl);
  require_ok(r);
  const Metrics m = read_metrics(jl);
  std::vector<int64_t> its;
  for (const auto& [it, rec] : m.iterations) its.push_back(it);
  CHECK(its == std::vector<int64_t>{1, 5, 10});  // the first iteration, then every --log-interval
  CHECK(m.iterations.at(10).at("consumed_samples") == 40);
  CHECK(m.iterations.at(10).at("memory_allocated_bytes").get<double>() > 0);
  REQUIRE(m.evaluations.size() == 3);  // at 5, 10 and after training
  CHECK(m.evaluations.back().at("after_training") == true);

  const auto names = mt::list_directory(tb);
  REQUIRE(names.size() == 1);
  const std::vector<mt::TensorBoardEvent> events = mt::read_tensorboard_events(tb + "/" + names[0]);
  std::map<std::string, std::vector<int64_t>> steps;
  for (const auto& e : events)
    for (const auto& [tag, v] : e.scalars) steps[tag].push_back(e.step);
  // TensorBoard gets every iteration's own values (--tensorboard-log-interval 1).
  CHECK(steps["lm loss"] == std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  CHECK(steps["learning-rate"].size() == 10);
  CHECK(steps["mem-allocated-bytes"].size() == 10);
  CHECK(steps["lm loss validation"].size() == 3);
}

// No W&B client: --wandb-project writes the TensorBoard event files into the W&B directory and the
// last rank prints, once, the `wandb sync` command that uploads them.
TEST_CASE("binary: --wandb-project writes the tensorboard event files into --wandb-save-dir and prints wandb sync",
          "[ckpt-train][binary][obs]") {
  TempDir dir;
  const std::string w = dir / "wandb";
  const Result r = megatrain(kGpt + " --train-iters 4 --eval-iters 0 --wandb-project tiny --wandb-exp-name gpt-2l "
                                    "--wandb-entity lab --wandb-save-dir " + w);
  require_ok(r);
  const std::string sync = "wandb sync --project tiny --entity lab --id gpt-2l " + w;
  const size_t at = r.out.find(sync);
  CHECK(at != std::string::npos);
  CHECK(r.out.find("wandb sync", at + 1) == std::string::npos);  // once
  const auto names = mt::list_directory(w);
  REQUIRE(names.size() == 1);
  CHECK(names[0].rfind("events.out.tfevents.", 0) == 0);
  std::vector<int64_t> steps;
  for (const auto& e : mt::read_tensorboard_events(w + "/" + names[0]))
    for (const auto& [tag, v] : e.scalars)
      if (tag == "lm loss") steps.push_back(e.step);
  CHECK(steps == std::vector<int64_t>{1, 2, 3, 4});

  // Without --wandb-save-dir the W&B directory is <save>/wandb (Megatron-LM's default); without
  // --save either, the run is refused as Megatron-LM fails on it.
  const std::string s = dir / "ckpt";
  require_ok(megatrain(kGpt + " --train-iters 2 --eval-iters 0 --wandb-project tiny --save " + s + " --save-interval 2"));
  CHECK(mt::list_directory(s + "/wandb").size() == 1);
  const Result refused = megatrain(kGpt + " --train-iters 2 --wandb-project tiny");
  CHECK(refused.code == 1);
  CHECK(refused.out.find("pass --wandb-save-dir DIR or --save") != std::string::npos);
}

// --exit-duration-in-mins: after the minutes have passed, the iteration in progress finishes, a
// checkpoint is saved and the run ends with exit 0, as Megatron's pretrain does. A minute is 0.2 s
// here (the hidden MEGATRAIN_DEBUG_SECONDS_PER_MINUTE hook), so 1 "minute" passes mid-run.
TEST_CASE("binary: --exit-duration-in-mins saves and exits 0 once the time is up", "[ckpt-train][binary]") {
  TempDir dir;
  const std::string s = dir / "s";
  Result r;
  r.code = run_command("MEGATRAIN_DEBUG_SECONDS_PER_MINUTE=0.2 " + std::string(MEGATRAIN_BINARY) + " " + kGpt +
                           " --train-iters 1000000 --save-interval 1000000 --eval-iters 0 --exit-duration-in-mins 1 "
                           "--save " + s,
                       &r.out);
  require_ok(r);
  INFO(r.out);
  CHECK(r.out.find("exiting program after") != std::string::npos);
  REQUIRE(fs::exists(s + "/latest_checkpointed_iteration.txt"));
  const int64_t saved = std::stoll(tracker(s));
  CHECK(saved > 0);
  CHECK(saved < 1000000);
  char name[32];
  std::snprintf(name, sizeof name, "/iter_%07lld", static_cast<long long>(saved));
  CHECK(fs::exists(s + name + "/manifest.json"));
  // The flag's value is checked: 0 minutes is refused.
  const Result bad = megatrain(kGpt + " --train-iters 5 --exit-duration-in-mins 0");
  CHECK(bad.code != 0);
  CHECK(bad.out.find("--exit-duration-in-mins must be > 0") != std::string::npos);
}

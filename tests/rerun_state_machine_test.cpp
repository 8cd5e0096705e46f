// Megatron-LM's rerun state machine (engine/rerun_state_machine.h): the machine alone on made-up
// values, and the megatrain binary on the CPU with injected errors (--error-injection-rate 1:
// every validated iteration, i.e. from the second one on).
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/rerun_state_machine.h"
#include "tests/training_binary_util.h"

using mt::RerunStateMachine;

namespace {

bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }
size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

// One iteration of the trainer's loop with the spiky-loss check: `first` on the first pass,
// `again` on a re-run. Returns the passes run and the decision.
struct Iteration {
  int passes = 0;
  RerunStateMachine::Decision decision;
};
Iteration spiky_iteration(RerunStateMachine& sm, int64_t it, double first, double again) {
  Iteration r;
  sm.should_run_forward_backward(it);
  for (;;) {
    const double v = r.passes == 0 ? first : again;
    ++r.passes;
    sm.validate_result(v, [&sm](double x) { return sm.is_unexpectedly_large(x, 10.0, "loss"); }, "Spiky loss", 0.0,
                       false);
    if (!sm.should_run_forward_backward(it)) break;
  }
  r.decision = sm.should_checkpoint_and_exit();
  return r;
}

}  // namespace

TEST_CASE("rerun state machine: a spiky loss after the first 100 samples is re-run and training continues",
          "[rerun]") {
  RerunStateMachine sm(RerunStateMachine::Mode::validate_results, 0, RerunStateMachine::Injected::transient_error, 1,
                       0, "node", 0, [](bool v) { return v; });
  // Iteration 1 is not validated; the next 100 set the maximum (2.0).
  for (int64_t it = 0; it < 101; ++it) CHECK(spiky_iteration(sm, it, it == 50 ? 2.0 : 1.0, 1.0).passes == 1);
  CHECK(spiky_iteration(sm, 101, 19.9, 19.9).passes == 1);  // < 10 x 2.0
  // A reproducible spike: re-run once, not fatal: continue.
  Iteration spike = spiky_iteration(sm, 102, 25.0, 25.0);
  CHECK(spike.passes == 2);
  CHECK_FALSE(spike.decision.exit);
  // A spike the re-run does not reproduce (transient): continue as well.
  spike = spiky_iteration(sm, 103, 25.0, 1.0);
  CHECK(spike.passes == 2);
  CHECK_FALSE(spike.decision.exit);
  CHECK(spiky_iteration(sm, 104, 1.0, 1.0).passes == 1);
}

TEST_CASE("rerun state machine: a NaN loss that reproduces asks for a checkpoint and exit code 16 and one that does "
          "not exits 17",
          "[rerun]") {
  for (const bool reproducible : {true, false}) {
    RerunStateMachine sm(RerunStateMachine::Mode::validate_results, 0, RerunStateMachine::Injected::transient_error,
                         1, 0, "node", 0, [](bool v) { return v; });
    auto nan_check = [&](double v) {
      sm.validate_result(v, [](double x) { return std::isnan(x); }, "found NaN in local forward loss calculation",
                         0.0, true);
    };
    sm.should_run_forward_backward(0);
    nan_check(NAN);  // iteration 1: not validated
    CHECK_FALSE(sm.should_run_forward_backward(0));
    CHECK_FALSE(sm.should_checkpoint_and_exit().exit);
    REQUIRE(sm.should_run_forward_backward(1));
    nan_check(NAN);
    REQUIRE(sm.should_run_forward_backward(1));  // the re-run
    nan_check(reproducible ? NAN : 3.0);
    CHECK_FALSE(sm.should_run_forward_backward(1));
    const RerunStateMachine::Decision d = sm.should_checkpoint_and_exit();
    CHECK(d.exit);
    CHECK(d.checkpoint == reproducible);
    CHECK(d.exit_code == (reproducible ? 16 : 17));
  }
}

using namespace mt_test::training_binary;

namespace {
const std::string kRun = kGpt + " --train-iters 6";

std::vector<std::pair<double, double>> losses_and_norms(const std::string& path) {
  std::vector<std::pair<double, double>> v;
  for (const auto& [it, j] : read_metrics(path).iterations)
    v.push_back({j.at("lm_loss").get<double>(), j.at("grad_norm").get<double>()});
  return v;
}
}  // namespace

TEST_CASE("megatrain --error-injection-type transient_error in the spiky-loss check re-runs the iteration and "
          "continues with the same losses",
          "[rerun][binary]") {
  mt_test::TempDir dir;
  const std::string checks = " --no-check-for-nan-in-loss-and-grad --check-for-spiky-loss";
  require_ok(megatrain(kRun + checks + " --metrics-jsonl " + (dir / "plain.jsonl")));
  const Result r = megatrain(kRun + checks + " --error-injection-rate 1 --error-injection-type transient_error" +
                             " --metrics-jsonl " + (dir / "injected.jsonl"));
  INFO(r.out);
  REQUIRE(r.code == 0);
  CHECK(contains(r.out, "RerunStateMachine initialized in mode RerunMode.VALIDATE_RESULTS"));
  CHECK(contains(r.out, "Result validation enabled"));
  // Iterations 2..6: one injection, one re-run and one "continue" each.
  CHECK(count(r.out, "warning: Injecting error type Transient error") == 5);
  CHECK(count(r.out, "Need to rerun step to check reproducibility of initial result") == 5);
  CHECK(contains(r.out, "on rank 0 at iteration #2 invocation #1 (message='Spiky loss')"));
  CHECK(contains(r.out, "iteration #2: First rerun: unexpected result is not reproducible within the tolerance ("));
  CHECK(contains(r.out, "iteration #2: Possible transient error!"));
  CHECK(count(r.out, "Continuing normal execution because failed validation was not fatal") == 5);
  const auto plain = losses_and_norms(dir / "plain.jsonl"), injected = losses_and_norms(dir / "injected.jsonl");
  REQUIRE(plain.size() == 6);
  CHECK(injected == plain);  // bit for bit: same micro-batches, dropout keys and parameters
}

TEST_CASE("megatrain --error-injection-type transient_error in the fatal NaN check exits 17 without a checkpoint",
          "[rerun][binary]") {
  mt_test::TempDir dir;
  const Result r = megatrain(kRun + " --error-injection-rate 1 --save " + (dir / "ck") + " --save-interval 100");
  INFO(r.out);
  CHECK(r.code == 17);
  CHECK(contains(r.out, "(message='found NaN in local forward loss calculation')"));
  CHECK(contains(r.out, "error: Rank 0, node "));
  CHECK(contains(r.out, "iteration #2: Possible transient error!"));
  CHECK(contains(r.out, "Exiting now. The job can be resumed from a previous checkpoint"));
  CHECK_FALSE(std::filesystem::exists(dir / "ck/latest_checkpointed_iteration.txt"));
}

TEST_CASE("megatrain --error-injection-type persistent_error and correct_result save a checkpoint and exit 16",
          "[rerun][binary]") {
  for (const std::string type : {"persistent_error", "correct_result"}) {
    mt_test::TempDir dir;
    const Result r = megatrain(kRun + " --error-injection-rate 1 --error-injection-type " + type + " --save " +
                               (dir / "ck") + " --save-interval 100");
    INFO(r.out);
    CHECK(r.code == 16);
    CHECK(contains(r.out, type == "correct_result" ? "Injecting error type Expected result"
                                                   : "Injecting error type Persistent error"));
    CHECK(contains(r.out, "iteration #2: First rerun: unexpected result is reproducible within the tolerance ("));
    CHECK(contains(r.out, "Need to rerun on a different GPU to verify correctness.!"));
    CHECK(contains(r.out, "Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun "
                          "the last iteration and establish a diagnostic"));
    // The last completed iteration (1): the failed one was not applied.
    CHECK(tracker(dir / "ck") == "1");
  }
}

TEST_CASE("megatrain --error-injection-type correct_result in a non-fatal check continues and injects once",
          "[rerun][binary]") {
  const Result r = megatrain(kRun + " --no-check-for-nan-in-loss-and-grad --check-for-large-grads "
                                    "--error-injection-rate 1 --error-injection-type correct_result");
  INFO(r.out);
  CHECK(r.code == 0);
  // Megatron clears an injected correct result only at a second re-run (from a checkpoint): no
  // further injection in this run.
  CHECK(count(r.out, "Injecting error type Expected result") == 1);
  CHECK(contains(r.out, "(message='found unexpected large grads before the optimizer step')"));
  CHECK(contains(r.out, "Continuing normal execution because failed validation was not fatal"));
}

TEST_CASE("megatrain --rerun-mode report_stats re-runs every iteration and logs the run-to-run variation",
          "[rerun][binary]") {
  mt_test::TempDir dir;
  require_ok(megatrain(kRun + " --metrics-jsonl " + (dir / "plain.jsonl")));
  const Result r = megatrain(kRun + " --rerun-mode report_stats --metrics-jsonl " + (dir / "stats.jsonl"));
  INFO(r.out);
  REQUIRE(r.code == 0);
  CHECK(contains(r.out, "RerunStateMachine initialized in mode RerunMode.REPORT_DETERMINISM_STATS"));
  // After iterations 1, 3 and 5 (0-indexed 0, 2, 4); the reference backend is deterministic.
  CHECK(count(r.out, "Stats on computation determinism in validation calls") == 3);
  CHECK(contains(r.out, "  From validation call 'found NaN in local forward loss calculation':\n    5 samples, all "
                        "identical"));
  CHECK(contains(r.out, "  From validation call 'found Inf in grad norm before the optimizer step':\n"));
  CHECK(losses_and_norms(dir / "stats.jsonl") == losses_and_norms(dir / "plain.jsonl"));
}

TEST_CASE("megatrain --rerun-mode disabled accepts the checks and bad values are refused", "[rerun][binary]") {
  const Result ok = megatrain(kRun + " --rerun-mode disabled --check-for-spiky-loss --check-for-large-grads");
  INFO(ok.out);
  CHECK(ok.code == 0);
  CHECK(contains(ok.out, "RerunStateMachine initialized in mode RerunMode.DISABLED"));
  const Result bad = megatrain(kRun + " --rerun-mode sometimes");
  CHECK(bad.code != 0);
  CHECK(contains(bad.out, "--rerun-mode"));
}

// --step-batch-size-schedule (Megatron-LM HEAD): parsing with Megatron's suffixes, order and
// messages, the global batch per iteration from the consumed samples, a reference-backend run
// whose iterations take the scheduled batches, and a resume in the middle of the schedule.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "tests/cli_test_util.h"
#include "tests/ckpt_test_util.h"
#include "tests/split_run_util.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;

namespace {

using Schedule = std::vector<std::pair<int64_t, int>>;

// small_gpt(): --seq-length 32, --micro-batch-size 2, one rank.
Config scheduled(const std::string& schedule, const Args& extra = {}) {
  return parse(small_gpt() + Args{"--step-batch-size-schedule", schedule} + extra);
}

std::string schedule_error(const std::string& schedule, const Args& extra = {}) {
  return parse_error(small_gpt() + Args{"--step-batch-size-schedule", schedule} + extra);
}

}  // namespace

TEST_CASE("flag --step-batch-size-schedule: thresholds in tokens with K/M/B/T suffixes, sorted, as samples", "[cli][batch-schedule]") {
  const Config c = scheduled("0:2 1K:4 2.5k:8");
  // 1000 // 32 = 31 and 2500 // 32 = 78 samples
  CHECK(c.train.batch_size_schedule == Schedule{{0, 2}, {31, 4}, {78, 8}});
  CHECK(c.train.global_batch == 2);      // Megatron's args.global_batch_size: micro-batch x DP
  CHECK(c.train.num_microbatches == 4);  // planned for the largest batch, 8 / 2
  // commas separate entries too; the order given does not matter; B and T are 1e9 and 1e12
  CHECK(scheduled("64:4,0:2").train.batch_size_schedule == Schedule{{0, 2}, {2, 4}});
  CHECK(scheduled("0:2 0.5M:4 1B:6 2T:8").train.batch_size_schedule ==
        Schedule{{0, 2}, {15625, 4}, {31250000, 6}, {62500000000, 8}});
  // int(float(x) * multiplier), then floor division by the sequence length: 2.4B tokens of 2048
  CHECK(parse(small_gpt() + words("--seq-length 2048 --max-position-embeddings 2048 --step-batch-size-schedule 0:16 2.4B:320"))
            .train.batch_size_schedule == Schedule{{0, 16}, {1171875, 320}});
  // word-split by an unquoted shell expansion: the words still make one schedule
  CHECK(parse(small_gpt() + words("--step-batch-size-schedule 0:2 64:4")).train.batch_size_schedule ==
        Schedule{{0, 2}, {2, 4}});
  // the batch of the iteration that starts after N consumed samples
  const TrainConfig& t = c.train;
  CHECK(t.global_batch_at(0) == 2);
  CHECK(t.global_batch_at(30) == 2);
  CHECK(t.global_batch_at(31) == 4);
  CHECK(t.global_batch_at(77) == 4);
  CHECK(t.global_batch_at(78) == 8);
  CHECK(t.global_batch_at(1000000) == 8);
  // --train-samples: the iterations the scheduled batches take (update_train_iters): 5 of 2
  // samples reach the threshold 10 (320 tokens), then 23 of 4 reach 102 >= 100
  Args by_samples = small_gpt();
  by_samples.erase(std::find(by_samples.begin(), by_samples.end(), "--train-iters"),
                   std::find(by_samples.begin(), by_samples.end(), "--train-iters") + 2);
  const Config s = parse(by_samples + words("--train-samples 100 --step-batch-size-schedule 0:2 320:4"));
  CHECK(s.train.total_iters == 28);
}

TEST_CASE("flag --step-batch-size-schedule: Megatron's errors, one line each naming the flag", "[cli][batch-schedule]") {
  const std::map<std::string, std::string> errors = {
      {"0:2 abc", "--step-batch-size-schedule: Invalid schedule entry \"abc\". Expected format: \"THRESHOLD:BATCH_SIZE\""},
      {"64:2", "--step-batch-size-schedule: first schedule entry must have threshold 0, got 2"},
      {"0:2 10:4", "--step-batch-size-schedule: schedule thresholds must be strictly increasing, got 0 before 0"},
      {"0:0", "--step-batch-size-schedule: batch size must be positive, got 0"},
      {"0:x", "--step-batch-size-schedule: could not convert string to float: 'X'"},
      {"0:2 1Q:4", "--step-batch-size-schedule: could not convert string to float: '1Q'"},
      {",", "--step-batch-size-schedule: schedule must have at least one entry"},
  };
  for (const auto& [schedule, message] : errors) {
    INFO(schedule);
    const std::string e = schedule_error(schedule);
    CHECK(e == message);
    CHECK(e.find('\n') == std::string::npos);
  }
  CHECK(schedule_error("0:2", words("--global-batch-size 4")) ==
        "Cannot specify both --step-batch-size-schedule and --global-batch-size");
  CHECK(schedule_error("0:2", words("--decrease-batch-size-if-needed")) ==
        "Cannot specify both --step-batch-size-schedule and --decrease-batch-size-if-needed");
  // --rampup-batch-size stays Megatron HEAD's no-op beside it
  CHECK(scheduled("0:2 64:4", words("--rampup-batch-size 2 2 100")).train.batch_size_schedule == Schedule{{0, 2}, {2, 4}});
}

namespace {

struct Recorder final : Reporter {
  std::vector<int64_t> batches, consumed;
  void on_iteration(const IterationStats& s) override {
    batches.push_back(s.global_batch_size);
    consumed.push_back(s.consumed_samples);
  }
  void on_eval(const EvalStats&) override {}
};

// The tiny GPT (sequence 8, micro-batch 2, one rank) with the batch stepping 2 -> 4 -> 6 at 32 and
// 64 tokens (4 and 8 samples), as the parser derives it.
Config tiny_scheduled(int64_t iterations) {
  Config c = test::tiny_gpt_config();
  c.train.global_batch_size.reset();
  c.train.train_iters = iterations;
  c.train.step_batch_size_schedule = "0:2 32:4 64:6";
  test::derive(c);
  c.train.batch_size_schedule = {{0, 2}, {4, 4}, {8, 6}};
  c.train.num_microbatches = 3;
  return c;
}

}  // namespace

TEST_CASE("flag --step-batch-size-schedule: each iteration trains the scheduled batch (reference backend)", "[engine][batch-schedule]") {
  const Config c = tiny_scheduled(6);
  ParallelState ps = make_single_process_state();
  auto be = make_reference_backend(1);
  const ModelDims dims = ModelDims::from_config(c, ps);
  ModelOptions o = ModelOptions::from_config(c, dims, DType::f32);
  GptModel model(dims, o, ps, *be);
  model.init_parameters();
  ArangeBatchSource src(c.train.micro_batch_size, c.model.seq_length, c.model.vocab_size);
  Recorder rec;
  Trainer trainer(c, ps, model, src, nullptr, rec);
  std::vector<int64_t> changes;
  trainer.on_microbatches_change = [&](int64_t it) { changes.push_back(it); };
  CHECK(trainer.train() == 6);
  // consumed 0, 2 (batch 2), 4 (batch 4), 8, 14, 20 (batch 6)
  CHECK(rec.batches == std::vector<int64_t>{2, 2, 4, 6, 6, 6});
  CHECK(rec.consumed == std::vector<int64_t>{2, 4, 8, 14, 20, 26});
  CHECK(src.produced() == 1 + 1 + 2 + 3 + 3 + 3);  // micro-batches of 2
  CHECK(changes == std::vector<int64_t>{2, 3});    // before iterations 3 and 4
  CHECK(trainer.schedule().num_steps() == 26);     // the scheduler counts samples
  CHECK(trainer.counters().micro_batch_serial == 13);
  // Every loss is finite and the model learned something.
  REQUIRE(trainer.loss_history().size() == 6);
  for (double l : trainer.loss_history()) CHECK(std::isfinite(l));
}

TEST_CASE("flag --step-batch-size-schedule: a schedule entry micro-batch x DP does not divide stops the run when reached", "[engine][batch-schedule]") {
  Config c = tiny_scheduled(6);
  c.train.batch_size_schedule = {{0, 2}, {4, 3}};
  ParallelState ps = make_single_process_state();
  auto be = make_reference_backend(1);
  const ModelDims dims = ModelDims::from_config(c, ps);
  GptModel model(dims, ModelOptions::from_config(c, dims, DType::f32), ps, *be);
  model.init_parameters();
  ArangeBatchSource src(c.train.micro_batch_size, c.model.seq_length, c.model.vocab_size);
  Recorder rec;
  Trainer trainer(c, ps, model, src, nullptr, rec);
  CHECK_THROWS_WITH(trainer.train(), "--step-batch-size-schedule: current global batch size (3) is not divisible by "
                                     "micro_batch_size (2) * data_parallel_size (1)");
  CHECK(rec.batches == std::vector<int64_t>{2, 2});
}

TEST_CASE("flag --step-batch-size-schedule: a resume in the middle of the schedule repeats the straight run", "[ckpt-train][resume][batch-schedule]") {
  const Config c = tiny_scheduled(6);
  mt_test::TempDir dir;
  std::vector<double> straight, second;
  int64_t straight_consumed = 0, second_consumed = 0;
  run_split_part(c, dir.path() + "/unused", 6, false, false, [&](Backend&, GptModel&, Trainer& t) {
    straight = t.loss_history();
    straight_consumed = t.consumed_samples();
  });
  // iteration 3 ends at 8 consumed samples: the resumed run starts at the batch of 6
  run_split_part(c, dir.path(), 3, false, true, [](Backend&, GptModel&, Trainer& t) { CHECK(t.consumed_samples() == 8); });
  run_split_part(c, dir.path(), 6, true, false, [&](Backend&, GptModel&, Trainer& t) {
    second = t.loss_history();
    second_consumed = t.consumed_samples();
  });
  REQUIRE(straight.size() == 6);
  REQUIRE(second.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    INFO("iteration " << 4 + i);
    CHECK(second[i] == straight[3 + i]);
  }
  CHECK(second_consumed == straight_consumed);
  CHECK(straight_consumed == 26);
}

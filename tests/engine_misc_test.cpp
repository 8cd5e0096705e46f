// Engine pieces: the RoPE table (Llama 3 scaling), the memory plan without a model, the trainer's
// exit and skip rules.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/gpt_model.h"
#include "engine/reporter.h"
#include "engine/rope_table.h"
#include "engine/trainer.h"
#include "parallel/parallel_state.h"
#include "tests/engine_test_util.h"

using namespace mt;

TEST_CASE("rope table: inverse frequencies, cos/sin layout, Llama 3 scaling", "[rope]") {
  const std::vector<float> inv = rope_inverse_frequencies(8, 10000.0);
  REQUIRE(inv.size() == 4);
  CHECK(inv[0] == 1.0f);
  CHECK(inv[1] == Approx(0.1).epsilon(1e-6));
  CHECK(inv[3] == Approx(0.001).epsilon(1e-6));
  RopeTableParams p;
  p.positions = 3;
  p.rot_dim = 8;
  const std::vector<float> t = rope_cos_sin_table(p);
  CHECK(t[2 * 8 + 0] == Approx(std::cos(2.0)));
  CHECK(t[2 * 8 + 4 + 1] == Approx(std::sin(0.2)));
  p.seq_len_interpolation_factor = 2;
  CHECK(rope_cos_sin_table(p)[2 * 8] == Approx(std::cos(1.0)));

  // Llama 3.x (factor 8, low 1, high 4, original context 8192): wavelengths below 2048 kept,
  // above 8192 divided by 8, in between interpolated.
  const std::vector<float> f = {1.0f, 0.001f, 0.0001f};
  const std::vector<float> s = llama3_scale_frequencies(f, 8.0);
  CHECK(s[0] == 1.0f);                                     // wavelength 6.28
  const double wl = 2 * M_PI / 0.001, smooth = (8192.0 / wl - 1.0) / 3.0;  // 6283: medium
  CHECK(s[1] == Approx(0.001 * ((1 - smooth) / 8 + smooth)).epsilon(1e-5));
  CHECK(s[2] == Approx(0.0001 / 8).epsilon(1e-6));        // wavelength 62832: long
}

TEST_CASE("rope table: YaRN frequencies and concentration (Megatron's YarnRotaryEmbedding)", "[rope][mla]") {
  // d = 16, base 10000, original context 4096, betas 32 and 1: the correction range is
  // d ln(4096 / (2 pi beta)) / (2 ln 10000), floored / ceiled: low = floor(2.62) = 2, high =
  // ceil(5.63) = 6.
  const int d = 16;
  const auto corr = [&](double beta) { return d * std::log(4096 / (2 * M_PI * beta)) / (2 * std::log(10000.0)); };
  const int low = static_cast<int>(std::floor(corr(32))), high = static_cast<int>(std::ceil(corr(1)));
  REQUIRE(low == 2);
  REQUIRE(high == 6);
  YarnParams y;
  y.factor = 40;
  const std::vector<float> plain = rope_inverse_frequencies(d, 10000), f = yarn_inverse_frequencies(d, 10000, y);
  REQUIRE(f.size() == 8);
  for (int i = 0; i < 8; ++i) {
    // Dims up to the range's start keep their frequency; past its end they are divided by s;
    // in between linearly blended.
    const double ramp = std::clamp((i - low) / double(high - low), 0.0, 1.0);
    INFO("dim pair " << i);
    CHECK(f[i] == Approx(plain[i] / 40.0 * ramp + plain[i] * (1 - ramp)).epsilon(1e-6));
  }
  CHECK(f[0] == plain[0]);
  // Factor 1: the plain frequencies.
  y.factor = 1;
  const std::vector<float> same = yarn_inverse_frequencies(d, 10000, y);
  for (int i = 0; i < 8; ++i) CHECK(same[i] == Approx(plain[i]).epsilon(1e-7));
  // The concentration factor multiplies cos and sin: mscale(40, 1) / mscale(40, 0) = 0.1 ln 40 + 1.
  CHECK(yarn_get_mscale(40, 1.0) == Approx(0.1 * std::log(40.0) + 1));
  CHECK(yarn_get_mscale(0.5, 1.0) == 1.0);
  RopeTableParams p;
  p.positions = 4;
  p.rot_dim = d;
  p.yarn = YarnParams{40, 4096, 32, 1, 1.0, 0.0, true};
  const std::vector<float> t = rope_cos_sin_table(p);
  const double mu = 0.1 * std::log(40.0) + 1;
  const std::vector<float> fy = yarn_inverse_frequencies(d, 10000, *p.yarn);
  CHECK(t[3 * d + 2] == Approx(mu * std::cos(3.0f * fy[2])).epsilon(1e-6));
  CHECK(t[3 * d + 8 + 7] == Approx(mu * std::sin(3.0f * fy[7])).epsilon(1e-6));
  p.yarn->mscale_all_dim = 1.0;  // DeepSeek-V3: mscale = mscale_all_dim, no concentration
  CHECK(rope_cos_sin_table(p)[3 * d + 2] == Approx(std::cos(3.0f * fy[2])).epsilon(1e-6));
  // Fractional ends (2.62, 5.63): dim pair 5's ramp is 0.79 instead of 0.75, so more of it is divided by s.
  YarnParams frac = *p.yarn;
  frac.factor = 40;
  frac.round_to_int = false;
  const double ramp5 = (5 - corr(32)) / (corr(1) - corr(32));
  CHECK(yarn_inverse_frequencies(d, 10000, frac)[5] == Approx(plain[5] / 40.0 * ramp5 + plain[5] * (1 - ramp5)).epsilon(1e-6));
  CHECK(yarn_inverse_frequencies(d, 10000, frac)[5] < f[5]);
}

TEST_CASE("the log line's losses come in Megatron's order: lm loss, the MoE losses, the mtp depths", "[mtp]") {
  LossMap m;
  for (const char* k : {"z_loss", "mtp_2 loss", "global_load_balancing_loss", "seq_load_balancing_loss", "lm loss",
                        "mtp_1 loss", "load_balancing_loss"})
    m[k] = 1.0;
  std::vector<std::string> keys;
  for (const auto& [k, v] : m) keys.push_back(k);
  CHECK(keys == std::vector<std::string>{"lm loss", "load_balancing_loss", "seq_load_balancing_loss",
                                         "global_load_balancing_loss", "z_loss", "mtp_1 loss", "mtp_2 loss"});
}

TEST_CASE("plan_memory equals the constructed model's plan", "[model]") {
  Config c = test::tiny_llama_config();
  ParallelState ps = make_single_process_state();
  const ModelDims d = ModelDims::from_config(c, ps);
  const ModelOptions o = ModelOptions::from_config(c, d, DType::f32);
  auto be = make_reference_backend(1);
  GptModel m(d, o, ps, *be);
  const MemoryPlan planned = GptModel::plan_memory(d, o);
  for (int i = 0; i < static_cast<int>(MemoryCategory::count); ++i)
    CHECK(planned.bytes[i] == m.memory_plan().bytes[i]);
  CHECK(planned.of(MemoryCategory::master_weights) == 0);  // float32: the parameters are the master copy
  // TP=2, second pipeline stage of two: half the layers, no embedding, smaller.
  const ModelDims d2 = ModelDims::from_config(c, RankPosition::split(c, 2, 1, 2, 1));
  CHECK(d2.layer_begin == 1);
  CHECK_FALSE(d2.first_stage);
  CHECK(GptModel::plan_memory(d2, ModelOptions::from_config(c, d2, DType::bf16)).of(MemoryCategory::parameters) <
        planned.of(MemoryCategory::parameters));
}

namespace {
// A single-process model of config c on the reference backend (float32), initialized: what the
// trainer tests below train or evaluate. Not movable: the model keeps references to ps and be.
struct TinyModel {
  ParallelState ps = make_single_process_state();
  std::unique_ptr<Backend> be = make_reference_backend(1);
  ModelDims d;
  std::unique_ptr<GptModel> model;
  explicit TinyModel(const Config& c) : d(ModelDims::from_config(c, ps)) {
    model = std::make_unique<GptModel>(d, ModelOptions::from_config(c, d, DType::f32), ps, *be);
    model->init_parameters();
  }
  TinyModel(const TinyModel&) = delete;
  TinyModel& operator=(const TinyModel&) = delete;
};

struct Counting final : Reporter {
  int lines = 0;
  void on_iteration(const IterationStats& s) override { lines += s.interval_end; }
  void on_eval(const EvalStats&) override {}
};
}  // namespace

TEST_CASE("trainer: --exit-interval stops early, --iterations-to-skip consumes without a step", "[train]") {
  Config c = test::tiny_gpt_config();
  c.train.train_iters = 20;
  c.train.exit_interval = 7;
  c.train.iterations_to_skip = {3};
  c.logging.log_interval = 1;
  test::derive(c);
  TinyModel m(c);
  ParallelState& ps = m.ps;
  const ModelDims& d = m.d;
  GptModel& model = *m.model;
  test::ArangeBatchSource src(d.micro_batch, d.seq, d.vocab);
  Counting rep;
  Trainer t(c, ps, model, src, nullptr, rep);
  int64_t exited_at = -1;
  t.before_early_exit = [&](int64_t it) { exited_at = it; };
  CHECK(t.train() == 7);
  CHECK(exited_at == 7);
  CHECK(t.consumed_samples() == 14);
  CHECK(t.loss_history().size() == 6);        // iteration 3 skipped
  CHECK(t.optimizer().successful_steps() == 6);
  CHECK(t.schedule().num_steps() == 12);      // the skipped iteration does not step the schedule
  CHECK(rep.lines == 6);
}

namespace {
struct EvalCapture final : Reporter {
  std::vector<EvalStats> evals;
  void on_iteration(const IterationStats&) override {}
  void on_eval(const EvalStats& e) override { evals.push_back(e); }
};

struct Evaluation {
  double loss = 0;
  int64_t consumed_valid_samples = 0, micro_batches = 0;
};

// One evaluation of the tiny GPT's initial weights (micro-batch 2, global batch 2) over an arange
// validation stream.
Evaluation evaluate_once(std::optional<int> eval_global_batch_size, int eval_iters) {
  Config c = test::tiny_gpt_config();
  c.train.eval_iters = eval_iters;
  c.train.eval_global_batch_size = eval_global_batch_size;
  test::derive(c);
  TinyModel m(c);
  ParallelState& ps = m.ps;
  const ModelDims& d = m.d;
  GptModel& model = *m.model;
  test::ArangeBatchSource train(d.micro_batch, d.seq, d.vocab);
  test::ArangeBatchSource valid(d.micro_batch, d.seq, d.vocab, -1, 1000);
  EvalCapture rep;
  Trainer t(c, ps, model, train, &valid, rep);
  t.set_has_validation(true);
  t.evaluate(false);
  REQUIRE(rep.evals.size() == 1);
  return {rep.evals[0].losses.at("lm loss"), t.counters().consumed_valid_samples, valid.produced()};
}
}  // namespace

// Megatron-LM's evaluate: eval_global_batch_size / (micro-batch x DP) micro-batches per evaluation
// iteration, consumed_valid_samples grows by eval_global_batch_size, and the loss is the mean over
// all of them.
TEST_CASE("trainer: --eval-global-batch-size sets the samples of each evaluation iteration", "[train]") {
  const Evaluation by_default = evaluate_once(std::nullopt, 3);  // the training global batch, 2
  CHECK(by_default.micro_batches == 3);
  CHECK(by_default.consumed_valid_samples == 6);
  const Evaluation eight = evaluate_once(8, 3);
  CHECK(eight.micro_batches == 12);
  CHECK(eight.consumed_valid_samples == 24);
  // One iteration of 8 samples is the same 8 samples as four iterations of the training batch.
  const Evaluation one_of_eight = evaluate_once(8, 1);
  const Evaluation four_of_two = evaluate_once(std::nullopt, 4);
  CHECK(one_of_eight.micro_batches == 4);
  CHECK(four_of_two.micro_batches == 4);
  CHECK(one_of_eight.loss == Approx(four_of_two.loss).epsilon(1e-6));
}

TEST_CASE("trainer: running out of training data is an error naming the iteration", "[train]") {
  Config c = test::tiny_gpt_config();
  c.train.train_iters = 5;
  test::derive(c);
  TinyModel m(c);
  ParallelState& ps = m.ps;
  const ModelDims& d = m.d;
  GptModel& model = *m.model;
  test::ArangeBatchSource src(d.micro_batch, d.seq, d.vocab, 3);
  Counting rep;
  Trainer t(c, ps, model, src, nullptr, rep);
  CHECK_THROWS_WITH(t.train(), Catch::Contains("iteration 4"));
}

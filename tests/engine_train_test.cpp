// CPU end to end: tiny GPT and Llama models train on --mock-data with the reference backend.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "app/training_data.h"
#include "engine/backend.h"
#include "engine/gpt_model.h"
#include "engine/model_chunks.h"
#include "engine/param_count.h"
#include "engine/trainer.h"
#include "parallel/parallel_state.h"
#include "tests/engine_test_util.h"

using namespace mt;

namespace {

struct CapturingReporter final : Reporter {
  std::vector<IterationStats> iterations;
  std::vector<EvalStats> evals;
  void on_iteration(const IterationStats& s) override {
    if (s.interval_end) iterations.push_back(s);
  }
  void on_eval(const EvalStats& e) override { evals.push_back(e); }
};

Config mock_config(Config c) {
  c = test::with_mock_training(c);  // two micro-batches per step: gradient accumulation
  c.train.train_iters = 60;
  c.train.lr_warmup_iters = 5;
  c.train.weight_decay = 0.01;
  c.train.eval_interval = 30;
  c.train.eval_iters = 2;
  test::derive(c);
  return c;
}

// A tiny model initialized on the reference backend, its mock data, and a trainer over them that
// reports to `reporter`.
struct Rig {
  ParallelState ps = make_single_process_state();
  std::unique_ptr<Backend> be = make_reference_backend(2);
  ModelDims dims;
  std::unique_ptr<GptModel> model;
  TrainingData data;
  std::unique_ptr<Trainer> trainer;
  Rig(const Config& cfg, Reporter& reporter) : dims(ModelDims::from_config(cfg, ps)) {
    // (The options the app's chunk planning gives: the distributed optimizer's shards and buckets.)
    model = std::make_unique<GptModel>(dims, model_chunk_specs(cfg, ps, DType::f32).at(0).options, ps, *be);
    model->init_parameters();
    data = build_training_data(cfg, 0, 1, 0);
    trainer = std::make_unique<Trainer>(cfg, ps, *model, *data.train, data.valid.get(), reporter);
  }
};

struct Run {
  std::vector<double> losses;
  CapturingReporter reporter;
};

std::unique_ptr<Run> train(const Config& cfg) {
  auto run = std::make_unique<Run>();
  Rig rig(cfg, run->reporter);
  rig.trainer->train();
  run->losses = rig.trainer->loss_history();
  return run;
}

void check_training(const Config& cfg) {
  auto a = train(cfg);
  REQUIRE(a->losses.size() == 60);
  INFO("first loss " << a->losses.front() << ", last " << a->losses.back());
  CHECK(a->losses.front() == Approx(std::log(64.0)).epsilon(0.1));  // uniform predictions at init
  CHECK(a->losses.back() < 0.5 * a->losses.front());
  // Megatron's log cadence: after the first iteration, then every --log-interval.
  REQUIRE(a->reporter.iterations.size() == 7);
  CHECK(a->reporter.iterations[0].iteration == 1);
  CHECK(a->reporter.iterations[6].iteration == 60);
  CHECK(a->reporter.iterations[6].consumed_samples == 240);
  CHECK(a->reporter.iterations[6].losses.at("lm loss") > 0);
  CHECK(a->reporter.evals.size() == 2);  // at 30 and 60
  auto b = train(cfg);
  REQUIRE(b->losses.size() == a->losses.size());
  for (size_t i = 0; i < a->losses.size(); ++i) REQUIRE(a->losses[i] == b->losses[i]);  // bit for bit
}

}  // namespace

TEST_CASE("CPU end to end: tiny GPT trains on mock data, reproducibly", "[train]") {
  Config c = test::tiny_gpt_config();
  c.model.hidden_dropout = 0.1;
  c.model.attention_dropout = 0.1;
  check_training(mock_config(c));
}

TEST_CASE("CPU end to end: tiny Llama trains on mock data, reproducibly", "[train]") {
  Config c = test::tiny_llama_config();
  check_training(mock_config(c));
}

// The optimizer's update beside the next forward (Optimizer::update_beside_forward): its pieces,
// cut at each layer's parameters, update every element once, and the gradients it read are zeroed
// only once it is joined; so training with MEGATRAIN_OPTIMIZER_OVERLAP=1 gives the same bits as the
// update in one pass (the default), evaluations included.
TEST_CASE("CPU end to end: the update beside the next forward gives the one-pass update's bits", "[train][optimizer]") {
  Config gpt = test::tiny_gpt_config();  // biases, tied embeddings, learned positions
  gpt.model.num_layers = 3;
  Config moe = test::with_moe(test::tiny_llama_config(), 3, 4, 2, 24, 2);
  moe.model.moe.aux_loss_coeff = {1e-2};
  Config distopt = test::tiny_llama_config();  // one rank's distributed optimizer: a range per bucket
  distopt.parallel.use_distributed_optimizer = true;
  distopt.parallel.ddp_bucket_size = 1500;
  distopt.parallel.overlap_grad_reduce = true;  // (buckets: only with overlapped reductions, as Megatron)
  for (Config c : {gpt, moe, distopt}) {
    c = mock_config(c);
    c.train.train_iters = 12;
    c.train.eval_interval = 5;
    c.train.total_iters = 12;
    struct Out {
      std::vector<double> losses;
      std::vector<float> params, master;
      bool beside = false;
    };
    auto run = [&](bool overlap) {
      setenv("MEGATRAIN_OPTIMIZER_OVERLAP", overlap ? "1" : "0", 1);
      CapturingReporter reporter;
      Rig rig(c, reporter);
      unsetenv("MEGATRAIN_OPTIMIZER_OVERLAP");
      Out o;
      o.beside = rig.trainer->optimizer().update_beside_forward();
      if (c.parallel.use_distributed_optimizer) REQUIRE(rig.trainer->optimizer().ranges().size() > 2);
      rig.trainer->train();
      o.losses = rig.trainer->loss_history();
      for (const EvalStats& e : reporter.evals) o.losses.push_back(e.losses.at("lm loss"));
      o.params.resize(static_cast<size_t>(rig.model->params_flat().numel()));
      rig.be->copy_to_host(o.params.data(), rig.model->params_flat());
      return o;
    };
    const Out a = run(true), b = run(false);
    CHECK(a.beside);
    CHECK_FALSE(b.beside);
    REQUIRE(a.losses.size() == 14);  // 12 iterations, evaluations at 5 and 10
    REQUIRE(a.losses.size() == b.losses.size());
    for (size_t i = 0; i < a.losses.size(); ++i) REQUIRE(a.losses[i] == b.losses[i]);
    REQUIRE(a.params == b.params);
    CHECK(a.losses[11] < a.losses[0]);
  }
}

// --log-energy's arithmetic with a counter that rises 100 J per training iteration, 1000 J per
// evaluation and 500 J per save (the after-iteration hook's, run through outside_interval as
// app/train.cpp does): the log lines see only the iterations' energy, as Megatron pauses its
// energy monitor around evaluations and saves.
TEST_CASE("energy logging: J/iter/GPU and W/GPU per log interval, evaluations and saves left out", "[train][energy]") {
  Config c = test::tiny_gpt_config();
  c = test::with_mock_training(c);
  c.train.train_iters = 12;
  c.train.eval_interval = 4;
  c.train.eval_iters = 1;
  c.logging.log_interval = 5;
  c.logging.log_energy = true;
  test::derive(c);
  CapturingReporter reporter;
  Rig rig(c, reporter);
  Trainer& trainer = *rig.trainer;
  int hooks = 0;
  trainer.after_iteration = [&](int64_t) {
    trainer.outside_interval([&] { ++hooks; });
    return true;
  };
  // Steps done: the micro-batch serial advances by the micro-batches of each step's forward-backward.
  trainer.energy_joules = [&] {
    const double steps = static_cast<double>(trainer.counters().micro_batch_serial) / c.train.num_microbatches;
    return 100.0 * steps + 1000.0 * static_cast<double>(reporter.evals.size()) + 500.0 * hooks;
  };
  trainer.train();
  REQUIRE(reporter.evals.size() == 3);  // at 4, 8, 12
  REQUIRE(hooks == 12);
  REQUIRE(reporter.iterations.size() == 3);  // after the first, at 5 and 10
  for (const IterationStats& s : reporter.iterations) {
    INFO("iteration " << s.iteration);
    REQUIRE(s.energy_per_gpu_j.has_value());
    CHECK(*s.energy_per_gpu_j == Approx(100.0));
    REQUIRE(s.power_per_gpu_w.has_value());
    CHECK(*s.power_per_gpu_w == Approx(100.0 / (s.elapsed_ms_per_iteration / 1000.0)).epsilon(1e-9));
  }
  // Without a counter the fields stay empty.
  CapturingReporter plain;
  Rig quiet(c, plain);
  quiet.trainer->train();
  REQUIRE_FALSE(plain.iterations.empty());
  CHECK_FALSE(plain.iterations.back().energy_per_gpu_j.has_value());
}

// --window-size: a window reaching back over the whole sequence (15 earlier tokens of 16) is
// causal attention, bit for bit; a window of 2 earlier tokens, on every other layer, trains too
// and is a different model.
TEST_CASE("CPU end to end: sliding-window attention", "[train]") {
  auto short_run = [](std::optional<std::pair<int, int>> window, std::optional<int> skip_every) {
    Config c = test::with_mock_training(test::tiny_llama_config());
    c.model.window_size = window;
    c.model.window_attn_skip_every = skip_every;
    c.train.train_iters = 12;
    c.train.lr_warmup_iters = 2;
    test::derive(c);
    return train(c)->losses;
  };
  const std::vector<double> causal = short_run(std::nullopt, std::nullopt);
  REQUIRE(causal.size() == 12);
  CHECK(short_run(std::make_pair(15, 0), std::nullopt) == causal);
  const std::vector<double> windowed = short_run(std::make_pair(2, 0), 2);
  REQUIRE(windowed.size() == 12);
  CHECK(windowed.front() != causal.front());
  CHECK(windowed.back() < 0.8 * windowed.front());
  CHECK(short_run(std::make_pair(2, 0), 2) == windowed);  // reproducible
}

// --qk-l2-norm is Megatron's L2Norm: RMS normalization of each q and k head without weights. At
// initialization --qk-layernorm's RMSNorm weights are ones, so the first loss is the same to the
// last bit; the L2 model has no q/k norm parameters, and training then differs.
TEST_CASE("CPU end to end: --qk-l2-norm is --qk-layernorm's RMSNorm without weights", "[train]") {
  auto short_run = [](bool l2) {
    Config c = test::with_mock_training(test::tiny_llama_config());  // RMSNorm
    c.model.qk_layernorm = !l2;
    c.model.qk_l2_norm = l2;
    c.train.train_iters = 12;
    c.train.lr_warmup_iters = 2;
    test::derive(c);
    return std::make_pair(train(c)->losses, count_parameters(c.model).total);
  };
  const auto [layernorm, layernorm_params] = short_run(false);
  const auto [l2, l2_params] = short_run(true);
  REQUIRE(l2.size() == 12);
  CHECK(l2.front() == layernorm.front());
  CHECK(l2.back() != layernorm.back());
  CHECK(l2.back() < 0.8 * l2.front());
  const auto& m = test::tiny_llama_config().model;
  CHECK(layernorm_params - l2_params == 2 * m.num_layers * m.head_dim);  // q and k weights per layer
}

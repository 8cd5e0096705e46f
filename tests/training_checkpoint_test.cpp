// Training checkpoints at the model level (app/checkpointing.h): resharding into other TP/PP
// layouts element by element, a bit-exact resume through the dynamic loss scaler, and the
// recorded configuration's checks. The binary-level tests are in training_checkpoint_binary_test.cpp.
#include <catch2/catch.hpp>

#include <cstring>
#include <memory>
#include <vector>

#include "app/checkpoint_args.h"
#include "app/checkpointing.h"
#include "core/error.h"
#include "core/shard.h"
#include "engine/backend.h"
#include "engine/gpt_model.h"
#include "engine/trainer.h"
#include "parallel/parallel_state.h"
#include "tests/ckpt_test_util.h"
#include "tests/engine_test_util.h"
#include "tests/split_run_util.h"

using namespace mt;
using Catch::Matchers::Contains;

namespace {

using test::host_copy;
using test::NullReporter;

// A trained TP=1, PP=1 model and the checkpoint it saved.
struct Trained {
  Config cfg;
  ParallelState ps = make_single_process_state();
  std::unique_ptr<Backend> be = make_reference_backend(1);
  std::unique_ptr<GptModel> model;
};

std::unique_ptr<Trained> train_and_save(Config cfg, const std::string& dir, int iterations) {
  auto t = std::make_unique<Trained>();
  cfg.checkpoint.save = dir;
  cfg.checkpoint.save_interval = 1000;
  t->cfg = cfg;
  const ModelDims dims = ModelDims::from_config(t->cfg, t->ps);
  t->model = std::make_unique<GptModel>(dims, ModelOptions::from_config(t->cfg, dims, DType::f32), t->ps, *t->be);
  t->model->init_parameters();
  test::ArangeBatchSource src(cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.vocab_size);
  NullReporter rep;
  Trainer trainer(t->cfg, t->ps, *t->model, src, nullptr, rep);
  trainer.after_iteration = [&](int64_t it) { return it < iterations; };
  trainer.train();
  REQUIRE(trainer.iteration() == iterations);
  TrainingCheckpoints ck(t->cfg, t->ps, *t->model);
  ck.save(trainer);
  return t;
}

// Loads `dir` into the model of rank (tp_rank of tp, pp_rank of pp) and checks every element of
// every parameter, master weight and Adam moment against the TP=1 model's global tensors.
void check_reshard(const Trained& t, const std::string& dir, int tp, int tp_rank, int pp, int pp_rank) {
  INFO("TP rank " << tp_rank << " of " << tp << ", PP rank " << pp_rank << " of " << pp);
  Config lc = t.cfg;
  lc.checkpoint.save.reset();
  lc.checkpoint.load = dir;
  ParallelState ps = make_single_process_state();  // loading needs no communication
  ps.tp_size = tp;
  ps.tp_rank = tp_rank;
  ps.pp_size = pp;
  ps.pp_rank = pp_rank;
  const ModelDims dims = ModelDims::from_config(lc, RankPosition::split(lc, tp, tp_rank, pp, pp_rank));
  GptModel m(dims, ModelOptions::from_config(lc, dims, DType::f32), ps, *t.be);
  TrainingCheckpoints ck(lc, ps, m);
  const ResumePoint r = ck.load();
  REQUIRE(r.loaded);
  CHECK(r.optimizer_state);

  const GptModel& g = *t.model;
  const std::vector<float> gp = host_copy(*t.be, g.params_flat()), gm = host_copy(*t.be, g.exp_avg_flat()),
                           gv = host_copy(*t.be, g.exp_avg_sq_flat());
  const std::vector<float> lp = host_copy(*t.be, m.params_flat()), lm = host_copy(*t.be, m.exp_avg_flat()),
                           lv = host_copy(*t.be, m.exp_avg_sq_flat());
  int64_t checked = 0, nonzero_moments = 0;
  for (const ParamDesc& p : m.params()) {
    // The last stage's copy of tied embeddings is the word embeddings.
    const int gi = find_param(g.params(), p.shared_copy ? p.init_name : p.name);
    REQUIRE(gi >= 0);
    const ParamDesc& q = g.params()[static_cast<size_t>(gi)];
    REQUIRE(q.global_shape == p.global_shape);
    for (int64_t j = 0; j < p.numel(); ++j) {
      const int64_t e = shard_global_index(p.shard, j);  // == the TP=1 local index
      const size_t a = static_cast<size_t>(p.offset + j), b = static_cast<size_t>(q.offset + e);
      if (lp[a] != gp[b] || lm[a] != gm[b] || lv[a] != gv[b]) {
        FAIL_CHECK(p.name << " element " << j << " (global " << e << ")");
        return;
      }
      nonzero_moments += lv[a] != 0;
      ++checked;
    }
  }
  CHECK(checked > 0);
  CHECK(nonzero_moments > 0);  // the moments were trained, not zeros on both sides
}

}  // namespace

TEST_CASE("training checkpoint of a TP=1 model loads into TP=2 and PP=2 ranks element for element", "[ckpt-train][reshard]") {
  mt_test::TempDir dir;
  SECTION("Llama: GQA, SwiGLU (chunked fc1), untied output, RMSNorm") {
    Config c = test::tiny_llama_config();
    c.model.num_layers = 4;
    auto t = train_and_save(c, dir.path(), 3);
    for (int r = 0; r < 2; ++r) check_reshard(*t, dir.path(), 2, r, 1, 0);
    for (int s = 0; s < 2; ++s) check_reshard(*t, dir.path(), 1, 0, 2, s);
    for (int r = 0; r < 2; ++r)
      for (int s = 0; s < 2; ++s) check_reshard(*t, dir.path(), 2, r, 2, s);
  }
  SECTION("GPT: learned positions, biases, tied embeddings (the last stage's copy)") {
    Config c = test::tiny_gpt_config();
    auto t = train_and_save(c, dir.path(), 3);
    for (int r = 0; r < 2; ++r) check_reshard(*t, dir.path(), 2, r, 1, 0);
    for (int s = 0; s < 2; ++s) check_reshard(*t, dir.path(), 1, 0, 2, s);
  }
}

namespace {

struct SplitRun {
  std::vector<double> losses;
  double scale = 0;
  std::vector<float> params, moments;
};

SplitRun run_part(const Config& base, const std::string& dir, int64_t to, bool load, bool save) {
  SplitRun out;
  test::run_split_part(base, dir, to, load, save, [&](Backend& be, GptModel& model, Trainer& trainer) {
    out.losses = trainer.loss_history();
    out.scale = trainer.loss_scaler().scale();
    out.params = test::host_copy(be, model.params_flat());
    out.moments = test::host_copy(be, model.exp_avg_sq_flat());
  });
  return out;
}

}  // namespace

TEST_CASE("resume through the dynamic loss scaler is bit-exact (optimizer steps, scaler state, dropout serial)", "[ckpt-train][resume]") {
  // fp16's dynamic loss scaler on the float32 reference model: the scale doubles every 2 clean
  // iterations, so a resume that lost the scaler state (or the Adam step count, or the dropout
  // serial) would change the numbers.
  Config c = test::tiny_gpt_config();
  c.model.hidden_dropout = 0.1;
  c.model.attention_dropout = 0.1;
  c.train.precision = Precision::fp16;
  c.train.initial_loss_scale = 1024;
  c.train.loss_scale_window = 2;
  c.train.global_batch_size = 4;  // two micro-batches per iteration
  c.train.train_iters = 8;
  c.train.lr_warmup_iters = 2;
  test::derive(c);
  mt_test::TempDir dir;
  const SplitRun straight = run_part(c, dir.path() + "/unused", 8, false, false);
  REQUIRE(straight.losses.size() == 8);
  CHECK(straight.scale == 1024.0 * 16);  // doubled after iterations 2, 4, 6, 8
  const SplitRun first = run_part(c, dir.path(), 4, false, true);
  const SplitRun second = run_part(c, dir.path(), 8, true, false);
  REQUIRE(second.losses.size() == 4);
  for (int i = 0; i < 4; ++i) {
    INFO("iteration " << 5 + i);
    CHECK(second.losses[static_cast<size_t>(i)] == straight.losses[static_cast<size_t>(4 + i)]);
  }
  CHECK(second.scale == straight.scale);
  CHECK(std::memcmp(second.params.data(), straight.params.data(), second.params.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(second.moments.data(), straight.moments.data(), second.moments.size() * sizeof(float)) == 0);
}

TEST_CASE("the recorded model configuration round trips and refuses another model shape", "[ckpt-train][args]") {
  Config c = test::tiny_llama_config();
  const nlohmann::json j = model_config_to_json(c.model);
  const ModelConfig back = model_config_from_json(j, "manifest.json");
  CHECK(model_config_to_json(back) == j);
  CHECK_NOTHROW(check_checkpoint_model(j, c.model, "x/manifest.json"));
  ModelConfig other = c.model;
  other.hidden_size = 64;
  other.num_layers = 3;
  try {
    check_checkpoint_model(j, other, "x/manifest.json");
    FAIL("a checkpoint of another model shape was accepted");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Contains("checkpoint x/manifest.json was saved for another model"));
    CHECK_THAT(e.what(), Contains("--num-layers is 2 in the checkpoint but 3 in this run"));
    CHECK_THAT(e.what(), Contains("--hidden-size is 32 in the checkpoint but 64 in this run"));
  }
  nlohmann::json broken = j;
  broken.erase("num_layers");
  CHECK_THROWS_WITH(model_config_from_json(broken, "m.json"), Contains("m.json: the saved model configuration lacks 'num_layers'"));
}

TEST_CASE("LR scheduler state: Megatron's checks against the run's schedule", "[ckpt-train][args]") {
  LrScheduleParams a;
  a.max_lr = 1e-3;
  a.decay_steps = 100;
  LrScheduleParams b = a;
  b.max_lr = 2e-3;
  const nlohmann::json j = lr_schedule_to_json(b, 40);
  CHECK(j.at("num_steps") == 40);
  const LrScheduleParams saved = lr_schedule_params_from_json(j, "m");
  CHECK(saved.max_lr == 2e-3);
  TrainConfig t;
  CHECK_THROWS_WITH(reconcile_lr_schedule(a, saved, t, "m"), Contains("learning rate (--lr): 0.001 in this run, 0.002 in the checkpoint"));
  t.override_opt_param_scheduler = true;
  CHECK(reconcile_lr_schedule(a, saved, t, "m").max_lr == 1e-3);
  t.override_opt_param_scheduler = false;
  t.use_checkpoint_opt_param_scheduler = true;
  CHECK(reconcile_lr_schedule(a, saved, t, "m").max_lr == 2e-3);
}

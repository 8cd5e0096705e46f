// The optimizer's update cut where the forward's needs start (engine/optimizer.h: update overlap):
// the parts cover every parameter once, and training with the cut update is bit for bit training
// with the whole one (MEGATRAIN_OVERLAP_UPDATE=0). On the reference backend the parts run in
// order; the CUDA backend runs the same parts beside the next forward.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "app/training_data.h"
#include "engine/backend.h"
#include "engine/distributed_optimizer.h"
#include "engine/gpt_model.h"
#include "engine/trainer.h"
#include "parallel/parallel_state.h"
#include "tests/engine_test_util.h"

using namespace mt;

namespace {

// Sets MEGATRAIN_OVERLAP_UPDATE for the scope (nullopt: unset), restoring what was there.
class OverlapEnv {
 public:
  explicit OverlapEnv(std::optional<std::string> value) {
    if (const char* old = std::getenv("MEGATRAIN_OVERLAP_UPDATE")) old_ = old;
    if (value) setenv("MEGATRAIN_OVERLAP_UPDATE", value->c_str(), 1);
    else unsetenv("MEGATRAIN_OVERLAP_UPDATE");
  }
  ~OverlapEnv() {
    if (old_) setenv("MEGATRAIN_OVERLAP_UPDATE", old_->c_str(), 1);
    else unsetenv("MEGATRAIN_OVERLAP_UPDATE");
  }

 private:
  std::optional<std::string> old_;
};

struct Quiet final : Reporter {
  void on_iteration(const IterationStats&) override {}
  void on_eval(const EvalStats&) override {}
};

struct Trained {
  std::vector<double> losses;
  std::vector<float> initial, params, master, exp_avg, exp_avg_sq;
  bool overlapped = false;
};

std::vector<float> host(Backend& be, const Tensor& t) {
  if (t.empty()) return {};
  Tensor src = t;
  std::vector<float> v(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::f32) {
    be.copy_to_host(v.data(), src);
    return v;
  }
  REQUIRE(t.dtype == DType::f64);
  std::vector<double> d(static_cast<size_t>(t.numel()));
  be.copy_to_host(d.data(), src);
  for (size_t i = 0; i < d.size(); ++i) v[i] = static_cast<float>(d[i]);  // (compared after the same rounding)
  return v;
}

// master: float64 master weights and optimizer states beside the float32 parameters (the model
// copy the update writes, as bf16 parameters on a GPU).
Trained train(const Config& cfg, bool master, std::optional<std::string> overlap) {
  const OverlapEnv env(std::move(overlap));
  ParallelState ps = make_single_process_state();
  auto be = make_reference_backend(2);
  const ModelDims dims = ModelDims::from_config(cfg, ps);
  ModelOptions opt = ModelOptions::from_config(cfg, dims, DType::f32);
  if (master) opt.accum = opt.grad = DType::f64;
  GptModel model(dims, opt, ps, *be);
  REQUIRE(model.has_master_copy() == master);
  model.init_parameters();
  TrainingData data = build_training_data(cfg, 0, 1, 0);
  Quiet quiet;
  Trainer trainer(cfg, ps, model, *data.train, data.valid.get(), quiet);
  Trained out;
  out.initial = host(*be, model.params_flat());
  out.overlapped = trainer.optimizer().update_overlapped();
  trainer.train();
  out.losses = trainer.loss_history();
  out.params = host(*be, model.params_flat());
  out.master = host(*be, model.master_flat());
  out.exp_avg = host(*be, model.exp_avg_flat());
  out.exp_avg_sq = host(*be, model.exp_avg_sq_flat());
  return out;
}

void check_same_training(const Config& cfg, bool master) {
  const Trained whole = train(cfg, master, "0");
  const Trained cut = train(cfg, master, std::nullopt);
  CHECK_FALSE(whole.overlapped);
  CHECK(cut.overlapped);
  REQUIRE(cut.losses.size() == static_cast<size_t>(cfg.train.total_iters));
  REQUIRE(whole.losses.size() == cut.losses.size());
  for (size_t i = 0; i < cut.losses.size(); ++i) REQUIRE(cut.losses[i] == whole.losses[i]);
  CHECK(cut.params == whole.params);
  CHECK(cut.master == whole.master);
  CHECK(cut.exp_avg == whole.exp_avg);
  CHECK(cut.exp_avg_sq == whole.exp_avg_sq);
  CHECK(cut.params != cut.initial);  // it trained
}

Config mock(Config c, OptimizerKind kind) {
  c = test::with_mock_training(c);  // two micro-batches per step
  c.train.train_iters = 8;
  c.train.lr_warmup_iters = 2;
  c.train.weight_decay = 0.1;
  c.train.clip_grad = 0.5;  // clipping active: the folded gradient scale reaches every part
  c.train.optimizer = kind;
  c.train.decoupled_lr = 3e-3;  // a group of its own for the embeddings and the output layer
  test::derive(c);
  return c;
}

}  // namespace

TEST_CASE("update parts: one per forward group, covering every parameter once", "[optimizer]") {
  for (const bool llama : {false, true}) {
    Config c = llama ? test::tiny_llama_config() : test::tiny_gpt_config();
    c.model.num_layers = 3;
    test::derive(c);
    ParallelState ps = make_single_process_state();
    auto be = make_reference_backend(1);
    const ModelDims d = ModelDims::from_config(c, ps);
    GptModel model(d, ModelOptions::from_config(c, d, DType::f32), ps, *be);
    const std::vector<UpdatePart> parts = plan_update_parts(model, 0, 0, false);
    INFO((llama ? "llama" : "gpt"));
    REQUIRE(parts.size() == 4);  // embeddings + layer 0, layer 1, layer 2, head
    std::vector<int> covered(static_cast<size_t>(model.grads_flat().numel()), 0);
    const std::vector<ParamDesc>& params = model.params();
    for (size_t k = 0; k < parts.size(); ++k) {
      const UpdatePart& u = parts[k];
      CHECK(u.range.norm.empty());
      if (k > 0) CHECK(u.first_param > parts[k - 1].first_param);
      const int end = k + 1 < parts.size() ? parts[k + 1].first_param : static_cast<int>(params.size());
      for (int i = u.first_param; i < end; ++i) {
        INFO(params[static_cast<size_t>(i)].name);
        if (params[static_cast<size_t>(i)].layer >= 0)
          CHECK(params[static_cast<size_t>(i)].layer == static_cast<int>(k));
      }
      for (const OptimSegment& s : u.range.update) {
        CHECK(s.offset >= 0);
        CHECK(s.offset + s.count <= u.range.numel);
        for (int64_t e = 0; e < s.count; ++e) ++covered[static_cast<size_t>(u.range.flat_offset + s.offset + e)];
      }
    }
    for (const ParamDesc& p : params)
      for (int64_t e = 0; e < p.numel(); ++e) {
        INFO(p.name << " element " << e);
        REQUIRE(covered[static_cast<size_t>(p.offset + e)] == 1);
      }
  }
}

TEST_CASE("update overlap: training with the update in parts is bit for bit the whole update", "[optimizer][train]") {
  SECTION("GPT, AdamW") { check_same_training(mock(test::tiny_gpt_config(), OptimizerKind::adam), false); }
  SECTION("GPT, SGD") { check_same_training(mock(test::tiny_gpt_config(), OptimizerKind::sgd), false); }
  SECTION("Llama, AdamW, master weights") {
    check_same_training(mock(test::tiny_llama_config(), OptimizerKind::adam), true);
  }
}

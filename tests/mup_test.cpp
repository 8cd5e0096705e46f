// --use-mup (Megatron-Core's MuP): the width multiplier's effects, each against Megatron-LM's
// formula: init stds, softmax scale, embedding and logit multipliers (also in a float64 gradient
// check), and the optimizer's hidden-matrix group (Adam: lr / w and eps / w; SGD: the vector-like
// parameters at lr x w).
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "engine/backend.h"
#include "engine/gpt_model.h"
#include "engine/optimizer.h"
#include "engine/param_layout.h"
#include "parallel/parallel_state.h"
#include "tests/cli_test_util.h"
#include "tests/engine_test_util.h"
#include "tests/model_gradcheck.h"

using namespace mt;
using Catch::Contains;
using mt::test::operator+;

namespace {

Config mup_config(double base, const std::string& extra = "") {
  return test::parse(test::small_gpt() + test::words("--use-mup --mup-base-hidden-size " +
                                                     std::to_string(static_cast<int>(base)) + " " + extra));
}

}  // namespace

TEST_CASE("mup: width multiplier, init stds, softmax scale and multipliers as Megatron-LM derives them", "[mup][cli]") {
  // small_gpt: hidden 64, 4 heads of 16, 2 layers; base 16: width 4.
  const Config c = mup_config(16, "--mup-embedding-mult 2.5 --init-method-std 0.04");
  CHECK(c.model.mup_width_mult == 4.0);
  CHECK(c.model.mup_output_mult == 0.25);  // left at 1: 1 / width
  const ModelDims d = ModelDims::from_config(c, RankPosition::split(c, 1, 0));
  CHECK(d.init_std == Approx(0.04 / 2.0));
  CHECK(d.output_init_std == Approx(0.04 / (std::sqrt(4.0) * 2.0)));
  CHECK(d.embedding_init_std == Approx(0.04));
  CHECK(d.output_layer_init_std == Approx(0.04));
  CHECK(d.softmax_scale == Approx(1.0 / 16));
  CHECK(d.embedding_mult == 2.5f);
  CHECK(d.logits_mult == 0.25f);
  // An explicit output multiplier stays; the base head dimension and power set the scale.
  const Config e = mup_config(32, "--mup-output-mult 0.3 --mup-base-head-dim 64 --mup-attn-scale-power 0.5");
  const ModelDims de = ModelDims::from_config(e, RankPosition::split(e, 1, 0));
  CHECK(e.model.mup_output_mult == 0.3);
  CHECK(de.softmax_scale == Approx(std::sqrt(64.0) / std::sqrt(16.0)));
  // Width 1 (no base given): the hidden sizes' stds and the logits unchanged, MuP's 1/d scale.
  const Config one = test::parse(test::small_gpt() + test::words("--use-mup"));
  const ModelDims d1 = ModelDims::from_config(one, RankPosition::split(one, 1, 0));
  CHECK(one.model.mup_width_mult == 1.0);
  CHECK(d1.logits_mult == 1.0f);
  CHECK(d1.init_std == Approx(0.02));
  CHECK(d1.softmax_scale == Approx(1.0 / 16));
  // The hidden matrices: not 1-D, not the embeddings, not the output layer.
  const Config u = mup_config(16, "--untie-embeddings-and-output-weights");
  int hidden = 0;
  for (const ParamDesc& p : build_param_descs(ModelDims::from_config(u, RankPosition::split(u, 1, 0)), nullptr)) {
    INFO(p.name);
    const bool expect = !p.is_1d() && !p.name.starts_with("embedding.") && p.name != "output_layer.weight";
    CHECK(p.mup_hidden == expect);
    hidden += p.mup_hidden ? 1 : 0;
  }
  CHECK(hidden == 2 * 4);  // qkv, proj, fc1, fc2 per layer
  CHECK_THAT(test::parse_error(test::small_gpt() + test::words("--use-mup --mup-base-hidden-size 0")),
             Contains("--mup-base-hidden-size must be positive."));
  std::vector<SetupMessage> notes;
  test::parse(test::small_gpt() + test::words("--mup-base-hidden-size 32"), 1, &notes);
  CHECK(std::any_of(notes.begin(), notes.end(), [](const SetupMessage& m) {
    return m.text == "--mup-base-hidden-size has no effect without --use-mup (as in Megatron-LM)";
  }));
}

TEST_CASE("mup: float64 gradient check with the embedding and logit multipliers and MuP's softmax scale",
          "[mup][model][gradcheck]") {
  Config c = test::tiny_llama_config();
  c.model.use_mup = true;
  c.model.mup_base_hidden_size = 8;
  c.model.mup_width_mult = 4.0;  // (what the CLI derives: hidden 32 / 8)
  c.model.mup_output_mult = 0.25;
  c.model.mup_embedding_mult = 3.0;
  test::derive(c);
  ParallelState ps = make_single_process_state();
  std::unique_ptr<Backend> be = make_reference_backend(2);
  const ModelDims d = ModelDims::from_config(c, ps);
  REQUIRE(d.logits_mult == 0.25f);
  GptModel model(d, ModelOptions::from_config(c, d, DType::f64), ps, *be);
  model.init_parameters();
  std::vector<double> w(static_cast<size_t>(model.params_flat().numel()));
  be->copy_to_host(w.data(), model.params_flat());
  // Bigger random weights than the init so that every path carries signal (as the model gradient
  // checks do), the others moved off their constants.
  for (const ParamDesc& p : model.params())
    for (int64_t k = 0; k < p.numel(); ++k) {
      double& v = w[static_cast<size_t>(p.offset + k)];
      v = p.init == InitKind::normal ? v * 20.0 : v + 0.1 * std::sin(1.0 + static_cast<double>(k));
    }
  be->copy_from_host(model.params_flat(), w.data());
  MicroBatch mb;
  test::ArangeBatchSource src(d.micro_batch, d.seq, d.vocab);
  src.next(mb);
  for (size_t k = 0; k < mb.tokens.size(); ++k) mb.labels[k] = static_cast<int32_t>((k * 29 + 3) % d.vocab);
  auto loss = [&] {
    be->fill(model.loss_sums(false), 0.0);
    model.stage_micro_batch(0, mb, 1.0, false, 42, true);
    model.forward(0);
    double s[2];
    be->copy_to_host(s, model.loss_sums(false));
    return s[0] / s[1];
  };
  model.zero_grads();
  loss();
  model.backward(0);
  std::vector<double> g(static_cast<size_t>(model.grads_flat().numel()));
  be->copy_to_host(g.data(), model.grads_flat());
  test::check_model_gradients(model, *be, g, loss, 4, 1e-5, 1e-6, 1e-9);
}

TEST_CASE("mup: Adam's hidden matrices step at lr / w with eps / w, the rest at lr and eps, SGD's vector-like "
          "parameters at lr x w",
          "[mup][optimizer]") {
  for (const char* optimizer : {"adam", "sgd"}) {
    INFO(optimizer);
    // A gradient as small as eps shows eps's scale in Adam's first step: g / (|g| + eps).
    Config c = mup_config(16, std::string("--optimizer ") + optimizer + " --adam-eps 1e-3 --lr 1e-2 --clip-grad 0 "
                                                                         "--weight-decay 0 --lr-decay-style constant");
    ParallelState ps = make_single_process_state();
    std::unique_ptr<Backend> be = make_reference_backend(1);
    const ModelDims d = ModelDims::from_config(c, ps);
    GptModel model(d, ModelOptions::from_config(c, d, DType::f32), ps, *be);
    model.init_parameters();
    std::vector<float> w0(static_cast<size_t>(model.params_flat().numel())), gr(w0.size(), 0.0f);
    be->copy_to_host(w0.data(), model.params_flat());
    const float grad = 1e-3f;
    for (const ParamDesc& p : model.params())
      for (int64_t k = 0; k < p.numel(); ++k) gr[static_cast<size_t>(p.offset + k)] = grad;
    be->copy_from_host(model.grads_flat(), gr.data());
    const float sums[2] = {2.0f, 4.0f};
    be->copy_from_host(model.loss_sums(false), sums);
    LrSchedule schedule(LrSchedule::params_from_config(c));
    LossScaler scaler = LossScaler::none();
    Optimizer opt(c, model, ps, schedule, scaler);
    REQUIRE_FALSE(opt.step(1).skipped);
    // The logged rate is --lr's schedule (Megatron's first group without an lr override), also where
    // SGD runs the vector-like parameters at w times it.
    CHECK(opt.learning_rate() == Approx(1e-2));
    std::vector<float> w1(w0.size());
    be->copy_to_host(w1.data(), model.params_flat());
    const double lr = 1e-2, width = 4.0, g = grad;
    for (const ParamDesc& p : model.params()) {
      INFO(p.name);
      const size_t i = static_cast<size_t>(p.offset);
      const double moved = static_cast<double>(w0[i]) - w1[i];
      double expect;
      if (std::string(optimizer) == "adam")
        expect = p.mup_hidden ? lr / width * g / (g + 1e-3 / width) : lr * g / (g + 1e-3);
      else
        expect = p.mup_hidden ? lr * g : lr * width * g;
      // (The weights are float32: their difference carries up to an ulp of w0 each.)
      CHECK(moved == Approx(expect).epsilon(1e-4).margin(2.0 * std::abs(w0[i]) * 0x1p-23));
    }
  }
}

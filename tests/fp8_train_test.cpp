// FP8 training on the reference backend (emulated FP8): tiny GPT and Llama models follow their
// float32 runs closely, the delayed-scaling state moves, and layers kept in bf16 by
// --first-last-layers-bf16 run the exact float path.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "app/training_data.h"
#include "engine/backend.h"
#include "engine/gpt_model.h"
#include "engine/trainer.h"
#include "parallel/parallel_state.h"
#include "tests/engine_test_util.h"
#include "tests/fp8_train_util.h"

using namespace mt;

namespace {

Config fp8_mock_config(Config c) {
  c = test::with_mock_training(c);  // two micro-batches per step: the amax is the max over both
  c.train.train_iters = 20;
  c.train.lr_warmup_iters = 3;
  c.train.eval_iters = 0;
  test::derive(c);
  return c;
}

using test::Fp8Run;
Fp8Run train(const Config& cfg) { return test::train_fp8(cfg); }

Config with_fp8(Config c, Fp8Format f, Fp8Recipe r) {
  c.train.fp8_format = f;
  c.train.fp8_recipe = r;
  return c;
}

// Hybrid FP8 with delayed scaling over a history of 4, the max of it.
Config with_delayed_fp8(Config c) {
  c = with_fp8(c, Fp8Format::hybrid, Fp8Recipe::delayed);
  c.train.fp8_amax_history_len = 4;
  c.train.fp8_amax_compute_algo = Fp8AmaxAlgo::max;
  return c;
}

void check_follows(const Fp8Run& ref, const Fp8Run& fp8, double rel) {
  REQUIRE(ref.losses.size() == fp8.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    INFO("iteration " << i + 1 << ": float " << ref.losses[i] << ", fp8 " << fp8.losses[i]);
    CHECK(std::fabs(fp8.losses[i] - ref.losses[i]) <= rel * ref.losses[i]);
  }
  if (fp8.losses.size() >= 20) CHECK(fp8.losses.back() < 0.8 * fp8.losses.front());  // it learns
}

}  // namespace

TEST_CASE("fp8 training: tiny GPT, hybrid delayed scaling, follows float32", "[fp8][engine][train]") {
  Config base = fp8_mock_config(test::tiny_gpt_config());
  const Fp8Run ref = train(base);
  Config c = with_fp8(base, Fp8Format::hybrid, Fp8Recipe::delayed);
  c.train.fp8_amax_history_len = 4;
  c.train.fp8_amax_compute_algo = Fp8AmaxAlgo::max;
  const Fp8Run f = train(c);
  check_follows(ref, f, 0.01);
  // Differs from float (it really rounds) and the scales left their initial 1.
  bool differs = false;
  for (size_t i = 0; i < ref.losses.size(); ++i) differs |= ref.losses[i] != f.losses[i];
  CHECK(differs);
  REQUIRE(f.scale.size() == 2u * 12u);
  for (float s : f.scale) {
    CHECK(std::isfinite(s));
    CHECK(s != 1.0f);
  }
  // Row 0 of the history was cleared by the last update, the rows behind it hold amaxes.
  for (size_t i = 0; i < 24; ++i) CHECK(f.history[i] == 0.0f);
  for (size_t i = 24; i < f.history.size(); ++i) CHECK(f.history[i] > 0.0f);
}

TEST_CASE("fp8 training: tiny Llama, e4m3 and tensorwise scaling, follows float32", "[fp8][engine][train]") {
  Config base = fp8_mock_config(test::tiny_llama_config());
  const Fp8Run ref = train(base);
  check_follows(ref, train(with_fp8(base, Fp8Format::e4m3, Fp8Recipe::tensorwise)), 0.01);
  Config nowgrad = with_fp8(base, Fp8Format::hybrid, Fp8Recipe::delayed);
  nowgrad.train.fp8_wgrad = false;
  check_follows(ref, train(nowgrad), 0.01);
}

TEST_CASE("fp8 training: MoE layers, each expert's GEMMs in FP8 with its own scales, follow float32",
          "[fp8][engine][train][moe]") {
  Config base = test::with_moe(test::tiny_llama_config(), 3, 4, 2, 20, 1);
  base.model.moe.moe_layer = {1, 0, 1};  // a dense layer between two MoE layers
  base = fp8_mock_config(base);
  const Fp8Run ref = train(base);
  const Fp8Run f = train(with_delayed_fp8(base));
  check_follows(ref, f, 0.01);
  // The experts' state: 2 MoE layers x 4 experts x 2 GEMMs (fc1, fc2) x 3 roles, every scale set
  // by an update, and every amax of the rows behind row 0 recorded: each expert's input, weight and
  // output gradient were cast (the output gradients only by the FP8 backward).
  const size_t n = 2u * 4u * 2u * 3u;
  REQUIRE(f.ex_scale.size() == n);
  REQUIRE(f.ex_history.size() == 4u * n);
  for (float s : f.ex_scale) {
    CHECK(std::isfinite(s));
    CHECK(s != 1.0f);
  }
  for (size_t i = 0; i < n; ++i) CHECK(f.ex_history[i] == 0.0f);
  for (size_t i = n; i < f.ex_history.size(); ++i) CHECK(f.ex_history[i] > 0.0f);
  // Each expert's weight scale comes from its own weight: the four experts' fc1 weight scales of a
  // layer are not one shared value.
  for (size_t layer = 0; layer < 2; ++layer) {
    std::vector<float> w;
    for (size_t expert = 0; expert < 4; ++expert) w.push_back(f.ex_scale[layer * 24 + expert * 6 + 1]);
    std::sort(w.begin(), w.end());
    CHECK(std::unique(w.begin(), w.end()) - w.begin() > 1);
  }
  // Tensorwise scaling follows too.
  check_follows(ref, train(with_fp8(base, Fp8Format::e4m3, Fp8Recipe::tensorwise)), 0.01);
}

TEST_CASE("fp8 training: multi-latent attention and an MTP depth, their GEMMs in FP8, follow float32",
          "[fp8][engine][train][mla][mtp]") {
  Config base = test::tiny_mla_config();
  base.model.mtp_num_layers = 1;
  base.model.mtp_loss_scaling_factor = 0.3;
  // (--first-last-layers-bf16 keeps decoder layers in bf16; the MTP depth runs in FP8 regardless.)
  base.train.first_last_layers_bf16 = true;
  base.train.num_layers_at_start_in_bf16 = 0;
  base.train.num_layers_at_end_in_bf16 = 1;
  base = fp8_mock_config(base);
  const Fp8Run ref = train(base);
  const Fp8Run f = train(with_delayed_fp8(base));
  check_follows(ref, f, 0.01);
  // The extra GEMMs' state: per FP8 layer MLA's five GEMMs (query down and up, key/value down and
  // up, output projection) and the MTP projection, three operands each. The decoder's FP8 layers
  // (all but the last) and the depth's layer: every MLA GEMM's scales set by an update; the MTP
  // projection's on the depth's layer only.
  const int L = base.model.num_layers;
  std::vector<int> expected;
  for (int l = 0; l < L - 1; ++l) expected.push_back(l);
  expected.push_back(L);  // the depth's layer (global L)
  REQUIRE(f.x_layers == expected);
  REQUIRE(f.x_scale.size() == expected.size() * 18u);
  for (size_t j = 0; j < expected.size(); ++j)
    for (size_t k = 0; k < 18; ++k) {
      INFO("layer " << expected[j] << " GEMM " << k / 3 << " operand " << k % 3);
      const float s = f.x_scale[j * 18 + k];
      CHECK(std::isfinite(s));
      if (k < 15 || expected[j] == L) CHECK(s != 1.0f);
      else CHECK(s == 1.0f);
    }
}

TEST_CASE("fp8 training: --first-last-layers-bf16 keeps those layers on the float path", "[fp8][engine][train]") {
  Config base = fp8_mock_config(test::tiny_gpt_config());
  base.train.train_iters = 4;
  base.train.total_iters = 4;
  const Fp8Run ref = train(base);
  Config all_bf16 = with_fp8(base, Fp8Format::hybrid, Fp8Recipe::tensorwise);
  all_bf16.train.first_last_layers_bf16 = true;  // 2 layers: layer 0 at the start, layer 1 at the end
  const Fp8Run a = train(all_bf16);
  CHECK(a.losses == ref.losses);  // no FP8 layer: bit for bit the float run
  CHECK(a.scale.empty());
  Config last_fp8 = all_bf16;
  last_fp8.train.num_layers_at_end_in_bf16 = 0;  // layer 1 in FP8
  const Fp8Run b = train(last_fp8);
  CHECK(b.scale.size() == 12u);
  CHECK(b.losses != ref.losses);
  check_follows(ref, b, 0.01);
}

TEST_CASE("fp8 training: delayed scaling calibrates its first step in float, then casts", "[fp8][engine][train]") {
  // Transformer Engine casts the first step with scale 1; here the FP8 layers run that step in the
  // compute dtype and only record the amaxes, so it is the float step, and the first delayed
  // update has real amaxes to scale by.
  Config base = fp8_mock_config(test::tiny_gpt_config());
  base.train.train_iters = 1;
  base.train.total_iters = 1;
  base.train.lr_warmup_iters = 0;  // a full-size first update
  const Fp8Run ref = train(base);
  const Fp8Run delayed = train(with_fp8(base, Fp8Format::hybrid, Fp8Recipe::delayed));
  REQUIRE(delayed.losses.size() == 1u);
  CHECK(delayed.losses[0] == ref.losses[0]);
  CHECK(delayed.params == ref.params);  // the same gradients, the same update
  REQUIRE(delayed.scale.size() == 2u * 12u);
  for (float s : delayed.scale) CHECK(s != 1.0f);  // the update found an amax for every operand

  base.train.train_iters = 3;
  base.train.total_iters = 3;
  const Fp8Run ref3 = train(base);
  const Fp8Run d3 = train(with_fp8(base, Fp8Format::hybrid, Fp8Recipe::delayed));
  REQUIRE(d3.losses.size() == 3u);
  CHECK(d3.losses[0] == ref3.losses[0]);
  CHECK(d3.losses[1] != ref3.losses[1]);  // step 2 casts to FP8 with the delayed scales
}

// The FP8 state of one FP8 layer, planned, allocated and initialized as a model does it.
struct OneLayerFp8 {
  Arena arena;
  Fp8State state;
  OneLayerFp8(Backend& be, Fp8Recipe recipe) : arena(be) {
    Fp8Options o;
    o.format = Fp8Format::hybrid;
    o.recipe = recipe;
    o.history_len = 2;
    o.layer_fp8 = {1};
    state.plan(o, 0, 1);
    state.layout(arena);
    arena.allocate();
    state.layout(arena);
    state.initialize(be);
  }
};

TEST_CASE("fp8 state: delayed scaling calibrates until its first update (also after a load)", "[fp8][engine]") {
  auto be = make_reference_backend(1);
  OneLayerFp8 delayed(*be, Fp8Recipe::delayed);
  Fp8State& st = delayed.state;
  CHECK(st.calibrating());

  // A checkpoint whose scales are all 1 (saved before any update) keeps the rule; one with an
  // updated scale does not.
  std::vector<float> packed(static_cast<size_t>(st.layer_floats()), 1.0f);
  st.load_from_host(*be, packed.data());
  CHECK(st.calibrating());
  packed[static_cast<size_t>(2 * Fp8State::kPerLayer + 5)] = 2.0f;  // scale[5] (history_len 2)
  st.load_from_host(*be, packed.data());
  CHECK_FALSE(st.calibrating());

  // Tensorwise scaling never needs the rule.
  CHECK_FALSE(OneLayerFp8(*be, Fp8Recipe::tensorwise).state.calibrating());
}

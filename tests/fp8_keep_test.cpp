// FP8 linear inputs quantized once, in forward (GptModel keeps the transposed copy for the
// weight-gradient GEMM), against the former path that quantizes them again in backward from the
// recomputed compute-dtype inputs (ModelOptions::TestSeams::fp8_keep_inputs = false). Same x, same scale:
// the same bits, so training must be bit-identical: every loss, grad norm, parameter and FP8
// scaling state. Also with full recompute (equal to no recompute) and with two micro-batches in
// flight (a pipeline's order: tensorwise scaling's scales change between a forward and its backward).
#include <catch2/catch.hpp>

#include <cmath>
#include <memory>
#include <optional>
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

using Run = test::Fp8Run;
Run train(const Config& cfg, bool requantize) { return test::train_fp8(cfg, !requantize); }

Config fp8_config(Config c, Fp8Format f, Fp8Recipe r, int iters) {
  c = test::with_mock_training(c);  // two micro-batches per step
  c.train.train_iters = iters;
  c.train.lr_warmup_iters = 1;
  c.train.eval_iters = 0;
  c.train.fp8_format = f;
  c.train.fp8_recipe = r;
  c.train.fp8_amax_history_len = 4;
  c.train.fp8_amax_compute_algo = Fp8AmaxAlgo::max;
  test::derive(c);
  return c;
}

void check_identical(const Run& a, const Run& b) {
  REQUIRE(a.losses.size() == b.losses.size());
  REQUIRE(a.grad_norms.size() == b.grad_norms.size());
  for (size_t i = 0; i < a.losses.size(); ++i) {
    INFO("iteration " << i + 1);
    CHECK(a.losses[i] == b.losses[i]);
    CHECK(a.grad_norms[i] == b.grad_norms[i]);
    CHECK(a.grad_norms[i] > 0.0);
  }
  CHECK(a.params == b.params);
  CHECK(a.scale == b.scale);
  CHECK(a.scale_inv == b.scale_inv);
  CHECK(a.history == b.history);
}

// Activation bytes the kept inputs add: per FP8 layer the four inputs' [K, N] FP8 copies (each
// 256-byte aligned), plus tensorwise's scale_inv [4] (one aligned block).
size_t kept_bytes_per_layer(const Config& c, Fp8Recipe r) {
  const int64_t N = static_cast<int64_t>(c.train.micro_batch_size) * c.model.seq_length;
  const int64_t h = c.model.hidden_size, att = static_cast<int64_t>(c.model.num_attention_heads) * c.model.head_dim;
  auto aligned = [](int64_t n) { return static_cast<size_t>((n + 255) / 256 * 256); };
  size_t b = aligned(h * N) * 2 + aligned(att * N) + aligned(c.model.ffn_size * N);
  if (r == Fp8Recipe::tensorwise) b += 256;
  return b;
}

}  // namespace

TEST_CASE("fp8 kept inputs: training is bit-identical to re-quantizing in backward", "[fp8][engine][train]") {
  struct Case {
    const char* name;
    Config model;
    Fp8Format format;
    Fp8Recipe recipe;
  };
  Config gpt_erf = test::tiny_gpt_config();
  gpt_erf.model.bias_gelu_fusion = false;  // exact (erf) GeLU; the default with biases is tanh
  test::derive(gpt_erf);
  const std::vector<Case> cases = {
      {"GPT hybrid delayed", test::tiny_gpt_config(), Fp8Format::hybrid, Fp8Recipe::delayed},
      {"GPT e4m3 tensorwise", test::tiny_gpt_config(), Fp8Format::e4m3, Fp8Recipe::tensorwise},
      {"GPT (erf GeLU) hybrid tensorwise", gpt_erf, Fp8Format::hybrid, Fp8Recipe::tensorwise},
      {"Llama hybrid delayed", test::tiny_llama_config(), Fp8Format::hybrid, Fp8Recipe::delayed},
      {"Llama hybrid tensorwise", test::tiny_llama_config(), Fp8Format::hybrid, Fp8Recipe::tensorwise},
  };
  for (const Case& k : cases) {
    INFO(k.name);
    Config c = fp8_config(k.model, k.format, k.recipe, 5);  // delayed: 1 calibrating step, then 4 in FP8
    // Norm outputs recomputed in both (layers re-quantizing in backward would otherwise keep
    // them, ModelOptions::keep_norm_outputs), so that the plans differ by the FP8 copies alone.
    c.train.recompute_granularity = RecomputeGranularity::selective;
    c.train.recompute_modules = {"core_attn", "layernorm"};
    const Run kept = train(c, false), requant = train(c, true);
    check_identical(kept, requant);
    // The FP8 GEMMs ran (the float run differs from iteration 2 on).
    Config float_cfg = c;
    float_cfg.train.fp8_format.reset();
    const Run ref = train(float_cfg, false);
    REQUIRE(ref.losses.size() == kept.losses.size());
    CHECK(ref.losses.back() != kept.losses.back());
    // Planned up front: the kept copies are activations; the re-quantize workspace is gone.
    const size_t act = kept.plan.of(MemoryCategory::activations), act0 = requant.plan.of(MemoryCategory::activations);
    CHECK(act - act0 == static_cast<size_t>(c.model.num_layers) * kept_bytes_per_layer(c, k.recipe));
    CHECK(kept.plan.of(MemoryCategory::workspace) < requant.plan.of(MemoryCategory::workspace));
  }
}

TEST_CASE("fp8 norm cast: casting the QKV and fc1 inputs from the norms' statistics trains bit-identically",
          "[fp8][engine][train]") {
  struct Case {
    const char* name;
    Config model;
    Fp8Recipe recipe;
    bool recompute_norms;
  };
  const std::vector<Case> cases = {
      {"GPT delayed", test::tiny_gpt_config(), Fp8Recipe::delayed, false},
      {"GPT tensorwise, norms recomputed", test::tiny_gpt_config(), Fp8Recipe::tensorwise, true},
      {"Llama delayed, norms recomputed", test::tiny_llama_config(), Fp8Recipe::delayed, true},
      {"Llama tensorwise", test::tiny_llama_config(), Fp8Recipe::tensorwise, false},
  };
  for (const Case& k : cases) {
    INFO(k.name);
    Config c = fp8_config(k.model, Fp8Format::hybrid, k.recipe, 5);
    if (k.recompute_norms) {
      c.train.recompute_granularity = RecomputeGranularity::selective;
      c.train.recompute_modules = {"core_attn", "layernorm"};
    }
    const Run cast = test::train_fp8(c, true, true), written = test::train_fp8(c, true, false);
    check_identical(cast, written);
  }
}

// Tensorwise scaling: the norm statistics take the amax of the output their FP8 cast reads, the
// norm backwards that of the proj / fc2 output gradients they write, the optimizer's update that of
// the new weights (ModelOptions::TestSeams::fp8_producer_amax), so those casts skip their amax pass. The
// reference backend checks every such amax against the cast's own max |x|, bit for bit; here
// training must also equal the run where every cast takes its own, and the taken path must have run
// (with hidden dropout the dropout backward takes the proj / fc2 gradients' amaxes). With
// evaluations between steps the first weight
// cast after an update is an evaluation's: it takes the update's amaxes, the training forward's recast
// takes its own (a mis-pairing would fail the reference's check).
TEST_CASE("fp8 tensorwise: amaxes taken by the ops that write the cast sources train bit-identically",
          "[fp8][engine][train]") {
  struct Case {
    const char* name;
    Config model;
    bool full_recompute;
    double hidden_dropout;
    int64_t taken_per_layer_step;  // casts per layer per micro-batch that use a producer's amax
    bool evaluate = false;         // one evaluation micro-batch after every second step
  };
  // Per layer and micro-batch: the QKV and fc1 input casts (2), proj's output gradient (1) and
  // fc2's (1, from the norm backwards: not in the last layer, the final norm's backward runs with
  // the head's, see GptModel::dy_amax_from_norm; from the dropout backward with hidden dropout: in
  // every layer). Full recompute runs each layer's forward twice.
  const std::vector<Case> cases = {
      {"GPT", test::tiny_gpt_config(), false, 0.0, 4},
      {"Llama", test::tiny_llama_config(), false, 0.0, 4},
      {"GPT, hidden dropout", test::tiny_gpt_config(), false, 0.1, 4},
      {"Llama, full recompute", test::tiny_llama_config(), true, 0.0, 6},
      {"GPT, evaluations", test::tiny_gpt_config(), false, 0.0, 4, true},
  };
  for (const Case& k : cases) {
    INFO(k.name);
    Config c = k.model;
    c.model.hidden_dropout = k.hidden_dropout;
    c = fp8_config(c, Fp8Format::hybrid, Fp8Recipe::tensorwise, 4);
    if (k.full_recompute) {
      c.train.recompute_granularity = RecomputeGranularity::full;
      c.train.recompute_method = RecomputeMethod::uniform;
      c.train.recompute_num_layers = 1;
    }
    if (k.evaluate) {
      c.train.eval_iters = 1;
      c.train.eval_interval = 2;
    }
    const Run taken = test::train_fp8(c, true, true, true), own = test::train_fp8(c, true, true, false);
    check_identical(taken, own);
    CHECK(own.amaxes_taken == 0);
    const int64_t layers = c.model.num_layers, micro = *c.train.global_batch_size / c.train.micro_batch_size;
    const int64_t iters = *c.train.train_iters;
    const int64_t fc2_missing = k.hidden_dropout > 0 ? 0 : 1;  // the last layer's fc2
    // The four weights of each layer once per update (the first step's casts take their own).
    const int64_t weights = Fp8State::kGemms * layers * (iters - 1);
    const int64_t training = (k.taken_per_layer_step * layers - fc2_missing) * micro * iters + weights;
    if (k.evaluate) CHECK(taken.amaxes_taken > training);  // (the evaluations' norm casts too)
    else CHECK(taken.amaxes_taken == training);
  }
}

TEST_CASE("fp8 kept inputs: --no-fp8-wgrad keeps nothing and trains alike", "[fp8][engine][train]") {
  Config c = fp8_config(test::tiny_llama_config(), Fp8Format::hybrid, Fp8Recipe::delayed, 4);
  c.train.fp8_wgrad = false;
  const Run a = train(c, false), b = train(c, true);
  check_identical(a, b);
  CHECK(a.plan.bytes == b.plan.bytes);
}

TEST_CASE("fp8 kept inputs: full recompute equals keeping activations", "[fp8][engine][train]") {
  // 3 layers, the first in bf16 (--first-last-layers-bf16 1 0): recompute groups of 2 are [0, 2)
  // and [2, 3), so the scratch entry of a group's first layer serves a bf16 and an FP8 layer.
  for (bool llama : {false, true}) {
    for (Fp8Recipe recipe : {Fp8Recipe::delayed, Fp8Recipe::tensorwise}) {
      INFO((llama ? "Llama" : "GPT") << (recipe == Fp8Recipe::delayed ? " delayed" : " tensorwise"));
      Config m = llama ? test::tiny_llama_config() : test::tiny_gpt_config();
      m.model.num_layers = 3;
      m.model.hidden_dropout = 0.1;  // the recomputed forward redraws the same masks
      test::derive(m);
      Config c = fp8_config(m, Fp8Format::hybrid, recipe, 4);
      c.train.first_last_layers_bf16 = true;
      c.train.num_layers_at_start_in_bf16 = 1;
      c.train.num_layers_at_end_in_bf16 = 0;
      const Run plain = train(c, false);
      for (RecomputeMethod method : {RecomputeMethod::uniform, RecomputeMethod::block}) {
        INFO((method == RecomputeMethod::uniform ? "uniform" : "block"));
        Config r = c;
        r.train.recompute_granularity = RecomputeGranularity::full;
        r.train.recompute_method = method;
        r.train.recompute_num_layers = 2;
        const Run rec = train(r, false);
        check_identical(plain, rec);
        CHECK(rec.plan.of(MemoryCategory::activations) < plain.plan.of(MemoryCategory::activations));
        if (method == RecomputeMethod::uniform && recipe == Fp8Recipe::tensorwise) check_identical(rec, train(r, true));
      }
    }
  }
}

namespace {

// Two micro-batches in flight in two slots, in a pipeline's order (forward 0, forward 1,
// backward 0, backward 1), for two steps without optimizer (delayed scaling: the first
// calibrates, the second casts). Returns the main grads of the second step.
std::vector<float> two_in_flight(const Config& cfg, bool requantize) {
  ParallelState ps = make_single_process_state();
  auto be = make_reference_backend(2);
  const ModelDims dims = ModelDims::from_config(cfg, ps);
  ModelOptions o = ModelOptions::from_config(cfg, dims, DType::f32);
  o.num_slots = 2;
  o.seams.fp8_keep_inputs = !requantize;
  GptModel model(dims, o, ps, *be);
  model.init_parameters();
  const int b = cfg.train.micro_batch_size, s = cfg.model.seq_length;
  test::ArangeBatchSource src(b, s, cfg.model.vocab_size);
  uint64_t serial = 0;
  for (int step = 0; step < 2; ++step) {
    model.zero_grads();
    model.fp8_begin_step();
    MicroBatch mb[2];
    for (int k = 0; k < 2; ++k) {
      REQUIRE(src.next(mb[k]));
      // Different scales per micro-batch: the second's inputs (and so their amaxes) are larger.
      if (k == 1)
        for (int32_t& t : mb[k].tokens) t = (t * 5 + 3) % cfg.model.vocab_size;
      model.stage_micro_batch(k, mb[k], 1.0, false, serial++, true);
      model.forward(k);
    }
    model.backward(0);
    model.backward(1, true);
    model.fp8_end_step();
  }
  std::vector<float> g(static_cast<size_t>(model.grads_flat().numel()));
  be->copy_to_host(g.data(), model.grads_flat());
  return g;
}

}  // namespace

TEST_CASE("fp8 kept inputs: two micro-batches in flight match re-quantizing", "[fp8][engine]") {
  for (bool llama : {false, true}) {
    for (Fp8Recipe recipe : {Fp8Recipe::delayed, Fp8Recipe::tensorwise}) {
      INFO((llama ? "Llama" : "GPT") << (recipe == Fp8Recipe::delayed ? " delayed" : " tensorwise"));
      Config c = llama ? test::tiny_llama_config() : test::tiny_gpt_config();
      c.model.hidden_size = 32;
      c.train.fp8_format = Fp8Format::hybrid;
      c.train.fp8_recipe = recipe;
      test::derive(c);
      const std::vector<float> kept = two_in_flight(c, false), requant = two_in_flight(c, true);
      REQUIRE(kept.size() == requant.size());
      size_t nonzero = 0;
      for (float v : kept) nonzero += v != 0.0f;
      CHECK(nonzero > kept.size() / 2);
      CHECK(kept == requant);
    }
  }
}

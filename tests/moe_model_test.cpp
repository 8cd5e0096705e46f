// Mixture-of-experts layers in the whole model (engine/blocks/moe.cpp) on the reference backend:
// float64 gradient checks of every parameter against central differences of the objective the
// gradients belong to (the loss plus the aux and z-losses), an MoE layer of one expert equal to the
// dense MLP with the same weights, and training.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/gpt_model.h"
#include "engine/moe_routing.h"
#include "parallel/parallel_state.h"
#include "tests/engine_test_util.h"
#include "tests/model_gradcheck.h"

using namespace mt;

namespace {

Config tiny_moe_config(int experts, int topk) {
  Config c = test::tiny_llama_config();
  c.model.num_layers = 3;
  MoeConfig& e = c.model.moe;
  e.num_experts = experts;
  e.router_topk = topk;
  e.ffn_hidden_size = 20;
  e.layer_freq = 1;
  e.moe_layer = {1, 0, 1};  // a dense layer between two MoE layers
  return c;
}

struct MoeHarness {
  Config cfg;
  ParallelState ps = make_single_process_state();
  std::unique_ptr<Backend> be = make_reference_backend(2);
  ModelDims dims;
  std::unique_ptr<GptModel> model;
  MicroBatch mb;

  explicit MoeHarness(const Config& c, DType dtype = DType::f64, double scale = 20.0) : cfg(c) {
    dims = ModelDims::from_config(cfg, ps);
    ModelOptions o = ModelOptions::from_config(cfg, dims, dtype);
    model = std::make_unique<GptModel>(dims, o, ps, *be);
    model->init_parameters();
    if (scale != 1.0) {
      // Bigger weights than the 0.02 init so that every path carries signal (and routing differs
      // by token).
      std::vector<double> w = params();
      for (const ParamDesc& p : model->params())
        for (int64_t k = 0; k < p.numel(); ++k) {
          double& v = w[static_cast<size_t>(p.offset + k)];
          v = p.init == InitKind::normal ? v * scale : v + 0.1 * std::sin(1.0 + static_cast<double>(k));
        }
      set_params(w);
    }
    test::ArangeBatchSource src(dims.micro_batch, dims.seq, dims.vocab);
    src.next(mb);
    for (size_t k = 0; k < mb.tokens.size(); ++k) {
      mb.tokens[k] = static_cast<int32_t>((k * 13 + 5) % dims.vocab);
      mb.labels[k] = static_cast<int32_t>((k * 29 + 3) % dims.vocab);
      mb.loss_mask[k] = (k % 5 == 3) ? 0.0f : 1.0f;
    }
  }

  // The parameters as doubles (float32 models converted).
  std::vector<double> params() {
    const Tensor p = model->params_flat();
    std::vector<double> w(static_cast<size_t>(p.numel()));
    if (p.dtype == DType::f64) {
      be->copy_to_host(w.data(), p);
    } else {
      std::vector<float> f(w.size());
      be->copy_to_host(f.data(), p);
      std::copy(f.begin(), f.end(), w.begin());
    }
    return w;
  }
  void set_params(const std::vector<double>& w) {
    const Tensor p = model->params_flat();
    if (p.dtype == DType::f64) {
      be->copy_from_host(p, w.data());
    } else {
      const std::vector<float> f(w.begin(), w.end());
      be->copy_from_host(p, f.data());
      be->synchronize();
    }
  }

  // The logged MoE loss sums ({aux, z}, {seq, 0}, {global, 0}: GptModel::moe_loss_sums).
  std::vector<double> moe_sums() {
    std::vector<double> m(2 * GptModel::kMoeTerms, 0.0);
    if (!model->moe_loss_sums().empty()) be->copy_to_host(m.data(), model->moe_loss_sums());
    return m;
  }

  // The objective whose gradient backward() computes: the loss of the micro-batch plus the MoE
  // layers' load-balancing and z-losses with their coefficients (the logged sums times the
  // coefficients).
  double objective(double* lm = nullptr) {
    model->moe_begin_step();  // (a step of this one micro-batch: global_aux_loss's counts its own)
    be->fill(model->loss_sums(false), 0.0);
    if (!model->moe_loss_sums().empty()) be->fill(model->moe_loss_sums(), 0.0);
    model->stage_micro_batch(0, mb, 1.0, false, 42, true);
    model->forward(0);
    double s[2];
    be->copy_to_host(s, model->loss_sums(false));
    const std::vector<double> m = moe_sums();
    if (lm) *lm = s[0] / s[1];
    return s[0] / s[1] + dims.moe_aux_coeff * m[0] + dims.moe_z_coeff * m[1] + dims.moe_seq_coeff * m[2] +
           dims.moe_global_coeff * m[4];
  }

  std::vector<double> grads() {
    model->zero_grads();
    objective();
    model->backward(0);
    model->check_grads_written();
    std::vector<double> g(static_cast<size_t>(model->grads_flat().numel()));
    be->copy_to_host(g.data(), model->grads_flat());
    return g;
  }

  void check_all(int samples_per_param) {
    const std::vector<double> g = grads();
    test::check_model_gradients(*model, *be, g, [this] { return objective(); }, samples_per_param, 1e-6, 1e-5, 1e-8);
  }
};

// The same model with the experts' fc1 outputs recomputed in backward (--recompute-modules moe):
// the same objective and gradients, bit for bit.
void check_moe_recompute_same(const Config& c, MoeHarness& h) {
  Config r = c;
  r.train.recompute_granularity = RecomputeGranularity::selective;
  r.train.recompute_modules = {"moe"};
  MoeHarness again(r);
  CHECK(again.objective() == h.objective());
  CHECK(again.grads() == h.grads());
}

}  // namespace

TEST_CASE("MoE gradient check: softmax top-2 routing with aux and z-losses, shared experts", "[moe][gradcheck]") {
  Config c = tiny_moe_config(4, 2);
  c.model.moe.aux_loss_coeff = {0.1};
  c.model.moe.z_loss_coeff = 0.01;
  c.model.moe.shared_expert_intermediate_size = 12;
  SECTION("ungated shared expert") {
    MoeHarness h(c);
    h.check_all(6);
  }
  SECTION("gated shared expert, float32 router") {
    c.model.moe.shared_expert_gate = true;
    c.model.moe.router_dtype = "fp32";
    MoeHarness h(c);
    h.check_all(6);
  }
}

TEST_CASE("MoE recomputation (--recompute-modules moe, shared_experts): the same loss and gradients bit for bit, "
          "less kept", "[moe]") {
  Config c = tiny_moe_config(4, 2);
  c.model.moe.aux_loss_coeff = {0.1};
  c.model.moe.z_loss_coeff = 0.01;
  c.model.moe.shared_expert_intermediate_size = 12;
  c.model.moe.shared_expert_gate = true;
  MoeHarness plain(c);
  const double loss = plain.objective();
  const std::vector<double> grads = plain.grads();
  const size_t kept = plain.model->memory_plan().of(MemoryCategory::activations);
  for (const std::vector<std::string>& modules :
       {std::vector<std::string>{"moe"}, {"shared_experts"}, {"core_attn", "layernorm", "moe"}}) {
    INFO(fmt::format("{}", fmt::join(modules, " ")));
    Config r = c;
    r.train.recompute_granularity = RecomputeGranularity::selective;
    r.train.recompute_modules = modules;
    MoeHarness h(r);
    CHECK(h.objective() == loss);
    CHECK(h.grads() == grads);
    CHECK(h.model->memory_plan().of(MemoryCategory::activations) < kept);
  }
}

TEST_CASE("MoE gradient check: input jitter, with the router in the compute dtype and in float32", "[moe][gradcheck]") {
  // Every expert chosen (top-4 of 4): the jitter moves the logits, and no choice can flip under the
  // finite differences' steps.
  Config c = tiny_moe_config(4, 4);
  c.model.moe.aux_loss_coeff = {0.1};
  c.model.moe.z_loss_coeff = 0.01;
  const double plain = MoeHarness(c).objective();
  c.model.moe.input_jitter_eps = 0.3;
  for (const bool fp32 : {false, true}) {
    INFO((fp32 ? "float32 router" : "router in the compute dtype"));
    if (fp32) c.model.moe.router_dtype = "fp32";
    MoeHarness h(c);
    // The jitter changes the router's logits, so the loss (the same weights and tokens), the same
    // at every evaluation.
    const double once = h.objective();
    CHECK(std::fabs(once - plain) > 1e-9);
    CHECK(h.objective() == once);
    h.check_all(6);
  }
}

TEST_CASE("MoE gradient check: pre-softmax, sigmoid and sqrtsoftplus with group-limited routing and scaling, GeLU experts",
          "[moe][gradcheck]") {
  SECTION("pre-softmax top-1 with scaling") {
    Config c = tiny_moe_config(3, 1);
    c.model.moe.router_pre_softmax = true;
    c.model.moe.router_topk_scaling_factor = 2.5;
    c.model.moe.aux_loss_coeff = {0.05};
    MoeHarness h(c);
    h.check_all(4);
  }
  SECTION("sigmoid and sqrtsoftplus, 8 experts in 4 groups, top-3 of the best 2 groups, aux loss; sqrtsoftplus top-1") {
    for (const auto& [score, k] : {std::pair{MoeScoreFunction::sigmoid, 3}, std::pair{MoeScoreFunction::sqrtsoftplus, 3},
                                   std::pair{MoeScoreFunction::sqrtsoftplus, 1}}) {
      Config c = tiny_moe_config(8, k);
      c.model.moe.score_function = score;
      if (k > 1) {
        c.model.moe.router_num_groups = 4;
        c.model.moe.router_group_topk = 2;
      }
      c.model.moe.router_topk_scaling_factor = 1.5;
      c.model.moe.aux_loss_coeff = {0.1};
      MoeHarness h(c);
      h.check_all(4);
    }
  }
  SECTION("GeLU experts and shared expert (LayerNorm), every other layer MoE") {
    Config c = tiny_moe_config(4, 2);
    c.model.swiglu = false;
    c.model.normalization = Normalization::layernorm;
    c.model.moe.moe_layer = {0, 1, 0};
    c.model.moe.shared_expert_intermediate_size = 8;
    c.model.moe.z_loss_coeff = 0.02;
    test::derive(c);
    MoeHarness h(c);
    h.check_all(4);
  }
}

// --moe-apply-probs-on-input (top-1): the routing weight scales the expert's input; its gradient
// comes from the input's gradient. SwiGLU and GeLU experts, sigmoid and pre-softmax routing, and
// with the experts' fc1 outputs recomputed (the same loss and gradients bit for bit).
TEST_CASE("MoE gradient check: routing weights on the experts' input (--moe-apply-probs-on-input)", "[moe][gradcheck]") {
  SECTION("sigmoid top-1, SwiGLU, aux loss and a shared expert") {
    Config c = tiny_moe_config(4, 1);
    c.model.moe.apply_probs_on_input = true;
    c.model.moe.score_function = MoeScoreFunction::sigmoid;
    c.model.moe.aux_loss_coeff = {0.05};
    c.model.moe.shared_expert_intermediate_size = 8;
    MoeHarness h(c);
    h.check_all(4);
    check_moe_recompute_same(c, h);
  }
  SECTION("pre-softmax top-1, GeLU experts") {
    Config c = tiny_moe_config(3, 1);
    c.model.moe.apply_probs_on_input = true;
    c.model.moe.router_pre_softmax = true;
    c.model.swiglu = false;
    c.model.normalization = Normalization::layernorm;
    test::derive(c);
    MoeHarness h(c);
    h.check_all(4);
  }
  SECTION("not the same model as the weights on the activation") {
    Config c = tiny_moe_config(4, 1);
    c.model.moe.score_function = MoeScoreFunction::sigmoid;
    MoeHarness on_activation(c);
    c.model.moe.apply_probs_on_input = true;
    MoeHarness on_input(c);
    CHECK(on_input.objective() != on_activation.objective());
  }
}

// Linear biases in MoE layers (Megatron's default --add-bias-linear; expert TP 1, no shared expert):
// the router's bias (init_method, as its weight), each expert's fc1 bias before the activation and
// fc2 bias times the routing weight (Megatron's expert MLP: output + output_bias * per_token_scale),
// so the routing weights' gradient takes d y . b too. Every parameter against central differences.
TEST_CASE("MoE gradient check: linear biases (router, experts' fc1 and fc2)", "[moe][gradcheck]") {
  auto biased = [](Config c) {
    c.model.add_bias_linear = true;
    c.model.add_qkv_bias = true;
    test::derive(c);
    return c;
  };
  SECTION("softmax top-2, SwiGLU, aux and z-losses") {
    Config c = biased(tiny_moe_config(4, 2));
    c.model.moe.aux_loss_coeff = {0.1};
    c.model.moe.z_loss_coeff = 0.01;
    MoeHarness h(c);
    int biases = 0;
    for (const ParamDesc& p : h.model->params())
      if (p.name.find(".mlp.router.bias") != std::string::npos ||
          (p.name.find(".mlp.experts.linear_fc") != std::string::npos && p.name.ends_with(".bias"))) {
        ++biases;
        CHECK_FALSE(p.weight_decay);
      }
    CHECK(biases == 6);  // two MoE layers: the router's, fc1's and fc2's
    h.check_all(6);
  }
  SECTION("float32 router, sigmoid top-3 of 8 experts in groups, GeLU experts") {
    Config c = biased(tiny_moe_config(8, 3));
    c.model.swiglu = false;
    c.model.normalization = Normalization::layernorm;
    c.model.moe.router_dtype = "fp32";
    c.model.moe.score_function = MoeScoreFunction::sigmoid;
    c.model.moe.router_num_groups = 4;
    c.model.moe.router_group_topk = 2;
    test::derive(c);
    MoeHarness h(c);
    h.check_all(4);
  }
  SECTION("routing weights on the input (top-1): fc2's bias added as is") {
    Config c = biased(tiny_moe_config(4, 1));
    c.model.moe.apply_probs_on_input = true;
    c.model.moe.score_function = MoeScoreFunction::sigmoid;
    MoeHarness h(c);
    h.check_all(4);
  }
  SECTION("token dropping (capacity factor 0.5), fc1 recomputed: the same loss and gradients bit for bit") {
    Config c = biased(tiny_moe_config(4, 2));
    c.model.moe.expert_capacity_factor = 0.5;
    MoeHarness h(c);
    h.check_all(4);
    check_moe_recompute_same(c, h);
  }
  SECTION("the biases change the model") {
    Config c = biased(tiny_moe_config(4, 2));
    MoeHarness with(c);
    std::vector<double> w = with.params();
    for (const ParamDesc& p : with.model->params())
      if (p.name.find(".mlp.experts.linear_fc2.bias") != std::string::npos)
        std::fill_n(w.begin() + p.offset, p.numel(), 0.0);
    const double before = with.objective();
    with.set_params(w);
    CHECK(with.objective() != before);
  }
}

TEST_CASE("MoE gradient check: Sinkhorn load balancing (top-2 softmax weights, top-1 sigmoid weight)",
          "[moe][gradcheck]") {
  for (const int k : {2, 1}) {
    INFO("top-" << k);
    Config c = tiny_moe_config(4, k);
    c.model.moe.load_balancing_type = {MoeLoadBalancing::sinkhorn};
    c.model.moe.aux_loss_coeff = {0.0};
    c.model.moe.z_loss_coeff = 0.01;
    MoeHarness h(c);
    h.check_all(4);
  }
}

TEST_CASE("MoE gradient check: seq_aux_loss over 3 sequences, and with one sequence it is aux_loss", "[moe][gradcheck]") {
  Config c = tiny_moe_config(4, 2);
  c.model.moe.load_balancing_type = {MoeLoadBalancing::seq_aux_loss};
  c.model.moe.aux_loss_coeff = {0.1};
  c.model.moe.z_loss_coeff = 0.01;
  c.train.micro_batch_size = 3;
  {
    MoeHarness h(c);
    REQUIRE(h.dims.moe_seq_coeff != 0);
    h.check_all(4);
  }
  // One sequence per micro-batch: the same objective and gradients as aux_loss.
  c.train.micro_batch_size = 1;
  MoeHarness seq(c);
  c.model.moe.load_balancing_type = {MoeLoadBalancing::aux_loss};
  MoeHarness whole(c);
  CHECK(seq.objective() == Approx(whole.objective()).epsilon(1e-13));
  const std::vector<double> gs = seq.grads(), gw = whole.grads();
  REQUIRE(gs.size() == gw.size());
  for (size_t i = 0; i < gs.size(); ++i) REQUIRE(gs[i] == Approx(gw[i]).epsilon(1e-12).margin(1e-15));
}

TEST_CASE("MoE gradient check: aux_loss, seq_aux_loss and global_aux_loss together, with the z-loss",
          "[moe][gradcheck]") {
  Config c = tiny_moe_config(4, 2);
  using LB = MoeLoadBalancing;
  c.model.moe.load_balancing_type = {LB::aux_loss, LB::seq_aux_loss, LB::global_aux_loss};
  c.model.moe.aux_loss_coeff = {0.1, 0.07, 0.05};
  c.model.moe.z_loss_coeff = 0.01;
  c.train.micro_batch_size = 3;
  MoeHarness h(c);
  REQUIRE(h.dims.moe_aux_coeff == 0.1f);
  REQUIRE(h.dims.moe_seq_coeff == 0.07f);
  REQUIRE(h.dims.moe_global_coeff == 0.05f);
  h.check_all(4);
  // Each term is logged apart: the sums differ (three sequences, not one micro-batch's counts).
  const std::vector<double> m = h.moe_sums();
  CHECK(m[0] > 0);
  CHECK(m[2] > 0);
  CHECK(m[4] > 0);
  CHECK(m[0] != Approx(m[2]).epsilon(1e-6));
}

TEST_CASE("MoE: global_aux_loss of one micro-batch on one rank is aux_loss", "[moe][gradcheck]") {
  Config c = tiny_moe_config(4, 2);
  c.model.moe.aux_loss_coeff = {0.1};
  c.model.moe.z_loss_coeff = 0.01;
  c.train.micro_batch_size = 2;
  MoeHarness aux(c);
  c.model.moe.load_balancing_type = {MoeLoadBalancing::global_aux_loss};
  MoeHarness global(c);
  REQUIRE(global.dims.moe_aux_coeff == 0.0f);
  REQUIRE(global.dims.moe_global_coeff == 0.1f);
  // (Megatron prints a zero load_balancing_loss beside it: "aux_loss" in "global_aux_loss".)
  CHECK(global.dims.moe_log_aux);
  CHECK(global.dims.moe_log_global);
  CHECK(!aux.dims.moe_log_global);
  CHECK(global.objective() == Approx(aux.objective()).epsilon(1e-13));
  CHECK(global.moe_sums()[4] == Approx(aux.moe_sums()[0]).epsilon(1e-13));
  CHECK(global.moe_sums()[0] == 0.0);
  const std::vector<double> gg = global.grads(), ga = aux.grads();
  REQUIRE(gg.size() == ga.size());
  for (size_t i = 0; i < gg.size(); ++i) REQUIRE(gg[i] == Approx(ga[i]).epsilon(1e-12).margin(1e-15));
}

// global_aux_loss's counts are the mean over the step's micro-batches so far (Megatron's running
// global_tokens_per_expert / ga_steps, reset each step). With aux_loss beside it, for one-sequence
// micro-batches A and B (a, b their aux values) the global values of the steps [A, B] and [B, A]
// are a + (b + x) / 2 and b + (a + y) / 2, with x, y the cross terms f sum_e P_B c_A, f sum_e P_A c_B;
// the micro-batch [A; B] of two sequences has aux value (a + b + x + y) / 4 (twice the tokens).
TEST_CASE("MoE: global_aux_loss averages the counts over the step's micro-batches and starts again each step",
          "[moe]") {
  Config c = tiny_moe_config(4, 2);
  using LB = MoeLoadBalancing;
  c.model.moe.load_balancing_type = {LB::aux_loss, LB::global_aux_loss};
  c.model.moe.aux_loss_coeff = {0.1, 0.1};
  c.train.micro_batch_size = 1;
  MoeHarness h(c);
  MicroBatch A = h.mb, B = h.mb;
  for (size_t k = 0; k < B.tokens.size(); ++k) B.tokens[k] = static_cast<int32_t>((k * 7 + 2) % h.dims.vocab);
  // One step's micro-batches, forward only (the training forward logs): {aux sum, global sum}.
  const auto step = [&](std::vector<const MicroBatch*> mbs) {
    h.model->moe_begin_step();
    h.be->fill(h.model->moe_loss_sums(), 0.0);
    uint64_t serial = 0;
    for (const MicroBatch* m : mbs) {
      h.model->stage_micro_batch(0, *m, 1.0, false, serial++, true);
      h.model->forward(0);
    }
    const std::vector<double> s = h.moe_sums();
    return std::make_pair(s[0], s[4]);
  };
  const auto [a, ga] = step({&A});
  const auto [b, gb] = step({&B});
  CHECK(ga == Approx(a).epsilon(1e-13));
  CHECK(gb == Approx(b).epsilon(1e-13));
  const auto [ab_aux, g1] = step({&A, &B});
  const auto [ba_aux, g2] = step({&B, &A});
  CHECK(ab_aux == Approx(a + b).epsilon(1e-13));
  CHECK(ba_aux == Approx(a + b).epsilon(1e-13));
  CHECK(g1 != Approx(ab_aux).epsilon(1e-6));  // (the second micro-batch's counts are a mean)
  // The same steps again: nothing carried over from the steps before.
  CHECK(step({&A, &B}).second == Approx(g1).epsilon(1e-13));

  Config c2 = c;
  c2.train.micro_batch_size = 2;
  MoeHarness both(c2);
  MicroBatch AB = both.mb;
  for (size_t k = 0; k < A.tokens.size(); ++k) {
    AB.tokens[k] = A.tokens[k];
    AB.tokens[A.tokens.size() + k] = B.tokens[k];
  }
  both.mb = AB;
  both.objective();
  const double aux_ab = both.moe_sums()[0];
  // x + y = 4 aux([A; B]) - a - b, so g1 + g2 = a + b + 2 aux([A; B]).
  CHECK(g1 + g2 == Approx(a + b + 2 * aux_ab).epsilon(1e-12));
}

TEST_CASE("MoE under full recomputation: the logged losses and the counts once per micro-batch", "[moe]") {
  Config c = tiny_moe_config(4, 2);
  using LB = MoeLoadBalancing;
  c.model.moe.load_balancing_type = {LB::aux_loss, LB::global_aux_loss};
  c.model.moe.aux_loss_coeff = {0.1, 0.05};
  c.model.moe.z_loss_coeff = 0.01;
  c.train.micro_batch_size = 2;
  MoeHarness plain(c);
  const std::vector<double> grads = plain.grads();
  const std::vector<double> sums = plain.moe_sums();
  Config r = c;
  r.train.recompute_granularity = RecomputeGranularity::full;
  r.train.recompute_method = RecomputeMethod::uniform;
  r.train.recompute_num_layers = 1;
  MoeHarness h(r);
  CHECK(h.grads() == grads);
  CHECK(h.moe_sums() == sums);  // (the backward's reruns of the forward log nothing)
}

TEST_CASE("gradient check: gpt-oss's gated unit (quick-GeGLU, linear offset, clamp) in dense, shared and routed MLPs",
          "[moe][gradcheck]") {
  Config c = tiny_moe_config(4, 2);
  c.model.swiglu = false;
  c.model.quick_geglu = true;
  c.model.glu_linear_offset = 1.0;
  c.model.moe.aux_loss_coeff = {0.1};
  c.model.moe.shared_expert_intermediate_size = 12;
  SECTION("quick-GeGLU with the offset") {
    MoeHarness h(c);
    REQUIRE(h.dims.swiglu);
    REQUIRE(h.dims.glu.quick_gelu);
    h.check_all(4);
  }
  SECTION("clamped (a clamp some fc1 outputs reach)") {
    c.model.activation_func_clamp_value = 0.8;
    MoeHarness h(c);
    REQUIRE(h.dims.glu.clamp == 0.8f);
    h.check_all(4);
  }
  SECTION("SwiGLU clamped (MoE only, as in Megatron-LM)") {
    c.model.quick_geglu = false;
    c.model.swiglu = true;
    c.model.glu_linear_offset = 0.0;
    c.model.activation_func_clamp_value = 0.8;
    MoeHarness h(c);
    REQUIRE_FALSE(h.dims.glu.quick_gelu);
    h.check_all(4);
  }
}

TEST_CASE("MoE: --moe-router-force-load-balancing routes by random logits, whatever the router's weights",
          "[moe]") {
  Config c = tiny_moe_config(4, 2);
  c.model.moe.router_force_load_balancing = true;
  c.model.moe.aux_loss_coeff = {0.1};
  MoeHarness h(c);
  const double before = h.objective();
  std::vector<double> w = h.params();
  const ParamDesc& router = h.model->params()[static_cast<size_t>(find_param(h.model->params(),
                                                                             "decoder.layers.0.mlp.router.weight"))];
  for (int64_t i = 0; i < router.numel(); ++i) w[static_cast<size_t>(router.offset + i)] *= -3.0;
  h.set_params(w);
  CHECK(h.objective() == before);  // the same routing, weights and aux loss
  // The router still gets the straight-through gradient of the random logits.
  const std::vector<double> g = h.grads();
  double norm = 0;
  for (int64_t i = 0; i < router.numel(); ++i) norm += std::abs(g[static_cast<size_t>(router.offset + i)]);
  CHECK(norm > 0);
  // Without the flag the router's weights matter.
  c.model.moe.router_force_load_balancing = false;
  MoeHarness plain(c);
  const double p0 = plain.objective();
  plain.set_params(w);
  CHECK(plain.objective() != p0);
}

TEST_CASE("MoE: --moe-router-force-biased adds a per-expert bias to the random logits", "[moe]") {
  Config c = tiny_moe_config(8, 2);
  c.model.moe.aux_loss_coeff = {0.1};
  c.model.moe.router_force_load_balancing = true;
  MoeHarness balanced(c);
  balanced.objective();
  const double aux_balanced = balanced.moe_sums()[0];  // two MoE layers' load-balancing sums
  c.model.moe.router_force_load_balancing = false;
  const auto run = [&](double std, std::vector<double>* w = nullptr) {
    Config b = c;
    b.model.moe.router_force_biased = std;
    MoeHarness h(b);
    REQUIRE(h.dims.moe_force_bias);
    if (w) h.set_params(*w);
    const double obj = h.objective();
    return std::pair<double, double>{obj, h.moe_sums()[0]};
  };
  // A large bias sends every token to the same two experts: the load-balancing sum rises to about
  // E / k per layer (about 1 per layer when balanced), with the bias redrawn (std > 0) or not.
  for (const double std : {-50.0, 50.0}) {
    INFO("std " << std);
    const auto [obj, aux] = run(std);
    CHECK(aux > 2.5 * aux_balanced);
    CHECK(run(std).first == obj);  // keyed by the seed, the layer (and the micro-batch): repeatable
  }
  // A small bias keeps the routing near balanced; redrawn and reused biases differ (other keys).
  const auto [obj_small, aux_small] = run(-0.01);
  CHECK(aux_small < 1.5 * aux_balanced);
  CHECK(run(0.01).first != obj_small);
  // As with forced balance the router's weights do not choose the experts.
  MoeHarness h(c);
  std::vector<double> w = h.params();
  const ParamDesc& router = h.model->params()[static_cast<size_t>(find_param(h.model->params(),
                                                                             "decoder.layers.0.mlp.router.weight"))];
  for (int64_t i = 0; i < router.numel(); ++i) w[static_cast<size_t>(router.offset + i)] *= -3.0;
  CHECK(run(-1.0, &w).first == run(-1.0).first);
}

TEST_CASE("MoE gradient check: token dropping by weight and by position (capacity factor 0.5)", "[moe][gradcheck]") {
  for (const MoeDropPolicy policy : {MoeDropPolicy::probs, MoeDropPolicy::position}) {
    INFO("policy " << (policy == MoeDropPolicy::probs ? "probs" : "position"));
    Config c = tiny_moe_config(4, 2);
    c.model.moe.aux_loss_coeff = {0.05};
    c.model.moe.expert_capacity_factor = 0.5;  // each expert takes a quarter of the rows at most
    c.model.moe.token_drop_policy = policy;
    MoeHarness h(c);
    CHECK(h.dims.moe_capacity() == (h.dims.tokens() + 3) / 4);
    h.check_all(4);
  }
}

TEST_CASE("MoE: aux-loss-free expert bias: counted tokens, the update, its effect on routing and gradients",
          "[moe][gradcheck]") {
  Config c = tiny_moe_config(8, 3);
  c.model.moe.score_function = MoeScoreFunction::sigmoid;
  c.model.moe.router_num_groups = 4;
  c.model.moe.router_group_topk = 2;
  c.model.moe.router_enable_expert_bias = true;
  c.model.moe.router_bias_update_rate = 0.5;  // large: the next routing must change
  c.model.moe.shared_expert_intermediate_size = 12;
  c.model.moe.aux_loss_coeff = {0.0};
  MoeHarness h(c);
  REQUIRE(h.model->has_expert_bias());
  for (int layer : {0, 2})
    for (float b : h.model->expert_bias(layer)) CHECK(b == 0.0f);
  // One training micro-batch: every token's k pairs counted once per MoE layer (backward only).
  const double before = h.objective();
  for (double n : h.model->expert_token_counts()) CHECK(n == 0.0);  // (forward counts nothing)
  h.grads();
  const std::vector<double>& counts = h.model->expert_token_counts();
  REQUIRE(counts.size() == 2 * 8u);
  for (int m = 0; m < 2; ++m) {
    double total = 0;
    for (int e = 0; e < 8; ++e) total += counts[static_cast<size_t>(m * 8 + e)];
    CHECK(total == static_cast<double>(h.dims.tokens() * 3));
  }
  std::vector<float> want(16, 0.0f);
  for (int m = 0; m < 2; ++m) moe_expert_bias_update(want.data() + m * 8, counts.data() + m * 8, 8, 0.5f);
  h.model->update_expert_bias();
  std::vector<float> got;
  for (int layer : {0, 2})
    for (float b : h.model->expert_bias(layer)) got.push_back(b);
  CHECK(got == want);
  for (double n : h.model->expert_token_counts()) CHECK(n == 0.0);
  // The biased choice routes differently (the loss moves: the weights are the unbiased scores of
  // other experts) and the gradients stay exact.
  CHECK(h.objective() != before);
  h.check_all(6);
}

TEST_CASE("MoE: Sinkhorn balances the experts' loads, and evaluation routes by the weights", "[moe]") {
  // The reference op on logits that favour expert 0 for every row: plain top-1 would send every
  // row there; Sinkhorn's choice spreads them. Evaluation takes the top of the weights (expert 0).
  auto be = make_reference_backend(1);
  const int64_t N = 64, E = 4;
  std::vector<float> z(static_cast<size_t>(N * E));
  for (int64_t t = 0; t < N; ++t)
    for (int64_t e = 0; e < E; ++e) z[static_cast<size_t>(t * E + e)] = (e == 0 ? 2.0f : 0.0f) + 0.3f * std::sin(t * 1.7f + e);
  std::vector<float> p(static_cast<size_t>(N));
  std::vector<int32_t> idx(static_cast<size_t>(N));
  const Tensor tz(z.data(), DType::f32, Device::cpu, {N, E}), tp(p.data(), DType::f32, Device::cpu, {N, 1}),
      ti(idx.data(), DType::i32, Device::cpu, {N, 1});
  be->moe_sinkhorn_route(tp, ti, tz, 1, N, true);
  std::vector<int> load(static_cast<size_t>(E), 0);
  for (int32_t e : idx) ++load[static_cast<size_t>(e)];
  for (int e = 0; e < E; ++e) CHECK(load[static_cast<size_t>(e)] >= N / E / 2);
  for (int64_t t = 0; t < N; ++t)  // the weight: sigmoid of the chosen logit
    CHECK(p[static_cast<size_t>(t)] == Approx(1.0 / (1.0 + std::exp(-z[static_cast<size_t>(t * E + idx[static_cast<size_t>(t)])]))));
  be->moe_sinkhorn_route(tp, ti, tz, 1, N, false);
  for (int32_t e : idx) CHECK(e == 0);
  // Blocks of rows are balanced on their own: two blocks of 32 choose as each block alone does.
  std::vector<int32_t> whole(static_cast<size_t>(N)), half(static_cast<size_t>(N / 2));
  be->moe_sinkhorn_route(tp, ti, tz, 1, N / 2, true);
  whole = idx;
  const Tensor tz2(z.data() + (N / 2) * E, DType::f32, Device::cpu, {N / 2, E}),
      tp2(p.data(), DType::f32, Device::cpu, {N / 2, 1}), ti2(half.data(), DType::i32, Device::cpu, {N / 2, 1});
  be->moe_sinkhorn_route(tp2, ti2, tz2, 1, N / 2, true);
  for (int64_t t = 0; t < N / 2; ++t) CHECK(whole[static_cast<size_t>(N / 2 + t)] == half[static_cast<size_t>(t)]);
}

TEST_CASE("MoE: one expert with top-1 routing is the dense MLP with the same weights", "[moe]") {
  // Pre-softmax over one expert gives every token the weight 1: the MoE layer is then the dense
  // SwiGLU MLP (the router gets no gradient). Same weights, same losses and gradients.
  Config dense = test::tiny_llama_config();
  dense.model.num_layers = 3;
  dense.model.ffn_hidden_size = 20;
  test::derive(dense);
  Config moe = tiny_moe_config(1, 1);
  moe.model.ffn_hidden_size = 20;  // the dense layer between the MoE layers
  test::derive(moe);
  moe.model.moe.router_pre_softmax = true;
  MoeHarness hd(dense, DType::f32, 5.0), hm(moe, DType::f32, 5.0);
  // Name map: the MoE layers' pre-MLP norm and experts take the dense layers' norm and MLP.
  auto dense_name = [](std::string n) {
    const std::pair<const char*, const char*> map[] = {
        {"pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"},
        {"mlp.experts.linear_fc1.weight", "mlp.linear_fc1.weight"},
        {"mlp.experts.linear_fc2.weight", "mlp.linear_fc2.weight"}};
    for (const auto& [from, to] : map)
      if (const size_t at = n.find(from); at != std::string::npos) n.replace(at, std::strlen(from), to);
    return n;
  };
  std::vector<float> wd(static_cast<size_t>(hd.model->params_flat().numel()));
  std::vector<float> wm(static_cast<size_t>(hm.model->params_flat().numel()), 0.0f);
  hd.be->copy_to_host(wd.data(), hd.model->params_flat());
  hm.be->copy_to_host(wm.data(), hm.model->params_flat());
  std::map<std::string, const ParamDesc*> by_name;
  for (const ParamDesc& p : hd.model->params()) by_name[p.name] = &p;
  int mapped = 0;
  for (const ParamDesc& p : hm.model->params()) {
    if (p.name.find("mlp.router.") != std::string::npos) continue;
    const auto it = by_name.find(dense_name(p.name));
    REQUIRE(it != by_name.end());
    REQUIRE(it->second->numel() == p.numel());
    std::memcpy(&wm[static_cast<size_t>(p.offset)], &wd[static_cast<size_t>(it->second->offset)],
                static_cast<size_t>(p.numel()) * sizeof(float));
    ++mapped;
  }
  CHECK(mapped == static_cast<int>(hd.model->params().size()));
  hm.be->copy_from_host(hm.model->params_flat(), wm.data());

  auto run = [](MoeHarness& h) {
    h.model->zero_grads();
    double lm = 0;
    h.objective(&lm);
    h.model->backward(0);
    std::vector<float> g(static_cast<size_t>(h.model->grads_flat().numel()));
    h.be->copy_to_host(g.data(), h.model->grads_flat());
    return std::make_pair(lm, g);
  };
  const auto [ld, gd] = run(hd);
  const auto [lm, gm] = run(hm);
  CHECK(lm == Approx(ld).epsilon(1e-6));
  for (const ParamDesc& p : hm.model->params()) {
    double diff = 0, norm = 0;
    if (p.name.find("mlp.router.") != std::string::npos) {
      for (int64_t k = 0; k < p.numel(); ++k) CHECK(gm[static_cast<size_t>(p.offset + k)] == 0.0f);
      continue;
    }
    const ParamDesc& q = *by_name.at(dense_name(p.name));
    for (int64_t k = 0; k < p.numel(); ++k) {
      const double a = gm[static_cast<size_t>(p.offset + k)], b = gd[static_cast<size_t>(q.offset + k)];
      diff = std::max(diff, std::fabs(a - b));
      norm = std::max(norm, std::fabs(b));
    }
    INFO(p.name << ": max |diff| " << diff << " of max |grad| " << norm);
    CHECK(norm > 0);
    CHECK(diff <= 1e-5 * norm);
  }
}

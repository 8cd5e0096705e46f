// A small MoE model (engine/blocks/moe.cpp) on the CUDA backend against the same model on the
// reference backend: the same parameters, one training micro-batch, the loss, the logged aux and
// z-losses and every parameter's gradient; float32 and bf16; also with the router's input jitter
// and the experts' fc1 outputs recomputed in backward (--recompute-modules moe), and with the
// routing weights on the experts' input (--moe-apply-probs-on-input), and with the aux, seq_aux and
// global_aux load-balancing losses together, and with gpt-oss's gated unit; and in FP8 (tensorwise
// scaling: the FP8 GEMMs run from the first step; each expert's GEMMs per expert on rows padded to 128).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/config.h"
#include "data/batch.h"
#include "engine/gpt_model.h"
#include "parallel/parallel_state.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/model_compare.h"

using namespace mt;
using namespace mt::gputest;

namespace {

Config moe_config(int experts, int topk, int seq, int batch) {
  Config c = small_llama_config(3, seq, batch);
  ModelConfig& m = c.model;
  m.group_query_attention = true;  // (GQA, and a dense MLP of 80 between the MoE layers)
  m.num_query_groups = 2;
  m.query_groups = 2;
  m.ffn_size = 80;
  m.moe.num_experts = experts;
  m.moe.router_topk = topk;
  m.moe.ffn_hidden_size = 40;
  m.moe.moe_layer = {1, 0, 1};
  m.moe.aux_loss_coeff = {0.01};
  m.moe.z_loss_coeff = 0.001;
  m.moe.shared_expert_intermediate_size = 24;
  m.moe.shared_expert_gate = true;
  return c;
}

}  // namespace

TEST_CASE("cuda MoE model: loss, aux and z-losses and every gradient match the reference", "[gpu][moe][model]") {
  // float32: top-k of more experts; bf16: every expert of each token selected (k = E), so that
  // rounding cannot change a selection and the gradients compare (a flipped choice of expert for a
  // token whose top scores nearly tie moves whole rows of expert gradients).
  struct Shape {
    int experts, topk, seq, batch;
    DType dtype;
    bool jitter_recompute = false;
    bool probs_on_input = false;  // --moe-apply-probs-on-input, top-1 sigmoid routing
    bool all_balancing = false;   // aux_loss, seq_aux_loss and global_aux_loss together
    bool gpt_oss_mlp = false;     // quick-GeGLU with the linear offset and the clamp (every MLP)
    bool fp8 = false;             // --fp8-format hybrid --fp8-recipe tensorwise (expert FFN 48)
    bool linear_bias = false;     // --add-bias-linear: the router's and the experts' biases (no shared expert)
  };
  for (const Shape& sh : {Shape{8, 2, 32, 2, DType::f32}, Shape{5, 3, 17, 3, DType::f32},  // (odd: 51 rows)
                          Shape{4, 4, 32, 2, DType::bf16}, Shape{3, 3, 17, 3, DType::bf16},
                          Shape{5, 3, 17, 3, DType::f32, true}, Shape{4, 4, 32, 2, DType::bf16, true},
                          Shape{5, 1, 17, 3, DType::f32, false, true}, Shape{1, 1, 32, 2, DType::bf16, true, true},
                          Shape{5, 3, 17, 3, DType::f32, false, false, true},
                          Shape{4, 4, 32, 2, DType::bf16, false, false, true},
                          Shape{5, 3, 17, 3, DType::f32, false, false, false, true},
                          Shape{4, 4, 32, 2, DType::bf16, true, false, false, true},
                          Shape{4, 4, 32, 2, DType::bf16, false, false, false, false, true},
                          Shape{3, 3, 32, 2, DType::bf16, true, false, false, false, true},
                          Shape{5, 3, 17, 3, DType::f32, false, false, false, false, false, true},
                          Shape{5, 1, 17, 3, DType::f32, true, true, false, false, false, true},
                          Shape{4, 4, 32, 2, DType::bf16, false, false, false, false, false, true},
                          Shape{3, 3, 32, 2, DType::bf16, false, false, false, false, true, true}}) {
    Config c = moe_config(sh.experts, sh.topk, sh.seq, sh.batch);
    if (sh.jitter_recompute) {
      c.model.moe.input_jitter_eps = 0.05;
      c.train.recompute_granularity = RecomputeGranularity::selective;
      c.train.recompute_modules = {"core_attn", "moe"};
    }
    if (sh.gpt_oss_mlp) {
      c.model.swiglu = false;
      c.model.quick_geglu = true;
      c.model.glu_linear_offset = 1.0;
      c.model.activation_func_clamp_value = 2.0;
    }
    if (sh.all_balancing) {
      using LB = MoeLoadBalancing;
      c.model.moe.load_balancing_type = {LB::aux_loss, LB::seq_aux_loss, LB::global_aux_loss};
      c.model.moe.aux_loss_coeff = {0.01, 0.02, 0.03};
    }
    if (sh.fp8) {
      // (FP8 GEMMs take dimensions in multiples of 16: 64 rows, h 64, the experts' FFN 48.)
      c.train.fp8_format = Fp8Format::hybrid;
      c.train.fp8_recipe = Fp8Recipe::tensorwise;
      c.model.moe.ffn_hidden_size = 48;
      c.model.moe.shared_expert_intermediate_size = 32;
    }
    if (sh.linear_bias) {
      c.model.add_bias_linear = true;
      c.model.add_qkv_bias = true;
      c.model.moe.shared_expert_intermediate_size.reset();  // (Megatron's shared experts have no biases)
      c.model.moe.shared_expert_gate = false;
    }
    if (sh.probs_on_input) {
      c.model.moe.apply_probs_on_input = true;
      c.model.moe.score_function = MoeScoreFunction::sigmoid;
    }
    Rng rng;
    const MicroBatch mb = random_micro_batch(rng, sh.batch, sh.seq, 96);
    const size_t n = static_cast<size_t>(sh.batch) * sh.seq;
    // Parameters: the reference model's initialization, scaled up so that routing differs by token.
    std::vector<double> w;
    run_model_micro_batch(ref(), c, DType::f32, {}, mb, &w);
    const DType T = sh.dtype;
    const bool bf16 = T == DType::bf16;
    // float32: the weights scaled up 4x, so that routing differs by token. bf16: the initial weights
    // as the bf16 model holds them (rounded to bf16) on both sides: scaled up 4x, this small model's
    // gradients move by 17% (dense) to 43% (MoE) under 2^-9 relative noise on the weights (measured
    // on the reference backend), so bf16 rounding could not be told from a fault; at the initial
    // scale they move by 0.4%.
    for (double& v : w) v = bf16 ? round_to(DType::bf16, v) : v * 4.0;
    // The biases start at zero: give them values, so that their paths carry signal.
    if (sh.linear_bias)
      for (double& v : w)
        if (v == 0.0) v = round_to(DType::bf16, 0.3 * rng.normal(1)[0]);
    const ModelRun r = run_model_micro_batch(ref(), c, DType::f32, w, mb);
    {
      INFO("experts " << sh.experts << " top-" << sh.topk << " rows " << n << (bf16 ? " bf16" : " float32")
                      << (sh.jitter_recompute ? ", jitter and MoE recompute" : "")
                      << (sh.probs_on_input ? ", routing weights on the input" : "")
                      << (sh.all_balancing ? ", aux, seq_aux and global_aux losses" : "")
                      << (sh.gpt_oss_mlp ? ", quick-GeGLU with offset and clamp" : "")
                      << (sh.fp8 ? ", FP8 (hybrid, tensorwise)" : "")
                      << (sh.linear_bias ? ", linear biases" : "")
                      << " (seed " << rng.seed() << ")");
      const ModelRun g = run_model_micro_batch(dev(), c, T, w, mb);
      const double tol = bf16 ? 3e-2 : 2e-3;
      CHECK(std::fabs(g.loss - r.loss) <= tol * std::fabs(r.loss));
      CHECK(std::fabs(g.aux - r.aux) <= tol * std::fabs(r.aux));
      CHECK(std::fabs(g.z - r.z) <= tol * std::fabs(r.z));
      CHECK(std::fabs(g.seq - r.seq) <= tol * std::fabs(r.seq));
      CHECK(std::fabs(g.global - r.global) <= tol * std::fabs(r.global));
      if (sh.all_balancing) CHECK((r.seq > 0 && r.global > 0));
      check_gradients_close(g.grads, r.grads, bf16);
    }
  }
}

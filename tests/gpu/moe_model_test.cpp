// A small MoE model (engine/blocks/moe.cpp) on the CUDA backend against the same model on the
// reference backend: the same parameters, one training micro-batch, the loss, the logged aux and
// z-losses and every parameter's gradient; float32 and bf16.
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

using namespace mt;
using namespace mt::gputest;

namespace {

Config moe_config(int experts, int topk, int seq, int batch) {
  Config c;
  ModelConfig& m = c.model;
  m.num_layers = 3;
  m.hidden_size = 64;
  m.num_attention_heads = 4;
  m.group_query_attention = true;
  m.num_query_groups = 2;
  m.max_position_embeddings = seq;
  m.seq_length = seq;
  m.vocab_size = 96;
  m.padded_vocab_size = 96;
  m.attention_dropout = 0;
  m.hidden_dropout = 0;
  m.normalization = Normalization::rmsnorm;
  m.swiglu = true;
  m.position_embedding_type = PositionEmbedding::rope;
  m.untie_embeddings_and_output_weights = true;
  m.add_bias_linear = false;
  m.head_dim = 16;
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
  c.train.micro_batch_size = batch;
  c.train.global_batch = batch;
  c.train.num_microbatches = 1;
  c.train.device = DeviceKind::gpu;
  return c;
}

struct Run {
  double loss = 0, aux = 0, z = 0;
  std::vector<double> grads;
};

// One training micro-batch of `c` on backend `be` in dtype T from the float parameters `w` (the
// reference model's, in its flat order; both models lay parameters out alike).
Run run(Backend& be, const Config& c, DType T, const std::vector<double>& w, const MicroBatch& mb,
        std::vector<double>* init = nullptr) {
  ParallelState ps = make_single_process_state();
  const ModelDims d = ModelDims::from_config(c, ps);
  ModelOptions o = ModelOptions::from_config(c, d, T);
  GptModel model(d, o, ps, be);
  model.init_parameters();
  if (init) {
    *init = download(be, model.master_flat());
  } else {
    // The model copy from the given float values (rounded to T); the master copy too.
    upload(be, model.params_flat(), w);
    if (model.has_master_copy()) upload(be, model.master_flat(), w);
  }
  model.zero_grads();
  be.fill(model.loss_sums(false), 0.0);
  be.fill(model.moe_loss_sums(), 0.0);
  model.stage_micro_batch(0, mb, 1.0, false, 7, true);
  model.forward(0);
  model.backward(0);
  model.check_grads_written();
  be.synchronize();
  Run r;
  const std::vector<double> sums = download(be, model.loss_sums(false));
  const std::vector<double> moe = download(be, model.moe_loss_sums());
  r.loss = sums[0] / sums[1];
  r.aux = moe[0];
  r.z = moe[1];
  r.grads = download(be, model.grads_flat());
  return r;
}

}  // namespace

TEST_CASE("cuda MoE model: loss, aux and z-losses and every gradient match the reference", "[gpu][moe][model]") {
  // float32: top-k of more experts; bf16: every expert of each token selected (k = E), so that
  // rounding cannot change a selection and the gradients compare (a flipped choice of expert for a
  // token whose top scores nearly tie moves whole rows of expert gradients).
  struct Shape {
    int experts, topk, seq, batch;
    DType dtype;
  };
  for (const Shape& sh : {Shape{8, 2, 32, 2, DType::f32}, Shape{5, 3, 17, 3, DType::f32},  // (odd: 51 rows)
                          Shape{4, 4, 32, 2, DType::bf16}, Shape{3, 3, 17, 3, DType::bf16}}) {
    const Config c = moe_config(sh.experts, sh.topk, sh.seq, sh.batch);
    MicroBatch mb;
    mb.batch = sh.batch;
    mb.seq = sh.seq;
    Rng rng;
    const size_t n = static_cast<size_t>(sh.batch) * sh.seq;
    const std::vector<double> toks = rng.ints(static_cast<int64_t>(n), 0, 96), labels = rng.ints(static_cast<int64_t>(n), 0, 96);
    for (size_t i = 0; i < n; ++i) {
      mb.tokens.push_back(static_cast<int32_t>(toks[i]));
      mb.labels.push_back(static_cast<int32_t>(labels[i]));
      mb.loss_mask.push_back(i % 7 == 3 ? 0.0f : 1.0f);
    }
    // Parameters: the reference model's initialization, scaled up so that routing differs by token.
    std::vector<double> w;
    run(ref(), c, DType::f32, {}, mb, &w);
    const DType T = sh.dtype;
    const bool bf16 = T == DType::bf16;
    // float32: the weights scaled up 4x, so that routing differs by token. bf16: the initial weights
    // as the bf16 model holds them (rounded to bf16) on both sides: scaled up 4x, this small model's
    // gradients move by 17% (dense) to 43% (MoE) under 2^-9 relative noise on the weights (measured
    // on the reference backend), so bf16 rounding could not be told from a fault; at the initial
    // scale they move by 0.4%.
    for (double& v : w) v = bf16 ? round_to(DType::bf16, v) : v * 4.0;
    const Run r = run(ref(), c, DType::f32, w, mb);
    {
      INFO("experts " << sh.experts << " top-" << sh.topk << " rows " << n << (bf16 ? " bf16" : " float32")
                      << " (seed " << rng.seed() << ")");
      const Run g = run(dev(), c, T, w, mb);
      const double tol = bf16 ? 3e-2 : 2e-3;
      CHECK(std::fabs(g.loss - r.loss) <= tol * std::fabs(r.loss));
      CHECK(std::fabs(g.aux - r.aux) <= tol * std::fabs(r.aux));
      CHECK(std::fabs(g.z - r.z) <= tol * std::fabs(r.z));
      // Gradients: each element relative to the largest (float32), and the whole vector's error norm.
      double gmax = 0, err = 0, diff2 = 0, ref2 = 0;
      for (size_t i = 0; i < r.grads.size(); ++i) {
        gmax = std::max(gmax, std::fabs(r.grads[i]));
        err = std::max(err, std::fabs(g.grads[i] - r.grads[i]));
        diff2 += (g.grads[i] - r.grads[i]) * (g.grads[i] - r.grads[i]);
        ref2 += r.grads[i] * r.grads[i];
      }
      INFO("max |grad| " << gmax << ", max error " << err << ", relative norm error " << std::sqrt(diff2 / ref2));
      CHECK(gmax > 0);
      if (!bf16) CHECK(err <= 5e-3 * gmax);
      CHECK(std::sqrt(diff2 / ref2) <= (bf16 ? 5e-2 : 2e-3));
    }
  }
}

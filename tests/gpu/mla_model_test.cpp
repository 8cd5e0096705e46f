// A small multi-latent-attention model (engine/blocks/mla.cpp) on the CUDA backend against the same
// model on the reference backend: the same parameters, one training micro-batch, the loss and every
// parameter's gradient; float32 and bf16, with and without a query rank, and with multi-token
// prediction depths (engine/blocks/mtp.cpp: their losses' gradients too).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/config.h"
#include "data/batch.h"
#include "engine/gpt_model.h"
#include "parallel/parallel_state.h"
#include "tests/gpu/gpu_test_util.h"

using namespace mt;
using namespace mt::gputest;

namespace {

struct MlaCase {
  int q_lora, kv_lora, nope, rope, v, seq, batch;
  bool latent_norm;
  DType dtype;
  int mtp = 0;
};

Config mla_config(const MlaCase& k) {
  Config c;
  ModelConfig& m = c.model;
  m.num_layers = 2;
  m.hidden_size = 64;
  m.num_attention_heads = 4;
  m.max_position_embeddings = k.seq;
  m.seq_length = k.seq;
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
  m.query_groups = 4;
  m.ffn_size = 96;
  m.multi_latent_attention = true;
  if (k.q_lora > 0) m.q_lora_rank = k.q_lora;
  m.kv_lora_rank = k.kv_lora;
  m.qk_head_dim = k.nope;
  m.qk_pos_emb_head_dim = k.rope;
  m.v_head_dim = k.v;
  m.qk_layernorm = k.latent_norm;
  m.rotary_scaling_factor = 40;
  m.mscale_all_dim = 1.0;
  if (k.mtp > 0) m.mtp_num_layers = k.mtp;
  c.train.micro_batch_size = k.batch;
  c.train.global_batch = k.batch;
  c.train.num_microbatches = 1;
  c.train.device = DeviceKind::gpu;
  return c;
}

struct Run {
  double loss = 0;
  std::vector<double> grads;
};

Run run(Backend& be, const Config& c, DType T, const std::vector<double>& w, const MicroBatch& mb,
        std::vector<double>* init = nullptr) {
  ParallelState ps = make_single_process_state();
  const ModelDims d = ModelDims::from_config(c, ps);
  GptModel model(d, ModelOptions::from_config(c, d, T), ps, be);
  model.init_parameters();
  if (init) {
    *init = download(be, model.master_flat());
  } else {
    upload(be, model.params_flat(), w);
    if (model.has_master_copy()) upload(be, model.master_flat(), w);
  }
  model.zero_grads();
  be.fill(model.loss_sums(false), 0.0);
  model.stage_micro_batch(0, mb, 1.0, false, 7, true);
  model.forward(0);
  model.backward(0);
  model.check_grads_written();
  be.synchronize();
  Run r;
  const std::vector<double> sums = download(be, model.loss_sums(false));
  r.loss = sums[0] / sums[1];
  r.grads = download(be, model.grads_flat());
  return r;
}

}  // namespace

TEST_CASE("cuda MLA model: loss and every gradient match the reference", "[gpu][mla][mtp][model]") {
  for (const MlaCase& k : {MlaCase{32, 24, 16, 8, 16, 32, 2, true, DType::f32},
                           MlaCase{0, 16, 8, 8, 12, 17, 3, true, DType::f32},   // direct queries, odd rows
                           MlaCase{0, 20, 12, 4, 8, 33, 1, false, DType::f32},  // no latent norms
                           MlaCase{32, 24, 16, 8, 16, 32, 2, true, DType::bf16},
                           MlaCase{32, 24, 16, 8, 16, 17, 3, true, DType::f32, 2},    // two mtp depths
                           MlaCase{0, 16, 8, 8, 12, 32, 2, false, DType::bf16, 1}}) {
    const Config c = mla_config(k);
    MicroBatch mb;
    mb.batch = k.batch;
    mb.seq = k.seq;
    Rng rng;
    const size_t n = static_cast<size_t>(k.batch) * k.seq;
    const std::vector<double> toks = rng.ints(static_cast<int64_t>(n), 0, 96), labels = rng.ints(static_cast<int64_t>(n), 0, 96);
    for (size_t i = 0; i < n; ++i) {
      mb.tokens.push_back(static_cast<int32_t>(toks[i]));
      mb.labels.push_back(static_cast<int32_t>(labels[i]));
      mb.loss_mask.push_back(i % 7 == 3 ? 0.0f : 1.0f);
    }
    std::vector<double> w;
    run(ref(), c, DType::f32, {}, mb, &w);
    const bool bf16 = k.dtype == DType::bf16;
    for (double& v : w) v = bf16 ? round_to(DType::bf16, v) : v * 4.0;
    const Run r = run(ref(), c, DType::f32, w, mb);
    INFO("mtp " << k.mtp << " q_lora " << k.q_lora << " kv_lora " << k.kv_lora << " d " << k.nope << "+" << k.rope << "/" << k.v
                   << " rows " << n << (bf16 ? " bf16" : " float32") << " (seed " << rng.seed() << ")");
    const Run g = run(dev(), c, k.dtype, w, mb);
    const double tol = bf16 ? 3e-2 : 2e-3;
    CHECK(std::fabs(g.loss - r.loss) <= tol * std::fabs(r.loss));
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

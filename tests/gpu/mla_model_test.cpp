// A small multi-latent-attention model (engine/blocks/mla.cpp) on the CUDA backend against the same
// model on the reference backend: the same parameters, one training micro-batch, the loss and every
// parameter's gradient; float32 and bf16, with and without a query rank, and with multi-token
// prediction depths (engine/blocks/mtp.cpp: their losses' gradients too); and in FP8 (tensorwise
// scaling: MLA's five GEMMs and the MTP projection through the extra FP8 state, engine/blocks/fp8_gemms.cpp).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
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

struct MlaCase {
  int q_lora, kv_lora, nope, rope, v, seq, batch;
  bool latent_norm;
  DType dtype;
  int mtp = 0;
  bool fp8 = false;  // --fp8-format hybrid --fp8-recipe tensorwise (every GEMM's sizes multiples of 16)
};

Config mla_config(const MlaCase& k) {
  Config c = small_llama_config(2, k.seq, k.batch);
  ModelConfig& m = c.model;
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
  if (k.fp8) {
    c.train.fp8_format = Fp8Format::hybrid;
    c.train.fp8_recipe = Fp8Recipe::tensorwise;
  }
  return c;
}

}  // namespace

TEST_CASE("cuda MLA model: loss and every gradient match the reference", "[gpu][mla][mtp][model]") {
  for (const MlaCase& k : {MlaCase{32, 24, 16, 8, 16, 32, 2, true, DType::f32},
                           MlaCase{0, 16, 8, 8, 12, 17, 3, true, DType::f32},   // direct queries, odd rows
                           MlaCase{0, 20, 12, 4, 8, 33, 1, false, DType::f32},  // no latent norms
                           MlaCase{32, 24, 16, 8, 16, 32, 2, true, DType::bf16},
                           MlaCase{32, 24, 16, 8, 16, 17, 3, true, DType::f32, 2},    // two mtp depths
                           MlaCase{0, 16, 8, 8, 12, 32, 2, false, DType::bf16, 1},
                           MlaCase{32, 32, 16, 16, 16, 32, 2, true, DType::bf16, 1, true}}) {
    const Config c = mla_config(k);
    Rng rng;
    const MicroBatch mb = random_micro_batch(rng, k.batch, k.seq, 96);
    const size_t n = static_cast<size_t>(k.batch) * k.seq;
    std::vector<double> w;
    run_model_micro_batch(ref(), c, DType::f32, {}, mb, &w);
    const bool bf16 = k.dtype == DType::bf16;
    for (double& v : w) v = bf16 ? round_to(DType::bf16, v) : v * 4.0;
    const ModelRun r = run_model_micro_batch(ref(), c, DType::f32, w, mb);
    INFO((k.fp8 ? "FP8 (tensorwise), " : "") << "mtp " << k.mtp << " q_lora " << k.q_lora << " kv_lora " << k.kv_lora << " d " << k.nope << "+" << k.rope << "/" << k.v
                   << " rows " << n << (bf16 ? " bf16" : " float32") << " (seed " << rng.seed() << ")");
    const ModelRun g = run_model_micro_batch(dev(), c, k.dtype, w, mb);
    const double tol = bf16 ? 3e-2 : 2e-3;
    CHECK(std::fabs(g.loss - r.loss) <= tol * std::fabs(r.loss));
    check_gradients_close(g.grads, r.grads, bf16);
  }
}

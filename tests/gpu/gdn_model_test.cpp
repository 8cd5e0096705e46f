// A small Gated DeltaNet hybrid (engine/blocks/gdn.cpp) on the CUDA backend against the same model
// on the reference backend: the same parameters, one training micro-batch, the loss and every
// parameter's gradient; float32 and bf16, sequences that end inside and span several 64-position
// chunks, and two value heads per key head.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "core/config.h"
#include "data/batch.h"
#include "engine/gpt_model.h"
#include "parallel/parallel_state.h"
#include "tests/engine_test_util.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/model_compare.h"

using namespace mt;
using namespace mt::gputest;

namespace {

struct GdnCase {
  int seq, batch, key_heads, value_heads, dk, dv;
  DType dtype;
};

// Three layers: Gated DeltaNet, softmax attention with the output gate, Gated DeltaNet; LayerNorm
// with zero-centred weights (Megatron-LM's test model).
Config gdn_config(const GdnCase& k) {
  Config c = small_llama_config(3, k.seq, k.batch);
  test::set_gdn_hybrid(c.model, k.key_heads, k.value_heads, k.dk, k.dv, 4);
  return c;
}

}  // namespace

TEST_CASE("cuda Gated DeltaNet model: loss and every gradient match the reference", "[gpu][gdn][model]") {
  for (const GdnCase& k : {GdnCase{32, 2, 2, 4, 16, 12, DType::f32}, GdnCase{70, 3, 1, 2, 32, 24, DType::f32},
                           GdnCase{130, 1, 2, 2, 64, 64, DType::f32}, GdnCase{70, 2, 2, 4, 16, 12, DType::bf16}}) {
    const Config c = gdn_config(k);
    Rng rng;
    const MicroBatch mb = random_micro_batch(rng, k.batch, k.seq, 96);
    std::vector<double> w;
    run_model_micro_batch(ref(), c, DType::f32, {}, mb, &w);
    const bool bf16 = k.dtype == DType::bf16;
    for (double& v : w) v = bf16 ? round_to(DType::bf16, v) : v * 4.0;
    const ModelRun r = run_model_micro_batch(ref(), c, DType::f32, w, mb);
    INFO("seq " << k.seq << " batch " << k.batch << " heads " << k.key_heads << "/" << k.value_heads << " dk " << k.dk
                << " dv " << k.dv << (bf16 ? " bf16" : " float32") << " (seed " << rng.seed() << ")");
    const ModelRun g = run_model_micro_batch(dev(), c, k.dtype, w, mb);
    // (The tolerances of the other model comparisons: float32 sums in another order, bf16 roundings.)
    const double tol = bf16 ? 3e-2 : 2e-3;
    CHECK(std::fabs(g.loss - r.loss) <= tol * std::fabs(r.loss));
    check_gradients_close(g.grads, r.grads, bf16);
  }
}

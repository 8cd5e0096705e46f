// Sharded gradients (ModelOptions::shard_grads, --use-megatron-fsdp optim_grads) and parameters
// (ModelOptions::shard_params, optim_grads_params: each layer's gathered from the shards into one of
// two slots before its forward and backward; one rank: a copy) on the CUDA backend: each layer's gradients staged in one of two slots, zeroed before the micro-batch's first
// write (also the bias gradient the next layer's norm backward writes, and the head's), then added
// into the shard (one data-parallel rank: the whole bucket) by DpGradSync in every micro-batch. Over
// three micro-batches each parameter's summed gradient equals the unsharded model's, on the same
// backend from the same initialization, float32 and bf16, with and without linear biases and with
// full recompute.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "core/config.h"
#include "data/batch.h"
#include "engine/dp_grad_sync.h"
#include "engine/gpt_model.h"
#include "parallel/parallel_state.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/model_compare.h"

using namespace mt;
using namespace mt::gputest;

namespace {

// Per parameter (params() order, flattened): the gradient summed over the micro-batches.
// prefetch: three unit slots, each layer's gather issued a layer ahead (ModelOptions::prefetch_units;
// on one rank the gathers are copies on the compute stream, so this checks the slots' turns).
std::vector<std::vector<double>> summed_gradients(Backend& be, const Config& c, DType T, bool shard, bool shard_params,
                                                   const std::vector<MicroBatch>& mbs, std::vector<double>* losses,
                                                   bool prefetch = false) {
  ParallelState ps = make_single_process_state();
  const ModelDims d = ModelDims::from_config(c, ps);
  ModelOptions o = ModelOptions::from_config(c, d, T);
  o.shard_optimizer_state = true;  // (the distributed optimizer over one rank)
  o.shard_grads = shard;
  o.shard_params = shard_params;
  o.prefetch_units = shard_params && prefetch;
  o.unit_slots = prefetch ? 3 : 2;
  GptModel model(d, o, ps, be);
  model.init_parameters();
  DpGradSync sync(c, ps, {&model});
  sync.start_step();
  model.zero_grads();
  be.fill(model.loss_sums(false), 0.0);
  for (size_t k = 0; k < mbs.size(); ++k) {
    model.stage_micro_batch(0, mbs[k], 1.0, false, 7 + k, true);
    model.forward(0);
    model.backward(0, k + 1 == mbs.size());
  }
  model.check_grads_written();
  sync.finish();
  be.synchronize();
  const std::vector<double> sums = download(be, model.loss_sums(false));
  losses->push_back(sums[0] / sums[1]);
  const GradLayout& L = model.grad_layout();
  const std::vector<double> flat = download(be, shard ? model.grad_shards() : model.grads_flat());
  std::vector<std::vector<double>> out(model.params().size());
  for (size_t k = 0; k < L.plan_param.size(); ++k) {
    const int i = L.plan_param[k];
    const ParamPlacement& p = L.plan.params[k];
    const GradBucket& b = L.plan.buckets[static_cast<size_t>(p.bucket)];
    // (One rank: a bucket's shard is the whole bucket, at its state offset.)
    const int64_t at = shard ? L.state_offset[static_cast<size_t>(p.bucket)] + (p.offset - b.offset) : p.offset;
    out[static_cast<size_t>(i)].assign(flat.begin() + at, flat.begin() + at + p.numel);
  }
  return out;
}

}  // namespace

TEST_CASE("cuda sharded gradients and parameters: every parameter's gradient over three micro-batches equals the unsharded model's",
          "[gpu][fsdp][model]") {
  struct Case {
    DType dtype;
    bool bias, recompute;
  };
  for (const Case k : {Case{DType::f32, true, false}, Case{DType::f32, false, true}, Case{DType::bf16, true, false}}) {
    Config c = small_llama_config(3, 17, 2);
    c.model.add_bias_linear = k.bias;  // (the next layer's norm backward then sums fc2's bias gradient)
    if (k.recompute) {
      c.train.recompute_granularity = RecomputeGranularity::full;
      c.train.recompute_method = RecomputeMethod::uniform;
      c.train.recompute_num_layers = 2;
    }
    c.parallel.use_distributed_optimizer = true;
    Rng rng;
    std::vector<MicroBatch> mbs;
    for (int j = 0; j < 3; ++j) mbs.push_back(random_micro_batch(rng, 2, 17, 96));
    std::vector<double> losses;
    const auto want = summed_gradients(dev(), c, k.dtype, false, false, mbs, &losses);
    for (const int variant : {0, 1, 2}) {
      const bool shard_params = variant > 0, prefetch = variant == 2;
      const auto got = summed_gradients(dev(), c, k.dtype, true, shard_params, mbs, &losses, prefetch);
      INFO("dtype " << dtype_name(k.dtype) << ", biases " << k.bias << ", recompute " << k.recompute
                    << ", sharded parameters " << shard_params << ", prefetched " << prefetch);
      CHECK(losses.back() == losses.front());  // the same forward
      REQUIRE(got.size() == want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        INFO("parameter " << i);
        check_gradients_close(got[i], want[i], k.dtype == DType::bf16);
      }
    }
  }
}

// FP8 parameters (--fp8-param-gather, delayed and tensorwise scaling) with sharded gradients: with
// their FP8 weights sharded too (each layer's all-gathered as FP8 bytes and transposed in its slot),
// the same FP8 GEMMs run on the same bytes, so the losses and every gradient are the same bits as
// with the FP8 weights whole; also with full recompute of all three layers as one group (a layer
// evicted from its slot is gathered and transposed again for its backward), and with MoE layers
// (layers 0 and 2: 4 experts of FFN 48, top-2, a shared expert of 32; their FP8 weights transposed
// at each use).
TEST_CASE("cuda sharded FP8 parameters: the same losses and gradients as whole FP8 parameters", "[gpu][fsdp][fp8][model]") {
  for (const Fp8Recipe recipe : {Fp8Recipe::delayed, Fp8Recipe::tensorwise})
    for (const int variant : {0, 1, 2}) {
      const bool recompute = variant == 1, moe = variant == 2;
      Config c = small_llama_config(3, 16, 2);
      if (moe) {
        c.model.moe.num_experts = 4;
        c.model.moe.router_topk = 2;
        c.model.moe.ffn_hidden_size = 48;
        c.model.moe.moe_layer = {1, 0, 1};
        c.model.moe.aux_loss_coeff = {0.01};
        c.model.moe.shared_expert_intermediate_size = 32;
      }
      c.train.fp8_format = Fp8Format::hybrid;
      c.train.fp8_recipe = recipe;
      c.train.fp8_param_gather = true;
      c.parallel.use_distributed_optimizer = true;
      if (recompute) {
        c.train.recompute_granularity = RecomputeGranularity::full;
        c.train.recompute_method = RecomputeMethod::uniform;
        c.train.recompute_num_layers = 3;
      }
      Rng rng;
      std::vector<MicroBatch> mbs;
      for (int j = 0; j < 3; ++j) mbs.push_back(random_micro_batch(rng, 2, 16, 96));
      std::vector<double> losses;
      const auto want = summed_gradients(dev(), c, DType::bf16, true, false, mbs, &losses);
      for (const bool prefetch : {false, true}) {  // (prefetched: the transposes made once each gather has landed)
        const auto got = summed_gradients(dev(), c, DType::bf16, true, true, mbs, &losses, prefetch);
        INFO((recipe == Fp8Recipe::delayed ? "delayed" : "tensorwise")
             << ", recompute " << recompute << ", MoE " << moe << ", prefetched " << prefetch);
        CHECK(losses.back() == losses.front());
        REQUIRE(got.size() == want.size());
        for (size_t i = 0; i < want.size(); ++i) {
          INFO("parameter " << i);
          CHECK(got[i] == want[i]);
        }
      }
    }
}

// Fine-grained activation offloading on the CUDA backend (engine/activation_offload.h): the kept
// tensors of every module go to pinned host memory on the offload stream after each layer's forward
// and come back before its backward, with two micro-batches in flight. Against the same model
// without offloading, from the same initialization: the same losses and gradients over three
// steps, float32 and bf16, dense and MoE, and with the compute waiting after every copy
// (--fine-grained-offloading-max-inflight-offloads 0).
#include <catch2/catch.hpp>

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

struct Result {
  std::vector<double> losses, grads;
  size_t activation_bytes = 0, host_bytes = 0;
  int copied_layers = 0;
};

// Three steps of two micro-batches in flight (both forwards, then both backwards); the gradients
// of the last step and every step's training loss. The parameters stay those of the
// initialization (the same on both models).
Result run(const Config& c, DType T, bool offload, std::optional<int> max_inflight, const std::vector<MicroBatch>& mbs) {
  ParallelState ps = make_single_process_state();
  const ModelDims d = ModelDims::from_config(c, ps);
  ModelOptions o = ModelOptions::from_config(c, d, T);
  o.num_slots = 2;
  if (!offload) o.offload = OffloadOptions();
  o.offload.max_inflight = max_inflight;
  GptModel model(d, o, ps, dev());
  model.init_parameters();
  Result r;
  for (int step = 0; step < 3; ++step) {
    model.zero_grads();
    dev().fill(model.loss_sums(false), 0.0);
    for (int j = 0; j < 2; ++j) {
      model.stage_micro_batch(j, mbs[static_cast<size_t>(2 * step + j)], 0.5, false, 11 + 2 * step + j, true);
      model.forward(j);
    }
    model.backward(1, false);
    model.backward(0, true);
    dev().synchronize();
    const std::vector<double> sums = download(dev(), model.loss_sums(false));
    r.losses.push_back(sums[0] / sums[1]);
  }
  r.grads = download(dev(), model.grads_flat());
  r.activation_bytes = model.memory_plan().of(MemoryCategory::activations);
  r.host_bytes = model.memory_plan().host;
  for (const OffloadPlan::Layer& l : model.offload_plan().layers) r.copied_layers += l.copied ? 1 : 0;
  return r;
}

}  // namespace

TEST_CASE("cuda offloaded activations: the same losses and gradients as kept on the device", "[gpu][offload][model]") {
  struct Case {
    DType dtype;
    bool moe;
  };
  for (const Case k : {Case{DType::f32, false}, Case{DType::bf16, false}, Case{DType::bf16, true}}) {
    Config c = small_llama_config(6, 33, 2);
    c.train.fine_grained_activation_offloading = true;
    c.train.offload_modules = {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"};
    c.train.min_offloaded_tensor_size = 0;
    if (k.moe) {
      c.model.moe.num_experts = 4;
      c.model.moe.router_topk = 2;
      c.model.moe.ffn_hidden_size = 48;
      c.model.moe.layer_freq = 1;
      c.model.moe.moe_layer = {1, 0, 1, 1, 0, 1};
      c.model.moe.grouped_gemm = true;
    }
    Rng rng;
    std::vector<MicroBatch> mbs;
    for (int j = 0; j < 6; ++j) mbs.push_back(random_micro_batch(rng, 2, 33, 96));
    const Result want = run(c, k.dtype, false, std::nullopt, mbs);
    for (const std::optional<int> cap : {std::optional<int>(), std::optional<int>(0), std::optional<int>(1)}) {
      INFO("dtype " << dtype_name(k.dtype) << ", moe " << k.moe << ", max in flight " << (cap ? *cap : -1));
      const Result got = run(c, k.dtype, true, cap, mbs);
      CHECK(got.copied_layers == 6);  // (two micro-batches in flight: every layer)
      CHECK(got.host_bytes > 0);
      CHECK(got.activation_bytes < want.activation_bytes);
      REQUIRE(got.losses.size() == want.losses.size());
      for (size_t s = 0; s < want.losses.size(); ++s) {
        CHECK(std::isfinite(got.losses[s]));
        CHECK(std::abs(got.losses[s] - want.losses[s]) <= 1e-6 * std::abs(want.losses[s]));
      }
      check_gradients_close(got.grads, want.grads, k.dtype == DType::bf16);
    }
  }
}

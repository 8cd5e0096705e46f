// FP8 parameters (--fp8-param-gather): the FP8 layers' linear weights live only as FP8, cast by the
// distributed optimizer from its float32 master weights. Checked on the reference backend (float32
// compute, the CPU's FP8 emulation; one rank, so each master shard is a whole bucket):
//  - the layout: those weights, and only they, fill an FP8 region whose buckets hold nothing else;
//  - after training, every FP8 parameter is bit for bit its master weights cast with the weight's
//    scale (the cast of the last optimizer step), and the transposed copies follow;
//  - training follows FP8 training without the flag (the same casts of the same weights, except
//    in the calibrating first step, whose compute-dtype GEMMs take the FP8 weights dequantized);
//  - memory: in bf16, 2 bytes less per FP8 weight (no compute-dtype copy beside the FP8 one);
//  - tensorwise (current) scaling: each step's weight scales come from that step's new master
//    weights, and training is bit for bit tensorwise training without the flag.
// tests/mpi/parallel_train.cmake runs it over DP, TP x DP and a resume onto another DP size.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "app/training_data.h"
#include "core/dtype.h"
#include "engine/backend.h"
#include "engine/gpt_model.h"
#include "engine/loss_scaler.h"
#include "engine/lr_schedule.h"
#include "engine/optimizer.h"
#include "engine/trainer.h"
#include "parallel/parallel_state.h"
#include "tests/engine_test_util.h"
#include "tests/split_run_util.h"

using namespace mt;

namespace {

Config fp8_config(Config c, bool param_gather, Fp8Recipe recipe = Fp8Recipe::delayed) {
  c = test::with_mock_training(c);  // two micro-batches per step
  c.train.train_iters = 6;
  c.train.lr_warmup_iters = 1;
  c.train.eval_iters = 0;
  c.train.fp8_format = Fp8Format::hybrid;
  c.train.fp8_amax_history_len = 4;
  c.train.fp8_amax_compute_algo = Fp8AmaxAlgo::max;
  c.train.fp8_param_gather = param_gather;
  c.train.fp8_recipe = recipe;
  if (recipe == Fp8Recipe::tensorwise) {  // (its casts have no history)
    c.train.fp8_amax_history_len = 1;
    c.train.fp8_amax_compute_algo = Fp8AmaxAlgo::most_recent;
    c.train.fp8_margin = 1;  // (the margin enters the weights' scales too)
  }
  c.parallel.use_distributed_optimizer = true;
  test::derive(c);
  return c;
}

ModelOptions options_for(const Config& c, const ModelDims& dims, DType compute) {
  ModelOptions o = ModelOptions::from_config(c, dims, compute);
  o.shard_optimizer_state = c.parallel.use_distributed_optimizer;
  return o;
}

template <typename T>
std::vector<T> to_host(Backend& be, const Tensor& t) {
  std::vector<T> h(static_cast<size_t>(t.nbytes() / sizeof(T)));
  be.copy_to_host(h.data(), t);
  return h;
}

struct Trained {
  std::vector<double> losses;
};

// Trains c on a fresh model; check(model, backend) runs after the last step.
template <typename Check>
Trained train(const Config& c, Check&& check) {
  ParallelState ps = make_single_process_state();
  auto be = make_reference_backend(2);
  const ModelDims dims = ModelDims::from_config(c, ps);
  GptModel model(dims, options_for(c, dims, DType::f32), ps, *be);
  model.init_parameters();
  TrainingData data = build_training_data(c, 0, 1, 0);
  test::NullReporter rep;
  Trainer trainer(c, ps, model, *data.train, nullptr, rep);
  trainer.train();
  check(model, *be);
  return {trainer.loss_history()};
}

bool is_linear_weight(const std::string& n) {
  for (const char* s : {".linear_qkv.weight", ".linear_proj.weight", ".linear_fc1.weight", ".linear_fc2.weight"})
    if (n.ends_with(s)) return true;
  return false;
}

int gemm_of(const std::string& name) {
  return name.ends_with(".linear_qkv.weight")    ? 0
         : name.ends_with(".linear_proj.weight") ? 1
         : name.ends_with(".linear_fc1.weight")  ? 2
                                                 : 3;
}

// Each FP8 weight is the cast of its master weights (one rank: the master shard of a bucket is the
// whole bucket) with the weight's scale.
void check_fp8_weights_are_master_casts(GptModel& m, Backend& be) {
  const GradLayout& L = m.grad_layout();
  const std::vector<float> master = to_host<float>(be, m.master_flat());
  const std::vector<float> scale = to_host<float>(be, m.fp8_state().scale());
  int checked = 0;
  for (int b = 0; b < L.num_buckets(); ++b) {
    if (!L.fp8_bucket(b)) continue;
    for (const ShardSegment& s : L.shard_segments(b)) {
      const ParamDesc& p = m.params()[static_cast<size_t>(s.param)];
      const int local = p.layer - m.dims().layer_begin;
      const int gemm = gemm_of(p.name);
      const float sc = scale[static_cast<size_t>((local * Fp8State::kGemms + gemm) * Fp8State::kRoles + Fp8State::w)];
      CHECK(sc != 1.0f);  // scaled from the weights' amax
      const Tensor q = m.param(s.param);
      REQUIRE(q.dtype == DType::fp8_e4m3);
      const std::vector<uint8_t> bits = to_host<uint8_t>(be, q);
      int64_t wrong = 0;
      for (int64_t i = 0; i < s.numel; ++i) {
        const float v = master[static_cast<size_t>(L.state_offset[static_cast<size_t>(b)] + s.shard_offset + i)];
        wrong += bits[static_cast<size_t>(s.param_offset + i)] != float_to_fp8_bits(DType::fp8_e4m3, v * sc);
      }
      CHECK(wrong == 0);
      ++checked;
    }
  }
  CHECK(checked == 4 * m.dims().stage_layers());
}

}  // namespace

TEST_CASE("fp8 param gather: the FP8 weights are the master weights cast with their scales", "[fp8][engine][train]") {
  for (test::ConfigMaker make : test::kTinyModels) {
    const Config model_cfg = make();
    INFO((model_cfg.model.swiglu ? "Llama" : "GPT"));
    const Config c = fp8_config(model_cfg, true);
    const Trained with = train(c, [&](GptModel& m, Backend& be) {
      REQUIRE(m.fp8_params());
      REQUIRE(m.has_master_copy());
      const GradLayout& L = m.grad_layout();
      // Layout: the FP8 region holds exactly the linear weights, in buckets of their own.
      for (const ParamDesc& p : m.params()) {
        INFO(p.name);
        CHECK(p.fp8_storage == is_linear_weight(p.name));
        CHECK((p.offset >= L.fp8_begin) == p.fp8_storage);
      }
      for (int b = 0; b < L.num_buckets(); ++b) {
        const GradBucket& k = L.plan.buckets[static_cast<size_t>(b)];
        CHECK((k.offset >= L.fp8_begin) == (k.offset + k.numel > L.fp8_begin));
      }
      check_fp8_weights_are_master_casts(m, be);
    });
    // Without the flag: the same FP8 training within FP8 noise (the runs part only by the
    // calibrating step's dequantized weights, and casts from the same float32 weights after it).
    const Trained without = train(fp8_config(model_cfg, false), [](GptModel& m, Backend&) { CHECK_FALSE(m.fp8_params()); });
    REQUIRE(with.losses.size() == without.losses.size());
    for (size_t i = 0; i < with.losses.size(); ++i) {
      INFO("iteration " << i + 1);
      CHECK(std::abs(with.losses[i] - without.losses[i]) < 2e-3 * std::abs(without.losses[i]));
    }
  }
}

// Tensorwise (current) scaling: each weight's scale is fp8_max / max |its master weights| / 2^margin,
// from the weights of this step (not an earlier one's).
void check_weight_scales_are_current(GptModel& m, Backend& be) {
  const GradLayout& L = m.grad_layout();
  const std::vector<float> master = to_host<float>(be, m.master_flat());
  const std::vector<float> scale = to_host<float>(be, m.fp8_state().scale());
  std::vector<float> amax(scale.size(), 0.0f);
  for (int b = 0; b < L.num_buckets(); ++b) {
    if (!L.fp8_bucket(b)) continue;
    for (const ShardSegment& s : L.shard_segments(b)) {
      const ParamDesc& p = m.params()[static_cast<size_t>(s.param)];
      float& a = amax[static_cast<size_t>(((p.layer - m.dims().layer_begin) * Fp8State::kGemms + gemm_of(p.name)) *
                                              Fp8State::kRoles + Fp8State::w)];
      for (int64_t i = 0; i < s.numel; ++i)
        a = std::max(a, std::abs(master[static_cast<size_t>(L.state_offset[static_cast<size_t>(b)] + s.shard_offset + i)]));
    }
  }
  const int margin = m.fp8_state().options().margin;
  int checked = 0;
  for (size_t i = Fp8State::w; i < scale.size(); i += Fp8State::kRoles) {
    REQUIRE(amax[i] > 0.0f);
    CHECK(scale[i] == (448.0f / amax[i]) / std::ldexp(1.0f, margin));
    ++checked;
  }
  CHECK(checked == 4 * m.dims().stage_layers());
}

TEST_CASE("fp8 param gather with tensorwise scaling: current weight scales, the same training as without the flag",
          "[fp8][engine][train]") {
  for (test::ConfigMaker make : test::kTinyModels) {
    const Config model_cfg = make();
    INFO((model_cfg.model.swiglu ? "Llama" : "GPT"));
    const Trained with = train(fp8_config(model_cfg, true, Fp8Recipe::tensorwise), [&](GptModel& m, Backend& be) {
      REQUIRE(m.fp8_params());
      check_fp8_weights_are_master_casts(m, be);
      check_weight_scales_are_current(m, be);
    });
    // Without the flag each step casts its float32 weights (the reference backend's compute dtype:
    // the master weights themselves) by their own amax: the same bits, so the same losses exactly.
    const Trained without =
        train(fp8_config(model_cfg, false, Fp8Recipe::tensorwise), [](GptModel& m, Backend&) { CHECK_FALSE(m.fp8_params()); });
    CHECK(with.losses == without.losses);
    REQUIRE(with.losses.size() == 6);
  }
}

TEST_CASE("fp8 param gather: bf16 memory plan holds 2 bytes less per FP8 weight", "[fp8][engine]") {
  for (test::ConfigMaker make : test::kTinyModels) {
    const Config model_cfg = make();
    INFO((model_cfg.model.swiglu ? "Llama" : "GPT"));
    ParallelState ps = make_single_process_state();
    const Config with_cfg = fp8_config(model_cfg, true), without_cfg = fp8_config(model_cfg, false);
    const ModelDims dims = ModelDims::from_config(with_cfg, ps);
    const MemoryPlan with = GptModel::plan_memory(dims, options_for(with_cfg, dims, DType::bf16));
    const MemoryPlan without = GptModel::plan_memory(dims, options_for(without_cfg, dims, DType::bf16));
    int64_t fp8_weights = 0, total = 0;
    for (const ParamDesc& p : build_param_descs(dims, &total))
      if (is_linear_weight(p.name)) fp8_weights += p.numel();
    const int64_t saved = static_cast<int64_t>(without.of(MemoryCategory::parameters)) -
                          static_cast<int64_t>(with.of(MemoryCategory::parameters));
    // Up to the regions' padding (a bucket ends on a multiple of 128 elements, parameters start on
    // multiples of 64, views on 256 bytes).
    CHECK(saved >= 2 * fp8_weights - 4096);
    CHECK(saved <= 2 * fp8_weights + 4096);
    CHECK(with.of(MemoryCategory::gradients) == without.of(MemoryCategory::gradients));
  }
}

TEST_CASE("fp8 param gather: a step skipped by the loss scaler recasts the weights with the new scales",
          "[fp8][engine][optimizer]") {
  const Config c = fp8_config(test::tiny_gpt_config(), true);
  ParallelState ps = make_single_process_state();
  auto be = make_reference_backend(1);
  const ModelDims dims = ModelDims::from_config(c, ps);
  GptModel model(dims, options_for(c, dims, DType::f32), ps, *be);
  model.init_parameters();
  LrSchedule schedule(LrSchedule::params_from_config(c));
  LossScaler scaler = LossScaler::dynamic(1024.0, 1.0, 1000, 1);
  Optimizer opt(c, model, ps, schedule, scaler);
  const std::vector<float> master_before = to_host<float>(*be, model.master_flat());
  // New scales, as the step's end sets them before the optimizer step: every scale halved.
  std::vector<float> scale = to_host<float>(*be, model.fp8_state().scale()), scale_inv(scale.size());
  for (size_t i = 0; i < scale.size(); ++i) scale_inv[i] = 1.0f / (scale[i] *= 0.5f);
  be->copy_from_host(model.fp8_state().scale(), scale.data());
  be->copy_from_host(model.fp8_state().scale_inv_all(), scale_inv.data());
  be->fill(model.grads_flat(), INFINITY);
  const float sums[2] = {2.0f, 4.0f};
  be->copy_from_host(model.loss_sums(false), sums);
  const StepOutcome o = opt.step(1);
  REQUIRE(o.skipped);
  CHECK(to_host<float>(*be, model.master_flat()) == master_before);
  check_fp8_weights_are_master_casts(model, *be);  // with the halved scales
}

namespace {

// Which scaling state and GEMM cast an FP8 parameter of the MLA x MoE x MTP model below, by name:
// 0 the dense state, 1 the experts' (GEMM `gemm` of expert 0; expert e's is gemm + 2e), 2 the
// extra one (MLA's five GEMMs, then the MTP projection, then the shared expert's two); -1: none.
std::pair<int, int> state_and_gemm(const std::string& n) {
  const std::pair<const char*, std::pair<int, int>> names[] = {
      {".mlp.linear_fc1.weight", {0, Fp8State::fc1}},
      {".mlp.linear_fc2.weight", {0, Fp8State::fc2}},
      {".mlp.experts.linear_fc1.weight", {1, 0}},
      {".mlp.experts.linear_fc2.weight", {1, 1}},
      {".self_attention.linear_q_down_proj.weight", {2, 0}},
      {".self_attention.linear_q_up_proj.weight", {2, 1}},
      {".self_attention.linear_kv_down_proj.weight", {2, 2}},
      {".self_attention.linear_kv_up_proj.weight", {2, 3}},
      {".self_attention.linear_proj.weight", {2, 4}},
      {".eh_proj.weight", {2, 5}},
      {".mlp.shared_experts.linear_fc1.weight", {2, 6}},
      {".mlp.shared_experts.linear_fc2.weight", {2, 7}}};
  for (const auto& [suffix, where] : names)
    if (n.ends_with(suffix)) return where;
  return {-1, 0};
}

}  // namespace

TEST_CASE("fp8 param gather: experts (a scale per expert), MLA, MTP and shared experts are FP8 parameters",
          "[fp8][engine][train][moe][mla]") {
  Config base = test::with_moe(test::tiny_mla_config(), 2, 4, 2, 24, 2);  // layer 0 MoE, layer 1 dense
  const MoeConfig& e = base.model.moe;
  base.model.moe.shared_expert_intermediate_size = 16;
  base.model.mtp_num_layers = 1;
  base.model.mtp_loss_scaling_factor = 0.3;
  const Config c = fp8_config(base, true);
  int experts_checked = 0;
  const Trained with = train(c, [&](GptModel& m, Backend& be) {
    REQUIRE(m.fp8_params());
    const GradLayout& L = m.grad_layout();
    const std::vector<float> master = to_host<float>(be, m.master_flat());
    const Fp8State* states[] = {&m.fp8_state(), &m.fp8_expert_state(), &m.fp8_extra_state()};
    std::vector<float> expert_scales;
    for (const ParamDesc& p : m.params()) {
      INFO(p.name);
      CHECK(p.fp8_storage == (state_and_gemm(p.name).first >= 0));
    }
    for (int b = 0; b < L.num_buckets(); ++b) {
      if (!L.fp8_bucket(b)) continue;
      for (const ShardSegment& s : L.shard_segments(b)) {
        const ParamDesc& p = m.params()[static_cast<size_t>(s.param)];
        INFO(p.name);
        const auto [state, gemm] = state_and_gemm(p.name);
        REQUIRE(state >= 0);
        const int local = p.layer - m.dims().layer_begin;
        const int groups = state == 1 ? e.num_experts : 1;
        const int64_t per_group = p.numel() / groups;
        const std::vector<uint8_t> bits = to_host<uint8_t>(be, m.param(s.param));
        int64_t wrong = 0;
        for (int g = 0; g < groups; ++g) {
          const float sc =
              to_host<float>(be, states[state]->meta(local, gemm + 2 * g, Fp8State::w).scale).at(0);
          CHECK(sc != 1.0f);  // scaled from the weights' amax
          if (state == 1 && gemm == 0) expert_scales.push_back(sc);
          for (int64_t i = std::max(s.param_offset, g * per_group);
               i < std::min(s.param_offset + s.numel, (g + 1) * per_group); ++i) {
            const float v = master[static_cast<size_t>(L.state_offset[static_cast<size_t>(b)] + s.shard_offset +
                                                       (i - s.param_offset))];
            wrong += bits[static_cast<size_t>(i)] != float_to_fp8_bits(DType::fp8_e4m3, v * sc);
          }
        }
        CHECK(wrong == 0);
        if (state == 1) ++experts_checked;
      }
    }
    // Each expert's weight is cast with its own scale: not one value for the four experts.
    std::sort(expert_scales.begin(), expert_scales.end());
    CHECK(std::unique(expert_scales.begin(), expert_scales.end()) - expert_scales.begin() > 1);
  });
  CHECK(experts_checked == 2);  // the MoE layer's fc1 and fc2
  // Without the flag: the same FP8 training within FP8 noise.
  const Trained without = train(fp8_config(base, false), [](GptModel& m, Backend&) { CHECK_FALSE(m.fp8_params()); });
  REQUIRE(with.losses.size() == without.losses.size());
  for (size_t i = 0; i < with.losses.size(); ++i) {
    INFO("iteration " << i + 1);
    CHECK(std::abs(with.losses[i] - without.losses[i]) < 2e-3 * std::abs(without.losses[i]));
  }
}

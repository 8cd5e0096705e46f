// The optimizer step on a model: clipping, the folded gradient scale, overflow skipping with a
// loss scaler, the NaN check.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "engine/backend.h"
#include "engine/gpt_model.h"
#include "engine/loss_scaler.h"
#include "engine/lr_schedule.h"
#include "engine/model_chunks.h"
#include "engine/optimizer.h"
#include "parallel/parallel_state.h"
#include "tests/engine_test_util.h"

using namespace mt;

namespace {

struct Setup {
  Config cfg;
  ParallelState ps = make_single_process_state();
  std::unique_ptr<Backend> be = make_reference_backend(1);
  std::unique_ptr<GptModel> model;
  std::vector<float> grads, params;

  // as_app: the options the app's chunk planning gives (engine/model_chunks.h: the distributed
  // optimizer's shards and buckets), else ModelOptions::from_config's.
  explicit Setup(Config c, bool as_app = false) : cfg(std::move(c)) {
    const ModelDims d = ModelDims::from_config(cfg, ps);
    const ModelOptions o = as_app ? model_chunk_specs(cfg, ps, DType::f32).at(0).options
                                  : ModelOptions::from_config(cfg, d, DType::f32);
    model = std::make_unique<GptModel>(d, o, ps, *be);
    model->init_parameters();
    params.resize(static_cast<size_t>(model->params_flat().numel()));
    be->copy_to_host(params.data(), model->params_flat());
    grads.assign(params.size(), 0.0f);
  }
  // Every parameter element gets gradient g (padding stays 0); the loss sums are set too.
  void set_grads(float g, float loss_sum = 2.0f, float tokens = 4.0f) {
    for (const auto& p : model->params())
      for (int64_t k = 0; k < p.numel(); ++k) grads[static_cast<size_t>(p.offset + k)] = g;
    be->copy_from_host(model->grads_flat(), grads.data());
    const float sums[2] = {loss_sum, tokens};
    be->copy_from_host(model->loss_sums(false), sums);
  }
  int64_t counted_elements(const Optimizer& opt) const {
    int64_t n = 0;
    for (const auto& s : opt.norm_segments()) n += s.count;
    return n;
  }
  std::vector<float> now() {
    std::vector<float> v(params.size());
    be->copy_to_host(v.data(), model->params_flat());
    return v;
  }
};

}  // namespace

TEST_CASE("optimizer step: global norm, clipping coefficient, AdamW update, schedule in samples", "[optimizer]") {
  Config c = test::tiny_gpt_config();
  c.train.clip_grad = 1.0;
  c.train.weight_decay = 0.1;
  c.train.global_batch_size = 4;
  c.train.micro_batch_size = 2;
  test::derive(c);
  Setup s(c);
  LrSchedule schedule(LrSchedule::params_from_config(c));
  LossScaler scaler = LossScaler::none();
  Optimizer opt(c, *s.model, s.ps, schedule, scaler);
  s.set_grads(0.5f);
  const StepOutcome o = opt.step(1);
  REQUIRE_FALSE(o.skipped);
  const double norm = 0.5 * std::sqrt(static_cast<double>(s.counted_elements(opt)));
  CHECK(*o.grad_norm == Approx(norm).epsilon(1e-6));
  CHECK(o.loss() == Approx(0.5));
  CHECK(schedule.num_steps() == 4);
  CHECK(opt.successful_steps() == 1);
  // Clipped gradient g = 0.5 * 1/(norm + 1e-6); Adam's first step moves by lr * (g/(|g| + eps) + wd * w).
  const double g = 0.5 * (1.0 / (norm + 1e-6));
  const double lr = static_cast<float>(1e-3), eps = static_cast<float>(1e-8), wd = static_cast<float>(0.1);
  const std::vector<float> after = s.now();
  for (const auto& p : s.model->params()) {
    const size_t i = static_cast<size_t>(p.offset);
    const double w0 = s.params[i];
    const double expect = w0 - lr * (g / (g + eps) + (p.weight_decay ? wd * w0 : 0.0));
    INFO(p.name);
    CHECK(after[i] == Approx(expect).epsilon(1e-6).margin(1e-9));
  }
}

TEST_CASE("optimizer step: overflow under loss scaling skips the update and the schedule", "[optimizer]") {
  Config c = test::tiny_gpt_config();
  Setup s(c);
  LrSchedule schedule(LrSchedule::params_from_config(c));
  LossScaler scaler = LossScaler::dynamic(1024.0, 1.0, 1000, 1);
  Optimizer opt(c, *s.model, s.ps, schedule, scaler);
  s.set_grads(INFINITY);
  const StepOutcome o = opt.step(1);
  CHECK(o.skipped);
  CHECK_FALSE(o.grad_norm.has_value());
  CHECK(scaler.scale() == 512.0);  // hysteresis 1: halved at once
  CHECK(schedule.num_steps() == 0);
  CHECK(opt.successful_steps() == 0);
  CHECK(s.now() == s.params);
  // A finite step divides the loss scale out: gradient 512 * 0.25 is a true gradient of 0.25.
  s.set_grads(512.0f * 0.25f);
  const StepOutcome ok = opt.step(2);
  REQUIRE_FALSE(ok.skipped);
  CHECK(*ok.grad_norm == Approx(0.25 * std::sqrt(static_cast<double>(s.counted_elements(opt)))).epsilon(1e-6));
}

TEST_CASE("optimizer step: NaN check names the iteration", "[optimizer]") {
  Config c = test::tiny_gpt_config();
  Setup s(c);
  LrSchedule schedule(LrSchedule::params_from_config(c));
  LossScaler scaler = LossScaler::none();
  Optimizer opt(c, *s.model, s.ps, schedule, scaler);
  s.set_grads(NAN);
  CHECK_THROWS_WITH(opt.step(7), Catch::Contains("iteration 7"));
  s.set_grads(0.1f, NAN, 4.0f);
  CHECK_THROWS_WITH(opt.step(8), Catch::Contains("lm loss"));
  c.train.check_for_nan_in_loss_and_grad = false;
  Optimizer lax(c, *s.model, s.ps, schedule, scaler);
  CHECK_NOTHROW(lax.step(9));
}

TEST_CASE("optimizer step: --apply-wd-to-qk-layernorm decays the q/k layernorm parameters and nothing else", "[optimizer]") {
  // The same gradients and weights, one step each: without the flag the q/k layernorm parameters
  // (1-D) get no weight decay; with it their step adds lr * wd * w, and every other parameter moves
  // exactly as without it.
  auto config = [](bool apply) {
    Config c = test::tiny_gpt_config();
    c.model.qk_layernorm = true;
    c.train.weight_decay = 0.1;
    c.train.apply_wd_to_qk_layernorm = apply;
    test::derive(c);
    return c;
  };
  const Config off_cfg = config(false), on_cfg = config(true);
  Setup off(off_cfg), on(on_cfg);
  REQUIRE(off.params == on.params);
  LrSchedule off_schedule(LrSchedule::params_from_config(off_cfg)), on_schedule(LrSchedule::params_from_config(on_cfg));
  LossScaler off_scaler = LossScaler::none(), on_scaler = LossScaler::none();
  Optimizer off_opt(off_cfg, *off.model, off.ps, off_schedule, off_scaler);
  Optimizer on_opt(on_cfg, *on.model, on.ps, on_schedule, on_scaler);
  // The q/k layernorm weights start at 1 and their biases at 0: give every parameter a nonzero
  // start so that the decay term shows (the same on both models).
  for (size_t i = 0; i < off.params.size(); ++i) off.params[i] = on.params[i] = 0.5f + 0.001f * static_cast<float>(i % 97);
  off.be->copy_from_host(off.model->params_flat(), off.params.data());
  on.be->copy_from_host(on.model->params_flat(), on.params.data());
  off.set_grads(0.25f);
  on.set_grads(0.25f);
  REQUIRE_FALSE(off_opt.step(1).skipped);
  REQUIRE_FALSE(on_opt.step(1).skipped);
  const std::vector<float> a = off.now(), b = on.now();
  const double lr = static_cast<float>(1e-3), wd = static_cast<float>(0.1);
  int qk_params = 0;
  for (const auto& p : on.model->params()) {
    INFO(p.name);
    const bool qk = p.name.find("self_attention.q_layernorm.") != std::string::npos ||
                    p.name.find("self_attention.k_layernorm.") != std::string::npos;
    const ParamDesc& q = off.model->params()[static_cast<size_t>(&p - on.model->params().data())];
    REQUIRE(q.name == p.name);
    CHECK(p.weight_decay == (qk || q.weight_decay));
    for (int64_t k = 0; k < p.numel(); ++k) {
      const size_t i = static_cast<size_t>(p.offset + k);
      if (!qk) {
        CHECK(b[i] == a[i]);
        continue;
      }
      const double w0 = on.params[i];
      CHECK(a[i] != b[i]);
      CHECK(static_cast<double>(a[i]) - b[i] == Approx(lr * wd * w0).epsilon(1e-2));
    }
    qk_params += qk ? 1 : 0;
  }
  CHECK(qk_params == 2 * 2 * 2);  // 2 layers x {q, k} x {weight, bias} (LayerNorm)
}

// The update beside the next forward: every parameter's elements are updated by the piece its
// forward waits for (the piece of the unit holding it: the last boundary at or before its index),
// each element once, with its group; over the whole buffer and over a distributed optimizer's
// buckets, dense and MoE.
TEST_CASE("optimizer: the update's pieces hold each parameter's elements where its forward waits", "[optimizer]") {
  Config llama = test::tiny_llama_config();
  llama.model.num_layers = 3;
  Config moe = test::with_moe(test::tiny_llama_config(), 3, 4, 2, 24, 2);
  Config gpt = test::tiny_gpt_config();
  for (bool distopt : {false, true})
    for (Config c : {llama, moe, gpt}) {
      c.parallel.use_distributed_optimizer = distopt;
      c.parallel.ddp_bucket_size = 700;
      c.parallel.overlap_grad_reduce = distopt;  // (buckets: only with overlapped reductions, as Megatron)
      Setup s(c, true);
      REQUIRE(s.model->grad_layout().sharded == distopt);
      LrSchedule sched(LrSchedule::params_from_config(s.cfg));
      LossScaler scaler = LossScaler::from_config(s.cfg);
      setenv("MEGATRAIN_OPTIMIZER_OVERLAP", "1", 1);
      Optimizer opt(s.cfg, *s.model, s.ps, sched, scaler);
      unsetenv("MEGATRAIN_OPTIMIZER_OVERLAP");
      REQUIRE(opt.update_beside_forward());
      REQUIRE(opt.ranges().size() > (distopt ? 2u : 0u));  // (a range per bucket)
      const std::vector<int> bounds = s.model->forward_param_boundaries();
      REQUIRE(bounds.size() == static_cast<size_t>(c.model.num_layers) + 2);  // embedding, layers, head
      const auto& params = s.model->params();
      // Each element of the flat buffer: the piece updating it (-1: none), its group.
      std::vector<int> piece_of(static_cast<size_t>(s.model->params_flat().numel()), -1), group(piece_of.size(), -1);
      for (size_t k = 0; k < opt.update_pieces().size(); ++k) {
        const Optimizer::UpdatePiece& u = opt.update_pieces()[k];
        const OptimRange& r = opt.ranges()[u.range];
        for (const OptimSegment& seg : u.update)
          for (int64_t e = r.flat_offset + seg.offset; e < r.flat_offset + seg.offset + seg.count; ++e) {
            REQUIRE(piece_of[static_cast<size_t>(e)] == -1);  // once
            piece_of[static_cast<size_t>(e)] = static_cast<int>(k);
            group[static_cast<size_t>(e)] = seg.group;
          }
      }
      // The same elements and groups as the one-pass update's segments.
      for (const OptimRange& r : opt.ranges())
        for (const OptimSegment& seg : r.update)
          for (int64_t e = r.flat_offset + seg.offset; e < r.flat_offset + seg.offset + seg.count; ++e) {
            REQUIRE(piece_of[static_cast<size_t>(e)] >= 0);
            REQUIRE(group[static_cast<size_t>(e)] == seg.group);
          }
      for (int i = 0; i < static_cast<int>(params.size()); ++i) {
        const int unit_first = *std::prev(std::upper_bound(bounds.begin(), bounds.end(), i));
        const ParamDesc& p = params[static_cast<size_t>(i)];
        INFO(p.name << (distopt ? " (distributed optimizer)" : ""));
        for (int64_t e = p.offset; e < p.offset + p.numel(); ++e) {
          const int k = piece_of[static_cast<size_t>(e)];
          REQUIRE(k >= 0);
          CHECK(opt.update_pieces()[static_cast<size_t>(k)].first_param == unit_first);
        }
      }
    }
}

// bf16 parameters whose master weights are remainders (the default: engine/model_chunks.cpp) against
// the same model with a separate float32 copy, on the reference backend (no forward: random
// gradients): after each of four steps the same bf16 parameters, master weights (joined), moments,
// gradient norm and --log-params-norm, bit for bit; one buffer, and the distributed optimizer's
// buckets on one rank; AdamW, and Muon (AdamW for the parameters it leaves).
TEST_CASE("optimizer: master weights as remainders give a separate float32 copy's bits", "[optimizer][precision-aware]") {
  for (const auto& [distopt, muon] : {std::pair{false, false}, std::pair{true, false}, std::pair{false, true},
                                      std::pair{true, true}}) {
    INFO("distributed optimizer " << distopt << ", muon " << muon);
    Config c = test::tiny_llama_config();
    c.train.precision = Precision::bf16;
    if (muon) c.train.optimizer = OptimizerKind::muon;
    c.train.clip_grad = 1.0;
    c.train.weight_decay = 0.1;
    c.parallel.use_distributed_optimizer = distopt;
    c.parallel.ddp_bucket_size = 1500;
    c.parallel.overlap_grad_reduce = distopt;  // (buckets: only with overlapped reductions, as Megatron)
    test::derive(c);
    ParallelState ps = make_single_process_state();
    std::unique_ptr<Backend> be = make_reference_backend(2);
    const ModelDims d = ModelDims::from_config(c, ps);
    ModelOptions with = model_chunk_specs(c, ps, DType::bf16).at(0).options;
    REQUIRE(with.master_remainders);
    REQUIRE(with.master_tie_bits);
    ModelOptions without = with;
    without.master_remainders = without.master_tie_bits = false;
    GptModel a(d, with, ps, *be), b(d, without, ps, *be);
    a.init_parameters();
    b.init_parameters();
    REQUIRE(a.master_flat().dtype == DType::i16);
    REQUIRE(b.master_flat().dtype == DType::f32);
    // Master weights with exact ties (the low half 0x8000) in every third element, as a load sets them.
    std::vector<float> full(static_cast<size_t>(a.grads_flat().numel()), 0.0f);
    be->copy_to_host(full.data(), b.has_master_copy() && !distopt ? b.master_flat() : b.grads_flat());
    if (distopt) {  // (the drawn values are gone from the gradient buffer: take the parameters')
      std::vector<uint16_t> w(static_cast<size_t>(b.params_flat().numel()));
      be->copy_to_host(w.data(), b.params_flat());
      for (size_t i = 0; i < w.size(); ++i) full[i] = bf16_bits_to_float(w[i]) * 1.001f;
    }
    int64_t ties = 0;
    for (const ParamDesc& p : a.params())
      for (int64_t k = 0; k < p.numel(); k += 3) {
        float& x = full[static_cast<size_t>(p.offset + k)];
        uint32_t u;
        std::memcpy(&u, &x, 4);
        u = (u & 0xFFFF0000u) | 0x8000u;
        std::memcpy(&x, &u, 4);
        ++ties;
      }
    REQUIRE(ties > 1000);
    be->copy_from_host(a.grads_flat(), full.data());
    a.params_from_full_master(a.grads_flat());
    be->copy_from_host(distopt ? b.grads_flat() : b.master_flat(), full.data());
    b.params_from_full_master(distopt ? b.grads_flat() : b.master_flat());
    LrSchedule sa(LrSchedule::params_from_config(c)), sb(LrSchedule::params_from_config(c));
    LossScaler la = LossScaler::none(), lb = LossScaler::none();
    Optimizer oa(c, a, ps, sa, la), ob(c, b, ps, sb, lb);
    if (distopt) REQUIRE(oa.ranges().size() > 2);
    auto bytes = [&](const Tensor& t) {
      std::vector<unsigned char> v(t.nbytes());
      be->copy_to_host(v.data(), t);
      return v;
    };
    std::mt19937_64 rng(9);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int step = 1; step <= 4; ++step) {
      INFO("step " << step);
      std::vector<float> g(static_cast<size_t>(a.grads_flat().numel()), 0.0f);
      for (const ParamDesc& p : a.params())
        for (int64_t k = 0; k < p.numel(); ++k) g[static_cast<size_t>(p.offset + k)] = 0.02f * nd(rng);
      const float sums[2] = {3.0f, 4.0f};
      for (GptModel* m : {&a, &b}) {
        be->copy_from_host(m->grads_flat(), g.data());
        be->copy_from_host(m->loss_sums(false), sums);
      }
      const StepOutcome ra = oa.step(step), rb = ob.step(step);
      REQUIRE(ra.grad_norm.has_value());
      CHECK(*ra.grad_norm == *rb.grad_norm);
      CHECK(bytes(a.params_flat()) == bytes(b.params_flat()));
      CHECK(bytes(a.exp_avg_flat()) == bytes(b.exp_avg_flat()));
      CHECK(bytes(a.exp_avg_sq_flat()) == bytes(b.exp_avg_sq_flat()));
      const std::vector<unsigned char> w = bytes(a.params_flat()), r = bytes(a.master_flat()),
                                       t = bytes(a.master_tie_words()), mb = bytes(b.master_flat());
      std::vector<float> joined(static_cast<size_t>(a.master_flat().numel()));
      a.master_to_host(joined.data(), w.data(), r.data(), t.data());
      CHECK(std::memcmp(joined.data(), mb.data(), mb.size()) == 0);
      CHECK(oa.params_norm() == ob.params_norm());
    }
  }
}

TEST_CASE("optimizer: the gradient norm takes the experts' squares their GEMMs summed, one micro-batch per step",
          "[optimizer][moe]") {
  // One micro-batch per step on one rank: model_chunk_specs turns ModelOptions::expert_grad_sumsq
  // on, and the norm reads the routed experts' weight gradients from GptModel::expert_grad_sumsq()
  // instead of the buffer (here they differ on purpose). Two micro-batches: from the buffer.
  for (const bool two_micro_batches : {false, true}) {
    INFO((two_micro_batches ? "two micro-batches" : "one micro-batch"));
    Config c = test::with_moe(test::tiny_llama_config(), 3, 4, 2, 24, 1);
    c.model.moe.shared_expert_intermediate_size = 16;
    c.train.clip_grad = 1.0;
    c.train.micro_batch_size = 1;
    c.train.global_batch_size = two_micro_batches ? 2 : 1;
    test::derive(c);
    Setup s(c, true);
    const Tensor slot = s.model->expert_grad_sumsq();
    REQUIRE(slot.empty() == two_micro_batches);
    LrSchedule schedule(LrSchedule::params_from_config(s.cfg));
    LossScaler scaler = LossScaler::none();
    Optimizer opt(s.cfg, *s.model, s.ps, schedule, scaler);
    s.set_grads(0.5f);
    int64_t fused = 0;
    for (const ParamDesc& p : s.model->params()) fused += s.model->sumsq_fused(p) ? p.numel() : 0;
    const float in_slot = 7.0f;
    if (!slot.empty()) {
      REQUIRE(fused > s.counted_elements(opt) / 2);  // (the experts: most of the parameters)
      s.be->copy_from_host(slot, &in_slot);
    } else {
      REQUIRE(fused == 0);
    }
    const StepOutcome o = opt.step(1);
    const double counted = static_cast<double>(s.counted_elements(opt));
    const double want = two_micro_batches ? 0.5 * std::sqrt(counted)
                                          : std::sqrt(0.25 * (counted - static_cast<double>(fused)) + in_slot);
    CHECK(*o.grad_norm == Approx(want).epsilon(1e-6));
  }
}

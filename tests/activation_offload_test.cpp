// Fine-grained activation offloading (engine/activation_offload.h): the plan's choices (Megatron-LM's
// size floor, last-layer margin, pipeline-rank budget and fraction), and whole models on the
// reference backend with their offloaded tensors overwritten by NaN after each copy to host: the
// same losses and gradients, bit for bit, as without offloading, in less device memory.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "engine/activation_offload.h"
#include "engine/backend.h"
#include "engine/gpt_model.h"
#include "engine/model_dims.h"
#include "parallel/parallel_state.h"
#include "tests/cli_test_util.h"
#include "tests/engine_test_util.h"
#include "tests/fp8_train_util.h"

namespace mt {
namespace {

OffloadOptions options(std::initializer_list<OffloadModule> mods) {
  OffloadOptions o;
  o.enabled = true;
  o.min_numel = 0;
  for (OffloadModule m : mods) o.modules[static_cast<size_t>(m)] = true;
  return o;
}

// Every layer keeps qkv (1000 bytes), attn_out (512) and h1 (256); layer l's input (300 bytes) is
// a candidate where `input` is set.
std::vector<OffloadCandidate> layer_candidates(int layers, bool input) {
  std::vector<OffloadCandidate> c;
  for (int l = 0; l < layers; ++l) {
    c.push_back({l, OffloadField::qkv, DType::f32, 250, 1024});
    c.push_back({l, OffloadField::attn_out, DType::f32, 128, 512});
    c.push_back({l, OffloadField::h1, DType::f32, 64, 256});
    if (input && l > 0) c.push_back({l, OffloadField::input, DType::f32, 75, 512});
  }
  return c;
}

}  // namespace

TEST_CASE("offload plan: two entries, the last two layers never copied, one copy per module", "[offload]") {
  const OffloadPlan p = OffloadPlan::make(options({OffloadModule::core_attn, OffloadModule::mlp_norm}), 6,
                                          layer_candidates(6, false), {}, true);
  REQUIRE(p.ring == 2);
  for (int l = 0; l < 6; ++l) {
    INFO("layer " << l);
    const OffloadPlan::Layer& ly = p.layers[static_cast<size_t>(l)];
    CHECK(ly.copied == (l < 4));
    REQUIRE(ly.pieces.size() == 3);  // (resident layers too: they live in their entry)
    // By module (core_attn before mlp_norm), then field; contiguous from 0.
    CHECK(ly.pieces[0].field == OffloadField::qkv);
    CHECK(ly.pieces[1].field == OffloadField::attn_out);
    CHECK(ly.pieces[2].field == OffloadField::h1);
    CHECK(ly.pieces[1].offset == 1024);
    CHECK(ly.pieces[2].offset == 1536);
    REQUIRE(ly.groups.size() == 2);
    CHECK(ly.groups[0].module == OffloadModule::core_attn);
    CHECK(ly.groups[0].bytes == 1536);
    CHECK(ly.groups[1].module == OffloadModule::mlp_norm);
    CHECK(ly.groups[1].offset == 1536);
    CHECK(ly.bytes == 1792);
  }
  CHECK(p.entry_bytes == 1792);
  CHECK(p.host_bytes_per_slot == 4 * 1792);
  CHECK(p.layers[3].host_offset == 3 * 1792);
  CHECK(p.module_bytes[static_cast<size_t>(OffloadModule::core_attn)] == 4 * 1536);
  CHECK(p.piece(2, OffloadField::h1) != nullptr);
  CHECK(p.piece(2, OffloadField::input) == nullptr);
  CHECK_THAT(p.summary(), Catch::Contains("from 4 of 6 layers") && Catch::Contains("2 device entries"));
}

TEST_CASE("offload plan: with several micro-batches in flight every layer is copied", "[offload]") {
  const OffloadPlan p = OffloadPlan::make(options({OffloadModule::core_attn}), 3, layer_candidates(3, false), {}, false);
  REQUIRE(p.ring == 2);
  for (const OffloadPlan::Layer& l : p.layers) CHECK(l.copied);
  CHECK(p.host_bytes_per_slot == 3 * 1536);
  CHECK(p.placed_bytes_per_slot == 3 * 1536);
  CHECK(p.layers[2].host_offset == 2 * 1536);
  // One layer is enough then.
  CHECK(OffloadPlan::make(options({OffloadModule::core_attn}), 1, layer_candidates(1, false), {}, false).ring == 2);
}

TEST_CASE("offload plan: three entries where a layer's tensors are written by the layer before", "[offload]") {
  // A layer's input (attn_norm) is written by the layer before: a third entry.
  OffloadPlan p = OffloadPlan::make(options({OffloadModule::attn_norm, OffloadModule::mlp_norm}), 6,
                                    layer_candidates(6, true), {}, true);
  CHECK(p.ring == 3);
  CHECK(p.layers[2].copied);
  CHECK_FALSE(p.layers[3].copied);
  CHECK(p.layers[0].pieces.size() == 1);  // (layer 0's input is the stage input: no candidate)
  // ln1's output written by the layer before's closing op (the fused norm) does the same.
  std::vector<OffloadCandidate> c;
  for (int l = 0; l < 6; ++l) c.push_back({l, OffloadField::ln1_out, DType::f32, 64, 256});
  p = OffloadPlan::make(options({OffloadModule::qkv_linear}), 6, c, std::vector<bool>(6, true), true);
  CHECK(p.ring == 3);
  p = OffloadPlan::make(options({OffloadModule::qkv_linear}), 6, c, std::vector<bool>(6, false), true);
  CHECK(p.ring == 2);
}

TEST_CASE("offload plan: the size floor, modules not named, and too few layers offload nothing", "[offload]") {
  OffloadOptions o = options({OffloadModule::core_attn});
  o.min_numel = 200;  // qkv (250 elements) is offloaded, attn_out (128) is not
  OffloadPlan p = OffloadPlan::make(o, 5, layer_candidates(5, false), {}, true);
  REQUIRE(p.ring == 2);
  REQUIRE(p.layers[0].pieces.size() == 1);
  CHECK(p.layers[0].pieces[0].field == OffloadField::qkv);
  o.min_numel = 251;
  CHECK(OffloadPlan::make(o, 5, layer_candidates(5, false), {}, true).ring == 0);
  CHECK(OffloadPlan::make(options({OffloadModule::moe_act}), 5, layer_candidates(5, false), {}, true).ring == 0);
  CHECK(OffloadPlan::make(options({OffloadModule::core_attn}), 2, layer_candidates(2, false), {}, true).ring == 0);
  p = OffloadPlan::make(options({OffloadModule::core_attn}), 3, layer_candidates(3, false), {}, true);
  CHECK(p.ring == 2);
  CHECK(p.layers[0].copied);
  CHECK_FALSE(p.layers[1].copied);
  OffloadOptions off = options({OffloadModule::core_attn});
  off.enabled = false;
  CHECK(OffloadPlan::make(off, 6, layer_candidates(6, false), {}, true).ring == 0);
}

TEST_CASE("offload plan: the pipeline rank's bytes stay first, then the fraction keeps the earliest groups",
          "[offload]") {
  // 6 layers, 2 entries: layers 0-3 copied, two groups each (core_attn 1536, mlp_norm 256): 8
  // eligible groups in forward order.
  const auto copied_groups = [](const OffloadPlan& p) {
    std::vector<std::string> g;
    for (size_t l = 0; l < p.layers.size(); ++l)
      if (p.layers[l].copied)
        for (const OffloadPlan::Group& x : p.layers[l].groups)
          g.push_back(std::to_string(l) + offload_module_name(x.module));
    return g;
  };
  OffloadOptions o = options({OffloadModule::core_attn, OffloadModule::mlp_norm});
  o.fraction = 0.5;  // int(8 x 0.5) = 4 disabled: the last four
  CHECK(copied_groups(OffloadPlan::make(o, 6, layer_candidates(6, false), {}, true)) ==
        std::vector<std::string>{"0core_attn", "0mlp_norm", "1core_attn", "1mlp_norm"});
  o.fraction = 0.8;  // int(8 x 0.2) = int(1.6000000000000005) = 1
  CHECK(copied_groups(OffloadPlan::make(o, 6, layer_candidates(6, false), {}, true)).size() == 7);
  o.fraction = 0.0;
  CHECK(OffloadPlan::make(o, 6, layer_candidates(6, false), {}, true).ring == 0);
  // Keep 1600 bytes on the device: the first two groups (1536 + 256 >= 1600), then the fraction of
  // the six left (int(6 x 0.5) = 3 more, from the end).
  o.fraction = 0.5;
  o.keep_bytes = 1600;
  CHECK(copied_groups(OffloadPlan::make(o, 6, layer_candidates(6, false), {}, true)) ==
        std::vector<std::string>{"1core_attn", "1mlp_norm", "2core_attn"});
  // A disabled group's tensors are laid out as usual (no piece), the others still in the entry.
  const OffloadPlan p = OffloadPlan::make(o, 6, layer_candidates(6, false), {}, true);
  CHECK(p.piece(0, OffloadField::qkv) == nullptr);
  CHECK(p.piece(2, OffloadField::h1) == nullptr);
  CHECK(p.piece(4, OffloadField::h1) != nullptr);  // (resident)
}

TEST_CASE("offload options: modules by name, fused_group_mlp takes the MoE fields, the rank's budget", "[offload]") {
  TrainConfig t;
  t.fine_grained_activation_offloading = true;
  t.offload_modules = {"core_attn", "fused_group_mlp"};
  t.delta_offload_bytes_across_pp_ranks = 1000;
  const OffloadOptions o = OffloadOptions::from_config(t, 3);
  CHECK(o.keep_bytes == 3000);
  CHECK(o.selected(OffloadField::qkv));
  CHECK(o.selected(OffloadField::attn_out));
  CHECK_FALSE(o.selected(OffloadField::h1));
  CHECK(o.module_of(OffloadField::moe_in) == OffloadModule::fused_group_mlp);
  CHECK(o.module_of(OffloadField::moe_fc1_pre) == OffloadModule::fused_group_mlp);
  CHECK(o.selected(OffloadField::moe_fc1_pre));
  OffloadOptions plain = o;
  plain.modules[static_cast<size_t>(OffloadModule::fused_group_mlp)] = false;
  CHECK(plain.module_of(OffloadField::moe_in) == OffloadModule::expert_fc1);
  CHECK(plain.module_of(OffloadField::moe_fc1_pre) == OffloadModule::moe_act);
}

namespace {

const std::vector<std::string> kAllModules = {"attn_norm", "qkv_linear", "core_attn", "attn_proj",
                                              "mlp_norm",  "expert_fc1", "moe_act"};

// One model on the reference backend in float64, with one or two slots.
struct Model {
  int slots = 2;
  ParallelState ps = make_single_process_state();
  std::unique_ptr<Backend> be = make_reference_backend(2);
  ModelDims dims;
  std::unique_ptr<GptModel> model;
  std::vector<MicroBatch> mbs;

  Model(const Config& c, bool offload, int num_slots = 2) : slots(num_slots) {
    dims = ModelDims::from_config(c, ps);
    ModelOptions o = ModelOptions::from_config(c, dims, DType::f64);
    o.num_slots = slots;
    if (offload) o.offload.poison = true;
    else o.offload = OffloadOptions();
    model = std::make_unique<GptModel>(dims, o, ps, *be);
    model->init_parameters();
    std::vector<double> w(static_cast<size_t>(model->params_flat().numel()));
    be->copy_to_host(w.data(), model->params_flat());
    for (size_t i = 0; i < model->params().size(); ++i) {  // bigger weights: every path carries signal
      const ParamDesc& p = model->params()[i];
      for (int64_t k = 0; k < p.numel(); ++k) {
        double& v = w[static_cast<size_t>(p.offset + k)];
        v = p.init == InitKind::normal ? v * 20.0 : v + 0.1 * std::sin(1.0 + k + 7.0 * i);
      }
    }
    be->copy_from_host(model->params_flat(), w.data());
    for (int j = 0; j < 2; ++j) {
      test::ArangeBatchSource src(dims.micro_batch, dims.seq, dims.vocab);
      MicroBatch mb;
      src.next(mb);
      for (size_t k = 0; k < mb.tokens.size(); ++k) {
        mb.tokens[k] = static_cast<int32_t>((k * (13 + 4 * j) + 5) % dims.vocab);
        mb.labels[k] = static_cast<int32_t>((k * 29 + 3 + j) % dims.vocab);
        mb.loss_mask[k] = (k % 5 == 3) ? 0.0f : 1.0f;
      }
      mbs.push_back(mb);
    }
  }

  // A step of two micro-batches: with two slots both in flight at once (as a pipeline's warm-up
  // holds them: both forwards, then both backwards), else one after the other; the loss sums and
  // the gradients.
  std::vector<double> step(int serial) {
    model->zero_grads();
    be->fill(model->loss_sums(false), 0.0);
    for (int j = 0; j < 2; ++j) {
      const int slot = slots == 2 ? j : 0;
      model->stage_micro_batch(slot, mbs[static_cast<size_t>(j)], 0.5, false, 42 + serial * 2 + j, true);
      if (slots == 2 && j == 1) model->backward_follows(1);  // (its last layers stay; slot 0's all went)
      model->forward(slot);
      if (slots == 1) model->backward(0, j == 1);
    }
    if (slots == 2) {  // (each backward's last layer back early, as the pipeline runner asks)
      model->prefetch_backward(1);
      model->backward(1, false);
      model->prefetch_backward(0);
      model->backward(0, true);
    }
    std::vector<double> out(static_cast<size_t>(model->grads_flat().numel()) + 2);
    be->copy_to_host(out.data(), model->grads_flat());
    be->copy_to_host(out.data() + out.size() - 2, model->loss_sums(false));
    return out;
  }

  double eval_loss() {
    be->fill(model->loss_sums(true), 0.0);
    model->stage_micro_batch(0, mbs[0], 1.0, true, 7, false);
    model->forward(0);
    double s[2];
    be->copy_to_host(s, model->loss_sums(true));
    return s[0] / s[1];
  }
};

Config offloaded(Config c, int layers, std::vector<std::string> modules = kAllModules) {
  c.model.num_layers = layers;
  c.train.fine_grained_activation_offloading = true;
  c.train.offload_modules = std::move(modules);
  c.train.min_offloaded_tensor_size = 0;
  test::derive(c);
  return c;
}

}  // namespace

TEST_CASE("offloaded activations: the same losses and gradients, step after step, in less device memory",
          "[offload][model]") {
  std::vector<std::pair<std::string, Config>> cases;
  cases.emplace_back("llama, all modules", offloaded(test::tiny_llama_config(), 6));
  cases.emplace_back("llama, core_attn only", offloaded(test::tiny_llama_config(), 5, {"core_attn"}));
  {
    Config c = test::tiny_gpt_config();  // learned positions, biases, LayerNorm, dropout
    c.model.hidden_dropout = 0.1;
    c.model.attention_dropout = 0.1;
    cases.emplace_back("gpt, dropout", offloaded(c, 6));
  }
  {
    Config c = test::tiny_llama_config();
    c.train.recompute_granularity = RecomputeGranularity::full;
    c.train.recompute_method = RecomputeMethod::block;
    c.train.recompute_num_layers = 2;  // layers 0 and 1 recomputed, 2-6 offloaded
    cases.emplace_back("llama, full recompute of the first two layers", offloaded(c, 7));
    c = test::tiny_llama_config();
    c.train.recompute_granularity = RecomputeGranularity::selective;
    c.train.recompute_modules = {"layernorm"};  // no norm outputs kept: qkv_linear has nothing
    cases.emplace_back("llama, selective recompute of the norms", offloaded(c, 6));
  }
  {
    Config c = test::with_moe(test::tiny_llama_config(), 6, 4, 2, 20, 1);
    c.model.moe.moe_layer = {1, 0, 1, 1, 1, 0};
    c.model.moe.shared_expert_intermediate_size = 12;
    c.model.moe.aux_loss_coeff = {1e-2};
    cases.emplace_back("moe", offloaded(c, 6));
  }
  {
    Config c = test::tiny_mla_config();
    cases.emplace_back("mla", offloaded(c, 5));
    c = test::tiny_gdn_config();
    c.model.linear_layer = {1, 0, 1, 1, 0, 0};
    cases.emplace_back("gdn", offloaded(c, 6));
    c = test::tiny_llama_config();
    c.model.mtp_num_layers = 1;
    cases.emplace_back("llama + mtp", offloaded(c, 5));
  }
  for (const auto& [name, c] : cases)
    for (const int slots : {1, 2}) {
    INFO(name << ", " << slots << " slot(s)");
    Model on(c, true, slots), off(c, false, slots);
    const OffloadPlan& plan = on.model->offload_plan();
    REQUIRE(plan.ring > 0);  // (else the case tests nothing)
    CHECK(off.model->offload_plan().ring == 0);
    int copied = 0;
    for (const OffloadPlan::Layer& l : plan.layers) copied += l.copied ? 1 : 0;
    CHECK(copied > 0);
    const MemoryPlan &po = on.model->memory_plan(), &pf = off.model->memory_plan();
    // Two micro-batches in flight: every layer copied (one: all but the last two or three); what
    // the slots kept of the offloaded tensors leaves the device, the shared entries come instead.
    const int placed = static_cast<int>(std::count_if(plan.layers.begin(), plan.layers.end(),
                                                      [](const OffloadPlan::Layer& l) { return !l.pieces.empty(); }));
    CHECK(copied == (slots == 2 ? placed : placed - plan.ring));
    CHECK((plan.placed_bytes_per_slot == plan.host_bytes_per_slot) == (slots == 2));
    CHECK(po.of(MemoryCategory::activations) + slots * plan.placed_bytes_per_slot ==
          pf.of(MemoryCategory::activations) + plan.ring * plan.entry_bytes);
    CHECK(po.of(MemoryCategory::activations) < pf.of(MemoryCategory::activations));
    CHECK(po.host == slots * plan.host_bytes_per_slot);
    CHECK(pf.host == 0);
    for (int step = 0; step < 3; ++step) {
      INFO("step " << step);
      const std::vector<double> a = on.step(step), b = off.step(step);
      REQUIRE(a.size() == b.size());
      const test::BitDiff d = test::bit_diff(a, b);
      CHECK(d.differ == 0);
      CHECK(d.nonzero > a.size() / 2);
      CHECK(std::isfinite(a[a.size() - 2]));
      // A plain gradient step on both (the same parameters again).
      std::vector<double> w(static_cast<size_t>(off.model->params_flat().numel()));
      off.be->copy_to_host(w.data(), off.model->params_flat());
      for (size_t i = 0; i < w.size(); ++i) w[i] -= 1e-2 * b[i];
      off.be->copy_from_host(off.model->params_flat(), w.data());
      on.be->copy_from_host(on.model->params_flat(), w.data());
    }
    const double e_on = on.eval_loss(), e_off = off.eval_loss();
    CHECK(std::memcmp(&e_on, &e_off, sizeof(double)) == 0);
    }
}

TEST_CASE("offloaded activations: each module offloads only its own tensors", "[offload][model]") {
  const Config base = test::with_moe(test::tiny_llama_config(), 6, 4, 2, 20, 1);
  const auto fields = [&](const std::string& module) {
    Config c = offloaded(base, 6, {module});
    c.model.moe.moe_layer = {0, 1, 1, 1, 1, 1};
    Model m(c, true);
    std::vector<OffloadField> f;
    for (const OffloadPlan::Piece& p : m.model->offload_plan().layers[1].pieces) f.push_back(p.field);
    return f;
  };
  using F = OffloadField;
  CHECK(fields("attn_norm") == std::vector<F>{F::input});
  CHECK(fields("qkv_linear") == std::vector<F>{F::ln1_out});
  CHECK(fields("core_attn") == std::vector<F>{F::qkv, F::attn_out, F::lse});
  CHECK(fields("mlp_norm") == std::vector<F>{F::h1});
  CHECK(fields("expert_fc1") == std::vector<F>{F::moe_in});
  CHECK(fields("moe_act") == std::vector<F>{F::moe_fc1_pre});
  // attn_proj's input is core_attn's output: without FP8 nothing of its own.
  Config c = offloaded(base, 6, {"attn_proj"});
  CHECK(Model(c, true).model->offload_plan().ring == 0);
}

TEST_CASE("offloading flags: Megatron-LM's checks, and no effect without offloading", "[offload][cli]") {
  using test::parse;
  using test::parse_error;
  using test::small_gpt;
  using test::words;
  using test::operator+;
  const Config c = parse(small_gpt() + words("--fine-grained-activation-offloading --offload-modules core_attn "
                                             "attn_proj --min-offloaded-tensor-size 4096 --activation-offload-fraction "
                                             "0.5 --delta-offload-bytes-across-pp-ranks 1024 "
                                             "--fine-grained-offloading-max-inflight-offloads 2"));
  CHECK(c.train.fine_grained_activation_offloading);
  CHECK(c.train.offload_modules == std::vector<std::string>{"core_attn", "attn_proj"});
  CHECK(c.train.min_offloaded_tensor_size == 4096);
  CHECK(c.train.activation_offload_fraction == 0.5);
  CHECK(c.train.delta_offload_bytes_across_pp_ranks == 1024);
  CHECK(c.train.fine_grained_offloading_max_inflight_offloads == 2);
  const std::string on = " --fine-grained-activation-offloading";
  CHECK_THAT(parse_error(small_gpt() + words(on)), Catch::Contains("needs --offload-modules"));
  CHECK_THAT(parse_error(small_gpt() + words(on + " --offload-modules attention")),
             Catch::Contains("--offload-modules attention: not one of"));
  CHECK_THAT(parse_error(small_gpt() + words(on + " --offload-modules attn_proj")),
             Catch::Contains("attn_proj needs core_attn"));
  CHECK_THAT(parse_error(small_gpt() + words(on + " --offload-modules moe_act --recompute-granularity selective "
                                                  "--recompute-modules moe")),
             Catch::Contains("--offload-modules moe_act with --recompute-modules moe"));
  CHECK_THAT(parse_error(small_gpt() + words(on + " --offload-modules fused_group_mlp")),
             Catch::Contains("needs --use-transformer-engine-op-fuser"));
  CHECK_THAT(parse_error(small_gpt() + words(on + " --offload-modules fused_group_mlp moe_act "
                                                  "--use-transformer-engine-op-fuser")),
             Catch::Contains("cannot be combined with moe_act"));
  CHECK_THAT(parse_error(small_gpt() + words(on + " --offload-modules core_attn --activation-offload-fraction 1.5")),
             Catch::Contains("--activation-offload-fraction must be in range [0, 1]"));
  CHECK_THAT(parse_error(small_gpt() + words(on + " --offload-modules core_attn --min-offloaded-tensor-size -1")),
             Catch::Contains("--min-offloaded-tensor-size must be non-negative"));
  CHECK_THAT(parse_error(small_gpt() + words(on + " --offload-modules core_attn --delta-offload-bytes-across-pp-ranks -1")),
             Catch::Contains("--delta-offload-bytes-across-pp-ranks must be non-negative"));
  CHECK_THAT(parse_error(small_gpt() + words(on + " --offload-modules core_attn --transformer-impl local")),
             Catch::Contains("--transformer-impl transformer_engine"));
  std::vector<SetupMessage> ms;
  parse(small_gpt() + words("--offload-modules core_attn --activation-offload-fraction 0.5"), 1, &ms);
  CHECK(test::has_message(ms, SetupMessage::Kind::note,
                          "--offload-modules has no effect without --fine-grained-activation-offloading"));
  CHECK(test::has_message(ms, SetupMessage::Kind::note,
                          "--activation-offload-fraction has no effect without --fine-grained-activation-offloading"));
}

}  // namespace mt

namespace mt {

TEST_CASE("offloaded activations in FP8 layers: their kept FP8 inputs go too, the same training bit for bit",
          "[offload][fp8]") {
  // Mock-data training through the Trainer (one slot: the last layers stay), FP8 GEMMs with
  // delayed and tensorwise scaling: with FP8 inputs kept, qkv_linear and attn_proj offload the QKV
  // and projection inputs' FP8 copies. Losses, grad norms, parameters and FP8 scaling state equal
  // those without offloading.
  for (const Fp8Recipe r : {Fp8Recipe::delayed, Fp8Recipe::tensorwise}) {
    INFO((r == Fp8Recipe::delayed ? "delayed" : "tensorwise"));
    Config c = test::with_mock_training(test::tiny_llama_config());
    c.model.num_layers = 6;
    c.train.train_iters = 4;
    c.train.lr_warmup_iters = 1;
    c.train.eval_iters = 0;
    c.train.fp8_format = Fp8Format::hybrid;
    c.train.fp8_recipe = r;
    test::derive(c);
    const test::Fp8Run off = test::train_fp8(c);
    c.train.fine_grained_activation_offloading = true;
    c.train.min_offloaded_tensor_size = 0;
    c.train.offload_modules = {"qkv_linear", "core_attn"};
    const test::Fp8Run core = test::train_fp8(c);
    c.train.offload_modules = {"qkv_linear", "core_attn", "attn_proj"};
    const test::Fp8Run on = test::train_fp8(c);
    CHECK(core.plan.host > 0);
    CHECK(on.plan.host > core.plan.host);  // (attn_proj: the projection input's FP8 copy)
    CHECK(on.plan.of(MemoryCategory::activations) < off.plan.of(MemoryCategory::activations));
    for (const test::Fp8Run* x : {&core, &on}) {
      REQUIRE(x->losses.size() == off.losses.size());
      CHECK(x->losses == off.losses);
      CHECK(x->grad_norms == off.grad_norms);
      CHECK(x->params == off.params);
      CHECK(x->scale == off.scale);
      CHECK(x->history == off.history);
    }
  }
}

}  // namespace mt

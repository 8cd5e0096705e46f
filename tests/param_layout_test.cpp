// Parameter descriptions: Megatron-Core names, shapes, shards, optimizer flags; layout-independent
// init (TP=2 shards equal the slices of the TP=1 tensors).
#include <catch2/catch.hpp>

#include <map>
#include <set>
#include <vector>

#include "core/shard.h"
#include "engine/backend.h"
#include "engine/gpt_model.h"
#include "engine/optimizer.h"
#include "engine/param_count.h"
#include "parallel/parallel_state.h"
#include "tests/engine_test_util.h"

using namespace mt;

namespace {

ParallelState tp_state(int tp_size, int tp_rank) {
  ParallelState ps = make_single_process_state();
  ps.tp_size = tp_size;
  ps.tp_rank = tp_rank;
  ps.world_size = tp_size;
  ps.rank = tp_rank;
  return ps;
}

std::vector<float> host_params(GptModel& m, Backend& be) {
  std::vector<float> v(static_cast<size_t>(m.params_flat().numel()));
  be.copy_to_host(v.data(), m.params_flat());
  return v;
}

}  // namespace

TEST_CASE("param descriptions: Megatron-Core names and global shapes (GPT and Llama)", "[params]") {
  Config g = test::tiny_gpt_config();
  ParallelState ps = make_single_process_state();
  int64_t total = 0;
  const auto gpt = build_param_descs(ModelDims::from_config(g, ps), &total);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : gpt) shapes[p.name] = p.global_shape;
  CHECK(shapes.at("embedding.word_embeddings.weight") == std::vector<int64_t>{64, 16});
  CHECK(shapes.at("embedding.position_embeddings.weight") == std::vector<int64_t>{16, 16});
  CHECK(shapes.at("decoder.layers.1.self_attention.linear_qkv.weight") == std::vector<int64_t>{48, 16});
  CHECK(shapes.at("decoder.layers.1.self_attention.linear_qkv.bias") == std::vector<int64_t>{48});
  CHECK(shapes.at("decoder.layers.0.self_attention.linear_qkv.layer_norm_bias") == std::vector<int64_t>{16});
  CHECK(shapes.at("decoder.layers.0.mlp.linear_fc1.weight") == std::vector<int64_t>{64, 16});
  CHECK(shapes.at("decoder.layers.0.mlp.linear_fc2.weight") == std::vector<int64_t>{16, 64});
  CHECK(shapes.count("decoder.final_layernorm.bias") == 1);
  CHECK(shapes.count("output_layer.weight") == 0);  // tied
  CHECK(gpt.size() == 2 + 2 * 12 + 2);
  for (const auto& p : gpt) {
    CHECK(p.offset % kParamAlignment == 0);
    CHECK(p.weight_decay == !(p.is_1d() || p.name.ends_with(".bias")));
  }

  Config l = test::tiny_llama_config();
  const auto llama = build_param_descs(ModelDims::from_config(l, ps), &total);
  shapes.clear();
  for (const auto& p : llama) shapes[p.name] = p.global_shape;
  CHECK(shapes.at("decoder.layers.0.self_attention.linear_qkv.weight") == std::vector<int64_t>{(4 + 2 * 2) * 8, 32});
  CHECK(shapes.at("decoder.layers.0.mlp.linear_fc1.weight") == std::vector<int64_t>{96, 32});  // [gate; up]
  CHECK(shapes.at("output_layer.weight") == std::vector<int64_t>{64, 32});
  CHECK(shapes.count("embedding.position_embeddings.weight") == 0);
  CHECK(shapes.count("decoder.layers.0.self_attention.linear_qkv.bias") == 0);
  CHECK(shapes.count("decoder.layers.0.mlp.linear_fc1.layer_norm_bias") == 0);  // RMSNorm
}

TEST_CASE("layout-independent init: TP=2 shards equal slices of the TP=1 model", "[params]") {
  for (bool llama : {false, true}) {
    Config c = llama ? test::tiny_llama_config() : test::tiny_gpt_config();
    auto be = make_reference_backend(1);
    ParallelState ps1 = make_single_process_state();
    GptModel whole(ModelDims::from_config(c, ps1), ModelOptions::from_config(c, ModelDims::from_config(c, ps1), DType::f32),
                   ps1, *be);
    whole.init_parameters();
    const std::vector<float> w1 = host_params(whole, *be);
    std::map<std::string, const ParamDesc*> by_name;
    for (const auto& p : whole.params()) by_name[p.name] = &p;
    int sharded = 0;
    for (int r = 0; r < 2; ++r) {
      ParallelState ps2 = tp_state(2, r);
      const ModelDims d2 = ModelDims::from_config(c, ps2);
      GptModel part(d2, ModelOptions::from_config(c, d2, DType::f32), ps2, *be);
      part.init_parameters();
      const std::vector<float> w2 = host_params(part, *be);
      REQUIRE(part.params().size() == whole.params().size());
      for (const auto& p : part.params()) {
        const ParamDesc& q = *by_name.at(p.name);
        REQUIRE(p.global_shape == q.global_shape);
        if (p.numel() != q.numel()) ++sharded;
        for (int64_t i = 0; i < p.numel(); ++i) {
          const int64_t g = shard_global_index(p.shard, i);
          INFO(p.name << " rank " << r << " element " << i);
          REQUIRE(w2[static_cast<size_t>(p.offset + i)] == w1[static_cast<size_t>(q.offset + g)]);
        }
      }
    }
    CHECK(sharded > 0);
  }
}

TEST_CASE("TP shards: QKV by whole groups, SwiGLU fc1 as [gate shard, up shard], duplicated flags", "[params]") {
  Config c = test::tiny_llama_config();  // 4 heads, 2 groups, d 8, ffn 48
  ParallelState ps = tp_state(2, 1);
  const auto descs = build_param_descs(ModelDims::from_config(c, ps), nullptr);
  for (const auto& p : descs) {
    if (p.name == "decoder.layers.0.self_attention.linear_qkv.weight") {
      CHECK(p.shard.local_rows == 32);  // one group: 2 q heads + k + v, 8 each
      CHECK(p.shard.row_offset == 32);
      CHECK_FALSE(p.tp_duplicated);
    }
    if (p.name == "decoder.layers.0.mlp.linear_fc1.weight") {
      CHECK(p.shard.chunks == 2);
      CHECK(p.shard.local_rows == 24);
      CHECK(p.shard.row_offset == 24);
      CHECK(shard_global_index(p.shard, 24 * 32) == (48 + 24) * 32);  // first row of the up chunk
    }
    if (p.name == "decoder.layers.0.self_attention.linear_proj.weight") {
      CHECK(p.shard.local_cols == 16);
      CHECK(p.shard.col_offset == 16);
    }
    if (p.name == "embedding.word_embeddings.weight") CHECK(p.shard.row_offset == 32);
    if (p.name.find("layer_norm_weight") != std::string::npos) CHECK(p.tp_duplicated);
  }
}

TEST_CASE("optimizer groups: no weight decay on biases and 1-D params, decoupled lr on embeddings/output",
          "[params][optimizer]") {
  Config c = test::tiny_gpt_config();
  c.train.decoupled_lr = 5e-3;
  c.train.decoupled_min_lr = 5e-4;
  ParallelState ps = make_single_process_state();
  auto be = make_reference_backend(1);
  const ModelDims d = ModelDims::from_config(c, ps);
  GptModel model(d, ModelOptions::from_config(c, d, DType::f32), ps, *be);
  LrSchedule schedule(LrSchedule::params_from_config(c));
  LossScaler scaler = LossScaler::none();
  Optimizer opt(c, model, ps, schedule, scaler);
  CHECK(opt.segments().size() < model.params().size());  // neighbours of one group merge
  for (size_t i = 0; i < model.params().size(); ++i) {
    const ParamDesc& p = model.params()[i];
    int g = -1, covering = 0;
    for (const OptimSegment& s : opt.segments())
      if (s.offset <= p.offset && p.offset + p.numel() <= s.offset + s.count) {
        g = s.group;
        ++covering;
      }
    REQUIRE(covering == 1);
    INFO(p.name);
    if (p.name == "embedding.word_embeddings.weight") CHECK(g == Optimizer::kDecoupledDecay);
    else if (p.name.ends_with(".bias") || p.is_1d()) CHECK(g == Optimizer::kNoDecay);
    else CHECK(g == Optimizer::kDecay);
  }
  CHECK(opt.learning_rate() == Approx(1e-3));  // no warmup: the peak at step 0
  CHECK(*opt.decoupled_learning_rate() == Approx(5e-3));
}

TEST_CASE("param descriptions agree with the planner's parameter counts", "[params]") {
  for (bool llama : {false, true}) {
    Config c = llama ? test::tiny_llama_config() : test::tiny_gpt_config();
    c.model.qk_layernorm = llama;
    test::derive(c);
    ParallelState ps = make_single_process_state();
    int64_t ours = 0;
    for (const auto& p : build_param_descs(ModelDims::from_config(c, ps), nullptr)) ours += p.numel();
    CHECK(ours == count_parameters(c.model).total);
  }
}

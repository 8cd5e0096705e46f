// Parameter counts and Megatron's FLOPs formula on known models (numbers worked out by hand in the
// comments).
#include <catch2/catch.hpp>

#include "core/config.h"
#include "engine/flops.h"
#include "engine/model_dims.h"
#include "engine/param_layout.h"
#include "engine/param_count.h"
#include "parallel/pipeline_layout.h"
#include "tests/engine_test_util.h"

using namespace mt;

namespace {

ModelConfig gpt3_175b() {
  ModelConfig m;
  m.num_layers = 96;
  m.hidden_size = 12288;
  m.num_attention_heads = 96;
  m.max_position_embeddings = 2048;
  m.seq_length = 2048;
  m.ffn_size = 4 * 12288;
  m.head_dim = 128;
  m.query_groups = 96;
  m.vocab_size = 50257;
  m.padded_vocab_size = 51200;  // 50257 padded to a multiple of 128 x TP 8
  m.add_qkv_bias = true;
  return m;
}

ModelConfig llama3_8b() {
  ModelConfig m;
  m.num_layers = 32;
  m.hidden_size = 4096;
  m.num_attention_heads = 32;
  m.group_query_attention = true;
  m.num_query_groups = 8;
  m.max_position_embeddings = 8192;
  m.seq_length = 8192;
  m.ffn_size = 14336;
  m.head_dim = 128;
  m.query_groups = 8;
  m.swiglu = true;
  m.normalization = Normalization::rmsnorm;
  m.position_embedding_type = PositionEmbedding::rope;
  m.add_bias_linear = false;
  m.add_qkv_bias = false;
  m.untie_embeddings_and_output_weights = true;
  m.vocab_size = 128256;
  m.padded_vocab_size = 128256;
  return m;
}

}  // namespace

TEST_CASE("parameters: GPT-3 175B", "[engine][params]") {
  const ParamCounts c = count_parameters(gpt3_175b());
  // Per layer: 2 LayerNorms 4h = 49,152; QKV 3h^2 + 3h = 452,984,832 + 36,864; projection
  // h^2 + h = 150,994,944 + 12,288; fc1 4h^2 + 4h = 603,979,776 + 49,152; fc2 4h^2 + h =
  // 603,979,776 + 12,288: 1,812,099,072, x96 = 173,961,510,912. Embeddings 51200 x 12288 =
  // 629,145,600, positions 2048 x 12288 = 25,165,824, final LayerNorm 24,576.
  CHECK(c.layer.total() == 1812099072LL);
  CHECK(c.layers == 173961510912LL);
  CHECK(c.word_embeddings == 629145600LL);
  CHECK(c.position_embeddings == 25165824LL);
  CHECK(c.output_layer == 0);
  CHECK(c.total == 174615846912LL);  // ~174.6e9
  // TP 8, PP 16: 6 layers per stage. One TP rank of a layer: sharded 1,812,025,344 / 8 =
  // 226,503,168 plus replicated norms and row-parallel biases 73,728 = 226,576,896; x6 =
  // 1,359,461,376. Stage 0 adds 629,145,600 / 8 = 78,643,200 and the positions 25,165,824; the
  // last stage the final norm 24,576 and its copy of the tied embeddings 78,643,200.
  PipelineSplit s;
  s.num_layers = 96;
  s.pp = 16;
  CHECK(stage_parameters_per_rank(gpt3_175b(), stage_chunks(s, 0), 8, 16) == 1463270400LL);
  CHECK(stage_parameters_per_rank(gpt3_175b(), stage_chunks(s, 7), 8, 16) == 1359461376LL);
  CHECK(stage_parameters_per_rank(gpt3_175b(), stage_chunks(s, 15), 8, 16) == 1438129152LL);
}

TEST_CASE("parameters: Llama-3 8B", "[engine][params]") {
  const ParamCounts c = count_parameters(llama3_8b());
  // Per layer: QKV 4096 x (4096 + 2 x 1024) = 25,165,824; projection 16,777,216; SwiGLU
  // 3 x 4096 x 14336 = 176,160,768; 2 RMSNorms 8,192: 218,112,000; x32 = 6,979,584,000.
  // Untied embeddings and output 2 x 128256 x 4096 = 1,050,673,152; final norm 4,096.
  CHECK(c.layer.total() == 218112000LL);
  CHECK(c.total == 8030261248LL);  // 8.03e9
  PipelineSplit s;
  s.num_layers = 32;
  CHECK(stage_parameters_per_rank(llama3_8b(), stage_chunks(s, 0), 1, 1) == 8030261248LL);
}

TEST_CASE("parameters: GPT-2 small (124M) and tied embeddings on one stage", "[engine][params]") {
  ModelConfig m;
  m.num_layers = 12;
  m.hidden_size = 768;
  m.num_attention_heads = 12;
  m.max_position_embeddings = 1024;
  m.seq_length = 1024;
  m.ffn_size = 3072;
  m.head_dim = 64;
  m.query_groups = 12;
  m.add_qkv_bias = true;
  m.padded_vocab_size = 50257;
  CHECK(count_parameters(m).total == 124439808LL);  // the published GPT-2 small count
  PipelineSplit s;
  s.num_layers = 12;
  CHECK(stage_parameters_per_rank(m, stage_chunks(s, 0), 1, 1) == 124439808LL);  // PP 1: one copy
}

TEST_CASE("FLOPs: Megatron's formula (HEAD, causal halving)", "[engine][flops]") {
  // Llama-3 8B per token: MLP 6*3*4096*14336*32 = 33,822,867,456; projections
  // 6*32*(4096*6144 + 4096*4096) = 8,053,063,680; logits 6*4096*128256 = 3,152,019,456;
  // attention 8192*6*4096*32 = 6,442,450,944: 51,470,401,536 (51.47 GFLOP/token).
  CHECK(flops_per_token(llama3_8b()) == Approx(51470401536.0).epsilon(1e-12));
  CHECK(num_floating_point_operations(llama3_8b(), 128) == Approx(51470401536.0 * 128 * 8192).epsilon(1e-12));
  // GPT-3 175B per token: 12*12288*49152*96 = 695,784,701,952; 6*96*4*12288^2 =
  // 347,892,350,976; 6*12288*51200 = 3,774,873,600; 2048*6*12288*96 = 14,495,514,624.
  CHECK(flops_per_token(gpt3_175b()) == Approx(1061947441152.0).epsilon(1e-12));
}

TEST_CASE("FLOPs: multi-latent attention and multi-token prediction (Megatron's terms)", "[engine][flops][mla][mtp]") {
  ModelConfig m = llama3_8b();
  m.num_layers = 4;
  m.hidden_size = 1024;
  m.num_attention_heads = 8;
  m.group_query_attention = false;
  m.query_groups = 8;
  m.seq_length = 1024;
  m.ffn_size = 2816;
  m.vocab_size = m.padded_vocab_size = 32000;
  m.multi_latent_attention = true;
  m.q_lora_rank = 256;
  m.kv_lora_rank = 128;
  m.qk_head_dim = 64;
  m.qk_pos_emb_head_dim = 32;
  m.v_head_dim = 64;
  m.mtp_num_layers = 1;
  // Per token, L + D = 5 layers: MLA's linear part 6 [256 (1024 + 8*96 + 1) + 128 (1024 + 8*128 + 1)
  // + 1024*32 + 8*64*1024] x 5 = 38,350,080; its core 6 (8*96/2 + 8*64/2) x 1024 x 5 = 19,660,800;
  // the SwiGLU MLPs 18*1024*2816 x 5 = 259,522,560; the depth's norms and projection
  // 6 (3*1024 + 2*1024^2) = 12,601,344; two output layers 6*1024*32000*2 = 393,216,000.
  CHECK(flops_per_token(m) == Approx(723350784.0).epsilon(1e-12));
  m.mtp_num_layers.reset();  // 4 layers, one output layer
  CHECK(flops_per_token(m) ==
        Approx(38350080.0 * 4 / 5 + 19660800.0 * 4 / 5 + 259522560.0 * 4 / 5 + 6.0 * 1024 * 32000).epsilon(1e-12));
}

TEST_CASE("parameters: MLA, MoE and MTP counts equal the model's own parameter list", "[engine][params][mla][mtp]") {
  for (const bool q_lora : {true, false}) {
    Config c = test::tiny_mla_config();
    ModelConfig& m = c.model;
    if (!q_lora) m.q_lora_rank.reset();
    m.num_layers = 3;
    m.moe.num_experts = 4;
    m.moe.router_topk = 2;
    m.moe.ffn_hidden_size = 12;
    m.moe.moe_layer = {0, 1, 1};
    m.mtp_num_layers = 2;
    test::derive(c);
    const ModelDims d = ModelDims::from_config(c, RankPosition::split(c, 1, 0));
    int64_t listed = 0, total = 0;
    for (const ParamDesc& p : build_param_descs(d, &total))
      if (!p.shared_copy) listed += p.shard.global_rows * p.shard.global_cols;
    INFO("query rank " << q_lora);
    CHECK(count_parameters(m).total == listed);
    CHECK(stage_parameters_per_rank(m, stage_chunks(PipelineSplit::from_config(c), 0), 1, 1) == listed);
  }
}

// Multi-token prediction with sliding windows: Megatron numbers each MTP depth's transformer layer
// on its own (1, 2, ...), so with --window-attn-skip-freq depth j + 1 takes decoder layer j + 1's
// window, not the last decoder layer's.
TEST_CASE("model dims: the MTP layers' windows follow Megatron's numbering of MTP layers", "[engine][mtp]") {
  Config c = test::tiny_llama_config();
  c.model.num_layers = 4;
  c.model.window_size = std::make_pair(5, 0);
  c.model.window_attn_skip_every = 2;  // layers 2 and 4 (1-based) attend fully
  c.model.mtp_num_layers = 3;
  test::derive(c);
  const ModelDims d = ModelDims::from_config(c, RankPosition::split(c, 1, 0));
  REQUIRE(d.window_left.size() == 7);
  const std::vector<int> want = {5, -1, 5, -1, /* MTP depths 1, 2, 3 */ 5, -1, 5};
  CHECK(d.window_left == want);
  // A list pattern shorter than the MTP depths it must cover is refused.
  Config l = c;
  l.model.window_attn_skip_every.reset();
  l.model.window_attn_pattern = {1, 0, 1, 1};
  l.model.mtp_num_layers = 5;
  l.model.num_layers = 4;
  test::derive(l);
  CHECK_THROWS_WITH(ModelDims::from_config(l, RankPosition::split(l, 1, 0)), Catch::Contains("multi-token prediction depth 5 reads entry 5"));
}

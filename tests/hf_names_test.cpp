// Hugging Face name/layout mapping: hand-built tiny examples, the attention math each layout
// implies, and round trips for GPT-2 and Llama (GQA, biases, interleaved RoPE, layernorm-1p).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <type_traits>

#include "app/hf_commands.h"
#include "checkpoint/hf_names.h"
#include "core/error.h"
#include "engine_test_util.h"

using namespace mt;

namespace {

HfModelSpec gpt2_spec() {
  HfModelSpec s;
  s.arch = HfArchitecture::gpt2;
  s.num_layers = 2;
  s.hidden_size = 8;
  s.num_attention_heads = 2;
  s.num_query_groups = 2;
  s.head_dim = 4;
  s.ffn_hidden_size = 32;
  s.vocab_size = 11;
  s.padded_vocab_size = 16;
  s.max_position_embeddings = 6;
  s.learned_position_embeddings = true;
  s.layernorm = true;
  s.add_bias_linear = true;
  s.eos_token_id = 10;
  s.bos_token_id = 10;
  return s;
}

HfModelSpec llama_spec() {
  HfModelSpec s;
  s.arch = HfArchitecture::llama;
  s.num_layers = 2;
  s.hidden_size = 8;
  s.num_attention_heads = 4;
  s.num_query_groups = 2;
  s.head_dim = 4;  // heads * head_dim (16) != hidden (8): allowed for Llama (head_dim field)
  s.ffn_hidden_size = 12;
  s.vocab_size = 13;
  s.padded_vocab_size = 16;
  s.max_position_embeddings = 32;
  s.learned_position_embeddings = false;
  s.layernorm = false;
  s.add_bias_linear = false;
  s.swiglu = true;
  s.untie_embeddings_and_output_weights = true;
  s.rotary_base = 500000;
  s.norm_epsilon = 1e-5;
  return s;
}

HostArray f32_array(std::vector<int64_t> shape, const std::function<float(int64_t)>& value) {
  HostArray a = HostArray::zeros(DType::f32, std::move(shape));
  for (int64_t i = 0; i < a.numel(); ++i) a.ptr<float>()[i] = value(i);
  return a;
}

const HfTensorMapping& find(const std::vector<HfTensorMapping>& ms, const std::string& ours) {
  for (const auto& m : ms)
    if (m.ours == ours) return m;
  FAIL("no mapping for " << ours);
  throw std::logic_error("unreachable");
}

}  // namespace

TEST_CASE("GPT-2 names and shapes", "[checkpoint][hf]") {
  const HfModelSpec s = gpt2_spec();
  const auto ms = hf_tensor_mappings(s);
  std::set<std::string> hf;
  for (const auto& m : ms)
    for (const auto& n : m.hf) hf.insert(n);
  const std::set<std::string> expected = {
      "transformer.wte.weight", "transformer.wpe.weight",
      "transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias", "transformer.h.0.attn.c_attn.weight",
      "transformer.h.0.attn.c_attn.bias", "transformer.h.0.attn.c_proj.weight", "transformer.h.0.attn.c_proj.bias",
      "transformer.h.0.ln_2.weight", "transformer.h.0.ln_2.bias", "transformer.h.0.mlp.c_fc.weight",
      "transformer.h.0.mlp.c_fc.bias", "transformer.h.0.mlp.c_proj.weight", "transformer.h.0.mlp.c_proj.bias",
      "transformer.h.1.ln_1.weight", "transformer.h.1.ln_1.bias", "transformer.h.1.attn.c_attn.weight",
      "transformer.h.1.attn.c_attn.bias", "transformer.h.1.attn.c_proj.weight", "transformer.h.1.attn.c_proj.bias",
      "transformer.h.1.ln_2.weight", "transformer.h.1.ln_2.bias", "transformer.h.1.mlp.c_fc.weight",
      "transformer.h.1.mlp.c_fc.bias", "transformer.h.1.mlp.c_proj.weight", "transformer.h.1.mlp.c_proj.bias",
      "transformer.ln_f.weight", "transformer.ln_f.bias"};
  CHECK(hf == expected);  // tied: no lm_head.weight
  const auto& qkv = find(ms, "decoder.layers.1.self_attention.linear_qkv.weight");
  CHECK(qkv.our_shape == std::vector<int64_t>{24, 8});
  CHECK(qkv.hf_shapes[0] == std::vector<int64_t>{8, 24});  // Conv1D [in, out]
  CHECK(find(ms, "decoder.layers.0.mlp.linear_fc1.weight").hf_shapes[0] == std::vector<int64_t>{8, 32});
  CHECK(find(ms, "decoder.layers.0.mlp.linear_fc2.weight").hf_shapes[0] == std::vector<int64_t>{32, 8});
  CHECK(find(ms, "embedding.word_embeddings.weight").hf_shapes[0] == std::vector<int64_t>{11, 8});
  CHECK(find(ms, "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight").hf[0] == "transformer.h.0.ln_1.weight");
  CHECK(find(ms, "decoder.layers.0.mlp.linear_fc1.layer_norm_bias").hf[0] == "transformer.h.0.ln_2.bias");

  HfModelSpec untied = s;
  untied.untie_embeddings_and_output_weights = true;
  CHECK(hf_tensor_mappings(untied).back().hf[0] == "lm_head.weight");
}

TEST_CASE("Llama names and shapes (GQA, untied)", "[checkpoint][hf]") {
  const auto ms = hf_tensor_mappings(llama_spec());
  std::vector<std::string> hf;
  for (const auto& m : ms)
    for (const auto& n : m.hf) hf.push_back(n);
  const std::vector<std::string> layer0 = {
      "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight",
      "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
      "model.layers.0.self_attn.o_proj.weight", "model.layers.0.post_attention_layernorm.weight",
      "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"};
  REQUIRE(hf.size() == 1 + 2 * layer0.size() + 2);
  CHECK(hf.front() == "model.embed_tokens.weight");
  CHECK(std::vector<std::string>(hf.begin() + 1, hf.begin() + 10) == layer0);
  CHECK(hf[hf.size() - 2] == "model.norm.weight");
  CHECK(hf.back() == "lm_head.weight");
  const auto& qkv = find(ms, "decoder.layers.0.self_attention.linear_qkv.weight");
  CHECK(qkv.our_shape == std::vector<int64_t>{(4 + 2 * 2) * 4, 8});
  CHECK(qkv.hf_shapes == std::vector<std::vector<int64_t>>{{16, 8}, {8, 8}, {8, 8}});
  CHECK(find(ms, "decoder.layers.0.mlp.linear_fc1.weight").our_shape == std::vector<int64_t>{24, 8});
  CHECK(find(ms, "decoder.layers.0.self_attention.linear_proj.weight").hf_shapes[0] == std::vector<int64_t>{8, 16});
}

TEST_CASE("QKV regrouping on a hand-built example", "[checkpoint][hf]") {
  // 4 query heads in 2 groups, head_dim 2, one column (a bias). Fused rows per group:
  // [q(2 heads x 2); k (2); v (2)]. Values: q head h dim j = 100+10h+j, k/v group g = 200/300+10g+j.
  const std::vector<float> fused = {100, 101, 110, 111, 200, 201, 300, 301,   // group 0
                                    120, 121, 130, 131, 210, 211, 310, 311};  // group 1
  std::vector<float> q(8), k(4), v(4);
  split_qkv_rows(fused.data(), 4, 4, 2, 2, 1, q.data(), k.data(), v.data());
  CHECK(q == std::vector<float>{100, 101, 110, 111, 120, 121, 130, 131});
  CHECK(k == std::vector<float>{200, 201, 210, 211});
  CHECK(v == std::vector<float>{300, 301, 310, 311});
  std::vector<float> back(16);
  merge_qkv_rows(q.data(), k.data(), v.data(), 4, 4, 2, 2, 1, back.data());
  CHECK(back == fused);
  // HF's repeat_kv pairs query head h with kv head h / (heads/groups): heads 0,1 -> kv 0, 2,3 -> kv 1,
  // which is exactly the group each query head sits in above.
}

TEST_CASE("GPT-2 c_attn computes the same q, k, v as our fused QKV", "[checkpoint][hf]") {
  // E = 8, 2 heads of 4. Our fused weight W [24, 8] rows [q_h0 k_h0 v_h0 q_h1 k_h1 v_h1] (groups =
  // heads); ours computes y = W x (+ b). HF computes y' = x @ c_attn.weight + c_attn.bias and splits
  // y' into [Q | K | V], heads contiguous inside each.
  const HfModelSpec s = gpt2_spec();
  const auto ms = hf_tensor_mappings(s);
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> dist(-8, 8);
  const HostArray W = f32_array({24, 8}, [&](int64_t) { return dist(rng) / 4.0f; });
  const HostArray b = f32_array({24}, [&](int64_t) { return dist(rng) / 4.0f; });
  const auto cw = export_hf_tensor(find(ms, "decoder.layers.0.self_attention.linear_qkv.weight"), s, W);
  const auto cb = export_hf_tensor(find(ms, "decoder.layers.0.self_attention.linear_qkv.bias"), s, b);
  REQUIRE(cw[0].shape == std::vector<int64_t>{8, 24});
  std::vector<float> x(8);
  for (auto& xi : x) xi = dist(rng) / 2.0f;
  for (int type = 0; type < 3; ++type)      // q, k, v
    for (int h = 0; h < 2; ++h)              // head
      for (int j = 0; j < 4; ++j) {          // dim within head
        const int our_row = h * 12 + type * 4 + j;
        const int hf_col = type * 8 + h * 4 + j;
        double ours = b.ptr<float>()[our_row], theirs = cb[0].ptr<float>()[hf_col];
        for (int i = 0; i < 8; ++i) {
          ours += W.ptr<float>()[our_row * 8 + i] * x[i];
          theirs += x[i] * cw[0].ptr<float>()[i * 24 + hf_col];
        }
        CHECK(ours == theirs);
      }
}

TEST_CASE("transposes, vocabulary rows, layernorm-1p and fc1 split", "[checkpoint][hf]") {
  HfModelSpec s = gpt2_spec();
  s.apply_layernorm_1p = true;
  const auto ms = hf_tensor_mappings(s);
  // c_proj: ours [out=8, in=8] -> HF [in, out]
  const HostArray proj = f32_array({8, 8}, [](int64_t i) { return static_cast<float>(i); });
  const auto cp = export_hf_tensor(find(ms, "decoder.layers.0.self_attention.linear_proj.weight"), s, proj);
  CHECK(cp[0].ptr<float>()[1 * 8 + 2] == proj.ptr<float>()[2 * 8 + 1]);
  // word embeddings: 16 padded rows -> 11; import pads by repeating row 10
  const HostArray emb = f32_array({16, 8}, [](int64_t i) { return static_cast<float>(i / 8); });
  const auto& em = find(ms, "embedding.word_embeddings.weight");
  const auto hf_emb = export_hf_tensor(em, s, emb);
  REQUIRE(hf_emb[0].shape == std::vector<int64_t>{11, 8});
  CHECK(hf_emb[0].ptr<float>()[10 * 8] == 10.0f);
  const HostArray back = import_hf_tensor(em, s, hf_emb);
  for (int r = 0; r < 16; ++r) CHECK(back.ptr<float>()[r * 8 + 3] == static_cast<float>(std::min(r, 10)));
  // layernorm-1p: stored gamma - 1, HF gamma
  const HostArray g = f32_array({8}, [](int64_t i) { return 0.125f * static_cast<float>(i) - 0.5f; });
  const auto& ln = find(ms, "decoder.final_layernorm.weight");
  CHECK(ln.transform == HfTransform::norm_1p);
  const auto hg = export_hf_tensor(ln, s, g);
  CHECK(hg[0].ptr<float>()[0] == 0.5f);
  CHECK(import_hf_tensor(ln, s, hg).bytes == g.bytes);
  CHECK(find(ms, "decoder.final_layernorm.bias").transform == HfTransform::copy);

  // SwiGLU fc1 [gate; up]
  const HfModelSpec ls = llama_spec();
  const auto lms = hf_tensor_mappings(ls);
  const HostArray fc1 = f32_array({24, 8}, [](int64_t i) { return static_cast<float>(i / 8); });
  const auto gu = export_hf_tensor(find(lms, "decoder.layers.1.mlp.linear_fc1.weight"), ls, fc1);
  CHECK(gu[0].ptr<float>()[0] == 0.0f);
  CHECK(gu[0].ptr<float>()[11 * 8] == 11.0f);
  CHECK(gu[1].ptr<float>()[0] == 12.0f);
  CHECK(gu[1].ptr<float>()[11 * 8 + 7] == 23.0f);
}

TEST_CASE("interleaved RoPE export permutes q/k into rotate-half order", "[checkpoint][hf]") {
  // One head of dim 4: interleaved rows (a0, b0, a1, b1) -> rotate-half rows (a0, a1, b0, b1).
  const std::vector<float> inter = {10, 11, 20, 21};
  std::vector<float> half(4), back(4);
  permute_rope_rows(inter.data(), 4, 1, 4, 1, half.data(), true);
  CHECK(half == std::vector<float>{10, 20, 11, 21});
  permute_rope_rows(half.data(), 4, 1, 4, 1, back.data(), false);
  CHECK(back == inter);

  // The math: RoPE applied to q = W x with interleaved pairs (2j, 2j+1) equals rotate-half RoPE
  // (pairs (j, j+d/2), HF's rotate_half) applied to q' = P W x, up to the same permutation P.
  const int d = 8;
  std::mt19937 rng(3);
  std::normal_distribution<double> nd;
  std::vector<double> q(d);
  for (auto& v : q) v = nd(rng);
  const double pos = 5, base = 10000;
  auto theta = [&](int j) { return pos * std::pow(base, -2.0 * j / d); };
  std::vector<double> rot_inter(d), qh(d), rot_half(d);
  for (int j = 0; j < d / 2; ++j) {
    const double c = std::cos(theta(j)), s = std::sin(theta(j));
    rot_inter[2 * j] = q[2 * j] * c - q[2 * j + 1] * s;
    rot_inter[2 * j + 1] = q[2 * j + 1] * c + q[2 * j] * s;
  }
  permute_rope_rows(q.data(), 8, 1, d, 1, qh.data(), true);
  for (int j = 0; j < d / 2; ++j) {  // x*cos + rotate_half(x)*sin with cos/sin = cat(freqs, freqs)
    const double c = std::cos(theta(j)), s = std::sin(theta(j));
    rot_half[j] = qh[j] * c - qh[j + d / 2] * s;
    rot_half[j + d / 2] = qh[j + d / 2] * c + qh[j] * s;
  }
  std::vector<double> expect(d);
  permute_rope_rows(rot_inter.data(), 8, 1, d, 1, expect.data(), true);
  for (int i = 0; i < d; ++i) CHECK(rot_half[i] == Approx(expect[i]).epsilon(1e-12));
}

TEST_CASE("export then import is the identity for every tensor", "[checkpoint][hf]") {
  std::vector<HfModelSpec> specs;
  specs.push_back(gpt2_spec());
  HfModelSpec g = gpt2_spec();
  g.untie_embeddings_and_output_weights = true;
  g.apply_layernorm_1p = true;
  specs.push_back(g);
  specs.push_back(llama_spec());
  HfModelSpec l = llama_spec();
  l.add_bias_linear = true;
  l.rotary_interleaved = true;
  l.apply_layernorm_1p = true;
  l.untie_embeddings_and_output_weights = false;
  specs.push_back(l);
  HfModelSpec mha = llama_spec();
  mha.num_query_groups = 4;
  specs.push_back(mha);

  std::mt19937 rng(11);
  std::uniform_int_distribution<int> dist(-64, 64);
  for (const HfModelSpec& s : specs) {
    size_t count = 0;
    for (const auto& m : hf_tensor_mappings(s)) {
      HostArray ours = f32_array(m.our_shape, [&](int64_t) { return dist(rng) / 16.0f; });
      if (m.transform == HfTransform::vocab_rows) {  // padding rows come back as copies of the last real row
        const int64_t cols = m.our_shape[1];
        for (int64_t r = s.vocab_size; r < s.padded_vocab_size; ++r)
          std::memcpy(ours.ptr<float>() + r * cols, ours.ptr<float>() + (s.vocab_size - 1) * cols, cols * 4);
      }
      const auto hf = export_hf_tensor(m, s, ours);
      REQUIRE(hf.size() == m.hf.size());
      for (size_t i = 0; i < hf.size(); ++i) CHECK(hf[i].shape == m.hf_shapes[i]);
      const HostArray back = import_hf_tensor(m, s, hf);
      INFO(m.ours);
      CHECK(back.shape == m.our_shape);
      CHECK(back.bytes == ours.bytes);
      ++count;
    }
    CHECK(count > 10);
  }
}

TEST_CASE("HF config.json fields and the spec they describe", "[checkpoint][hf]") {
  const HfModelSpec g = gpt2_spec();
  const auto c = hf_config_json(g);
  CHECK(c["architectures"][0] == "GPT2LMHeadModel");
  CHECK(c["model_type"] == "gpt2");
  CHECK(c["n_embd"] == 8);
  CHECK(c["n_layer"] == 2);
  CHECK(c["n_head"] == 2);
  CHECK(c["n_positions"] == 6);
  CHECK(c["vocab_size"] == 11);
  CHECK(c["n_inner"].is_null());  // ffn == 4 * hidden: HF's default
  CHECK(c["activation_function"] == "gelu_new");
  CHECK(c["tie_word_embeddings"] == true);
  CHECK(c["eos_token_id"] == 10);
  const HfModelSpec g2 = hf_spec_from_config(c, 8, 1);
  CHECK(g2.hidden_size == 8);
  CHECK(g2.ffn_hidden_size == 32);
  CHECK(g2.padded_vocab_size == 16);
  CHECK(!g2.untie_embeddings_and_output_weights);

  HfModelSpec l = llama_spec();
  l.use_rope_scaling = true;
  const auto lc = hf_config_json(l);
  CHECK(lc["architectures"][0] == "LlamaForCausalLM");
  CHECK(lc["num_key_value_heads"] == 2);
  CHECK(lc["head_dim"] == 4);
  CHECK(lc["intermediate_size"] == 12);
  CHECK(lc["rope_theta"] == 500000.0);
  CHECK(lc["rms_norm_eps"] == 1e-5);
  CHECK(lc["hidden_act"] == "silu");
  CHECK(lc["attention_bias"] == false);
  CHECK(lc["tie_word_embeddings"] == false);
  CHECK(lc["rope_scaling"]["rope_type"] == "llama3");
  CHECK(lc["rope_scaling"]["factor"] == 8.0);
  const HfModelSpec l2 = hf_spec_from_config(lc, 128, 2);
  CHECK(l2.num_query_groups == 2);
  CHECK(l2.use_rope_scaling);
  CHECK(l2.padded_vocab_size == 256);
  CHECK(l2.untie_embeddings_and_output_weights);

  // GPT-2's published vocabulary pads to 50304 with Megatron's default 128.
  nlohmann::json gpt2 = {{"model_type", "gpt2"}, {"n_embd", 768}, {"n_layer", 12}, {"n_head", 12},
                         {"n_positions", 1024},  {"vocab_size", 50257}, {"n_inner", nullptr}};
  const HfModelSpec real = hf_spec_from_config(gpt2);
  CHECK(real.padded_vocab_size == 50304);
  CHECK(real.ffn_hidden_size == 3072);
  CHECK(real.head_dim == 64);
}

TEST_CASE("models HF cannot express are refused naming the flag", "[checkpoint][hf]") {
  HfModelSpec g = gpt2_spec();
  g.swiglu = true;
  CHECK_THROWS_AS(hf_tensor_mappings(g), Unsupported);
  CHECK_THROWS_WITH(hf_tensor_mappings(g), Catch::Contains("--swiglu"));
  HfModelSpec l = llama_spec();
  l.rotary_percent = 0.5;
  CHECK_THROWS_WITH(hf_tensor_mappings(l), Catch::Contains("--rotary-percent"));
  l = llama_spec();
  l.qk_layernorm = true;
  CHECK_THROWS_WITH(hf_config_json(l), Catch::Contains("--qk-layernorm"));
  l = llama_spec();
  l.qk_l2_norm = true;
  CHECK_THROWS_WITH(hf_config_json(l), Catch::Contains("--qk-l2-norm"));
  l = llama_spec();
  l.nope_layers = true;  // --no-rope-freq
  CHECK_THROWS_WITH(hf_config_json(l), Catch::Contains("--no-rope-freq"));
  l = llama_spec();
  l.attention_sinks = true;  // --softmax-type learnable / off-by-one
  CHECK_THROWS_WITH(hf_config_json(l), Catch::Contains("--softmax-type"));
  nlohmann::json bad = {{"model_type", "falcon"}};
  CHECK_THROWS_WITH(hf_spec_from_config(bad), Catch::Contains("falcon"));
  // Llama with q/k/v biases only is Qwen2, not Llama (whose attention_bias covers o_proj too).
  l = llama_spec();
  l.add_qkv_bias = true;
  CHECK_THROWS_WITH(hf_tensor_mappings(l), Catch::Contains("Qwen2ForCausalLM has q/k/v biases only"));
  l.arch = HfArchitecture::qwen2;
  l.add_bias_linear = true;
  CHECK_THROWS_WITH(hf_tensor_mappings(l), Catch::Contains("cannot express this model as Qwen2ForCausalLM"));
}

TEST_CASE("Qwen2 and Mistral configs: q/k/v biases, sliding windows", "[checkpoint][hf]") {
  HfModelSpec q = llama_spec();
  q.arch = HfArchitecture::qwen2;
  q.add_qkv_bias = true;
  const auto qc = hf_config_json(q);
  CHECK(qc["architectures"][0] == "Qwen2ForCausalLM");
  CHECK(qc["model_type"] == "qwen2");
  CHECK(qc["use_sliding_window"] == false);
  CHECK(!qc.contains("attention_bias"));
  const HfModelSpec q2 = hf_spec_from_config(qc, 128, 1);
  CHECK(q2.arch == HfArchitecture::qwen2);
  CHECK(q2.add_qkv_bias);
  CHECK(!q2.add_bias_linear);
  // q/k/v biases map to the fused QKV bias; o_proj and the MLP have none.
  std::set<std::string> hf_names;
  for (const HfTensorMapping& m : hf_tensor_mappings(q2))
    for (const std::string& n : m.hf) hf_names.insert(n);
  CHECK(hf_names.count("model.layers.1.self_attn.k_proj.bias") == 1);
  CHECK(hf_names.count("model.layers.1.self_attn.o_proj.bias") == 0);
  CHECK(hf_names.count("model.layers.1.mlp.up_proj.bias") == 0);
  // Qwen2's window: only with use_sliding_window, from max_window_layers on (or per layer_types).
  nlohmann::json windowed = qc;
  windowed["sliding_window"] = 4096;
  windowed.erase("layer_types");
  CHECK(!hf_spec_from_config(windowed).sliding_window);  // Qwen2-7B's config: a size, but switched off
  windowed["use_sliding_window"] = true;
  windowed["max_window_layers"] = 0;
  HfModelSpec w = hf_spec_from_config(windowed);
  CHECK(w.sliding_window == 4096);
  CHECK(w.window_layers.empty());  // every layer
  windowed["max_window_layers"] = 1;
  w = hf_spec_from_config(windowed);
  CHECK(w.window_layers == std::vector<int>{0, 1});
  windowed["layer_types"] = {"sliding_attention", "full_attention"};
  CHECK(hf_spec_from_config(windowed).window_layers == std::vector<int>{1, 0});  // layer_types wins
  windowed["layer_types"] = {"chunked_attention", "full_attention"};
  CHECK_THROWS_WITH(hf_spec_from_config(windowed), Catch::Contains("chunked_attention"));
  windowed["layer_types"] = {"sliding_attention", "sliding_attention"};
  // A null size: transformers attends fully on every layer; an absent one is its default 4096.
  windowed["sliding_window"] = nullptr;
  CHECK(!hf_spec_from_config(windowed).sliding_window);
  windowed.erase("sliding_window");
  CHECK(hf_spec_from_config(windowed).sliding_window == 4096);
  // Export writes the window back: the first max_window_layers layers attend fully.
  w.window_layers = {0, 1};
  const auto wc = hf_config_json(w);
  CHECK(wc["use_sliding_window"] == true);
  CHECK(wc["sliding_window"] == 4096);
  CHECK(wc["max_window_layers"] == 1);
  CHECK(wc["layer_types"] == nlohmann::json{"full_attention", "sliding_attention"});
  CHECK(hf_spec_from_config(wc).window_layers == std::vector<int>{0, 1});
  w.window_layers = {1, 0};  // a full layer after a windowed one: Qwen2 cannot say that
  CHECK_THROWS_WITH(hf_config_json(w), Catch::Contains("max_window_layers"));

  // transformers >= 5 writes rope_parameters instead of rope_theta / rope_scaling.
  nlohmann::json v5 = hf_config_json(llama_spec());
  v5.erase("rope_theta");
  v5["rope_scaling"] = nullptr;
  v5["rope_parameters"] = {{"rope_theta", 250000.0}, {"rope_type", "default"}};
  CHECK(hf_spec_from_config(v5, 128, 1).rotary_base == 250000.0);
  CHECK(!hf_spec_from_config(v5, 128, 1).use_rope_scaling);
  v5["rope_parameters"] = {{"rope_theta", 500000.0}, {"rope_type", "llama3"}, {"factor", 32.0}, {"low_freq_factor", 1.0},
                           {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  const HfModelSpec scaled = hf_spec_from_config(v5, 128, 1);
  CHECK(scaled.rotary_base == 500000.0);
  CHECK(scaled.use_rope_scaling);
  CHECK(scaled.rope_scaling_factor == 32.0);
  v5["rope_parameters"]["rope_type"] = "yarn";
  CHECK_THROWS_WITH(hf_spec_from_config(v5), Catch::Contains("rope_scaling"));

  // Mistral's config is Llama's with a sliding window on every layer: v0.1's 4096, v0.3's none.
  nlohmann::json mistral = hf_config_json(llama_spec());
  mistral["model_type"] = "mistral";
  mistral["sliding_window"] = nullptr;
  const HfModelSpec m = hf_spec_from_config(mistral, 128, 1);
  CHECK(m.arch == HfArchitecture::mistral);
  CHECK(!m.add_bias_linear);
  CHECK(!m.sliding_window);
  mistral["sliding_window"] = 4096;
  HfModelSpec mw = hf_spec_from_config(mistral);
  CHECK(mw.sliding_window == 4096);
  CHECK(mw.window_layers.empty());
  const auto mc = hf_config_json(mw);
  CHECK(mc["architectures"][0] == "MistralForCausalLM");
  CHECK(mc["model_type"] == "mistral");
  CHECK(mc["sliding_window"] == 4096);
  CHECK(!mc.contains("attention_bias"));
  mw.window_layers = {1, 0};
  CHECK_THROWS_WITH(hf_config_json(mw), Catch::Contains("one sliding window for every layer"));
  mistral["sliding_window"] = 0;
  CHECK_THROWS_WITH(hf_spec_from_config(mistral), Catch::Contains("sliding_window 0"));
  // Llama and GPT-2 have no window to write.
  HfModelSpec lw = llama_spec();
  lw.sliding_window = 8;
  CHECK_THROWS_WITH(hf_config_json(lw), Catch::Contains("MistralForCausalLM"));
}

TEST_CASE("export picks Mistral for a Llama-shaped model with a sliding window", "[checkpoint][hf]") {
  Config c = test::tiny_llama_config();
  CHECK(hf_architecture_of(c.model) == HfArchitecture::llama);
  c.model.window_size = std::make_pair(7, 0);
  CHECK(hf_architecture_of(c.model) == HfArchitecture::mistral);
  HfModelSpec s = HfModelSpec::from_model_config(c.model, HfArchitecture::mistral);
  CHECK(s.sliding_window == 8);
  CHECK(s.window_layers.empty());
  c.model.window_attn_skip_every = 2;  // layer 2 of 2 attends fully
  s = HfModelSpec::from_model_config(c.model, HfArchitecture::mistral);
  CHECK(s.window_layers == std::vector<int>{1, 0});
  c.model.window_size = std::make_pair(-1, 0);  // no window after all
  CHECK(hf_architecture_of(c.model) == HfArchitecture::llama);
  CHECK(!HfModelSpec::from_model_config(c.model, HfArchitecture::llama).sliding_window);
}

TEST_CASE("GPT-2 export names the GeLU form the model computes", "[checkpoint][hf]") {
  Config c = test::tiny_gpt_config();  // biases on: Megatron's fused bias-GeLU, the tanh form
  CHECK(HfModelSpec::from_model_config(c.model, HfArchitecture::gpt2).gelu_activation == "gelu_new");
  c.model.bias_gelu_fusion = false;  // --no-bias-gelu-fusion: exact GeLU
  CHECK(HfModelSpec::from_model_config(c.model, HfArchitecture::gpt2).gelu_activation == "gelu");
  c.model.openai_gelu = true;
  CHECK(HfModelSpec::from_model_config(c.model, HfArchitecture::gpt2).gelu_activation == "gelu_new");
}

namespace {

// A tiny DeepSeek-V3: MLA with a query LoRA, one dense layer then two MoE layers of 4 experts
// (top-2 of 2 groups, one group picked), a shared expert of twice the expert FFN, the expert bias.
HfModelSpec deepseek_spec() {
  HfModelSpec s = llama_spec();  // (RMSNorm, SwiGLU, no biases, untied; hidden 8, vocabulary 13 of 16)
  s.arch = HfArchitecture::deepseek_v3;
  s.num_layers = 3;
  s.num_attention_heads = s.num_query_groups = 2;
  s.q_lora_rank = 6;
  s.kv_lora_rank = 4;
  s.qk_nope_head_dim = 3;
  s.qk_rope_head_dim = 4;
  s.v_head_dim = 5;
  s.head_dim = 7;
  s.mla_latent_norms = true;
  s.rotary_base = 10000;
  s.norm_epsilon = 1e-6;
  s.first_dense_layers = 1;
  s.num_experts = 4;
  s.moe_topk = 2;
  s.moe_ffn_hidden_size = 3;
  s.router_groups = 2;
  s.router_group_topk = 1;
  s.shared_expert_ffn = 6;
  s.routed_scaling_factor = 2.5;
  s.expert_bias = true;
  s.rope_interleave = true;  // (Megatron's MLA rotates interleaved pairs)
  return s;
}

}  // namespace

TEST_CASE("DeepSeek-V3 names and shapes: MLA, a dense layer, MoE layers with shared experts", "[checkpoint][hf]") {
  const HfModelSpec s = deepseek_spec();
  const auto ms = hf_tensor_mappings(s);
  const auto& q_up = find(ms, "decoder.layers.0.self_attention.linear_q_up_proj.weight");
  CHECK(q_up.hf == std::vector<std::string>{"model.layers.0.self_attn.q_b_proj.weight"});
  CHECK(q_up.our_shape == std::vector<int64_t>{2 * 7, 6});
  CHECK(find(ms, "decoder.layers.0.self_attention.linear_kv_down_proj.weight").hf_shapes[0] ==
        std::vector<int64_t>{4 + 4, 8});
  CHECK(find(ms, "decoder.layers.0.self_attention.linear_kv_up_proj.weight").our_shape == std::vector<int64_t>{2 * 8, 4});
  CHECK(find(ms, "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight").hf[0] ==
        "model.layers.0.self_attn.q_a_layernorm.weight");
  CHECK(find(ms, "decoder.layers.0.self_attention.linear_proj.weight").our_shape == std::vector<int64_t>{8, 2 * 5});
  // Layer 0 dense (the fused pre-MLP norm), layers 1 and 2 MoE (a standalone one).
  CHECK(find(ms, "decoder.layers.0.mlp.linear_fc1.layer_norm_weight").hf[0] == "model.layers.0.post_attention_layernorm.weight");
  CHECK(find(ms, "decoder.layers.1.pre_mlp_layernorm.weight").hf[0] == "model.layers.1.post_attention_layernorm.weight");
  CHECK(find(ms, "decoder.layers.2.mlp.router.expert_bias").hf[0] == "model.layers.2.mlp.gate.e_score_correction_bias");
  const auto& fc1 = find(ms, "decoder.layers.1.mlp.experts.linear_fc1.weight");
  REQUIRE(fc1.hf.size() == 8);
  CHECK(fc1.hf[2] == "model.layers.1.mlp.experts.1.gate_proj.weight");
  CHECK(fc1.hf[3] == "model.layers.1.mlp.experts.1.up_proj.weight");
  CHECK(find(ms, "decoder.layers.1.mlp.shared_experts.linear_fc1.weight").hf[1] ==
        "model.layers.1.mlp.shared_experts.up_proj.weight");
  for (const auto& m : ms) CHECK(m.ours.find("decoder.layers.0.mlp.experts") == std::string::npos);

  // Without the expert bias the HF router's bias is zeros (no tensor of ours).
  HfModelSpec nb = deepseek_spec();
  nb.expert_bias = false;
  int zeros = 0;
  for (const auto& m : hf_tensor_mappings(nb))
    if (m.transform == HfTransform::zeros) {
      ++zeros;
      CHECK(m.ours.empty());
      CHECK(m.hf[0].ends_with("mlp.gate.e_score_correction_bias"));
    }
  CHECK(zeros == 2);

  // config.json and back.
  const auto c = hf_config_json(s);
  CHECK(c["model_type"] == "deepseek_v3");
  CHECK(c["first_k_dense_replace"] == 1);
  CHECK(c["n_shared_experts"] == 2);
  CHECK(c["n_group"] == 2);
  CHECK(c["topk_group"] == 1);
  CHECK(c["norm_topk_prob"] == true);
  CHECK(c["rope_interleave"] == true);
  CHECK(c["q_lora_rank"] == 6);
  const HfModelSpec back = hf_spec_from_config(c, 16, 1);
  CHECK(back.arch == HfArchitecture::deepseek_v3);
  CHECK(back.q_lora_rank == 6);
  CHECK(back.kv_lora_rank == 4);
  CHECK(back.qk_rope_head_dim == 4);
  CHECK(back.v_head_dim == 5);
  CHECK(back.first_dense_layers == 1);
  CHECK(back.num_experts == 4);
  CHECK(back.shared_expert_ffn == 6);
  CHECK(back.routed_scaling_factor == 2.5);
  CHECK(back.router_groups == 2);
  CHECK(back.router_group_topk == 1);
  CHECK(back.expert_bias);
  CHECK(back.rope_interleave);
  CHECK(back.padded_vocab_size == 16);
  // transformers' grouping (two best per group) agrees with Megatron's only at top-k = 2 x group top-k.
  auto bad = c;
  bad["topk_group"] = 2;
  CHECK_THROWS_AS(hf_spec_from_config(bad, 16, 1), Unsupported);
  bad = c;
  bad["norm_topk_prob"] = false;
  CHECK_THROWS_AS(hf_spec_from_config(bad, 16, 1), Unsupported);
}

TEST_CASE("DeepSeek-V3: export then import is the identity, and rotate-half HF RoPE rows are permuted", "[checkpoint][hf]") {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> dist(-64, 64);
  for (bool interleave : {false, true}) {
    HfModelSpec s = deepseek_spec();
    s.rope_interleave = interleave;
    for (const auto& m : hf_tensor_mappings(s)) {
      if (m.transform == HfTransform::zeros) continue;
      HostArray ours = f32_array(m.our_shape, [&](int64_t) { return dist(rng) / 16.0f; });
      if (m.transform == HfTransform::vocab_rows) {
        const int64_t cols = m.our_shape[1];
        for (int64_t r = s.vocab_size; r < s.padded_vocab_size; ++r)
          std::memcpy(ours.ptr<float>() + r * cols, ours.ptr<float>() + (s.vocab_size - 1) * cols, cols * 4);
      }
      INFO(m.ours << " interleave " << interleave);
      const HostArray back = import_hf_tensor(m, s, export_hf_tensor(m, s, ours));
      CHECK(back.bytes == ours.bytes);
    }
  }
  // Import from an HF model without rope_interleave (rotate-half pairs (j, j + 2)): each head's RoPE
  // rows (after its 3 nope rows) go to our interleaved pairs (2j, 2j+1); the nope rows stay.
  HfModelSpec s = deepseek_spec();
  s.rope_interleave = false;
  const auto ms = hf_tensor_mappings(s);
  const auto& q_up = find(ms, "decoder.layers.0.self_attention.linear_q_up_proj.weight");
  const HostArray hf = f32_array(q_up.hf_shapes[0], [](int64_t i) { return static_cast<float>(i / 6); });  // row index
  const HostArray ours = import_hf_tensor(q_up, s, {hf});
  std::vector<float> rows;
  for (int64_t r = 0; r < 14; ++r) rows.push_back(ours.ptr<float>()[r * 6]);
  CHECK(rows == std::vector<float>{0, 1, 2, 3, 5, 4, 6, 7, 8, 9, 10, 12, 11, 13});
  const auto& kv_down = find(ms, "decoder.layers.0.self_attention.linear_kv_down_proj.weight");
  const HostArray hkv = f32_array(kv_down.hf_shapes[0], [](int64_t i) { return static_cast<float>(i / 8); });
  const HostArray okv = import_hf_tensor(kv_down, s, {hkv});
  std::vector<float> kv_rows;
  for (int64_t r = 0; r < 8; ++r) kv_rows.push_back(okv.ptr<float>()[r * 8]);
  CHECK(kv_rows == std::vector<float>{0, 1, 2, 3, 4, 6, 5, 7});
}

TEST_CASE("DeepSeek-V3 export refuses what its HF model cannot express, naming the flag", "[checkpoint][hf]") {
  // A derived model configuration as a run saves it: MLA, one dense layer, two MoE layers.
  auto model = [] {
    ModelConfig m;
    m.num_layers = 3;
    m.hidden_size = 8;
    m.num_attention_heads = 2;
    m.query_groups = 2;
    m.head_dim = 7;
    m.ffn_size = 12;
    m.vocab_size = 13;
    m.padded_vocab_size = 16;
    m.max_position_embeddings = 32;
    m.position_embedding_type = PositionEmbedding::rope;
    m.normalization = Normalization::rmsnorm;
    m.swiglu = true;
    m.add_bias_linear = false;
    m.multi_latent_attention = true;
    m.q_lora_rank = 6;
    m.kv_lora_rank = 4;
    m.qk_head_dim = 3;
    m.qk_pos_emb_head_dim = 4;
    m.v_head_dim = 5;
    m.qk_layernorm = true;
    m.moe.num_experts = 4;
    m.moe.router_topk = 2;
    m.moe.expert_ffn = 3;
    m.moe.moe_layer = {0, 1, 1};
    m.moe.score_function = MoeScoreFunction::sigmoid;
    m.moe.router_enable_expert_bias = true;
    return m;
  };
  CHECK(hf_architecture_of(model()) == HfArchitecture::deepseek_v3);
  const HfModelSpec ok = HfModelSpec::from_model_config(model(), HfArchitecture::deepseek_v3);
  CHECK_NOTHROW(hf_tensor_mappings(ok));
  CHECK(ok.first_dense_layers == 1);
  CHECK(ok.routed_scaling_factor == 1.0);
  auto refused = [&](const std::function<void(ModelConfig&)>& change, const std::string& why) {
    ModelConfig m = model();
    change(m);
    const HfModelSpec s = HfModelSpec::from_model_config(m, HfArchitecture::deepseek_v3);
    CHECK_THROWS_WITH(hf_tensor_mappings(s), Catch::Contains("DeepseekV3ForCausalLM") && Catch::Contains(why));
  };
  refused([](ModelConfig& m) { m.moe.score_function = MoeScoreFunction::softmax; }, "--moe-router-score-function");
  refused([](ModelConfig& m) { m.moe.moe_layer = {1, 0, 1}; }, "dense layer after an MoE layer");
  refused([](ModelConfig& m) {
    m.moe.router_num_groups = 2;
    m.moe.router_group_topk = 2;
  }, "twice the group top-k");
  refused([](ModelConfig& m) {
    m.moe.shared_expert_intermediate_size = 4;
  }, "--moe-shared-expert-intermediate-size 4");
  refused([](ModelConfig& m) { m.qk_layernorm = false; }, "--qk-layernorm");
  refused([](ModelConfig& m) { m.moe.shared_expert_gate = true; m.moe.shared_expert_intermediate_size = 6; },
          "--moe-shared-expert-gate");
  refused([](ModelConfig& m) { m.moe.apply_probs_on_input = true; m.moe.router_topk = 1; },
          "--moe-apply-probs-on-input");
}

TEST_CASE("DeepSeek-V3 YaRN: rope_scaling as transformers reads it, and back", "[checkpoint][hf]") {
  HfModelSpec s = deepseek_spec();
  s.yarn = true;
  s.yarn_factor = 40;
  s.yarn_mscale = 1.0;
  s.yarn_mscale_all_dim = 1.0;
  auto c = hf_config_json(s);
  // factor x 4096 is whole: DeepSeek-V3's form (transformers then takes max / original as the factor).
  CHECK(c["max_position_embeddings"] == 40 * 4096);
  CHECK(c["rope_scaling"]["type"] == "yarn");
  CHECK(c["rope_scaling"]["factor"] == 40.0);
  CHECK(c["rope_scaling"]["original_max_position_embeddings"] == 4096);
  CHECK(c["rope_scaling"]["mscale_all_dim"] == 1.0);
  HfModelSpec back = hf_spec_from_config(c, 16, 1);
  CHECK(back.yarn);
  CHECK(back.yarn_factor == 40.0);
  CHECK(back.yarn_mscale == 1.0);
  CHECK(back.yarn_mscale_all_dim == 1.0);
  // A factor whose product with 4096 is not whole: no original in rope_scaling, the original
  // context as max_position_embeddings (transformers' fallback).
  s.yarn_factor = 2.5001;
  c = hf_config_json(s);
  CHECK(c["max_position_embeddings"] == 4096);
  CHECK_FALSE(c["rope_scaling"].contains("original_max_position_embeddings"));
  CHECK(hf_spec_from_config(c, 16, 1).yarn_factor == 2.5001);
  // What Megatron's MLA YaRN cannot take: another original context, factors that disagree,
  // mscale without mscale_all_dim, other betas.
  auto refused = [&](const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json bad = hf_config_json(deepseek_spec());
    bad["max_position_embeddings"] = 40 * 4096;
    bad["rope_scaling"] = {{"type", "yarn"}, {"factor", 40.0}, {"original_max_position_embeddings", 4096},
                           {"mscale", 1.0}, {"mscale_all_dim", 1.0}};
    CHECK_NOTHROW(hf_spec_from_config(bad, 16, 1));
    change(bad);
    CHECK_THROWS_AS(hf_spec_from_config(bad, 16, 1), Unsupported);
  };
  refused([](nlohmann::json& j) { j["rope_scaling"]["original_max_position_embeddings"] = 8192; j["max_position_embeddings"] = 40 * 8192; });
  refused([](nlohmann::json& j) { j["max_position_embeddings"] = 4096; });
  refused([](nlohmann::json& j) { j["rope_scaling"]["mscale_all_dim"] = 0.0; j["rope_scaling"]["mscale"] = 0.7; });
  refused([](nlohmann::json& j) { j["rope_scaling"]["beta_fast"] = 16; });
  refused([](nlohmann::json& j) { j["rope_scaling"]["type"] = "linear"; j["rope_scaling"]["rope_type"] = "linear"; });
}

TEST_CASE("DeepSeek-V3 MTP depths as model.layers.{L + j}, DeepSeek's checkpoint layout", "[checkpoint][hf]") {
  HfModelSpec s = deepseek_spec();  // 3 layers, the last two MoE, untied
  s.mtp_layers = 1;
  const auto ms = hf_tensor_mappings(s);
  auto hf_of = [&](const std::string& hf) -> const HfTensorMapping& {
    for (const auto& m : ms)
      for (const auto& n : m.hf)
        if (n == hf) return m;
    FAIL("no mapping to " << hf);
    throw std::logic_error("unreachable");
  };
  CHECK(hf_of("model.layers.3.embed_tokens.weight").ours == "embedding.word_embeddings.weight");
  CHECK(hf_of("model.layers.3.embed_tokens.weight").transform == HfTransform::vocab_rows_copy);
  CHECK(hf_of("model.layers.3.shared_head.head.weight").ours == "output_layer.weight");
  CHECK(hf_of("model.layers.3.enorm.weight").ours == "mtp.layers.0.enorm.weight");
  CHECK(hf_of("model.layers.3.hnorm.weight").ours == "mtp.layers.0.hnorm.weight");
  CHECK(hf_of("model.layers.3.eh_proj.weight").our_shape == std::vector<int64_t>{8, 16});
  CHECK(hf_of("model.layers.3.shared_head.norm.weight").ours == "mtp.layers.0.final_layernorm.weight");
  CHECK(hf_of("model.layers.3.self_attn.q_b_proj.weight").ours ==
        "mtp.layers.0.transformer_layer.self_attention.linear_q_up_proj.weight");
  // The depth's layer is an MoE layer like the last one; its expert bias is ours by global index.
  CHECK(hf_of("model.layers.3.mlp.gate.e_score_correction_bias").ours == "decoder.layers.3.mlp.router.expert_bias");
  CHECK(hf_of("model.layers.3.mlp.experts.2.up_proj.weight").ours ==
        "mtp.layers.0.transformer_layer.mlp.experts.linear_fc1.weight");
  // Tied: the head's copy is the embedding.
  HfModelSpec tied = s;
  tied.untie_embeddings_and_output_weights = false;
  for (const auto& m : hf_tensor_mappings(tied))
    if (m.hf[0] == "model.layers.3.shared_head.head.weight") CHECK(m.ours == "embedding.word_embeddings.weight");
  const auto c = hf_config_json(s);
  CHECK(c["num_nextn_predict_layers"] == 1);
  CHECK(hf_spec_from_config(c, 16, 1).mtp_layers == 1);
}

TEST_CASE("Qwen3-MoE and Qwen2-MoE config.json: MoE layers, norm_topk_prob and the shared expert, both ways", "[hf]") {
  HfModelSpec s = llama_spec();
  s.arch = HfArchitecture::qwen3_moe;
  s.qk_layernorm = true;
  s.num_layers = 3;
  s.num_experts = 4;
  s.moe_topk = 2;
  s.moe_ffn_hidden_size = 6;
  s.moe_layers = {0, 1, 1};
  s.router_aux_loss_coef = 0.01;
  nlohmann::json c = hf_config_json(s);
  CHECK(c["architectures"][0] == "Qwen3MoeForCausalLM");
  CHECK(c["model_type"] == "qwen3_moe");
  CHECK(c["mlp_only_layers"] == nlohmann::json::array({0}));
  CHECK(c["decoder_sparse_step"] == 1);
  CHECK(c["norm_topk_prob"] == true);
  CHECK(c["attention_bias"] == false);
  HfModelSpec b = hf_spec_from_config(c, 16, 1);
  CHECK(b.arch == HfArchitecture::qwen3_moe);
  CHECK(b.qk_layernorm);
  CHECK(b.moe_layers == s.moe_layers);
  CHECK(b.norm_topk_prob);
  CHECK(b.num_experts == 4);
  CHECK(b.moe_ffn_hidden_size == 6);
  CHECK(b.ffn_hidden_size == 12);
  CHECK(b.router_aux_loss_coef == 0.01);
  // transformers' rule: layer i is MoE unless in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0;
  // norm_topk_prob's default is false.
  c["decoder_sparse_step"] = 2;
  c["mlp_only_layers"] = nlohmann::json::array();
  c.erase("norm_topk_prob");
  b = hf_spec_from_config(c, 16, 1);
  CHECK(b.moe_layers == std::vector<int>{0, 1, 0});
  CHECK_FALSE(b.norm_topk_prob);
  c["decoder_sparse_step"] = 1;
  b = hf_spec_from_config(c, 16, 1);
  CHECK(b.moe_layers.empty());  // every layer MoE
  // The tensors of a dense layer, an MoE layer and the q/k norms.
  std::set<std::string> names;
  for (const HfTensorMapping& m : hf_tensor_mappings(s))
    for (const std::string& n : m.hf) names.insert(n);
  CHECK(names.count("model.layers.0.mlp.gate_proj.weight") == 1);
  CHECK(names.count("model.layers.0.mlp.gate.weight") == 0);
  CHECK(names.count("model.layers.1.mlp.gate.weight") == 1);
  CHECK(names.count("model.layers.2.mlp.experts.3.down_proj.weight") == 1);
  CHECK(names.count("model.layers.1.self_attn.q_norm.weight") == 1);
  CHECK(names.count("model.layers.1.self_attn.k_norm.weight") == 1);
  CHECK(names.count("model.layers.1.mlp.shared_expert_gate.weight") == 0);

  HfModelSpec q = llama_spec();
  q.arch = HfArchitecture::qwen2_moe;
  q.add_qkv_bias = true;
  q.num_experts = 4;
  q.moe_topk = 2;
  q.moe_ffn_hidden_size = 6;
  q.norm_topk_prob = false;
  q.shared_expert_ffn = 10;
  q.shared_expert_gate = true;
  nlohmann::json qc = hf_config_json(q);
  CHECK(qc["model_type"] == "qwen2_moe");
  CHECK(qc["shared_expert_intermediate_size"] == 10);
  CHECK(qc["norm_topk_prob"] == false);
  const HfModelSpec qb = hf_spec_from_config(qc, 16, 1);
  CHECK(qb.arch == HfArchitecture::qwen2_moe);
  CHECK(qb.add_qkv_bias);
  CHECK(qb.shared_expert_ffn == 10);
  CHECK(qb.shared_expert_gate);
  CHECK_FALSE(qb.norm_topk_prob);
  bool gate = false;
  for (const HfTensorMapping& m : hf_tensor_mappings(q))
    if (m.hf.at(0) == "model.layers.1.mlp.shared_expert_gate.weight") {
      gate = true;
      CHECK(m.ours == "decoder.layers.1.mlp.shared_experts.gate_weight");
      CHECK(m.hf_shapes.at(0) == std::vector<int64_t>{1, 8});
    }
  CHECK(gate);
  qc["shared_expert_intermediate_size"] = 0;
  CHECK_THROWS_AS(hf_spec_from_config(qc, 16, 1), Unsupported);
  // A Qwen2-MoE spec without the gate, or a Qwen3 one without q/k norms, is refused.
  q.shared_expert_gate = false;
  CHECK_THROWS_AS(q.validate(), Unsupported);
  s.qk_layernorm = false;
  CHECK_THROWS_AS(s.validate(), Unsupported);
}

TEST_CASE("Qwen3-Next's row orders: q_proj per head [q | gate], in_proj_qkvz / in_proj_ba per key head, the "
          "convolution's channels all q, all k, all v", "[hf]") {
  HfModelSpec s = llama_spec();  // hidden 8, 4 heads of 4 in 2 query groups
  s.arch = HfArchitecture::qwen3_next;
  s.qk_layernorm = true;
  s.apply_layernorm_1p = true;
  s.attention_output_gate = true;
  s.gdn_layers = {1, 0};
  s.gdn_key_heads = 2;
  s.gdn_value_heads = 4;  // two per key head
  s.gdn_dk = 3;
  s.gdn_dv = 2;
  s.gdn_conv = 4;
  s.num_experts = 0;
  const auto ms = hf_tensor_mappings(s);
  // Each of our rows holds its row index: where it lands names the layout.
  auto row_ids = [](const HfTensorMapping& m) {
    const int64_t cols = m.our_shape.size() == 2 ? m.our_shape[1] : 1;
    return f32_array(m.our_shape, [cols](int64_t i) { return static_cast<float>(i / cols); });
  };
  auto hf_row = [](const HostArray& a, int64_t r) {
    const int64_t cols = a.numel() / a.shape[0];
    return static_cast<int64_t>(a.ptr<float>()[r * cols]);
  };
  {  // ours per group [q (2 heads) | gate (2 heads) | k | v], heads of 4
    const HfTensorMapping& m = find(ms, "decoder.layers.1.self_attention.linear_qkv.weight");
    CHECK(m.transform == HfTransform::qkvg_split);
    const auto out = export_hf_tensor(m, s, row_ids(m));
    // q_proj head 1 (group 0's second): its q rows are ours 4-7, its gate rows ours 12-15.
    CHECK(hf_row(out[0], 8) == 4);
    CHECK(hf_row(out[0], 12) == 12);
    // head 2 (group 1's first): q from ours 24, gate from ours 32; k_proj / v_proj of group 1.
    CHECK(hf_row(out[0], 16) == 24);
    CHECK(hf_row(out[0], 20) == 32);
    CHECK(hf_row(out[1], 4) == 40);
    CHECK(hf_row(out[2], 4) == 44);
    CHECK(import_hf_tensor(m, s, out).bytes == row_ids(m).bytes);
  }
  {  // ours per key head [q 3 | k 3 | v 2x2 | z 2x2 | beta 2 | alpha 2] = 18 rows
    const HfTensorMapping& m = find(ms, "decoder.layers.0.self_attention.in_proj.weight");
    CHECK(m.hf == std::vector<std::string>{"model.layers.0.linear_attn.in_proj_qkvz.weight",
                                           "model.layers.0.linear_attn.in_proj_ba.weight"});
    const auto out = export_hf_tensor(m, s, row_ids(m));
    CHECK(out[0].shape == std::vector<int64_t>{28, 8});
    CHECK(hf_row(out[0], 13) == 13);  // key head 0's last z row
    CHECK(hf_row(out[0], 14) == 18);  // key head 1's first q row
    CHECK(hf_row(out[1], 0) == 14);   // key head 0's beta
    CHECK(hf_row(out[1], 3) == 17);   // key head 0's second alpha
    CHECK(hf_row(out[1], 4) == 32);   // key head 1's first beta
    CHECK(import_hf_tensor(m, s, out).bytes == row_ids(m).bytes);
  }
  {  // ours per key head [q 3 | k 3 | v 4]; HF [q 0 | q 1 | k 0 | k 1 | v 0 | v 1], Conv1d [C, 1, K]
    const HfTensorMapping& m = find(ms, "decoder.layers.0.self_attention.conv1d.weight");
    const auto out = export_hf_tensor(m, s, row_ids(m));
    CHECK(out[0].shape == std::vector<int64_t>{20, 1, 4});
    CHECK(hf_row(out[0], 3) == 10);   // key head 1's first q channel
    CHECK(hf_row(out[0], 6) == 3);    // key head 0's first k channel
    CHECK(hf_row(out[0], 12) == 6);   // key head 0's first v channel
    CHECK(hf_row(out[0], 16) == 16);  // key head 1's first v channel
    CHECK(import_hf_tensor(m, s, out).bytes == row_ids(m).bytes);
  }
  // The gated output norm: HF's weight plain, ours zero-centred; the others copied as they are.
  CHECK(find(ms, "decoder.layers.0.self_attention.out_norm.weight").transform == HfTransform::norm_1p);
  CHECK(find(ms, "decoder.layers.1.self_attention.q_layernorm.weight").transform == HfTransform::copy);
  CHECK(find(ms, "decoder.final_layernorm.weight").transform == HfTransform::copy);
  // The gated attention and zero-centred norms are required.
  s.attention_output_gate = false;
  CHECK_THROWS_AS(s.validate(), Unsupported);
  s.attention_output_gate = true;
  s.apply_layernorm_1p = false;
  CHECK_THROWS_AS(s.validate(), Unsupported);
}

TEST_CASE("the settings a Hugging Face spec and ModelConfig share go both ways", "[checkpoint][hf]") {
  // Every setting for_each_hf_model_setting lists, set to a value of its own (not its default),
  // comes back the same through HfModelSpec::from_model_config and model_config_from_hf.
  ModelConfig m;
  double next = 2;
  int listed = 0;
  for_each_hf_model_setting([&](auto, auto field) {
    using T = std::remove_reference_t<decltype(m.*field)>;
    if constexpr (std::is_same_v<T, bool>) m.*field = !(m.*field);
    else if constexpr (std::is_integral_v<T>) m.*field = static_cast<T>(next * 8);
    else m.*field = static_cast<T>(next / 64);
    next += 1;
    ++listed;
  });
  CHECK(listed >= 20);
  const HfModelSpec s = HfModelSpec::from_model_config(m, HfArchitecture::llama);
  for_each_hf_model_setting([&](auto ours, auto theirs) { CHECK(s.*ours == m.*theirs); });
  const ModelConfig back = model_config_from_hf(s, 128);
  for_each_hf_model_setting([&](auto, auto field) { CHECK(back.*field == m.*field); });
}

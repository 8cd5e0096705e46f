// export-hf / import-hf / forward-logits through the binary: the exported model's logits computed
// by an independent numpy implementation (tests/hf/numpy_forward.py) match megatrain's, export
// then import gives back the same parameters, and the flags import-hf prints train from the import.
// (tests/hf/check_hf_logits.py does the same against transformers where torch is installed.)
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <cstring>
#include <set>
#include <sstream>

#include "checkpoint/checkpoint_io.h"
#include "checkpoint/file_io.h"
#include "ckpt_test_util.h"
#include "tests/skip.h"

using mt_test::read_bytes;
using mt_test::run_command;
using mt_test::TempDir;
namespace fs = std::filesystem;

namespace {

const std::string kCommon =
    "--device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 100 --seq-length 16 "
    "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --eval-iters 0 "
    "--init-method-std 0.1";  // larger weights: logits of a few units, a sensitive comparison
const std::string kGpt = kCommon + " --num-layers 2 --hidden-size 32 --num-attention-heads 4";
const std::string kGptTanh = kGpt + " --openai-gelu";
const std::string kGptErf = kGpt + " --no-bias-gelu-fusion";  // exact GeLU (kGpt: fused bias-GeLU, tanh)
const std::string kLlama = kCommon +
                           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --normalization RMSNorm --swiglu "
                           "--ffn-hidden-size 48 --position-embedding-type rope --group-query-attention "
                           "--num-query-groups 2 --untie-embeddings-and-output-weights --disable-bias-linear "
                           "--norm-epsilon 1e-6 --rotary-base 500000";
// Qwen2: the Llama shape with biases on q/k/v only.
const std::string kQwen2 = kLlama + " --add-qkv-bias";
// Sliding windows shorter than kTokens: Mistral (every layer; HF sliding_window 4) and Qwen2 (its
// second layer only; HF max_window_layers 1).
const std::string kMistralWindow = kLlama + " --window-size 3,0";
const std::string kQwen2Window = kQwen2 + " --window-size 2,0 --window-attn-skip-freq '[0,1]'";
// Nemotron-4's shape (NemotronForCausalLM): LayerNorm1P, squared ReLU, RoPE over half of each head;
// without biases, and with them (Megatron's bias-activation fusion off, as squared ReLU needs).
const std::string kNemotron = kCommon +
                              " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --squared-relu "
                              "--apply-layernorm-1p --ffn-hidden-size 48 --position-embedding-type rope "
                              "--rotary-percent 0.5 --group-query-attention --num-query-groups 2 "
                              "--untie-embeddings-and-output-weights --disable-bias-linear";
const std::string kNemotronBias = kCommon +
                                  " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --squared-relu "
                                  "--apply-layernorm-1p --ffn-hidden-size 48 --position-embedding-type rope "
                                  "--rotary-percent 0.5 --no-bias-gelu-fusion";
// Mixtral: the Llama shape with every MLP a mixture of 4 SwiGLU experts, top-2 softmax routing.
const std::string kMixtral = kLlama + " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24 "
                                      "--moe-aux-loss-coeff 0.01 --moe-grouped-gemm";
// Qwen3: the Llama shape with an RMSNorm over each head's q and k, heads of 10 (not hidden / heads).
const std::string kQwen3 = kLlama + " --qk-layernorm --kv-channels 10";
// Qwen3-MoE: Qwen3's attention, a dense first layer (mlp_only_layers [0]) and an MoE layer of 4
// experts, top-2 renormalized (norm_topk_prob). Qwen2-MoE: Qwen2's attention, every layer MoE with
// top-2 of the softmax over all experts (--moe-router-pre-softmax: norm_topk_prob false) and a
// shared expert behind its sigmoid gate.
const std::string kQwen3Moe = kQwen3 + " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24 "
                                       "--moe-layer-freq '[0,1]' --moe-aux-loss-coeff 0.01 --moe-grouped-gemm";
const std::string kQwen2Moe = kQwen2 + " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24 "
                                       "--moe-router-pre-softmax --moe-shared-expert-intermediate-size 16 "
                                       "--moe-shared-expert-gate --moe-grouped-gemm";
// Qwen3-Next: three Gated DeltaNet layers (2 key heads of 6, 4 value heads of 5) and a gated
// softmax-attention layer (3 heads of 10, one KV head, q/k norms, RoPE over 4 of 10 dims),
// zero-centred norms; MoE layers of 5 experts top-2 with a gated shared expert, layer 2 dense.
const std::string kQwen3Next = kCommon +
                               " --num-layers 4 --hidden-size 24 --num-attention-heads 3 --normalization RMSNorm "
                               "--swiglu --ffn-hidden-size 40 --position-embedding-type rope --group-query-attention "
                               "--num-query-groups 1 --kv-channels 10 --untie-embeddings-and-output-weights "
                               "--disable-bias-linear --norm-epsilon 1e-6 --apply-layernorm-1p --qk-layernorm "
                               "--attention-output-gate --rotary-percent 0.4 --experimental-attention-variant "
                               "gated_delta_net --linear-attention-freq 4 --linear-num-key-heads 2 "
                               "--linear-num-value-heads 4 --linear-key-head-dim 6 --linear-value-head-dim 5 "
                               "--num-experts 5 --moe-router-topk 2 --moe-ffn-hidden-size 12 --moe-layer-freq '[1,0,1,1]' "
                               "--moe-shared-expert-intermediate-size 8 --moe-shared-expert-gate --moe-grouped-gemm";
// DeepSeek-V3: multi-latent attention (a query LoRA, both latent norms, plain RoPE), a dense layer,
// then an MoE layer of 4 experts with sigmoid routing over 2 groups, the expert bias, a scaling
// factor and a shared expert of two experts' size; one MTP depth (DeepSeek's model.layers.{L} layout).
const std::string kDeepseek = kCommon +
                              " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --normalization RMSNorm "
                              "--swiglu --ffn-hidden-size 48 --position-embedding-type rope "
                              "--untie-embeddings-and-output-weights --disable-bias-linear --norm-epsilon 1e-6 "
                              "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 "
                              "--qk-pos-emb-head-dim 4 --v-head-dim 6 --qk-layernorm --rope-type rope --no-rope-fusion "
                              "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 16 --moe-layer-freq '[0,1]' "
                              "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                              "--moe-router-bias-update-rate 0.01 --moe-router-topk-scaling-factor 2.5 "
                              "--moe-router-num-groups 2 --moe-router-group-topk 1 "
                              "--moe-shared-expert-intermediate-size 32 --moe-grouped-gemm --mtp-num-layers 1";
const std::string kTokens = "5,17,42,99,0,63,8,21,77,3";

std::string megatrain_ok(const std::string& args) {
  std::string out;
  const int code = run_command(std::string(MEGATRAIN_BINARY) + " " + args, &out);
  INFO("megatrain " << args << "\n" << out);
  REQUIRE(code == 0);
  return out;
}

std::vector<float> read_npy_f32(const std::string& path, int64_t* rows, int64_t* cols) {
  const std::string b = read_bytes(path);
  REQUIRE(b.size() > 10);
  REQUIRE(b.compare(0, 6, "\x93NUMPY") == 0);
  const size_t hlen = static_cast<unsigned char>(b[8]) | (static_cast<size_t>(static_cast<unsigned char>(b[9])) << 8);
  const std::string header = b.substr(10, hlen);
  REQUIRE(header.find("'descr': '<f4'") != std::string::npos);
  const size_t open = header.find("'shape': (");
  REQUIRE(open != std::string::npos);
  std::sscanf(header.c_str() + open + 10, "%ld, %ld", rows, cols);
  std::vector<float> v(static_cast<size_t>(*rows * *cols));
  REQUIRE(b.size() == 10 + hlen + v.size() * sizeof(float));
  std::memcpy(v.data(), b.data() + 10 + hlen, v.size() * sizeof(float));
  return v;
}

// Trains a few steps and saves; returns the checkpoint directory.
std::string trained_checkpoint(const TempDir& dir, const std::string& model) {
  const std::string ckpt = dir / "ckpt";
  megatrain_ok(model + " --train-iters 3 --save-interval 3 --save " + ckpt);
  return ckpt;
}

void check_numpy_logits(const std::string& model, const char* what) {
  std::string why;
  const auto py = mt_test::find_test_python("numpy safetensors", &why);
  if (!py) {
    mt::test::report_skip("the numpy logits check of " + std::string(what) + ": " + why);
    return;
  }
  TempDir dir;
  const std::string ckpt = trained_checkpoint(dir, model), hf = dir / "hf", npy = dir / "logits.npy";
  // A small shard limit: the export is split into several files with an index.
  const std::string out = megatrain_ok("export-hf --load " + ckpt + " --output " + hf + " --max-shard-size 20000");
  CHECK(out.find("safetensors files (model.safetensors.index.json maps them)") != std::string::npos);
  CHECK(fs::exists(hf + "/model.safetensors.index.json"));
  const nlohmann::json index = nlohmann::json::parse(read_bytes(hf + "/model.safetensors.index.json"));
  std::set<std::string> files;
  for (const auto& [name, file] : index.at("weight_map").items()) files.insert(file.get<std::string>());
  CHECK(files.size() >= 2);
  for (const std::string& f : files) CHECK(fs::exists(hf + "/" + f));
  CHECK_FALSE(fs::exists(hf + "/model.safetensors"));
  megatrain_ok("forward-logits --load " + ckpt + " --tokens " + kTokens + " --output " + npy);
  int64_t rows = 0, cols = 0;
  read_npy_f32(npy, &rows, &cols);
  CHECK(rows == 10);
  CHECK(cols == 100);  // the tokenizer's vocabulary, padding columns dropped
  std::string check;
  const int code = run_command(*py + " " + MEGATRAIN_SOURCE_DIR + "/tests/hf/numpy_forward.py " + hf + " " + kTokens +
                                   " --compare " + npy,
                               &check);
  INFO(check);
  CHECK(code == 0);
  CHECK(check.find("OK") != std::string::npos);
}

}  // namespace

TEST_CASE("export-hf: numpy's GPT-2 forward of the export gives megatrain's logits (erf and tanh GeLU)", "[ckpt-train][hf][python]") {
  check_numpy_logits(kGptErf, "GPT-2 (gelu)");
  check_numpy_logits(kGpt, "GPT-2 (gelu_new, Megatron's fused bias-GeLU)");
  check_numpy_logits(kGptTanh, "GPT-2 (gelu_new, --openai-gelu)");
}

TEST_CASE("export-hf: numpy's Llama forward of the export gives megatrain's logits (GQA, SwiGLU, RoPE, untied)", "[ckpt-train][hf][python]") {
  check_numpy_logits(kLlama, "Llama");
  check_numpy_logits(kQwen2, "Qwen2 (q/k/v biases)");
  check_numpy_logits(kMistralWindow, "Mistral (sliding window)");
  check_numpy_logits(kQwen2Window, "Qwen2 (sliding window on layer 2)");
  check_numpy_logits(kMixtral, "Mixtral (4 experts, top-2)");
}

TEST_CASE("export-hf: numpy's Qwen3, Qwen3-MoE, Qwen2-MoE and Qwen3-Next forwards of the export give megatrain's logits", "[ckpt-train][hf][python]") {
  check_numpy_logits(kQwen3, "Qwen3 (q/k norms, head dim 10)");
  check_numpy_logits(kQwen3Moe, "Qwen3-MoE (a dense layer, then 4 experts top-2)");
  check_numpy_logits(kQwen2Moe, "Qwen2-MoE (top-2 without renormalizing, a gated shared expert)");
  check_numpy_logits(kQwen3Next, "Qwen3-Next (Gated DeltaNet and gated attention layers, MoE with a gated shared expert)");
}

TEST_CASE("export-hf: numpy's Nemotron forward of the export gives megatrain's logits (LayerNorm1P, squared ReLU, "
          "partial RoPE)", "[ckpt-train][hf][python]") {
  check_numpy_logits(kNemotron, "Nemotron");
  check_numpy_logits(kNemotronBias, "Nemotron (biases)");
}

TEST_CASE("export-hf then import-hf gives back the parameters, and import-hf's flags train from it", "[ckpt-train][hf]") {
  for (const std::string& model :
       {kGpt, kGptErf, kLlama, kQwen2, kMistralWindow, kQwen2Window, kNemotron, kNemotronBias, kMixtral, kDeepseek,
        kQwen3, kQwen3Moe, kQwen2Moe, kQwen3Next}) {
    TempDir dir;
    const std::string ckpt = trained_checkpoint(dir, model), hf = dir / "hf", back = dir / "back";
    megatrain_ok("export-hf --load " + ckpt + " --output " + hf);
    CHECK(fs::exists(hf + "/model.safetensors"));
    CHECK_FALSE(fs::exists(hf + "/model.safetensors.index.json"));
    const nlohmann::json config = nlohmann::json::parse(read_bytes(hf + "/config.json"));
    const bool llama = model == kLlama, qwen2 = model == kQwen2 || model == kQwen2Window, mistral = model == kMistralWindow;
    const bool nemotron = model == kNemotron || model == kNemotronBias, mixtral = model == kMixtral;
    const bool deepseek = model == kDeepseek, qwen3 = model == kQwen3, qwen3_moe = model == kQwen3Moe,
               qwen2_moe = model == kQwen2Moe, qwen3_next = model == kQwen3Next;
    CHECK(config.at("architectures").at(0) == (deepseek    ? "DeepseekV3ForCausalLM"
                                               : qwen3     ? "Qwen3ForCausalLM"
                                               : qwen3_moe ? "Qwen3MoeForCausalLM"
                                               : qwen2_moe ? "Qwen2MoeForCausalLM"
                                               : qwen3_next ? "Qwen3NextForCausalLM"
                                               : llama    ? "LlamaForCausalLM"
                                               : qwen2    ? "Qwen2ForCausalLM"
                                               : mistral  ? "MistralForCausalLM"
                                               : nemotron ? "NemotronForCausalLM"
                                               : mixtral  ? "MixtralForCausalLM"
                                                          : "GPT2LMHeadModel"));
    if (mixtral) {
      CHECK(config.at("num_local_experts") == 4);
      CHECK(config.at("num_experts_per_tok") == 2);
      CHECK(config.at("intermediate_size") == 24);
    }
    CHECK(config.at("vocab_size") == 100);
    if (qwen3 || qwen3_moe) CHECK(config.at("head_dim") == 10);
    if (qwen3_moe || qwen2_moe) {
      CHECK(config.at("num_experts") == 4);
      CHECK(config.at("num_experts_per_tok") == 2);
      CHECK(config.at("moe_intermediate_size") == 24);
      CHECK(config.at("intermediate_size") == 48);
      CHECK(config.at("norm_topk_prob") == qwen3_moe);
      CHECK(config.at("mlp_only_layers") == (qwen3_moe ? nlohmann::json::array({0}) : nlohmann::json::array()));
    }
    if (qwen2_moe) CHECK(config.at("shared_expert_intermediate_size") == 16);
    if (deepseek) {
      CHECK(config.at("first_k_dense_replace") == 1);
      CHECK(config.at("n_routed_experts") == 4);
      CHECK(config.at("n_shared_experts") == 2);
      CHECK(config.at("routed_scaling_factor") == 2.5);
      CHECK(config.at("kv_lora_rank") == 8);
      CHECK(config.at("qk_rope_head_dim") == 4);
      CHECK(config.at("num_nextn_predict_layers") == 1);
    }
    if (qwen3_next) {
      CHECK(config.at("layer_types") ==
            nlohmann::json::array({"linear_attention", "linear_attention", "linear_attention", "full_attention"}));
      CHECK(config.at("mlp_only_layers") == nlohmann::json::array({1}));
      CHECK(config.at("partial_rotary_factor") == 0.4);
      CHECK(config.at("linear_value_head_dim") == 5);
    }
    if (!llama && !qwen2 && !mistral && !nemotron && !mixtral && !deepseek && !qwen3 && !qwen3_moe && !qwen2_moe &&
        !qwen3_next)
      CHECK(config.at("activation_function") == (model == kGptErf ? "gelu" : "gelu_new"));
    if (nemotron) {
      CHECK(config.at("hidden_act") == "relu2");
      CHECK(config.at("partial_rotary_factor") == 0.5);
      CHECK(config.at("attention_bias") == (model == kNemotronBias));
    }
    if (mistral) CHECK(config.at("sliding_window") == 4);
    if (model == kQwen2Window) {
      CHECK(config.at("sliding_window") == 3);
      CHECK(config.at("max_window_layers") == 1);
    }
    const std::string out = megatrain_ok("import-hf --hf-dir " + hf + " --save " + back);
    CHECK(read_bytes(back + "/latest_checkpointed_iteration.txt") == "release");

    // Every parameter: the same values; the padded vocabulary rows repeat the last real row.
    mt::CheckpointReader a(ckpt), b(back);
    const auto names = a.names();
    CHECK(names == b.names());
    for (const std::string& n : names) {
      INFO(n);
      const auto& ia = a.info(n);
      REQUIRE(b.info(n).global_shape == ia.global_shape);
      const int64_t numel = ia.global_rows * ia.global_cols;
      std::vector<float> va(static_cast<size_t>(numel)), vb(va.size());
      const mt::ShardIndex whole = mt::ShardIndex::whole(ia.global_rows, ia.global_cols);
      a.read(n, whole, mt::Tensor(va.data(), mt::DType::f32, mt::Device::cpu, {numel}));
      b.read(n, whole, mt::Tensor(vb.data(), mt::DType::f32, mt::Device::cpu, {numel}));
      const bool vocab_rows = n == "embedding.word_embeddings.weight" || n == "output_layer.weight";
      const int64_t real = vocab_rows ? 100 * ia.global_cols : numel;
      // Qwen3-Next's Gated DeltaNet output norm: ours zero-centred (w - 1), HF's plain w, so the
      // float32 round trip (x + 1) - 1 keeps x to within one float32 step of 1 + x; all else exact.
      const bool plus_one = qwen3_next && n.find("out_norm.weight") != std::string::npos;
      if (plus_one) {
        for (int64_t i = 0; i < numel; ++i)
          CHECK(std::fabs(va[static_cast<size_t>(i)] - vb[static_cast<size_t>(i)]) <=
                std::ldexp(1.0, -23) * (1.0 + std::fabs(va[static_cast<size_t>(i)])));
        continue;
      }
      CHECK(std::memcmp(va.data(), vb.data(), static_cast<size_t>(real) * sizeof(float)) == 0);
      for (int64_t i = real; i < numel; ++i)
        if (vb[static_cast<size_t>(i)] != vb[static_cast<size_t>(99 * ia.global_cols + i % ia.global_cols)]) {
          FAIL_CHECK("padding row element " << i << " is not the last real row's");
          break;
        }
    }
    // The same logits from the original and the round-tripped checkpoint (padding rows play no part).
    megatrain_ok("forward-logits --load " + ckpt + " --tokens " + kTokens + " --output " + (dir / "a.npy"));
    megatrain_ok("forward-logits --load " + back + " --tokens " + kTokens + " --output " + (dir / "b.npy"));
    if (qwen3_next) {  // (the output norm's last bits, above)
      int64_t ra = 0, ca = 0, rb = 0, cb = 0;
      const std::vector<float> la = read_npy_f32(dir / "a.npy", &ra, &ca), lb = read_npy_f32(dir / "b.npy", &rb, &cb);
      REQUIRE(la.size() == lb.size());
      float scale = 0, diff = 0;
      for (size_t i = 0; i < la.size(); ++i) {
        scale = std::max(scale, std::fabs(la[i]));
        diff = std::max(diff, std::fabs(la[i] - lb[i]));
      }
      CHECK(scale > 0.1f);
      CHECK(diff <= 1e-5f * scale);
    } else {
      CHECK(read_bytes(dir / "a.npy") == read_bytes(dir / "b.npy"));
    }

    // The printed flag line builds the same model: training from the import loads it (iteration 0).
    const std::string marker = "optimizer flags; loading a release checkpoint restores the weights only and starts at iteration 0):\n";
    const size_t at = out.find(marker);
    REQUIRE(at != std::string::npos);
    std::string flags = out.substr(at + marker.size());
    flags = flags.substr(0, flags.find('\n'));
    CHECK(flags.find("--load " + back) != std::string::npos);
    CHECK((flags.find("--no-bias-gelu-fusion") != std::string::npos) == (model == kGptErf || model == kNemotronBias));
    const std::string run = megatrain_ok(flags + " --device cpu --mock-data --micro-batch-size 1 --lr 1e-3 --train-iters 1 "
                                                 "--eval-iters 0");
    CHECK(run.find("successfully loaded checkpoint from " + back) != std::string::npos);
    CHECK(run.find("iteration        1/       1") != std::string::npos);
    // --use-checkpoint-args rebuilds the same model from the import alone (the loss of the first
    // iteration, the same batch and weights, is the same to the last digit). (DeepSeek-V3 also
    // needs --no-rope-fusion for MLA with plain RoPE and its router's groups on the command line,
    // Qwen2-MoE its shared expert's gate: Megatron-LM's checkpoint arguments leave those out.)
    const std::string bare = megatrain_ok("--load " + back + " --use-checkpoint-args --vocab-size 100 --device cpu "
                                          "--mock-data --micro-batch-size 1 --lr 1e-3 --train-iters 1 --eval-iters 0" +
                                          std::string(deepseek    ? " --no-rope-fusion --moe-router-num-groups 2 --moe-router-group-topk 1"
                                                      : qwen2_moe || qwen3_next ? " --moe-shared-expert-gate"
                                                                  : ""));
    CHECK(bare.find(std::string("Setting num_layers to ") + (qwen3_next ? "4" : "2") + " from checkpoint") !=
          std::string::npos);
    auto loss = [](const std::string& log) {
      const size_t at = log.find("lm loss: ");
      return at == std::string::npos ? std::string("(none)") : log.substr(at, 21);
    };
    CHECK(loss(bare) == loss(run));
    CHECK(loss(run) != "(none)");
  }
}

TEST_CASE("export-hf refuses what Hugging Face cannot express, naming the flag", "[ckpt-train][hf]") {
  TempDir dir;
  const std::string ckpt = dir / "ckpt";
  megatrain_ok(kGpt + " --qk-layernorm --train-iters 1 --save-interval 1 --save " + ckpt);
  std::string out;
  const int code = run_command(std::string(MEGATRAIN_BINARY) + " export-hf --load " + ckpt + " --output " + (dir / "hf"), &out);
  CHECK(code != 0);
  CHECK(out.find("--qk-layernorm") != std::string::npos);
  // Squared ReLU exports only as Nemotron, whose norms are LayerNorm1P.
  const std::string relu2 = dir / "relu2";
  megatrain_ok(kGpt + " --squared-relu --no-bias-gelu-fusion --train-iters 1 --save-interval 1 --save " + relu2);
  CHECK(run_command(std::string(MEGATRAIN_BINARY) + " export-hf --load " + relu2 + " --output " + (dir / "hf2"), &out) != 0);
  CHECK(out.find("cannot express this model as NemotronForCausalLM") != std::string::npos);
  CHECK(out.find("--apply-layernorm-1p") != std::string::npos);
  // A mixture of experts exports as Mixtral, which has no shared expert.
  const std::string shared = dir / "shared";
  megatrain_ok(kMixtral + " --moe-shared-expert-intermediate-size 16 --train-iters 1 --save-interval 1 --save " + shared);
  CHECK(run_command(std::string(MEGATRAIN_BINARY) + " export-hf --load " + shared + " --output " + (dir / "hf3"), &out) != 0);
  CHECK(out.find("cannot express this model as MixtralForCausalLM: --moe-shared-expert-intermediate-size") !=
        std::string::npos);
  // Multi-latent attention exports as DeepSeek-V3, whose shared experts have no gate.
  const std::string gated = dir / "gated";
  megatrain_ok(kDeepseek + " --moe-shared-expert-gate --train-iters 1 --save-interval 1 --save " + gated);
  CHECK(run_command(std::string(MEGATRAIN_BINARY) + " export-hf --load " + gated + " --output " + (dir / "hf4"), &out) != 0);
  CHECK(out.find("cannot express this model as DeepseekV3ForCausalLM: --moe-shared-expert-gate") != std::string::npos);
  // Qwen2-MoE gates its shared expert; Qwen3-MoE has none; Qwen3's attention_bias is q, k, v and o.
  const std::string ungated = dir / "ungated";
  megatrain_ok(kQwen2 + " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24 --moe-shared-expert-intermediate-size 16 "
                        "--moe-grouped-gemm --train-iters 1 --save-interval 1 --save " + ungated);
  CHECK(run_command(std::string(MEGATRAIN_BINARY) + " export-hf --load " + ungated + " --output " + (dir / "hf5"), &out) != 0);
  CHECK(out.find("cannot express this model as Qwen2MoeForCausalLM: --moe-shared-expert-intermediate-size without "
                 "--moe-shared-expert-gate") != std::string::npos);
  const std::string shared3 = dir / "shared3";
  megatrain_ok(kQwen3Moe + " --moe-shared-expert-intermediate-size 16 --train-iters 1 --save-interval 1 --save " + shared3);
  CHECK(run_command(std::string(MEGATRAIN_BINARY) + " export-hf --load " + shared3 + " --output " + (dir / "hf6"), &out) != 0);
  CHECK(out.find("cannot express this model as Qwen3MoeForCausalLM: --moe-shared-expert-intermediate-size") !=
        std::string::npos);
  const std::string qkv3 = dir / "qkv3";
  megatrain_ok(kQwen3 + " --add-qkv-bias --train-iters 1 --save-interval 1 --save " + qkv3);
  CHECK(run_command(std::string(MEGATRAIN_BINARY) + " export-hf --load " + qkv3 + " --output " + (dir / "hf7"), &out) != 0);
  CHECK(out.find("cannot express this model as Qwen3ForCausalLM: --add-qkv-bias alone") != std::string::npos);
}

TEST_CASE("import-hf: a DeepSeek-V3 config asking for MTP depths its checkpoint lacks imports without them",
          "[ckpt-train][hf]") {
  // transformers builds no MTP layers, so a model it saved has none of model.layers.{L}.* whatever
  // num_nextn_predict_layers says (its DeepseekV3Config defaults to 1).
  TempDir dir;
  std::string model = kDeepseek;
  const std::string mtp = " --mtp-num-layers 1";
  model.erase(model.find(mtp), mtp.size());
  const std::string ckpt = trained_checkpoint(dir, model), hf = dir / "hf", back = dir / "back";
  megatrain_ok("export-hf --load " + ckpt + " --output " + hf);
  nlohmann::json config = nlohmann::json::parse(read_bytes(hf + "/config.json"));
  REQUIRE(config.at("num_nextn_predict_layers") == 0);
  config["num_nextn_predict_layers"] = 1;
  mt::write_file_atomically(hf + "/config.json", config.dump(2));
  const std::string out = megatrain_ok("import-hf --hf-dir " + hf + " --save " + back);
  CHECK(out.find("asks for 1 multi-token prediction depth(s) (num_nextn_predict_layers) but the checkpoint holds no "
                 "model.layers.2.* tensors: imported without them") != std::string::npos);
  CHECK(out.find("--mtp-num-layers") == std::string::npos);  // (the printed flags build no MTP depth)
  megatrain_ok("forward-logits --load " + ckpt + " --tokens " + kTokens + " --output " + (dir / "a.npy"));
  megatrain_ok("forward-logits --load " + back + " --tokens " + kTokens + " --output " + (dir / "b.npy"));
  CHECK(read_bytes(dir / "a.npy") == read_bytes(dir / "b.npy"));
}

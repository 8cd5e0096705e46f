// Mapping between megatrain's parameters (Megatron-Core names and layouts, global layer numbers)
// and Hugging Face's causal LMs (names, layouts, config.json; the families below). Mistral is
// Llama's layout with a sliding window on every layer (--window-size); Qwen2 is Llama with biases
// on q/k/v only (Megatron's --add-qkv-bias with --disable-bias-linear), and a sliding window on its
// upper layers when it has one; Qwen3 is Llama with q/k norms (--qk-layernorm).
// Pure functions on host arrays; the export-hf / import-hf commands do the file I/O.
//
// Layout differences handled here (Hugging Face transformers' modeling_gpt2.py, modeling_llama.py,
// modeling_mistral.py and modeling_qwen2.py against Megatron-Core's layers):
// * Fused QKV: ours groups rows per query group [q (heads/groups * d); k (d); v (d)] x groups.
//   Llama has separate q/k/v_proj; GPT-2's Conv1D c_attn is [in, 3E] with [Q | K | V] columns.
// * GPT-2 Conv1D weights are [in, out]: every linear weight is transposed.
// * SwiGLU fc1 is [gate (f); up (f)] globally -> gate_proj, up_proj.
// * Embedding and output rows: ours are padded to Megatron's padded vocabulary; HF holds the true
//   vocabulary. Import pads by repeating the last row, as Megatron's checkpoint converter does.
// * --apply-layernorm-1p stores (gamma - 1): export adds 1, import subtracts it.
// * RoPE: Megatron's default (non-interleaved) rotate-half pairs dims (j, j + d/2) exactly as HF
//   Llama's rotate_half does (both build cos/sin as cat(freqs, freqs)), so q/k need no permutation.
//   A model trained with --rotary-interleaved pairs (2j, 2j+1): export permutes q/k rows per head.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/dtype.h"

namespace mt {

enum class HfArchitecture { gpt2, llama, mistral, qwen2, qwen3, nemotron, mixtral, qwen2_moe, qwen3_moe, qwen3_next,
                            deepseek_v3 };
// "GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
// "NemotronForCausalLM" (Nemotron-4's shape: LayerNorm1P, squared-ReLU MLP, partial RoPE),
// "MixtralForCausalLM" (Mistral's attention; every layer's MLP a mixture of SwiGLU experts with
// softmax top-k routing renormalized over the chosen experts, Megatron's default router),
// "Qwen3ForCausalLM" (Llama with an RMSNorm over each head's q and k before RoPE: --qk-layernorm),
// "Qwen3MoeForCausalLM" (Qwen3's attention; MoE layers of SwiGLU experts with softmax top-k routing,
// renormalized over the chosen experts or not (norm_topk_prob: Megatron's default router, or
// --moe-router-pre-softmax), dense layers where mlp_only_layers says),
// "Qwen2MoeForCausalLM" (Qwen2's attention with q/k/v biases; Qwen3-MoE's layers plus a shared
// expert scaled by a sigmoid gate: --moe-shared-expert-intermediate-size, --moe-shared-expert-gate),
// "Qwen3NextForCausalLM" (Gated DeltaNet layers beside gated softmax-attention layers, zero-centred
// RMSNorms (--apply-layernorm-1p), q/k norms, partial RoPE, Qwen2-MoE's MoE layers or dense MLPs),
// "DeepseekV3ForCausalLM" (multi-latent attention; dense layers, then MoE layers of SwiGLU experts
// with sigmoid group-limited routing, the expert bias, a scaling factor and shared experts).
const char* hf_architecture_name(HfArchitecture a);
// The Qwen families (qwen2, qwen3 and their MoE models): one sliding-window scheme, Llama's layout.
bool hf_is_qwen(HfArchitecture a);
bool hf_is_qwen_moe(HfArchitecture a);

// What the mapping needs to know about the model.
struct HfModelSpec {
  HfArchitecture arch = HfArchitecture::gpt2;
  int num_layers = 0;
  int hidden_size = 0;
  int num_attention_heads = 0;
  int num_query_groups = 0;  // = heads without GQA
  int head_dim = 0;
  int ffn_hidden_size = 0;
  int vocab_size = 0;         // the tokenizer's (HF's vocab_size)
  int padded_vocab_size = 0;  // ours (Megatron's padding)
  int max_position_embeddings = 0;
  bool learned_position_embeddings = false;
  bool layernorm = true;  // false: RMSNorm
  bool add_bias_linear = true;
  bool add_qkv_bias = false;
  bool swiglu = false;
  bool squared_relu = false;
  bool gated_unit_variant = false;  // --quick-geglu, --glu-linear-offset or --activation-func-clamp-value
  bool attention_sinks = false;     // --softmax-type off-by-one / learnable
  bool qk_layernorm = false;
  bool qk_l2_norm = false;
  bool nope_layers = false;  // --no-rope-freq: some layers skip RoPE
  bool attention_output_gate = false;
  bool untie_embeddings_and_output_weights = false;
  bool apply_layernorm_1p = false;
  bool rotary_interleaved = false;
  double rotary_percent = 1.0;
  double rotary_base = 10000;
  bool use_rope_scaling = false;
  double rope_scaling_factor = 8.0;
  // Sliding-window attention: HF's sliding_window, the keys a query sees with itself (Megatron's
  // --window-size LEFT + 1), and which layers have it (1 = windowed; empty: every layer).
  std::optional<int> sliding_window;
  std::vector<int> window_layers;
  double norm_epsilon = 1e-5;
  double init_method_std = 0.02;
  double hidden_dropout = 0.1;
  double attention_dropout = 0.1;
  // GPT-2's activation_function: "gelu_new" (tanh approximation: --openai-gelu or Megatron's fused
  // bias-GeLU, the default) or "gelu" (erf: --no-bias-gelu-fusion). from_model_config picks it.
  std::string gelu_activation = "gelu_new";
  std::optional<int> bos_token_id, eos_token_id;
  // Mixture of experts (Mixtral): experts per layer, experts per token, each expert's FFN size,
  // the aux-loss coefficient (HF's router_aux_loss_coef); and what the model has that Mixtral
  // cannot express (the flags, refused by validate()).
  int num_experts = 0, moe_topk = 0, moe_ffn_hidden_size = 0;
  double router_aux_loss_coef = 0.0;
  std::vector<std::string> moe_unexpressible;
  // Qwen's MoE models: which layers are MoE (1) or dense (0; empty: every layer MoE), whether the
  // top-k weights are renormalized (norm_topk_prob: Megatron's softmax over the top-k logits; false:
  // --moe-router-pre-softmax), and the shared expert's sigmoid gate (shared_expert_ffn below).
  std::vector<int> moe_layers;
  bool norm_topk_prob = true;
  bool shared_expert_gate = false;
  // Qwen3-Next: which layers are Gated DeltaNet (1) or softmax attention (0), and the Gated DeltaNet
  // heads: key (query) heads of gdn_dk, value heads of gdn_dv, the convolution's taps.
  std::vector<int> gdn_layers;
  int gdn_key_heads = 0, gdn_value_heads = 0, gdn_dk = 0, gdn_dv = 0, gdn_conv = 4;
  bool is_moe_layer(int layer) const {
    return num_experts > 0 && (moe_layers.empty() || moe_layers.at(static_cast<size_t>(layer)) != 0);
  }
  // DeepSeek-V3: multi-latent attention (the query LoRA rank, 0 for a direct projection; the
  // key/value LoRA rank; per head the dims without and with RoPE and the value dim; whether the
  // latent norms exist, Megatron's --qk-layernorm with MLA), the dense layers before the MoE ones
  // (first_k_dense_replace), the router's groups (n_group, topk_group), routed_scaling_factor,
  // the shared experts' FFN size (n_shared_experts x moe_intermediate_size), whether the router
  // has its expert bias (e_score_correction_bias; zeros otherwise), and whether the RoPE part
  // rotates interleaved pairs (rope_interleave, as Megatron's MLA does; an HF model without it has
  // its RoPE rows permuted on import).
  int q_lora_rank = 0, kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  bool mla_latent_norms = false;
  int first_dense_layers = 0, router_groups = 1, router_group_topk = 1, shared_expert_ffn = 0;
  double routed_scaling_factor = 1.0;
  bool expert_bias = false;
  bool rope_interleave = false;
  int mtp_layers = 0;  // multi-token prediction depths (num_nextn_predict_layers)
  // MLA's YaRN RoPE (Megatron's --rope-type yarn, its default; transformers' rope_scaling yarn):
  // the scaling factor, mscale, mscale_all_dim, and the original context (Megatron's MLA keeps
  // 4096, beta_fast 32, beta_slow 1 and integer correction bounds: transformers' defaults).
  bool yarn = false;
  double yarn_factor = 1.0, yarn_mscale = 1.0, yarn_mscale_all_dim = 0.0;
  int yarn_original_max_position_embeddings = 4096;
  std::string torch_dtype = "float32";

  // From a validated Config's model section (derived values filled).
  static HfModelSpec from_model_config(const ModelConfig& m, HfArchitecture arch);
  // Throws mt::Unsupported naming the flag when the model cannot be expressed in `arch`.
  void validate() const;
};

// The settings an HfModelSpec and megatrain's ModelConfig hold one to one: f(&HfModelSpec::x,
// &ModelConfig::y) for each. Both directions read this list (HfModelSpec::from_model_config, and
// import-hf's model_config_from_hf); what an architecture maps otherwise is written beside it.
template <typename F>
void for_each_hf_model_setting(F&& f) {
  f(&HfModelSpec::num_layers, &ModelConfig::num_layers);
  f(&HfModelSpec::hidden_size, &ModelConfig::hidden_size);
  f(&HfModelSpec::num_attention_heads, &ModelConfig::num_attention_heads);
  f(&HfModelSpec::num_query_groups, &ModelConfig::query_groups);
  f(&HfModelSpec::head_dim, &ModelConfig::head_dim);
  f(&HfModelSpec::ffn_hidden_size, &ModelConfig::ffn_size);
  f(&HfModelSpec::vocab_size, &ModelConfig::vocab_size);
  f(&HfModelSpec::padded_vocab_size, &ModelConfig::padded_vocab_size);
  f(&HfModelSpec::max_position_embeddings, &ModelConfig::max_position_embeddings);
  f(&HfModelSpec::add_bias_linear, &ModelConfig::add_bias_linear);
  f(&HfModelSpec::swiglu, &ModelConfig::swiglu);
  f(&HfModelSpec::squared_relu, &ModelConfig::squared_relu);
  f(&HfModelSpec::qk_layernorm, &ModelConfig::qk_layernorm);
  f(&HfModelSpec::untie_embeddings_and_output_weights, &ModelConfig::untie_embeddings_and_output_weights);
  f(&HfModelSpec::apply_layernorm_1p, &ModelConfig::apply_layernorm_1p);
  f(&HfModelSpec::rotary_interleaved, &ModelConfig::rotary_interleaved);
  f(&HfModelSpec::rotary_percent, &ModelConfig::rotary_percent);
  f(&HfModelSpec::rotary_base, &ModelConfig::rotary_base);
  f(&HfModelSpec::use_rope_scaling, &ModelConfig::use_rope_scaling);
  f(&HfModelSpec::rope_scaling_factor, &ModelConfig::rope_scaling_factor);
  f(&HfModelSpec::norm_epsilon, &ModelConfig::norm_epsilon);
  f(&HfModelSpec::init_method_std, &ModelConfig::init_method_std);
  f(&HfModelSpec::hidden_dropout, &ModelConfig::hidden_dropout);
  f(&HfModelSpec::attention_dropout, &ModelConfig::attention_dropout);
}

// How one of our tensors becomes HF tensors (and back).
enum class HfTransform {
  copy,           // same layout
  transpose,      // ours [out, in] <-> GPT-2 Conv1D [in, out]
  vocab_rows,     // embedding / output rows: ours padded <-> HF true vocabulary
  vocab_rows_copy,// the same, for a second HF copy of a tensor another mapping already imports
                  // (DeepSeek-V3's MTP embed_tokens and shared_head.head): import writes nothing
  norm_1p,        // ours gamma - 1 <-> HF gamma
  qkv_split,      // ours fused QKV (weight or bias) <-> Llama q_proj, k_proj, v_proj
  qkv_c_attn,     // ours fused QKV weight <-> GPT-2 c_attn.weight [E, 3E] (split, concat, transpose)
  qkv_c_attn_bias,// ours fused QKV bias <-> GPT-2 c_attn.bias [3E] ([q | k | v])
  fc1_split,      // ours = the HF tensors' rows, concatenated in order: [gate; up] <-> gate_proj,
                  // up_proj; an MoE layer's experts (each [gate; up], or each down) <-> theirs
  mla_q_rope,     // MLA q_b_proj / q_proj: per head [nope; rope] rows, the rope rows permuted
                  // to or from rotate-half pairs when the HF model has no rope_interleave
  mla_kv_rope,    // MLA kv_a_proj_with_mqa: [kv_lora; rope] rows, the same for its rope rows
  zeros,          // no tensor of ours (ours empty): export writes zeros (DeepSeek-V3's expert bias
                  // of a model without one), import checks nothing
  qkvg_split,     // ours fused gated QKV [q | gate | k | v] per group <-> Qwen3-Next's q_proj (per
                  // head [q | gate]), k_proj, v_proj
  gdn_in_proj,    // ours per key head [q k v z | beta alpha] <-> in_proj_qkvz, in_proj_ba (per key head)
  gdn_conv,       // ours conv channels per key head [q k v] <-> HF's [all q | all k | all v] (Conv1d [C, 1, K])
};

struct HfTensorMapping {
  std::string ours;
  std::vector<int64_t> our_shape;
  std::vector<std::string> hf;  // 1 name, or 3 (q, k, v) / 2 (gate, up)
  std::vector<std::vector<int64_t>> hf_shapes;
  HfTransform transform = HfTransform::copy;
};

// Every parameter of the model, in our order (embeddings, layers, final norm, output).
std::vector<HfTensorMapping> hf_tensor_mappings(const HfModelSpec& spec);

// config.json for the HF model; and the spec an HF config.json describes (for import). The
// padded vocabulary of an imported spec is Megatron's: vocab rounded up to a multiple of
// make_vocab_size_divisible_by * tp.
nlohmann::json hf_config_json(const HfModelSpec& spec);
HfModelSpec hf_spec_from_config(const nlohmann::json& config, int make_vocab_size_divisible_by = 128, int tp = 1);

// A dense row-major host array.
struct HostArray {
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;

  int64_t numel() const;
  static HostArray zeros(DType dtype, std::vector<int64_t> shape);
  template <typename T>
  T* ptr() { return reinterpret_cast<T*>(bytes.data()); }
  template <typename T>
  const T* ptr() const { return reinterpret_cast<const T*>(bytes.data()); }
};

// Converts one of our tensors (global, unsharded) to its HF tensors, in mapping.hf order; and back.
std::vector<HostArray> export_hf_tensor(const HfTensorMapping& mapping, const HfModelSpec& spec, const HostArray& ours);
HostArray import_hf_tensor(const HfTensorMapping& mapping, const HfModelSpec& spec, const std::vector<HostArray>& hf);

// ---- building blocks, on raw row-major arrays of `elem`-byte elements ----

// Fused grouped QKV rows [(heads + 2*groups) * head_dim, cols] <-> q [heads*d, cols], k, v [groups*d, cols].
void split_qkv_rows(const void* fused, size_t elem, int heads, int groups, int head_dim, int64_t cols, void* q,
                    void* k, void* v);
void merge_qkv_rows(const void* q, const void* k, const void* v, size_t elem, int heads, int groups, int head_dim,
                    int64_t cols, void* fused);
// dst[c][r] = src[r][c]
void transpose_rows(const void* src, size_t elem, int64_t rows, int64_t cols, void* dst);
// Within each head's head_dim rows: interleaved pairs (2j, 2j+1) -> rotate-half pairs (j, j+d/2)
// (to_rotate_half), or back.
void permute_rope_rows(const void* src, size_t elem, int heads, int head_dim, int64_t cols, void* dst,
                       bool to_rotate_half);

}  // namespace mt

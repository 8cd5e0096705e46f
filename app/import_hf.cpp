// megatrain import-hf: a Hugging Face GPT-2 or Llama directory as a megatrain release checkpoint.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <set>
#include <type_traits>

#include "app/checkpoint_args.h"
#include "app/hf_commands.h"
#include "app/megatron_args.h"
#include "app/subcommand_args.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/file_io.h"
#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "core/log.h"

namespace mt {

using nlohmann::json;

ModelConfig model_config_from_hf(const HfModelSpec& s, int make_vocab_size_divisible_by) {
  ModelConfig m;
  for_each_hf_model_setting([&](auto ours, auto theirs) {
    m.*theirs = static_cast<std::remove_reference_t<decltype(m.*theirs)>>(s.*ours);
  });
  m.ffn_hidden_size = s.ffn_hidden_size;
  if (s.head_dim * s.num_attention_heads != s.hidden_size) m.kv_channels = s.head_dim;
  m.group_query_attention = s.num_query_groups != s.num_attention_heads;
  m.num_query_groups = m.group_query_attention ? s.num_query_groups : 1;
  m.position_embedding_type = s.learned_position_embeddings ? PositionEmbedding::learned_absolute : PositionEmbedding::rope;
  m.normalization = s.layernorm ? Normalization::layernorm : Normalization::rmsnorm;
  m.openai_gelu = s.arch == HfArchitecture::gpt2 && s.gelu_activation != "gelu";
  // Exact GeLU; and squared ReLU with biases, which Megatron's bias-activation fusion refuses.
  m.bias_gelu_fusion =
      !(s.arch == HfArchitecture::gpt2 && s.gelu_activation == "gelu") && !(s.squared_relu && s.add_bias_linear);
  m.add_qkv_bias = s.add_bias_linear || s.add_qkv_bias;
  if (s.sliding_window) {
    m.window_size = std::make_pair(*s.sliding_window - 1, 0);
    m.window_attn_pattern = s.window_layers;
  }
  m.make_vocab_size_divisible_by = make_vocab_size_divisible_by;
  m.seq_length = s.max_position_embeddings;
  if (s.arch == HfArchitecture::qwen3_next) {  // Gated DeltaNet layers beside gated softmax attention
    m.attention_output_gate = true;
    m.gated_delta_net = true;
    m.linear_attention_pattern = s.gdn_layers;
    m.linear_layer.assign(s.gdn_layers.begin(), s.gdn_layers.end());
    m.linear_conv_kernel_dim = s.gdn_conv;
    m.linear_key_head_dim = s.gdn_dk;
    m.linear_value_head_dim = s.gdn_dv;
    m.linear_num_key_heads = s.gdn_key_heads;
    m.linear_num_value_heads = s.gdn_value_heads;
  }
  if (s.arch == HfArchitecture::deepseek_v3) {
    // Multi-latent attention with both latent norms and plain RoPE on its RoPE part; the first
    // first_dense_layers layers dense, the others MoE with sigmoid routing, the expert bias, the
    // scaling factor, the router's groups and the shared experts.
    m.multi_latent_attention = true;
    if (s.q_lora_rank > 0) m.q_lora_rank = s.q_lora_rank;
    m.kv_lora_rank = s.kv_lora_rank;
    m.qk_head_dim = s.qk_nope_head_dim;
    m.qk_pos_emb_head_dim = s.qk_rope_head_dim;
    m.v_head_dim = s.v_head_dim;
    m.qk_layernorm = true;
    m.rope_type = s.yarn ? "yarn" : "rope";
    if (s.mtp_layers > 0) m.mtp_num_layers = s.mtp_layers;
    if (s.yarn) {
      m.rotary_scaling_factor = s.yarn_factor;
      m.mscale = s.yarn_mscale;
      m.mscale_all_dim = s.yarn_mscale_all_dim;
    }
    m.rotary_interleaved = false;  // (the import permuted interleaved HF weights to rotate-half)
    if (s.num_experts > 0) {
      MoeConfig& e = m.moe;
      e.num_experts = s.num_experts;
      e.router_topk = s.moe_topk;
      e.ffn_hidden_size = s.moe_ffn_hidden_size;
      e.expert_ffn = s.moe_ffn_hidden_size;
      e.layer_pattern.assign(static_cast<size_t>(s.num_layers), 1);
      for (int l = 0; l < s.first_dense_layers; ++l) e.layer_pattern[static_cast<size_t>(l)] = 0;
      e.moe_layer.assign(e.layer_pattern.begin(), e.layer_pattern.end());
      e.score_function = MoeScoreFunction::sigmoid;
      if (s.routed_scaling_factor != 1.0) e.router_topk_scaling_factor = s.routed_scaling_factor;
      if (s.router_groups > 1) {
        e.router_num_groups = s.router_groups;
        e.router_group_topk = s.router_group_topk;
      }
      if (s.shared_expert_ffn > 0) e.shared_expert_intermediate_size = s.shared_expert_ffn;
      e.router_enable_expert_bias = s.expert_bias;
      e.aux_loss_coeff = {0.0};
    }
  } else if (s.num_experts > 0) {
    // Mixtral, Qwen2-MoE, Qwen3-MoE: softmax top-k (renormalized: Megatron's default router; or
    // not: --moe-router-pre-softmax), MoE layers where moe_layers says (every layer when empty),
    // Qwen2-MoE's gated shared expert.
    MoeConfig& e = m.moe;
    e.num_experts = s.num_experts;
    e.router_topk = s.moe_topk;
    e.ffn_hidden_size = s.moe_ffn_hidden_size;
    e.expert_ffn = s.moe_ffn_hidden_size;
    e.router_pre_softmax = !s.norm_topk_prob;
    e.layer_freq = 1;
    e.moe_layer.assign(static_cast<size_t>(s.num_layers), 1);
    if (!s.moe_layers.empty()) {
      e.layer_pattern = s.moe_layers;
      e.moe_layer.assign(s.moe_layers.begin(), s.moe_layers.end());
    }
    if (s.shared_expert_ffn > 0) e.shared_expert_intermediate_size = s.shared_expert_ffn;
    e.shared_expert_gate = s.shared_expert_gate;
    e.aux_loss_coeff = {s.router_aux_loss_coef};
  }
  return m;
}

namespace {

// The flags that train from the import (the user adds data, batch and optimizer flags): the
// model's settings as the flag table records them for this run (`flags`: checkpoint_config_json's,
// through Megatron's argument names as export-megatron writes them, app/megatron_args.h), the
// tokenizer's, and the choices a training run of it makes besides: grouped GEMMs and all-to-all
// dispatch for MoE, and Megatron's --no-rope-fusion for multi-latent attention with plain RoPE.
std::vector<std::string> training_flags(const ModelConfig& m, const json& flags, const std::string& save_dir) {
  const PickleRef args = megatron_args_from_flags(flags);
  std::vector<std::string> f = megatron_model_flags(*args, "import-hf", /*every_setting=*/true);
  for (const std::string& t : megatron_tokenizer_flags(*args, "import-hf")) f.push_back(t);
  if (m.moe.enabled()) f.insert(f.end(), {"--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall"});
  if (m.multi_latent_attention && m.rope_type != "yarn") f.push_back("--no-rope-fusion");
  f.insert(f.end(), {"--load", save_dir});
  return f;
}

// The HF checkpoint's tensors, from model.safetensors or the files an index names.
class HfTensors {
 public:
  explicit HfTensors(const std::string& dir) {
    const std::string index = join_path(dir, "model.safetensors.index.json");
    std::set<std::string> names;
    if (path_exists(index)) {
      json j;
      try {
        j = json::parse(read_text_file(index));
        for (auto it = j.at("weight_map").begin(); it != j.at("weight_map").end(); ++it)
          names.insert(it.value().get<std::string>());
      } catch (const json::exception& e) {
        fail("{} is not a valid safetensors index: {}", index, e.what());
      }
    } else if (path_exists(join_path(dir, "model.safetensors"))) {
      names.insert("model.safetensors");
    } else {
      fail("{} has neither model.safetensors nor model.safetensors.index.json (save the model with "
           "save_pretrained(..., safe_serialization=True))", dir);
    }
    for (const auto& n : names) files_.push_back(std::make_unique<SafetensorsFile>(join_path(dir, n)));
    for (const auto& f : files_)
      for (const auto& e : f->entries()) unused_.insert(e.name);
  }

  // The tensor `name` (GPT-2 checkpoints from the original release lack the "transformer." prefix).
  HostArray take(const std::string& name) {
    const SafetensorsEntry* e = find(name);
    if (!e && name.rfind("transformer.", 0) == 0) e = find(name.substr(12));
    if (!e) fail("the Hugging Face checkpoint has no tensor '{}'", name);
    unused_.erase(e->name);
    if (!e->dtype) fail("Hugging Face tensor '{}' has dtype {}, which megatrain does not hold", name, e->dtype_string);
    HostArray a;
    a.dtype = *e->dtype;
    a.shape = e->shape;
    a.bytes.assign(e->data, e->data + e->nbytes());
    return a;
  }
  const std::set<std::string>& unused() const { return unused_; }

 private:
  const SafetensorsEntry* find(const std::string& name) const {
    for (const auto& f : files_)
      if (const SafetensorsEntry* e = f->find(name)) return e;
    return nullptr;
  }
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::set<std::string> unused_;
};

}  // namespace

HfImportResult import_hf(const std::string& hf_dir, const std::string& save_dir, int divisible_by, int tp) {
  if (divisible_by <= 0) fail("import-hf: --make-vocab-size-divisible-by must be > 0 (got {})", divisible_by);
  if (tp <= 0) fail("import-hf: --tensor-model-parallel-size must be > 0 (got {})", tp);
  const std::string config_path = join_path(hf_dir, "config.json");
  json config;
  try {
    config = json::parse(read_text_file(config_path));
  } catch (const json::exception& e) {
    fail("{} is not valid JSON: {}", config_path, e.what());
  }
  HfImportResult r;
  r.spec = hf_spec_from_config(config, divisible_by, tp);
  HfTensors hf(hf_dir);
  // DeepSeek-V3's multi-token prediction depths (model.layers.{L + j}): a model transformers saved
  // has none (it builds no MTP layers, whatever num_nextn_predict_layers says): import it without
  // them, as transformers runs it. Some of a depth's tensors but not all stays an error (below).
  if (r.spec.arch == HfArchitecture::deepseek_v3 && r.spec.mtp_layers > 0) {
    const std::string first = fmt::format("model.layers.{}.", r.spec.num_layers);
    const bool any = std::any_of(hf.unused().begin(), hf.unused().end(),
                                 [&](const std::string& n) { return n.rfind(first, 0) == 0; });
    if (!any) {
      log::warn0("import-hf: config.json asks for {} multi-token prediction depth(s) (num_nextn_predict_layers) but the "
                 "checkpoint holds no {}* tensors: imported without them, as transformers runs the model",
                 r.spec.mtp_layers, first);
      r.spec.mtp_layers = 0;
    }
  }
  r.model = model_config_from_hf(r.spec, divisible_by);

  CheckpointWriter writer(save_dir, 0, 0, 1, /*release=*/true);
  std::vector<HostArray> held;  // the writer reads them at save()
  const std::vector<HfTensorMapping> mappings = hf_tensor_mappings(r.spec);
  held.reserve(mappings.size());
  for (const HfTensorMapping& m : mappings) {
    std::vector<HostArray> in;
    for (const std::string& n : m.hf) in.push_back(hf.take(n));
    if (m.ours.empty() || m.transform == HfTransform::vocab_rows_copy) continue;  // (zeros; a second copy)
    held.push_back(import_hf_tensor(m, r.spec, in));
    const HostArray& a = held.back();
    const int64_t rows = a.shape[0], cols = a.shape.size() == 2 ? a.shape[1] : 1;
    writer.add(m.ours, CheckpointKind::model, ShardIndex::whole(rows, cols),
               Tensor(const_cast<unsigned char*>(a.bytes.data()), a.dtype, Device::cpu, {a.numel()}), m.our_shape);
  }
  // Tensors the mapping does not use: a tied lm_head copy, attention-mask buffers, rotary tables;
  // Qwen3-Next's multi-token prediction layers (mtp.*, which transformers leaves unused too) in one line.
  int64_t mtp = 0;
  for (const std::string& n : hf.unused()) {
    if (n.rfind("mtp.", 0) == 0) {
      ++mtp;
      continue;
    }
    if (!(n == "lm_head.weight" && !r.spec.untie_embeddings_and_output_weights) && n.find("attn.bias") == std::string::npos &&
        n.find("masked_bias") == std::string::npos && n.find("rotary_emb.inv_freq") == std::string::npos)
      log::warn0("import-hf: the Hugging Face tensor '{}' has no megatrain counterpart and is not imported", n);
  }
  if (mtp > 0)
    log::warn0("import-hf: {} multi-token prediction tensors (mtp.*) are not imported (transformers does not use them "
               "either)", mtp);

  // The flags of this model as a training run would save them, for --use-checkpoint-args
  // (app/checkpoint_cli_args.h): the same settings the printed flag line gives.
  Config as_run;
  as_run.model = r.model;
  as_run.parallel.tensor_model_parallel_size = tp;
  if (path_exists(join_path(hf_dir, "tokenizer.json"))) {
    as_run.data.tokenizer_type = "HuggingFaceTokenizer";
    as_run.data.tokenizer_model = hf_dir;
  } else {
    as_run.data.tokenizer_type = "NullTokenizer";
    as_run.data.vocab_size = r.spec.vocab_size;
  }
  RunState rs;
  rs.config = json{{"model", model_config_to_json(r.model)},
                   {"flags", checkpoint_config_json(as_run).at("flags")},
                   {"imported_from", hf_dir}};
  writer.set_run_state(rs);
  writer.save(SaveGroup{});
  r.flags = training_flags(r.model, rs.config.at("flags"), save_dir);
  return r;
}

int import_hf_main(const std::vector<std::string>& args) {
  const SubcommandArgs a("import-hf", args,
                         {"--hf-dir", "--save", "--make-vocab-size-divisible-by", "--tensor-model-parallel-size"});
  const std::string hf_dir = a.required("--hf-dir", "DIR (a Hugging Face model directory)");
  const std::string save = a.required("--save", "CKPT (where the megatrain checkpoint goes)");
  const int divisible = static_cast<int>(a.integer("--make-vocab-size-divisible-by", 128));
  const int tp = static_cast<int>(a.integer("--tensor-model-parallel-size", 1));
  const HfImportResult r = import_hf(hf_dir, save, divisible, tp);
  const std::string line = shell_quoted_line(r.flags);
  std::printf("imported %s (%s, %d layers, vocabulary %d padded to %d) into %s as a release checkpoint\n",
              hf_dir.c_str(), hf_architecture_name(r.spec.arch),
              r.spec.num_layers, r.spec.vocab_size, r.spec.padded_vocab_size, save.c_str());
  std::printf("train from it with these model flags (plus your data, batch and optimizer flags; loading a release "
              "checkpoint restores the weights only and starts at iteration 0):\n%s\n", line.c_str());
  return 0;
}

}  // namespace mt

// megatrain export-hf: a checkpoint (any parallel layout) as a Hugging Face model directory.
#include <fmt/format.h>

#include <cstdio>
#include <iostream>

#include "app/checkpoint_args.h"
#include "app/hf_commands.h"
#include "app/subcommand_args.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/file_io.h"
#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "core/shape_text.h"

namespace mt {

using nlohmann::json;

HfArchitecture hf_architecture_of(const ModelConfig& m) {
  // The family a model belongs to; HfModelSpec::validate() then refuses what that family cannot
  // express (naming the flag).
  bool windowed = false;
  for (int layer = 0; layer < m.num_layers; ++layer) windowed = windowed || attention_window_left(m, layer) >= 0;
  const bool qkv_bias_only = m.add_qkv_bias && !m.add_bias_linear;
  if (m.multi_latent_attention) return HfArchitecture::deepseek_v3;  // (with MoE layers or without)
  if (m.gated_delta_net) return HfArchitecture::qwen3_next;        // (dense or MoE)
  if (m.moe.enabled()) {  // (validate() names what the family cannot express)
    if (m.qk_layernorm) return HfArchitecture::qwen3_moe;
    return qkv_bias_only ? HfArchitecture::qwen2_moe : HfArchitecture::mixtral;
  }
  if (m.squared_relu) return HfArchitecture::nemotron;
  if (m.normalization == Normalization::rmsnorm || m.swiglu || m.position_embedding_type == PositionEmbedding::rope) {
    if (m.qk_layernorm) return HfArchitecture::qwen3;
    if (qkv_bias_only) return HfArchitecture::qwen2;
    return windowed ? HfArchitecture::mistral : HfArchitecture::llama;  // Mistral: Llama with a sliding window
  }
  return HfArchitecture::gpt2;
}

namespace {

const char* torch_dtype_of(DType t) {
  switch (t) {
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    case DType::f64: return "float64";
    default: return "float32";
  }
}

}  // namespace

std::vector<std::string> export_hf(const HfExportOptions& o) {
  CheckpointReader reader(o.load, o.ckpt_step);
  const std::string manifest = join_path(reader.directory(), "manifest.json");
  const RunState& rs = reader.run_state();
  if (!rs.config.contains("model"))
    fail("{} records no model configuration: cannot tell which Hugging Face model it is", manifest);
  const ModelConfig m = model_config_from_json(rs.config.at("model"), manifest);
  if (m.position_embedding_type == PositionEmbedding::yarn)
    throw Unsupported("export-hf does not map --position-embedding-type yarn (a YaRN rope_scaling) yet");
  if (m.use_mup)
    throw Unsupported("export-hf does not map --use-mup models (their embedding and logit multipliers and softmax "
                      "scale) yet");
  HfModelSpec spec = HfModelSpec::from_model_config(m, hf_architecture_of(m));
  if (spec.arch == HfArchitecture::deepseek_v3 && spec.norm_epsilon != 1e-6)
    fmt::print(stderr, "note: transformers' DeepSeek-V3 normalizes the MLA latents with eps 1e-6; this model's "
                       "--norm-epsilon is {} (its other norms keep it as rms_norm_eps)\n", spec.norm_epsilon);
  if (m.mtp_num_layers.value_or(0) > 0 && spec.arch != HfArchitecture::deepseek_v3)  // (DeepSeek-V3's has a place)
    fmt::print(stderr, "note: export-hf leaves out the {} multi-token prediction layer(s) (mtp.layers.*): the Hugging "
                       "Face model has no place for them\n", *m.mtp_num_layers);
  const DType dtype = reader.info("embedding.word_embeddings.weight").dtype;
  spec.torch_dtype = torch_dtype_of(dtype);
  if (rs.config.contains("derived")) {
    const int eod = rs.config["derived"].value("eod_id", -1);
    if (eod >= 0 && eod < spec.vocab_size) spec.eos_token_id = eod;
  }
  const std::vector<HfTensorMapping> mappings = hf_tensor_mappings(spec);  // validates the spec

  // Shards: consecutive mappings, a new file once the next would pass the limit (the outputs of
  // one mapping, e.g. q/k/v, stay together).
  std::vector<std::vector<size_t>> shards(1);
  std::vector<uint64_t> shard_bytes(1, 0);
  uint64_t total = 0;
  for (size_t i = 0; i < mappings.size(); ++i) {
    if (mappings[i].ours.empty()) {  // (zeros of HF's: float32)
      shards.back().push_back(i);
      continue;
    }
    const CheckpointTensorInfo& info = reader.info(mappings[i].ours);
    if (info.global_shape != mappings[i].our_shape)
      fail("{}: tensor '{}' is {} but its recorded model configuration makes it {}", manifest, mappings[i].ours,
           shape_text(info.global_shape), shape_text(mappings[i].our_shape));
    uint64_t bytes = 0;
    for (const auto& s : mappings[i].hf_shapes) bytes += static_cast<uint64_t>(shape_numel(s)) * dtype_size(info.dtype);
    if (!shards.back().empty() && shard_bytes.back() + bytes > o.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes.push_back(0);
    }
    shards.back().push_back(i);
    shard_bytes.back() += bytes;
    total += bytes;
  }

  make_directories(o.output);
  std::vector<std::string> files;
  json weight_map = json::object();
  for (size_t f = 0; f < shards.size(); ++f) {
    const std::string name = shards.size() == 1 ? std::string("model.safetensors")
                                                : fmt::format("model-{:05d}-of-{:05d}.safetensors", f + 1, shards.size());
    std::vector<HostArray> held;  // the shard's tensors stay in memory until the file is written
    held.reserve(16);
    SafetensorsWriter w(join_path(o.output, name));
    w.set_metadata("format", "pt");
    std::vector<std::pair<std::string, size_t>> order;
    for (size_t i : shards[f]) {
      const HfTensorMapping& mp = mappings[i];
      if (mp.ours.empty()) {  // a tensor the HF model has and this one does not: zeros
        order.push_back({mp.hf[0], held.size()});
        held.push_back(HostArray::zeros(DType::f32, mp.hf_shapes[0]));
        weight_map[mp.hf[0]] = name;
        continue;
      }
      const CheckpointTensorInfo& info = reader.info(mp.ours);
      HostArray ours = HostArray::zeros(info.dtype, mp.our_shape);
      Tensor view(ours.bytes.data(), info.dtype, Device::cpu, {ours.numel()});
      reader.read(mp.ours, CheckpointKind::model,
                  ShardSlice::whole(ShardIndex::whole(info.global_rows, info.global_cols)), view, mp.our_shape);
      std::vector<HostArray> out = export_hf_tensor(mp, spec, ours);
      for (size_t k = 0; k < out.size(); ++k) {
        order.push_back({mp.hf[k], held.size()});
        held.push_back(std::move(out[k]));
        weight_map[mp.hf[k]] = name;
      }
    }
    for (const auto& [hf_name, at] : order) w.add(hf_name, held[at].dtype, held[at].shape, held[at].bytes.data());
    w.finish(/*durable=*/true);
    files.push_back(name);
  }
  if (shards.size() > 1) {
    const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_file_atomically(join_path(o.output, "model.safetensors.index.json"), index.dump(2) + "\n");
  } else {
    remove_tree(join_path(o.output, "model.safetensors.index.json"));  // a stale one would win in transformers
  }
  write_file_atomically(join_path(o.output, "config.json"), hf_config_json(spec).dump(2) + "\n");
  return files;
}

int export_hf_main(const std::vector<std::string>& args) {
  const SubcommandArgs a("export-hf", args, {"--load", "--ckpt-step", "--output", "--max-shard-size"});
  HfExportOptions o;
  o.load = a.required("--load", "CKPT (the checkpoint directory to export)");
  o.output = a.required("--output", "DIR (where config.json and model.safetensors go)");
  if (a.get("--ckpt-step")) o.ckpt_step = a.integer("--ckpt-step", 0);
  const int64_t limit = a.integer("--max-shard-size", static_cast<int64_t>(o.max_shard_bytes));
  if (limit <= 0) fail("export-hf: --max-shard-size must be > 0 bytes (got {})", limit);
  o.max_shard_bytes = static_cast<uint64_t>(limit);
  const std::vector<std::string> files = export_hf(o);
  std::printf("exported %s to %s: config.json and %zu safetensors file%s\n", o.load.c_str(), o.output.c_str(),
              files.size(), files.size() == 1 ? "" : "s (model.safetensors.index.json maps them)");
  return 0;
}

}  // namespace mt

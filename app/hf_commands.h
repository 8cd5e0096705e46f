// Hugging Face conversion and a logits dump, as subcommands:
//   megatrain export-hf --load CKPT [--ckpt-step N] --output DIR [--max-shard-size BYTES]
//       config.json + model.safetensors (GPT2LMHeadModel or LlamaForCausalLM), sharded with
//       model.safetensors.index.json above --max-shard-size (default 5 GB, as transformers'
//       save_pretrained), from a checkpoint of any parallel layout.
//   megatrain import-hf --hf-dir DIR --save CKPT [--make-vocab-size-divisible-by N]
//                       [--tensor-model-parallel-size N]
//       a megatrain "release" checkpoint (Megatron's converters' iteration-0 semantics: loading it
//       restores the weights only) and the Megatron flags that describe the model.
//   megatrain forward-logits --load CKPT [--ckpt-step N] --tokens 1,2,3 --output logits.npy
//                            [--device cpu|gpu] [--bf16]
//       the logits of one sequence (float32 [tokens, vocab] .npy), for checks against other
//       implementations; the model comes from the checkpoint's recorded configuration.
// The mapping itself (names, layouts, config.json) is checkpoint/hf_names.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/hf_names.h"
#include "core/config.h"

namespace mt {

int export_hf_main(const std::vector<std::string>& args);
int import_hf_main(const std::vector<std::string>& args);
int forward_logits_main(const std::vector<std::string>& args);

// GPT2LMHeadModel for LayerNorm + learned positions, LlamaForCausalLM for RMSNorm + RoPE + SwiGLU
// (MistralForCausalLM with a sliding window, Qwen2ForCausalLM with q/k/v biases only); other
// combinations are refused naming the flag (HfModelSpec::validate).
HfArchitecture hf_architecture_of(const ModelConfig& m);

struct HfExportOptions {
  std::string load;
  std::optional<int64_t> ckpt_step;
  std::string output;
  uint64_t max_shard_bytes = 5000000000ull;  // transformers' "5GB"
};
// Returns the safetensors files written (names inside `output`).
std::vector<std::string> export_hf(const HfExportOptions& o);

struct HfImportResult {
  HfModelSpec spec;
  ModelConfig model;
  std::vector<std::string> flags;  // the Megatron flags describing the model (and --load)
};
HfImportResult import_hf(const std::string& hf_dir, const std::string& save_dir, int make_vocab_size_divisible_by = 128,
                         int tensor_parallel_size = 1);

// The ModelConfig (derived values included) an HF model spec describes.
ModelConfig model_config_from_hf(const HfModelSpec& spec, int make_vocab_size_divisible_by);

// Logits [tokens.size(), vocab_size] (the tokenizer's vocabulary, padding columns dropped) of the
// checkpoint's model on one sequence, float32, row-major; computed in float32, or bf16 (GPU only).
std::vector<float> forward_logits(const std::string& load, std::optional<int64_t> ckpt_step,
                                  const std::vector<int32_t>& tokens, DeviceKind device, int* vocab_size,
                                  bool bf16 = false);

}  // namespace mt

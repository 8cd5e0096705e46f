#include "app/unsupported.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

namespace mt::cli {

namespace {
using W = UnsupportedRule::When;
}

const std::vector<UnsupportedRule>& unsupported_rules() {
  static const std::vector<UnsupportedRule> rules = {
      // model (1.1)
      {"--decoder-num-layers", W::any_use, {}, "encoder-decoder models"},
      {"--decoder-seq-length", W::any_use, {}, "encoder-decoder models"},
      {"--position-embedding-type", W::values, {"mrope", "relative"}, ""},
      {"--spec", W::any_use, {}, ""},
      {"--mtp-use-repeated-layer", W::any_use, {}, "multi-token prediction"},
      {"--mtp-detach-heads", W::any_use, {}, "multi-token prediction"},
      {"--mtp-hsm", W::any_use, {}, "multi-token prediction"},
      {"--experimental-attention-variant", W::values, {"gdn2", "dsa"},
       "Gated DeltaNet 2 and DeepSeek sparse attention layers (gated_delta_net / gdn is built)"},
      {"--apply-residual-connection-post-layernorm", W::any_use, {}, "the residual is each block's input, not its norm's output"},
      {"--fp32-residual-connection", W::any_use, {},
       "the residual stream is kept in the activation dtype"},
      // parallelism (1.2)
      {"--expert-tensor-parallel-size", W::conditional, {}, "", false,
       "with --num-experts, values not dividing --tensor-model-parallel-size not supported yet"},
      // training (1.3)
      {"--optimizer", W::values, {"lion", "soap", "adaptive_muon"}, ""},
      {"--dataloader-type", W::values, {"external"}, "megatrain reads in the order of Megatron's single and cyclic loaders"},
      // mixed precision (1.4)
      {"--fp16-lm-cross-entropy", W::any_use, {}, "the loss is computed in fp32"},
      {"--main-params-dtype", W::other_than, {"fp32"}, "fp32 master weights only"},
      {"--exp-avg-dtype", W::values, {"fp16", "fp8"}, "fp32 or bf16 moments (fp16 and fp8 need per-tensor scaling)"},
      {"--exp-avg-sq-dtype", W::values, {"fp16", "fp8"}, "fp32 or bf16 moments (fp16 and fp8 need per-tensor scaling)"},
      // data and tokenizer (1.5)
      {"--tokenizer-type",
       W::values,
       {"BertWordPieceLowerCase", "BertWordPieceCase", "TikTokenizer", "MultimodalTokenizer", "NullMultimodalTokenizer",
        "SFTTokenizer"},
       "use GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer "
       "or NullTokenizer"},
      {"--vocab-extra-ids", W::other_than, {"0"}, ""},
      // checkpointing (1.6)
      {"--ckpt-format", W::values, {"zarr"}, "use torch_dist (the default) or torch"},
      {"--non-persistent-ckpt-type", W::values, {"local"}, "per-rank local checkpoints (nvidia-resiliency-ext)"},
      {"--non-persistent-local-ckpt-dir", W::any_use, {}, "local non-persistent checkpoints"},
      {"--non-persistent-local-ckpt-algo", W::other_than, {"fully_parallel"}, "local non-persistent checkpoints"},
      // recompute (1.8)
      {"--distribute-saved-activations", W::any_use, {}, ""},
      // regularization / init (1.9)
      {"--init-method-xavier-uniform", W::any_use, {},
       "Megatron-LM with Megatron-Core 0.20 fails on it too: TransformerConfig has no scaled_init_method"},
      // distributed (1.10)
      {"--megatron-fsdp-version", W::other_than, {"1"}, "use 1, the default: the same sharding"},
      {"--enable-full-sharding-in-hsdp", W::any_use, {}, ""},
      {"--torch-fsdp2-no-reshard-after-forward", W::any_use, {}, "FSDP2's ZeRO-2 variant"},
      {"--megatron-fsdp-enable-fine-grained-param-gather", W::any_use, {}, ""},
      {"--nccl-communicator-config-path", W::any_use, {}, ""},
      {"--use-sharp", W::any_use, {}, ""},
      {"--sharp-enabled-group", W::any_use, {}, ""},
      // mixture of experts (1.11): built are top-k routing (softmax or sigmoid, pre-softmax, groups,
      // scaling), the aux and z losses, shared experts, on one expert-parallel rank (TP+SP: ETP = TP). Refused
      // after Megatron's rules (app/validate_moe.cpp), so that an invalid combination gets Megatron's
      // error first; the values with no Config representation at parse time.
      {"--num-experts", W::conditional, {}, "", false,
       "with --fp4-format not supported yet"},
      {"--moe-router-load-balancing-type", W::values, {"quantile_balancing"},
       "built: aux_loss, seq_aux_loss, global_aux_loss, sinkhorn, none"},
      {"--moe-router-dtype", W::values, {"fp64"}, "the router computes in fp32", true},
      {"--moe-latent-size", W::any_use, {}, ""},
      {"--moe-use-upcycling", W::any_use, {}, ""},
      {"--moe-upcycling-granularity", W::other_than, {"1"}, ""},
      {"--moe-router-quantile-balancing-ema", W::other_than, {"0"}, "quantile balancing"},
      // FP8 / FP4 (1.12)
      {"--fp8-recipe", W::values, {"mxfp8", "blockwise", "custom"}, "FP8 recipes built: delayed, tensorwise"},
      {"--fp8-quantizer-factory", W::any_use, {}, "FP8 recipes built: delayed, tensorwise"},
      {"--fp8-interval", W::other_than, {"1"}, ""},
      {"--fp8-dot-product-attention", W::any_use, {},
       "attention runs in bf16 with FP8 linear layers (cuDNN's FP8 attention backward also needs head "
       "dimension 128 on Hopper); drop --fp8-dot-product-attention"},
      {"--fp8-multi-head-attention", W::any_use, {},
       "attention runs in bf16 with FP8 linear layers; drop --fp8-multi-head-attention"},
      {"--fp4-format", W::any_use, {}, ""},
      {"--fp4-recipe", W::other_than, {"nvfp4"}, ""},
      {"--fp4-param-gather", W::any_use, {}, ""},
      {"--te-rng-tracker", W::any_use, {}, ""},
      {"--cuda-graph-impl", W::other_than, {"none"}, ""},
      {"--enable-cuda-graph", W::any_use, {}, ""},
      {"--cuda-graph-modules", W::any_use, {}, "CUDA graphs"},
      {"--cuda-graph-warmup-steps", W::other_than, {"3"}, "CUDA graphs"},
      {"--external-cuda-graph", W::any_use, {}, ""},
      // the rest of Megatron-LM's command line (app/cli_other.cpp)
      {"--export-model-type", W::other_than, {"GPTModel"}, ""},
      {"--export-legacy-megatron", W::any_use, {}, ""},
      {"--export-real-quant-cfg", W::any_use, {}, "ModelOpt quantization"},
      {"--export-quant-cfg", W::any_use, {}, "ModelOpt quantization"},
      {"--finetune-hf-dataset", W::any_use, {}, ""},
      {"--qad-train-target", W::any_use, {}, ""},
      {"--freeze-base-for-mtp", W::any_use, {}, ""},
      {"--export-qk-l2-norm", W::any_use, {}, "megatrain's own flag for it: --qk-l2-norm"},
      {"--export-moe-apply-probs-on-input", W::any_use, {}, "megatrain's own flag for it: --moe-apply-probs-on-input"},
      {"--export-offline-model", W::any_use, {}, ""},
      {"--modelopt-enabled", W::any_use, {}, ""},
      {"--adlr-autoresume", W::any_use, {}, ""},
      {"--batch-invariant-mode", W::any_use, {}, ""},
      {"--cpu-offloading-num-layers", W::other_than, {"0"}, ""},
      {"--ddp-param-name-patterns-for-fp32-local-accumulation", W::any_use, {}, ""},
      {"--ddp-reduce-scatter-with-fp32-accumulation", W::any_use, {}, ""},
      {"--dump-param-to-param-group-map", W::any_use, {}, ""},
      {"--enable-ft-package", W::any_use, {}, ""},
      {"--enable-mhc-connections", W::any_use, {}, ""},
      {"--enable-msc", W::any_use, {}, ""},
      {"--expert-tensor-parallel-num-weight-shards", W::any_use, {}, ""},
      {"--fake-process-group", W::any_use, {}, ""},
      {"--fault-injector-delay-start-iteration", W::any_use, {}, ""},
      {"--fault-injector-fault-delay", W::any_use, {}, ""},
      {"--fault-injector-fault-probabilities", W::any_use, {}, ""},
      {"--fault-injector-fault-types", W::any_use, {}, ""},
      {"--fault-injector-mtti-seconds", W::any_use, {}, ""},
      {"--fault-injector-num-ranks", W::any_use, {}, ""},
      {"--fault-injector-offset-seconds", W::any_use, {}, ""},
      {"--fault-injector-ranks", W::any_use, {}, ""},
      {"--fault-injector-seed", W::any_use, {}, ""},
      {"--fp4-quantizer-factory", W::any_use, {}, ""},
      {"--fp8-output-proj", W::any_use, {}, ""},
      {"--freeze-all-layers", W::any_use, {}, ""},
      {"--full-validation", W::any_use, {}, ""},
      {"--heterogeneous-layers-config-encoded-json", W::any_use, {}, ""},
      {"--heterogeneous-layers-config-path", W::any_use, {}, ""},
      {"--hybrid-context-parallel", W::any_use, {}, ""},
      {"--hybrid-layer-pattern", W::any_use, {}, ""},
      {"--hybrid-override-pattern", W::any_use, {}, ""},
      {"--inference-rng-tracker", W::any_use, {}, ""},
      {"--inprocess-restart", W::any_use, {}, ""},
      {"--is-hybrid-model", W::any_use, {}, ""},
      {"--kitchen-config-file", W::any_use, {}, ""},
      {"--kitchen-recipe-number", W::any_use, {}, ""},
      {"--lazy-mpu-init", W::any_use, {}, ""},
      {"--load-main-params-from-ckpt", W::any_use, {}, ""},
      {"--log-max-attention-logit", W::any_use, {}, ""},
      {"--logits-load-dir", W::any_use, {}, ""},
      {"--logits-save-dir", W::any_use, {}, ""},
      {"--max-seqlen-per-dp-cp-rank", W::any_use, {}, ""},
      {"--mlp-chunks-for-training", W::other_than, {"1"}, ""},
      {"--moe-combine-bwd-dtype", W::other_than, {"bf16"}, ""},
      {"--moe-dispatch-fwd-dtype", W::other_than, {"bf16"}, ""},
      {"--moe-enable-routing-replay", W::any_use, {}, ""},
      {"--moe-expert-rank-capacity-factor", W::any_use, {}, ""},
      {"--moe-mlp-glu-interleave-size", W::any_use, {}, ""},
      {"--moe-paged-stash", W::any_use, {}, ""},
      {"--moe-routing-trace-path", W::any_use, {}, ""},
      {"--moe-shared-expert-glu-interleave-size", W::any_use, {}, ""},
      {"--mtp-hybrid-override-pattern", W::any_use, {}, ""},
      {"--mtp-standalone", W::any_use, {}, ""},
      {"--multiple-validation-sets", W::any_use, {}, ""},
      {"--no-pad-vocab-size", W::any_use, {}, ""},
      {"--no-save-tokenizer-assets", W::any_use, {}, ""},
      {"--no-strict-fsdp-dtensor-load", W::any_use, {}, ""},
      {"--no-tokenizer-sentencepiece-ignore-extra-whitespaces", W::any_use, {}, ""},
      {"--nvtx-ranges", W::any_use, {}, ""},
      {"--optimizer-cpu-offload", W::any_use, {}, ""},
      {"--optimizer-cuda-graph", W::any_use, {}, ""},
      {"--output-logit-dtype", W::any_use, {}, ""},
      {"--per-dataset-sequences-path", W::any_use, {}, ""},
      {"--perform-rl-step", W::any_use, {}, ""},
      {"--phase-transition-iterations", W::any_use, {}, ""},
      {"--pipeline-model-parallel-comm-backend", W::values, {"ucc"}, ""},
      {"--qk-clip", W::any_use, {}, ""},
      {"--replication", W::any_use, {}, ""},
      {"--result-rejected-tracker-filename", W::any_use, {}, ""},
      {"--sample-rate", W::other_than, {"1.0"}, ""},
      {"--save-activations-interval", W::any_use, {}, ""},
      {"--save-dgrads-interval", W::any_use, {}, ""},
      {"--save-params-interval", W::any_use, {}, ""},
      {"--save-tokens-per-expert-interval", W::any_use, {}, ""},
      {"--save-wgrads-interval", W::any_use, {}, ""},
      {"--sft", W::any_use, {}, ""},
      {"--te-precision-config-file", W::any_use, {}, ""},
      {"--tensor-parallel-num-weight-shards", W::any_use, {}, ""},
      {"--tokenizer-hf-no-include-special-tokens", W::any_use, {}, ""},
      {"--tokenizer-metadata", W::any_use, {}, ""},
      {"--tokenizer-sentencepiece-legacy", W::any_use, {}, ""},
      {"--use-kitchen-attention", W::any_use, {}, ""},
      {"--yaml-cfg", W::any_use, {}, ""},
  };
  return rules;
}

namespace {

// Equal as numbers when both parse as numbers ("0.0" == "0", "1e-3" == "0.001"), else as text.
bool same_value(const std::string& a, const std::string& b) {
  if (a == b) return true;
  char* ea = nullptr;
  char* eb = nullptr;
  const double x = std::strtod(a.c_str(), &ea);
  const double y = std::strtod(b.c_str(), &eb);
  return !a.empty() && !b.empty() && *ea == '\0' && *eb == '\0' && x == y;
}

bool in(const std::string& v, const std::vector<std::string>& set) {
  for (const auto& s : set)
    if (same_value(v, s)) return true;
  return false;
}

std::string describe(const std::string& flag, const std::vector<std::string>& values) {
  std::string s = flag;
  for (const auto& v : values) s += " " + v;
  return s;
}

}  // namespace

std::vector<std::string> unsupported_problems(const std::map<std::string, FlagValue>& given, bool after_validation) {
  std::vector<std::string> problems;
  for (const UnsupportedRule& r : unsupported_rules()) {
    if (r.when == W::conditional || r.after_validation != after_validation) continue;
    auto it = given.find(r.flag);
    if (it == given.end()) continue;
    const std::vector<std::string>& vals = it->second.values;
    std::vector<std::string> bad;
    switch (r.when) {
      case W::any_use:
        bad = vals;
        break;
      case W::other_than:
        for (const auto& v : vals)
          if (!in(v, r.values)) bad.push_back(v);
        if (bad.empty()) continue;
        break;
      case W::values:
        for (const auto& v : vals)
          if (in(v, r.values)) bad.push_back(v);
        if (bad.empty()) continue;
        break;
      case W::conditional:
        continue;
    }
    std::string line = "megatrain does not support " + describe(r.flag, r.when == W::any_use ? vals : bad) + " yet";
    if (!r.why.empty()) line += " (" + r.why + ")";
    problems.push_back(std::move(line));
  }
  return problems;
}

std::string unsupported_summary(const std::string& flag) {
  // Every rule of the flag, joined with "; " (the refused values of several rules as one list).
  std::vector<std::string> parts, refused_values;
  for (const UnsupportedRule& r : unsupported_rules()) {
    if (r.flag != flag) continue;
    std::string list;
    for (const auto& v : r.values) list += (list.empty() ? "" : ", ") + (v.empty() ? std::string("''") : v);
    switch (r.when) {
      case W::any_use: parts.push_back("not supported yet"); break;
      case W::other_than: parts.push_back("accepted only as " + list + " (the default); other values not supported yet"); break;
      case W::values: refused_values.push_back(list); break;
      case W::conditional: parts.push_back(r.summary); break;
    }
  }
  if (!refused_values.empty()) {
    std::string list;
    for (const auto& l : refused_values) list += (list.empty() ? "" : ", ") + l;
    parts.insert(parts.begin(), "values " + list + " not supported yet");
  }
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : "; ") + p;
  return out;
}

bool fully_unsupported(const std::string& flag) {
  for (const UnsupportedRule& r : unsupported_rules())
    if (r.flag == flag && (r.when == W::any_use || r.when == W::other_than)) return true;
  return false;
}

}  // namespace mt::cli

// megatrain forward-logits: the logits of one token sequence under a checkpoint's model, for
// comparisons with other implementations (tests/hf/: transformers, numpy). The model is built
// from the configuration the checkpoint records; weights load as --finetune loads them.
#include <fmt/format.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "app/checkpoint_args.h"
#include "app/checkpointing.h"
#include "app/hf_commands.h"
#include "app/subcommand_args.h"
#include "app/train.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/file_io.h"
#include "core/error.h"
#include "engine/gpt_model.h"
#include "parallel/parallel_state.h"

namespace mt {

namespace {

std::vector<int32_t> parse_tokens(const std::string& text) {
  std::vector<int32_t> out;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    size_t used = 0;
    long v = -1;
    try {
      v = std::stol(item, &used);
    } catch (...) {
      used = 0;
    }
    if (used != item.size() || item.empty() || v < 0)
      fail("forward-logits: --tokens must be comma-separated non-negative token ids (got '{}')", item);
    out.push_back(static_cast<int32_t>(v));
    at = comma + 1;
  }
  return out;
}

// numpy .npy version 1.0, little-endian float32, C order.
void write_npy_f32(const std::string& path, const std::vector<float>& data, int64_t rows, int64_t cols) {
  std::string header = fmt::format("{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {}), }}", rows, cols);
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::string bytes("\x93NUMPY\x01\x00", 8);
  const uint16_t len = static_cast<uint16_t>(header.size());
  bytes.push_back(static_cast<char>(len & 0xff));
  bytes.push_back(static_cast<char>(len >> 8));
  bytes += header;
  bytes.append(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(float));
  write_file_atomically(path, bytes);
}

}  // namespace

std::vector<float> forward_logits(const std::string& load, std::optional<int64_t> ckpt_step,
                                  const std::vector<int32_t>& tokens, DeviceKind device, int* vocab_size, bool bf16) {
  if (tokens.empty()) fail("forward-logits: no tokens");
  const CheckpointReader reader(load, ckpt_step);
  const std::string manifest = join_path(reader.directory(), "manifest.json");
  if (!reader.run_state().config.contains("model"))
    fail("{} records no model configuration: forward-logits cannot build the model", manifest);

  Config cfg;
  cfg.model = model_config_from_json(reader.run_state().config.at("model"), manifest);
  const int n = static_cast<int>(tokens.size());
  if (n > cfg.model.max_position_embeddings)
    fail("forward-logits: {} tokens exceed the model's {} positions", n, cfg.model.max_position_embeddings);
  for (int32_t t : tokens)
    if (t >= cfg.model.vocab_size) fail("forward-logits: token {} is outside the vocabulary of {}", t, cfg.model.vocab_size);
  cfg.model.seq_length = n;
  cfg.train.micro_batch_size = 1;
  cfg.train.global_batch = 1;
  cfg.train.num_microbatches = 1;
  cfg.train.device = device;
  cfg.train.optimizer = OptimizerKind::sgd;  // no optimizer state to allocate
  cfg.train.sgd_momentum = 0;
  cfg.checkpoint.load = load;
  cfg.checkpoint.ckpt_step = ckpt_step;
  cfg.checkpoint.finetune = true;  // weights only

  ParallelState ps = make_single_process_state();
  std::unique_ptr<Backend> backend = make_backend(cfg);
  const ModelDims dims = ModelDims::from_config(cfg, ps);
  if (bf16 && device != DeviceKind::gpu) fail("forward-logits: --bf16 needs --device gpu");
  ModelOptions options = ModelOptions::from_config(cfg, dims, bf16 ? DType::bf16 : DType::f32);
  options.logits_chunk_rows = n;  // all rows' logits at once: they are the output
  GptModel model(dims, options, ps, *backend);
  TrainingCheckpoints(cfg, ps, model).load();

  MicroBatch mb;
  mb.resize(1, n);
  for (int t = 0; t < n; ++t) {
    mb.tokens[t] = tokens[t];
    mb.labels[t] = t + 1 < n ? tokens[t + 1] : 0;
    mb.loss_mask[t] = 1.0f;
    mb.positions[t] = t;
    mb.segments[t] = 0;
  }
  model.stage_micro_batch(0, mb, 1.0, false, 0, /*training=*/false);
  model.forward(0);
  const Tensor logits = model.logits();
  std::vector<float> all(static_cast<size_t>(logits.numel()));
  if (logits.dtype == DType::f32) {
    backend->copy_to_host(all.data(), logits);
  } else {
    std::vector<uint16_t> half(all.size());
    backend->copy_to_host(half.data(), logits);
    for (size_t i = 0; i < all.size(); ++i) all[i] = bf16_bits_to_float(half[i]);
  }
  const int64_t V = dims.vocab_local(), v = cfg.model.vocab_size;
  std::vector<float> out(static_cast<size_t>(n) * v);
  for (int t = 0; t < n; ++t) std::memcpy(&out[static_cast<size_t>(t) * v], &all[static_cast<size_t>(t) * V], v * sizeof(float));
  if (vocab_size) *vocab_size = static_cast<int>(v);
  return out;
}

int forward_logits_main(const std::vector<std::string>& args) {
  const SubcommandArgs a("forward-logits", args, {"--load", "--ckpt-step", "--tokens", "--output", "--device"},
                         {"--bf16"});
  const std::string load = a.required("--load", "CKPT");
  const std::string output = a.required("--output", "FILE (a .npy of float32 [tokens, vocab])");
  const std::vector<int32_t> tokens = parse_tokens(a.required("--tokens", "IDS (comma-separated token ids)"));
  std::optional<int64_t> step;
  if (a.get("--ckpt-step")) step = a.integer("--ckpt-step", 0);
  const std::string dev = a.get("--device").value_or("cpu");
  if (dev != "cpu" && dev != "gpu") fail("forward-logits: --device must be cpu or gpu (got '{}')", dev);
  int vocab = 0;
  const std::vector<float> logits = forward_logits(load, step, tokens, dev == "gpu" ? DeviceKind::gpu : DeviceKind::cpu, &vocab, a.has("--bf16"));
  write_npy_f32(output, logits, static_cast<int64_t>(tokens.size()), vocab);
  std::printf("wrote logits [%zu, %d] to %s\n", tokens.size(), vocab, output.c_str());
  return 0;
}

}  // namespace mt

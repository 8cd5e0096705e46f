// Megatron-LM's mixture-of-experts checkpoints (tests/fixtures/megatron/moe*, written by Megatron-LM's
// own save code: tests/fixtures/megatron/README.md): import-megatron of each layout (torch_dist, with
// the experts of every layer stacked or not, across files under expert parallelism; torch, one file,
// expert-parallel rank files, tensor-parallel rank files), then the imported model's loss of every
// token of Megatron-LM's batch against the loss Megatron-LM computed for it (forward.json).
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "app/checkpoint_args.h"
#include "app/checkpointing.h"
#include "app/import_megatron.h"
#include "app/train.h"
#include "checkpoint/checkpoint_io.h"
#include "ckpt_test_util.h"
#include "core/error.h"
#include "data/batch.h"
#include "engine/gpt_model.h"
#include "parallel/parallel_state.h"

using mt_test::read_bytes;
using mt_test::TempDir;

namespace {

const std::string kFixtures = "tests/fixtures/megatron";

// The loss of every token (sample-major [b][s]) of the model in a megatrain checkpoint, in
// float32 on the reference backend, over the padded vocabulary as Megatron-LM's loss takes it.
std::vector<std::vector<double>> token_losses(const std::string& ckpt, const std::vector<std::vector<int>>& tokens,
                                              const std::vector<std::vector<int>>& labels) {
  const mt::CheckpointReader reader(ckpt);
  mt::Config cfg;
  cfg.model = mt::model_config_from_json(reader.run_state().config.at("model"), ckpt);
  const int B = static_cast<int>(tokens.size()), S = static_cast<int>(tokens[0].size());
  cfg.model.seq_length = S;
  cfg.train.micro_batch_size = B;
  cfg.train.global_batch = B;
  cfg.train.num_microbatches = 1;
  cfg.train.device = mt::DeviceKind::cpu;
  cfg.train.optimizer = mt::OptimizerKind::sgd;
  cfg.train.sgd_momentum = 0;
  cfg.checkpoint.load = ckpt;
  cfg.checkpoint.finetune = true;
  mt::ParallelState ps = mt::make_single_process_state();
  std::unique_ptr<mt::Backend> be = mt::make_backend(cfg);
  const mt::ModelDims dims = mt::ModelDims::from_config(cfg, ps);
  mt::ModelOptions options = mt::ModelOptions::from_config(cfg, dims, mt::DType::f32);
  options.logits_chunk_rows = int64_t{B} * S;
  mt::GptModel model(dims, options, ps, *be);
  mt::TrainingCheckpoints(cfg, ps, model).load();
  mt::MicroBatch mb;
  mb.resize(B, S);
  for (int b = 0; b < B; ++b)
    for (int s = 0; s < S; ++s) {
      const size_t k = static_cast<size_t>(b) * S + s;
      mb.tokens[k] = tokens[b][s];
      mb.labels[k] = labels[b][s];
      mb.loss_mask[k] = 1.0f;
      mb.positions[k] = s;
      mb.segments[k] = 0;
    }
  model.stage_micro_batch(0, mb, 1.0, false, 0, /*training=*/false);
  model.forward(0);
  const mt::Tensor logits = model.logits();
  const int64_t V = dims.vocab_local();
  REQUIRE(logits.numel() == int64_t{B} * S * V);
  std::vector<float> all(static_cast<size_t>(logits.numel()));
  be->copy_to_host(all.data(), logits);
  std::vector<std::vector<double>> out(static_cast<size_t>(B), std::vector<double>(static_cast<size_t>(S)));
  for (int b = 0; b < B; ++b)
    for (int s = 0; s < S; ++s) {
      const float* row = all.data() + (static_cast<size_t>(s) * B + b) * V;  // (rows are sequence-major)
      double m = row[0], sum = 0;
      for (int64_t v = 1; v < V; ++v) m = std::max(m, static_cast<double>(row[v]));
      for (int64_t v = 0; v < V; ++v) sum += std::exp(row[v] - m);
      out[b][s] = m + std::log(sum) - row[labels[b][s]];
    }
  return out;
}

}  // namespace

TEST_CASE("import-megatron: Megatron-LM's mixture-of-experts checkpoints give Megatron-LM's losses",
          "[megatron-import][moe]") {
  // moe: a dense layer, then two MoE layers (4 experts, top-2 softmax, a gated shared expert);
  // moe_bias: two MoE layers, all stacked in torch_dist (8 experts, sigmoid, group-limited top-3,
  // scaling, the expert bias); moe_ep2 / moe_tp2: the moe model saved over 2 expert-parallel /
  // tensor-parallel (+SP) ranks.
  for (const char* dir : {"moe/dist", "moe/torch", "moe_bias/dist", "moe_bias/torch", "moe_ep2/dist", "moe_ep2/torch",
                          "moe_tp2/torch"}) {
    INFO(dir);
    const std::string model = std::string(dir).substr(0, std::string(dir).find('/'));
    const nlohmann::json oracle = nlohmann::json::parse(read_bytes(kFixtures + "/" + model + "/forward.json"));
    const auto tokens = oracle.at("tokens").get<std::vector<std::vector<int>>>();
    const auto labels = oracle.at("labels").get<std::vector<std::vector<int>>>();
    const auto want = oracle.at("losses").get<std::vector<std::vector<double>>>();
    TempDir tmp;
    const mt::MegatronImportResult r = mt::import_megatron(kFixtures + "/" + dir, std::nullopt, tmp / "ckpt");
    CHECK_FALSE(r.resumable);  // (saved without optimizer state)
    CHECK(r.model.moe.num_experts == (model == "moe_bias" ? 8 : 4));
    const auto got = token_losses(tmp / "ckpt", tokens, labels);
    double worst = 0;
    for (size_t b = 0; b < want.size(); ++b)
      for (size_t s = 0; s < want[b].size(); ++s) worst = std::max(worst, std::fabs(got[b][s] - want[b][s]));
    INFO("losses " << want[0][0] << " ... (Megatron-LM) and " << got[0][0] << " ... (megatrain); worst difference "
                   << worst);
    // float32 on both sides, summed in other orders, losses between 1.3 and 11.2 (measured: at most
    // 1.5e-5; moe_tp2's 2.4e-5, whose own losses differ from Megatron-LM's one-rank run's by 1.1e-5).
    // A wrong expert, norm or bias moves them by 1e-2 or more.
    CHECK(worst < 4e-5);
  }
}

TEST_CASE("import-megatron: what megatrain does not read of Megatron-LM's MoE checkpoints is named",
          "[megatron-import][moe][errors]") {
  TempDir tmp;
  // An expert-parallel rank's files gone.
  std::filesystem::copy(kFixtures + "/moe_ep2/torch", tmp / "torch", std::filesystem::copy_options::recursive);
  std::filesystem::remove_all(tmp / "torch/iter_0000003/mp_rank_00_001");
  CHECK_THROWS_WITH(mt::import_megatron(tmp / "torch", std::nullopt, tmp / "out"),
                    Catch::Contains("1 rank directories") && Catch::Contains("x expert parallel 2"));
}

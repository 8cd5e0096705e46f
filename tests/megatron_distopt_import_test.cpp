// Megatron-LM's optimizer state in import-megatron where it is not stored by parameter name: the
// distributed optimizer's flat buffers (torch_dist's per-bucket ones and the torch format's
// distrib_optim.pt) and the torch format's index-keyed state, checked on real Megatron-LM checkpoints
// (tests/fixtures/megatron/make_optimizer_fixtures.sh): every parameter's main weights must be its
// model weights, and a CPU run resumed from the import must repeat the losses Megatron-LM printed
// after the save.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "app/cli.h"
#include "app/import_megatron.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/megatron_checkpoint.h"
#include "checkpoint/megatron_flat_layout.h"
#include "ckpt_test_util.h"
#include "core/environment.h"
#include "core/error.h"
#include "engine/loss_scaler.h"
#include "parallel/pipeline_layout.h"

using mt_test::losses_and_norms;
using mt_test::read_bytes;
using mt_test::run_command;
using mt_test::TempDir;

namespace {

const std::string kFixtures = "tests/fixtures/megatron";

// The flags of make_optimizer_fixtures.sh (without --use-distributed-optimizer: one CPU process).
const std::string kCommon =
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 60 "
    "--make-vocab-size-divisible-by 32 --seq-length 32 --max-position-embeddings 32 --split 99,1,0 --log-interval 1 "
    "--eval-iters 0 --eval-interval 1000 --attention-dropout 0 --hidden-dropout 0 --seed 1234";
const std::string kLlama =
    "--num-layers 4 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
    "--untie-embeddings-and-output-weights --qk-layernorm";

// make_cpu_curves.sh's MoE models (STRAIGHT=1): softmax top-2 with the aux and z-losses and a
// gated shared expert after a dense layer; sigmoid group-limited top-3 with scaling and the expert bias.
const std::string kLlamaMoe =
    "--hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
    "--untie-embeddings-and-output-weights";
const std::string kMoe = "--num-layers 3 " + kLlamaMoe +
                         " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24 --moe-layer-freq [0,1,1] "
                         "--moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --moe-shared-expert-intermediate-size 16 "
                         "--moe-shared-expert-gate";
const std::string kMoeBias = "--num-layers 2 " + kLlamaMoe +
                             " --num-experts 8 --moe-router-topk 3 --moe-ffn-hidden-size 16 --moe-router-score-function "
                             "sigmoid --moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk-scaling-factor "
                             "2.0 --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-2 --moe-aux-loss-coeff 1e-2";

// make_mla_fixtures.sh's model: multi-latent attention with a query LoRA and latent norms, YaRN.
const std::string kMla =
    "--num-layers 2 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --multi-latent-attention "
    "--q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 4 --v-head-dim 8 --qk-layernorm "
    "--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
    "--position-embedding-type rope --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --rotary-base 10000";

std::vector<std::string> words(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

using Slots = std::vector<mt::FlatSlot>;
bool same(const Slots& a, const Slots& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].bucket != b[i].bucket || a[i].offset != b[i].offset) return false;
  return true;
}

}  // namespace

TEST_CASE("megatron_flat_slots lays parameters out as Megatron's DistributedDataParallel does", "[megatron-import]") {
  using mt::FlatParam;
  // registration order A, B, C: laid out backwards (C, B, A), each start a multiple of 64
  const std::vector<FlatParam> abc = {{"A", 10}, {"B", 100}, {"C", 5}};
  CHECK(same(mt::megatron_flat_slots(abc, {202}, "t"), Slots{{0, 192}, {0, 64}, {0, 0}}));
  // a bucket closes after the parameter that reaches its size
  CHECK(same(mt::megatron_flat_slots(abc, {164, 10}, "t"), Slots{{1, 0}, {0, 64}, {0, 0}}));
  CHECK(same(mt::megatron_flat_slots(abc, {5, 100, 10}, "t"), Slots{{2, 0}, {1, 0}, {0, 0}}));
  // the tied word embeddings of a pipelined first stage: a bucket of their own, the one before
  // closed where they would have started
  const std::vector<FlatParam> first_stage = {{"emb", 30, true}, {"layer", 7}};
  CHECK(same(mt::megatron_flat_slots(first_stage, {64, 30}, "t"), Slots{{1, 0}, {0, 0}}));
  // the last stage's copy (registered last: laid out first)
  const std::vector<FlatParam> last_stage = {{"layer", 7}, {"", 30, true}};
  CHECK(same(mt::megatron_flat_slots(last_stage, {30, 7}, "t"), Slots{{1, 0}, {0, 0}}));
  // stored sizes the parameters do not fit
  CHECK_THROWS_WITH(mt::megatron_flat_slots(abc, {100}, "chunk X"),
                    Catch::Contains("chunk X") && Catch::Contains("bucket 0 is stored with 100 elements") &&
                        Catch::Contains("end at 164"));
  CHECK_THROWS_WITH(mt::megatron_flat_slots(abc, {202, 5}, "t"), Catch::Contains("fill 1 of the 2 stored buckets"));
  CHECK_THROWS_WITH(mt::megatron_flat_slots(abc, {164}, "t"), Catch::Contains("more than the 1 stored buckets"));
  CHECK_THROWS_WITH(mt::megatron_flat_slots(abc, {300}, "t"), Catch::Contains("stored with 300 elements"));

  // The sizes Megatron's bucket-size rule gives (the torch format does not store them)
  CHECK(mt::megatron_flat_bucket_sizes(abc, std::nullopt) == std::vector<int64_t>{202});
  CHECK(mt::megatron_flat_bucket_sizes(abc, 100) == std::vector<int64_t>{164, 10});
  CHECK(mt::megatron_flat_bucket_sizes(abc, 5) == std::vector<int64_t>{5, 100, 10});
  CHECK(mt::megatron_flat_bucket_sizes(first_stage, std::nullopt) == std::vector<int64_t>{64, 30});
  CHECK(mt::megatron_flat_bucket_sizes(last_stage, 1000) == std::vector<int64_t>{30, 7});
}

TEST_CASE("import-megatron carries the distributed optimizer's flat buckets over", "[megatron-import]") {
  struct Case {
    const char* dir;
    bool bf16;
  };
  for (const Case c : {Case{"llama/distopt_dp2", false}, Case{"llama/distopt_tp2pp2vpp", false},
                       Case{"gpt/distopt_tp2pp2vpp", true}, Case{"llama/torch_distopt_dp2", false}}) {
    INFO(c.dir);
    const mt::MegatronCheckpoint ck(kFixtures + "/" + c.dir, std::nullopt);
    CHECK(ck.optimizer_layout() == "flat buckets");
    CHECK(ck.distributed_optimizer());
    // the torch format's distrib_optim.pt: each chunk's buckets end to end
    CHECK(ck.flat_coalesced() == (ck.format() == "torch"));
    REQUIRE(ck.optimizer_step() == 3);
    TempDir tmp;
    // the import checks every parameter's main weights against its model weights
    const mt::MegatronImportResult r = mt::import_megatron(kFixtures + "/" + c.dir, std::nullopt, tmp / "ckpt", false);
    CHECK(r.resumable);
    CHECK(r.weights_only_reason.empty());
    CHECK(r.optimizer_source ==
          (ck.format() == "torch" ? "the distributed optimizer's distrib_optim.pt" : "the distributed optimizer's flat buckets"));
    mt::CheckpointReader reader(tmp / "ckpt");
    CHECK(reader.iteration() == 3);
    CHECK(reader.run_state().extra.at("optimizer").at("successful_steps") == 3);
    CHECK(reader.run_state().consumed_train_samples == 12);
    int params = 0;
    for (const std::string& name : reader.names()) {
      INFO(name);
      CHECK(reader.has(name + ".exp_avg", mt::CheckpointKind::optimizer));
      CHECK(reader.has(name + ".exp_avg_sq", mt::CheckpointKind::optimizer));
      // float32 main weights beside bf16 model weights only
      CHECK(reader.has(name, mt::CheckpointKind::main_params) == c.bf16);
      ++params;
    }
    CHECK(params == (c.bf16 ? 52 : 35));
  }
}

TEST_CASE("import-megatron carries the torch format's index-keyed optimizer state over", "[megatron-import]") {
  struct Case {
    const char* dir;
    bool bf16;
  };
  for (const Case c : {Case{"llama/torch_tp2pp2", false}, Case{"gpt/torch_tp2pp2vpp", true}}) {
    INFO(c.dir);
    const mt::MegatronCheckpoint ck(kFixtures + "/" + c.dir, std::nullopt);
    CHECK(ck.format() == "torch");
    CHECK(ck.optimizer_layout() == "by index");
    CHECK_FALSE(ck.distributed_optimizer());
    REQUIRE(ck.optimizer_step() == 3);
    // two param groups per rank file: with weight decay, then without
    const std::vector<mt::MegatronCheckpoint::IndexedGroup> groups = ck.indexed_groups(1, 1);
    REQUIRE(groups.size() == 2);
    CHECK(groups[0].wd_mult == 1.0);
    CHECK(groups[1].wd_mult == 0.0);
    TempDir tmp;
    // bf16: every parameter's float32 main weights (fp32_from_fp16_params) checked against it;
    // float32: every state's shape against the parameter's shard
    const mt::MegatronImportResult r = mt::import_megatron(kFixtures + "/" + c.dir, std::nullopt, tmp / "ckpt", false);
    CHECK(r.resumable);
    CHECK(r.optimizer_source == "the optimizer's state keyed by parameter index");
    mt::CheckpointReader reader(tmp / "ckpt");
    CHECK(reader.iteration() == 3);
    CHECK(reader.run_state().extra.at("optimizer").at("successful_steps") == 3);
    CHECK(reader.run_state().consumed_train_samples == 12);
    for (const std::string& name : reader.names()) {
      INFO(name);
      CHECK(reader.has(name + ".exp_avg_sq", mt::CheckpointKind::optimizer));
      CHECK(reader.has(name, mt::CheckpointKind::main_params) == c.bf16);
    }
  }
}

TEST_CASE("import-megatron carries --fp16's dynamic loss-scaler state over", "[megatron-import]") {
  // Megatron-LM ran --fp16 --initial-loss-scale 512 --loss-scale-window 4 --hysteresis 2: after 3
  // clean iterations the scaler holds scale 512, growth tracker 3, hysteresis tracker 2, and its
  // log shows the scale doubling in iteration 4.
  for (const char* dir : {"gpt/fp16_torch", "gpt/fp16_dist"}) {
    INFO(dir);
    const std::string path = kFixtures + "/" + dir;
    std::istringstream log(mt_test::read_bytes(path + "_iterations.log"));
    std::vector<std::string> lines;
    for (std::string line; std::getline(log, line);) lines.push_back(line);
    REQUIRE(lines.size() == 6);
    CHECK(lines[2].find("loss scale: 512.0 |") != std::string::npos);
    CHECK(lines[3].find("loss scale: 1024.0 |") != std::string::npos);
    const mt::MegatronCheckpoint ck(path, std::nullopt);
    const std::optional<mt::MegatronCheckpoint::GradScalerState> g = ck.grad_scaler();
    REQUIRE(g);
    CHECK(g->scale == 512.0);
    CHECK(g->growth_tracker == 3);
    CHECK(g->hysteresis_tracker == 2);
    TempDir tmp;
    const mt::MegatronImportResult r = mt::import_megatron(path, std::nullopt, tmp / "ckpt", false);
    CHECK(r.resumable);
    mt::CheckpointReader reader(tmp / "ckpt");
    const nlohmann::json& s = reader.run_state().loss_scaler;
    CHECK(s.at("kind") == "dynamic");
    CHECK(s.at("scale") == 512.0);
    CHECK(s.at("growth_tracker") == 3);
    CHECK(s.at("hysteresis_tracker") == 2);
    for (const std::string& name : reader.names()) CHECK(reader.has(name, mt::CheckpointKind::main_params));
    // megatrain's scaler continued from that state doubles in the next clean iteration, as
    // Megatron-LM's did.
    mt::LossScaler scaler = mt::LossScaler::dynamic(512.0, 1.0, 4, 2);
    scaler.set_state(s.at("scale"), s.at("growth_tracker"), s.at("hysteresis_tracker"));
    scaler.update(false);
    CHECK(scaler.scale() == 1024.0);
  }
  // float32 and bf16 checkpoints have no scaler state
  CHECK_FALSE(mt::MegatronCheckpoint(kFixtures + "/llama/torch_tp2pp2", std::nullopt).grad_scaler());
  CHECK_FALSE(mt::MegatronCheckpoint(kFixtures + "/gpt/torch_tp2pp2vpp", std::nullopt).grad_scaler());
}

TEST_CASE("a damaged distrib_optim.pt is named", "[megatron-import]") {
  TempDir tmp;
  namespace fs = std::filesystem;
  fs::copy(kFixtures + "/llama/torch_distopt_dp2", tmp / "m", fs::copy_options::recursive);
  const std::string file = tmp / "m/iter_0000003/mp_rank_00/distrib_optim.pt";
  fs::resize_file(file, fs::file_size(file) / 2);
  CHECK_THROWS_WITH(mt::import_megatron(tmp / "m", std::nullopt, tmp / "ckpt", false),
                    Catch::Contains("distrib_optim.pt"));
  CHECK_FALSE(fs::exists(tmp / "ckpt/latest_checkpointed_iteration.txt"));
  // the weights alone do not need it
  fs::remove(file);
  const mt::MegatronImportResult r = mt::import_megatron(tmp / "m", std::nullopt, tmp / "weights", true);
  CHECK_FALSE(r.resumable);
  CHECK(mt::CheckpointReader(tmp / "weights").iteration() == 0);
}

TEST_CASE("flat buckets placed in the wrong order are caught", "[megatron-import]") {
  // The llama fixtures were saved by the local layer spec; Transformer Engine's order moves each
  // layer's input norm behind linear_proj, which changes where the buckets end. (Where an order
  // changed no bucket's size, check_main_weights below would stop the import.)
  std::vector<std::string> flags = words(kCommon + " " + kLlama + " --train-iters 1 --device cpu");
  std::vector<mt::SetupMessage> messages;
  const mt::Config cfg = mt::parse_config(flags, mt::Environment{}, &messages);
  auto mismatched = [&](mt::MegatronCheckpoint& ck) {
    int differ = 0;
    for (const std::string& name : ck.parameter_names()) {
      const mt::HostArray model = ck.parameter(name);
      const std::optional<mt::HostArray> main = ck.optimizer_state("fp32_param", name);
      REQUIRE(main);
      REQUIRE(main->bytes.size() == model.bytes.size());
      if (std::memcmp(main->bytes.data(), model.bytes.data(), model.bytes.size()) != 0) ++differ;
    }
    return differ;
  };
  mt::PipelineSplit dp2;
  dp2.num_layers = 4;
  mt::PipelineSplit vpp = dp2;
  vpp.pp = 2;
  vpp.vpp = 2;
  for (const bool te_spec : {false, true}) {
    INFO("te_spec " << te_spec);
    mt::MegatronCheckpoint buckets(kFixtures + "/llama/distopt_dp2", std::nullopt);  // 3000-element buckets
    const std::string why = mt::place_flat_optimizer_state(buckets, cfg, 1, dp2, te_spec);
    mt::MegatronCheckpoint chunks(kFixtures + "/llama/distopt_tp2pp2vpp", std::nullopt);
    const std::string why_chunks = mt::place_flat_optimizer_state(chunks, cfg, 2, vpp, te_spec);
    if (!te_spec) {
      REQUIRE(why.empty());
      REQUIRE(why_chunks.empty());
      CHECK(mismatched(buckets) == 0);
      CHECK(mismatched(chunks) == 0);
    } else {
      CHECK_THAT(why, Catch::Contains("do not fit") && Catch::Contains("dp_group_idx_0.gbuf_idx_0"));
      CHECK_THAT(why_chunks, Catch::Contains("do not fit") && Catch::Contains("tensor rank 0, pipeline rank 0"));
    }
  }
}

TEST_CASE("check_main_weights: the model weights must be the main weights, rounded", "[megatron-import]") {
  mt::HostArray main = mt::HostArray::zeros(mt::DType::f32, {2, 3});
  float* m = main.ptr<float>();
  for (int i = 0; i < 6; ++i) m[i] = 0.1f * static_cast<float>(i + 1) + 1e-4f;
  mt::HostArray f32 = main;
  CHECK_NOTHROW(mt::check_main_weights(main, f32, "w", "ckpt"));
  f32.ptr<float>()[4] += 1e-7f;
  CHECK_THROWS_WITH(mt::check_main_weights(main, f32, "w", "ckpt"),
                    Catch::Contains("'w'") && Catch::Contains("1 of 6 elements differ, the first at 4") &&
                        Catch::Contains("--weights-only"));
  mt::HostArray bf16 = mt::HostArray::zeros(mt::DType::bf16, {2, 3});
  for (int i = 0; i < 6; ++i) bf16.ptr<uint16_t>()[i] = mt::float_to_bf16_bits(m[i]);
  CHECK_NOTHROW(mt::check_main_weights(main, bf16, "w", "ckpt"));
  bf16.ptr<uint16_t>()[0] ^= 1;  // one unit in the last place
  CHECK_THROWS_WITH(mt::check_main_weights(main, bf16, "w", "ckpt"), Catch::Contains("the first at 0"));
  CHECK_THROWS_WITH(mt::check_main_weights(main, mt::HostArray::zeros(mt::DType::bf16, {3, 2}), "w", "ckpt"),
                    Catch::Contains("[2, 3]"));
}

TEST_CASE("import-megatron reads the distributed optimizer's fully reshardable layout", "[megatron-import]") {
  for (const char* dir : {"llama/distopt_dp2_full", "gpt/distopt_tp2pp2vpp_full"}) {
    INFO(dir);
    const mt::MegatronCheckpoint ck(kFixtures + "/" + dir, std::nullopt);
    CHECK(ck.optimizer_layout() == "by parameter");
    CHECK(ck.distributed_optimizer());
    CHECK(ck.optimizer_step() == 3);
    TempDir tmp;
    const mt::MegatronImportResult r = mt::import_megatron(kFixtures + "/" + dir, std::nullopt, tmp / "ckpt", false);
    CHECK(r.resumable);
    CHECK(r.optimizer_source == "the distributed optimizer's state by parameter name");
    CHECK(mt::CheckpointReader(tmp / "ckpt").run_state().extra.at("optimizer").at("successful_steps") == 3);
  }
}

TEST_CASE("a run resumed from Megatron-LM's optimizer state repeats Megatron-LM's losses", "[megatron-import][binary]") {
  // Megatron-LM trained 6 iterations in float32 (on H100s) and saved after 3 (torch_dist and torch
  // formats, distributed and not); megatrain's CPU reference backend resumes the import in one
  // process (data parallel 1, two micro-batches).
  // Also Megatron-LM's multi-latent attention (make_mla_fixtures.sh: torch_dist, the optimizer by
  // parameter name).
  // And Megatron-LM's MoE models, trained on the CPU (make_cpu_curves.sh STRAIGHT=1: torch_dist, the
  // optimizer by parameter name, or the distributed optimizer's flat buffer, each expert's fc1 and
  // fc2 a parameter of Megatron's own there; under EP 2 the experts' buffers a chained optimizer of
  // their own; the expert bias, a buffer, continues from the checkpoint's).
  for (const char* dir : {"llama/distopt_dp2", "llama/distopt_tp2pp2vpp", "llama/torch_tp2pp2", "llama/torch_distopt_dp2",
                          "mla/dist", "moe_resume/dist", "moe_bias_resume/dist", "moe_resume/distopt",
                          "moe_resume/distopt_ep2"}) {
    INFO(dir);
    const std::string d = dir;
    const std::string& model = d.rfind("mla/", 0) == 0         ? kMla
                               : d.rfind("moe_resume/", 0) == 0 ? kMoe
                               : d.rfind("moe_bias_resume/", 0) == 0 ? kMoeBias
                                                                   : kLlama;
    TempDir tmp;
    std::string imported, out;
    const int import_code = run_command(
        std::string(MEGATRAIN_BINARY) + " import-megatron --load " + kFixtures + "/" + dir + " --save " + (tmp / "ckpt"),
        &imported);
    INFO(imported);
    REQUIRE(import_code == 0);
    const int code = run_command(std::string(MEGATRAIN_BINARY) + " --device cpu " + kCommon + " " + model +
                                     " --train-iters 6 --load " + (tmp / "ckpt"),
                                 &out);
    INFO(out);
    REQUIRE(code == 0);
    const auto ours = losses_and_norms(out);
    const auto megatron = losses_and_norms(read_bytes(kFixtures + "/" + dir + "_iterations.log"));
    REQUIRE(megatron.size() == 6);
    REQUIRE(ours.size() == 3);
    // Megatron prints the loss with 7 significant digits and the gradient norm with 3 decimals.
    // Iteration 5, the second of a resumed run, prints the mean of iterations 4 and 5, as a
    // resumed Megatron-LM does (bench/RESULTS.md, 2026-11-28).
    const double want[3] = {megatron[3].first, (megatron[3].first + megatron[4].first) / 2, megatron[5].first};
    for (size_t i = 0; i < 3; ++i) {
      INFO("iteration " << i + 4);
      CHECK(std::abs(ours[i].first - want[i]) <= 3e-6);
      CHECK(std::abs(ours[i].second - megatron[i + 3].second) <= 1.5e-3);
    }
  }
}

TEST_CASE("Megatron-FSDP's fsdp_dtensor checkpoints resume to Megatron-LM's losses", "[megatron-import][binary]") {
  // make_fsdp_fixtures.sh: Megatron-LM trained 4 iterations under --use-megatron-fsdp (ZeRO-3,
  // float32, on the CPU) and saved after 2 in its fsdp_dtensor format: the model's main weights
  // with SwiGLU's linear_fc1 in two halves (weight_w, weight_v) and each expert its own tensor,
  // Adam's moments and a step per parameter, the args and scheduler as objects. megatrain imports
  // it and resumes iterations 3 and 4 (the second printed as the mean of both, as a resumed
  // Megatron-LM prints it).
  struct Case {
    const char* dir;
    std::string model;
    size_t tensors;
    const char* format = "fsdp_dtensor";
  };
  const std::string swiglu_llama = "--num-layers 2 " + kLlamaMoe;
  const std::string moe = "--num-layers 3 " + kLlamaMoe +
                          " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24 --moe-layer-freq [0,1,1] "
                          "--moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --moe-shared-expert-intermediate-size 16 "
                          "--moe-shared-expert-gate";
  // (fsdp/llama_tp2: saved by two processes at tensor parallel 2 with SP, each file holding its
  // rank's shards; resumed on one rank. fsdp/llama_torch_dcp: the same llama under torch FSDP2, in
  // its torch_dcp format: the unwrapped model's state dict, fc1 whole, Adam's state keyed by
  // index into the param groups.)
  for (const Case& c : {Case{"fsdp/llama", swiglu_llama, 15}, Case{"fsdp/moe", moe, 29},
                        Case{"fsdp/llama_tp2", swiglu_llama, 15},
                        Case{"fsdp/llama_torch_dcp", swiglu_llama, 15, "torch_dcp"}}) {
    INFO(c.dir);
    const std::string dir = kFixtures + "/" + c.dir;
    const mt::MegatronCheckpoint ck(dir, std::nullopt);
    CHECK(ck.format() == c.format);
    CHECK(ck.iteration() == 2);
    CHECK(ck.optimizer_layout() == "by parameter");
    CHECK(ck.distributed_optimizer());
    CHECK(ck.optimizer_step() == 2);
    // SwiGLU's halves stacked as megatrain (and Megatron's torch_dist) keep fc1: the gate's rows first.
    const mt::HostArray fc1 = ck.parameter("decoder.layers.0.mlp.linear_fc1.weight");
    CHECK(fc1.shape == std::vector<int64_t>{128, 32});
    TempDir tmp;
    const mt::MegatronImportResult r = mt::import_megatron(dir, std::nullopt, tmp / "ckpt", false);
    CHECK(r.resumable);
    CHECK(r.format == c.format);
    CHECK(r.tensors == static_cast<int>(c.tensors));
    CHECK(r.optimizer_source == "the distributed optimizer's state by parameter name");
    std::string out;
    const int code = run_command(std::string(MEGATRAIN_BINARY) + " --device cpu " + kCommon + " " + c.model +
                                     " --train-iters 4 --load " + (tmp / "ckpt"),
                                 &out);
    INFO(out);
    REQUIRE(code == 0);
    const auto ours = losses_and_norms(out);
    const auto megatron = losses_and_norms(read_bytes(dir + "_iterations.log"));
    REQUIRE(megatron.size() == 4);
    REQUIRE(ours.size() == 2);
    CHECK(std::abs(ours[0].first - megatron[2].first) <= 3e-6);
    CHECK(std::abs(ours[1].first - (megatron[2].first + megatron[3].first) / 2) <= 3e-6);
    CHECK(std::abs(ours[0].second - megatron[2].second) <= 1.5e-3);
    CHECK(std::abs(ours[1].second - megatron[3].second) <= 1.5e-3);
  }
}

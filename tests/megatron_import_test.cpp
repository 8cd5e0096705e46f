// Reading Megatron-LM's checkpoints: the pickle reader against Python's own pickles, and
// import-megatron on real Megatron-LM checkpoints (tests/fixtures/megatron/README.md): every
// layout (torch_dist; torch with TP 2 x PP 2, with and without virtual stages) must give exactly
// the tensors torch.load reads, and training from the import must repeat Megatron-LM's losses.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>

#include "app/import_megatron.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/megatron_checkpoint.h"
#include "checkpoint/pickle.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/torch_file.h"
#include "ckpt_test_util.h"
#include "core/error.h"
#include "python_oracle.h"

using mt_test::losses_and_norms;
using mt_test::read_bytes;
using mt_test::run_command;
using mt_test::TempDir;
namespace fs = std::filesystem;

namespace {

const std::string kFixtures = "tests/fixtures/megatron";

mt::PickleRef read_pickle_file(const std::string& path) {
  const std::string bytes = read_bytes(path);
  return mt::read_pickle(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), path);
}

std::vector<int64_t> ints_of(const mt::PickleValue& v) {
  std::vector<int64_t> out;
  for (const auto& i : v.items) {
    REQUIRE(i->is(mt::PickleKind::integer));
    out.push_back(i->integer);
  }
  return out;
}

// The model's tensors as the import wrote them, by name.
std::map<std::string, std::pair<mt::CheckpointTensorInfo, std::vector<unsigned char>>> read_import(const std::string& dir) {
  mt::CheckpointReader r(dir);
  std::map<std::string, std::pair<mt::CheckpointTensorInfo, std::vector<unsigned char>>> out;
  for (const std::string& name : r.names()) {
    const mt::CheckpointTensorInfo& info = r.info(name);
    const int64_t rows = info.global_shape[0], cols = info.global_shape.size() == 2 ? info.global_shape[1] : 1;
    std::vector<unsigned char> bytes(static_cast<size_t>(rows * cols) * mt::dtype_size(info.dtype));
    r.read(name, mt::ShardIndex::whole(rows, cols), mt::Tensor(bytes.data(), info.dtype, mt::Device::cpu, {rows * cols}));
    out[name] = {info, std::move(bytes)};
  }
  return out;
}

// The local implementation's norm names (expected.safetensors) as megatrain's.
std::string te_name(std::string n) {
  for (const auto& [from, to] : {std::pair<std::string, std::string>{"input_layernorm.", "self_attention.linear_qkv.layer_norm_"},
                                 {"pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"}}) {
    const size_t p = n.find(from);
    if (p != std::string::npos) n = n.substr(0, p) + to + n.substr(p + from.size());
  }
  return n;
}

}  // namespace

TEST_CASE("the pickle reader reads Python's pickles (protocols 2 and 4) as they were written", "[megatron-import]") {
  for (const char* file : {"pickle_protocol2.bin", "pickle_protocol4.bin"}) {
    INFO(file);
    const mt::PickleRef root = read_pickle_file(kFixtures + "/" + file);
    REQUIRE(root->is(mt::PickleKind::dict));
    const mt::PickleValue& data = root->at("data", file);
    CHECK(data.at("name", file).text == "megatrain");
    CHECK(ints_of(data.at("ints", file)) == std::vector<int64_t>{0, 1, -1, 255, 256, 65535, 65536, -2147483648LL,
                                                                 1LL << 40, -(1LL << 40), INT64_MAX});
    const mt::PickleValue& floats = data.at("floats", file);
    REQUIRE(floats.is(mt::PickleKind::tuple));
    REQUIRE(floats.items.size() == 3);
    CHECK(floats.items[0]->floating == 1.5);
    CHECK(std::signbit(floats.items[1]->floating));
    CHECK(floats.items[2]->floating == 1e-300);
    const mt::PickleValue& flags = data.at("flags", file);
    REQUIRE(flags.items.size() == 3);
    CHECK(flags.items[0]->boolean);
    CHECK_FALSE(flags.items[1]->boolean);
    CHECK(flags.items[2]->is(mt::PickleKind::none));
    // bytes: protocol 2 spells them _codecs.encode(text, "latin1"), protocol 4 as raw bytes
    const mt::PickleValue& raw = data.at("raw", file);
    REQUIRE(raw.is(mt::PickleKind::bytes));
    CHECK(raw.text == std::string("\x00\x80\xff", 3));
    const mt::PickleValue& nested = data.at("nested", file);  // an OrderedDict, in order
    REQUIRE(nested.is(mt::PickleKind::dict));
    REQUIRE(nested.entries.size() == 2);
    CHECK(nested.entries[0].first->text == "a");
    CHECK(nested.entries[0].second->at("b", file).is(mt::PickleKind::tuple));
    CHECK(ints_of(*nested.entries[1].second) == std::vector<int64_t>{1, 2, 3, 4});
    CHECK(data.at("unicode", file).text == "h\xc3\xa9llo \xe4\xb8\x96");
    // argparse.Namespace: an object whose attributes are its state dict
    const mt::PickleValue& args = root->at("args", file);
    CHECK(args.is_object("argparse.Namespace"));
    CHECK(args.at("num_layers", file).integer == 4);
    CHECK(args.at("lr", file).floating == 3e-4);
    CHECK(args.at("swiglu", file).boolean);
    CHECK(args.at("tokenizer_type", file).text == "GPT2BPETokenizer");
    CHECK(ints_of(args.at("window_size", file)) == std::vector<int64_t>{127, 0});
    CHECK(mt::megatron_arg(args, "seq") == nullptr);  // None
    CHECK(mt::megatron_arg(args, "absent") == nullptr);
    // the same list twice: a memo reference to one value
    const mt::PickleValue& shared = root->at("shared", file);
    REQUIRE(shared.items.size() == 2);
    CHECK(shared.items[0].get() == shared.items[1].get());
    CHECK(shared.items[0].get() == &data.at("ints", file));
  }
}

TEST_CASE("the pickle reader refuses damaged input with the file's name", "[megatron-import]") {
  const std::string bytes = read_bytes(kFixtures + "/pickle_protocol4.bin");
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  CHECK_THROWS_WITH(mt::read_pickle(p, bytes.size() - 20, "cut.pkl"),
                    Catch::Contains("cut.pkl") && Catch::Contains("unexpected end of data"));
  std::string bad = bytes;
  bad[12] = '\xff';  // not an opcode
  CHECK_THROWS_WITH(mt::read_pickle(reinterpret_cast<const unsigned char*>(bad.data()), bad.size(), "bad.pkl"),
                    Catch::Contains("bad.pkl") && Catch::Contains("unknown opcode 0xff"));
}

TEST_CASE("the pickle reader fails cleanly on every truncation and on corrupted bytes", "[megatron-import][errors]") {
  for (const char* file : {"pickle_protocol2.bin", "pickle_protocol4.bin"}) {
    const std::string bytes = read_bytes(kFixtures + "/" + file);
    const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
    for (size_t n = 0; n < bytes.size(); ++n) {
      INFO(file << " cut to " << n << " bytes");
      CHECK_THROWS_AS(mt::read_pickle(p, n, file), mt::Error);
    }
    // single-byte corruptions: read or refused with mt::Error, never anything else
    uint64_t state = 0x9e3779b97f4a7c15ull;
    for (int trial = 0; trial < 2000; ++trial) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      std::string bad = bytes;
      bad[static_cast<size_t>(state >> 33) % bad.size()] = static_cast<char>(state >> 13);
      try {
        mt::read_pickle(reinterpret_cast<const unsigned char*>(bad.data()), bad.size(), file);
      } catch (const mt::Error&) {
      }
    }
  }
}

TEST_CASE("import-megatron: every layout of a Megatron-LM checkpoint gives the tensors torch.load reads", "[megatron-import]") {
  for (const char* model : {"llama", "gpt"}) {
    const std::string dir = kFixtures + "/" + model;
    const mt::SafetensorsFile expected(dir + "/expected.safetensors");
    // (tp1_dist twice: the second time written in parts of one tensor each, as a large model's
    // import is, a few GB at a time)
    for (const char* layout : {"tp1_dist", "tp2pp2/torch", "tp2pp2/torch_dist", "tp2pp2vpp/torch", "tp1_dist parts"}) {
      INFO(model << " " << layout);
      TempDir tmp;
      const std::string source = std::string(layout) == "tp1_dist parts" ? "tp1_dist" : layout;
      const bool parts = source != layout;
      const mt::MegatronImportResult r =
          mt::import_megatron(dir + "/" + source, std::nullopt, tmp / "ckpt", false, parts ? 1 : uint64_t{4} << 30);
      if (parts) CHECK(mt::CheckpointReader(tmp / "ckpt").saved_world_size() == r.tensors);
      CHECK(r.format == (source.find("dist") != std::string::npos ? "torch_dist" : "torch"));
      CHECK(r.iteration == 3);
      const auto got = read_import(tmp / "ckpt");
      CHECK(got.size() == expected.entries().size());
      CHECK(static_cast<size_t>(r.tensors) == got.size());
      for (const mt::SafetensorsEntry& e : expected.entries()) {
        INFO(e.name);
        auto it = got.find(te_name(e.name));
        REQUIRE(it != got.end());
        const auto& [info, bytes] = it->second;
        REQUIRE(e.dtype);
        CHECK(info.dtype == *e.dtype);
        CHECK(info.global_shape == e.shape);
        REQUIRE(bytes.size() == e.nbytes());
        CHECK(std::memcmp(bytes.data(), e.data, bytes.size()) == 0);
      }
    }
  }
}

TEST_CASE("import-megatron: the model flags come from the checkpoint's args", "[megatron-import]") {
  TempDir tmp;
  const mt::MegatronImportResult llama = mt::import_megatron(kFixtures + "/llama/tp2pp2/torch", std::nullopt, tmp / "l");
  const std::string l = fmt::format("{}", fmt::join(llama.model_flags, " "));
  for (const char* f : {"--num-layers 4", "--hidden-size 32", "--ffn-hidden-size 64", "--group-query-attention",
                        "--num-query-groups 2", "--position-embedding-type rope", "--normalization RMSNorm", "--swiglu",
                        "--disable-bias-linear", "--qk-layernorm", "--untie-embeddings-and-output-weights",
                        "--make-vocab-size-divisible-by 32"})
    CHECK_THAT(l, Catch::Contains(f));
  CHECK_THAT(l, !Catch::Contains("--kv-channels") && !Catch::Contains("--tensor-model-parallel-size"));
  // A model without experts: Megatron's saved MoE defaults (--moe-router-topk 2, ...) are left out.
  CHECK_THAT(l, !Catch::Contains("--moe-") && !Catch::Contains("--num-experts"));
  CHECK(llama.model.padded_vocab_size == 64);
  CHECK(llama.model.swiglu);
  CHECK(llama.model.qk_layernorm);
  const mt::MegatronImportResult gpt = mt::import_megatron(kFixtures + "/gpt/tp1_dist", std::nullopt, tmp / "g");
  const std::string g = fmt::format("{}", fmt::join(gpt.model_flags, " "));
  CHECK_THAT(g, Catch::Contains("--position-embedding-type learned_absolute") && Catch::Contains("--normalization LayerNorm"));
  CHECK_THAT(g, !Catch::Contains("--rotary-base") && !Catch::Contains("--swiglu") && !Catch::Contains("--disable-bias-linear"));
  CHECK(fmt::format("{}", fmt::join(gpt.tokenizer_flags, " ")) == "--tokenizer-type NullTokenizer --vocab-size 60");
}

TEST_CASE("import-megatron: missing and damaged checkpoints are named", "[megatron-import][errors]") {
  TempDir tmp;
  CHECK_THROWS_WITH(mt::import_megatron(tmp.path(), std::nullopt, tmp / "out"),
                    Catch::Contains("latest_checkpointed_iteration.txt") && Catch::Contains(tmp.path()));
  // an iteration directory given itself
  const mt::MegatronImportResult direct =
      mt::import_megatron(kFixtures + "/gpt/tp1_dist/iter_0000003/", std::nullopt, tmp / "direct");
  CHECK(direct.iteration == 3);
  CHECK(direct.tensors == 52);
  CHECK_THROWS_WITH(mt::import_megatron(kFixtures + "/gpt/tp1_dist", 7, tmp / "out"),
                    Catch::Contains("iter_0000007 does not exist") && Catch::Contains("--ckpt-step"));
  // a pipeline rank's files gone
  fs::copy(kFixtures + "/gpt/tp2pp2/torch", tmp / "torch", fs::copy_options::recursive);
  fs::remove_all(tmp / "torch/iter_0000003/mp_rank_01_001");
  CHECK_THROWS_WITH(mt::import_megatron(tmp / "torch", std::nullopt, tmp / "out"),
                    Catch::Contains("3 rank directories") && Catch::Contains("tensor parallel 2 x pipeline parallel 2"));
  // a truncated shard file
  fs::copy(kFixtures + "/llama/tp1_dist", tmp / "dist", fs::copy_options::recursive);
  const std::string distcp = tmp / "dist/iter_0000003/__0_0.distcp";
  fs::resize_file(distcp, fs::file_size(distcp) / 2);
  CHECK_THROWS_WITH(mt::import_megatron(tmp / "dist", std::nullopt, tmp / "out"),
                    Catch::Contains("__0_0.distcp") && Catch::Contains("truncated"));
  CHECK_FALSE(fs::exists(tmp / "out/latest_checkpointed_iteration.txt"));
}

TEST_CASE("training from an imported Megatron-LM checkpoint repeats Megatron-LM's losses", "[megatron-import][binary]") {
  // The flags of make_fixtures.sh's llama run; Megatron-LM ran them in float32 on an H100, this
  // runs megatrain's CPU reference backend.
  const std::string flags =
      "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 3 --mock-data --tokenizer-type NullTokenizer "
      "--vocab-size 60 --make-vocab-size-divisible-by 32 --seq-length 32 --max-position-embeddings 32 --split 99,1,0 "
      "--log-interval 1 --eval-iters 0 --eval-interval 1000 --transformer-impl local --no-gradient-accumulation-fusion "
      "--no-masked-softmax-fusion --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm --attention-dropout 0 "
      "--hidden-dropout 0 --seed 1234 --num-layers 4 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 "
      "--group-query-attention --num-query-groups 2 --position-embedding-type rope --normalization RMSNorm --swiglu "
      "--disable-bias-linear --untie-embeddings-and-output-weights --qk-layernorm";
  TempDir tmp;
  std::string out;
  INFO(out);
  REQUIRE(run_command(std::string(MEGATRAIN_BINARY) + " import-megatron --load " + kFixtures +
                          "/llama/tp2pp2vpp/torch --save " + (tmp / "ckpt"),
                      &out) == 0);
  CHECK_THAT(out, Catch::Contains("Megatron-LM torch format, iteration 3, 35 tensors"));
  REQUIRE(run_command(std::string(MEGATRAIN_BINARY) + " --device cpu " + flags + " --load " + (tmp / "ckpt") + " --finetune",
                      &out) == 0);
  const auto ours = losses_and_norms(out);
  const auto megatron = losses_and_norms(read_bytes(kFixtures + "/llama/megatron_finetune_iterations.log"));
  REQUIRE(megatron.size() == 3);
  REQUIRE(ours.size() == megatron.size());
  for (size_t i = 0; i < ours.size(); ++i) {
    INFO("iteration " << i + 1);
    // Megatron prints the loss with 7 significant digits and the gradient norm with 3 decimals.
    CHECK(std::abs(ours[i].first - megatron[i].first) <= 3e-6);
    CHECK(std::abs(ours[i].second - megatron[i].second) <= 1.5e-3);
  }
}

TEST_CASE("import-megatron: a torch_dist checkpoint with its optimizer state becomes one to resume from", "[megatron-import][python]") {
  // tests/oracles/megatron_torch_dist_writer.py writes Megatron-Core's layout without torch (the
  // real files were compared on the GPU machine: bench/RESULTS.md, 2026-11-28).
  const auto python = mt::oracle::python_or_skip("import-megatron resume");
  if (!python) return;
  TempDir tmp;
  const nlohmann::json expected = nlohmann::json::parse(mt::oracle::run_capture(
      *python + " tests/oracles/megatron_torch_dist_writer.py " + mt::oracle::shell_quote(tmp / "megatron")));
  // in parts of about 20 kB: the resume below reads a checkpoint of several "ranks"
  const mt::MegatronImportResult r = mt::import_megatron(tmp / "megatron", std::nullopt, tmp / "ckpt", false, 20000);
  REQUIRE(r.resumable);
  CHECK(mt::CheckpointReader(tmp / "ckpt").saved_world_size() > 3);
  CHECK(r.iteration == 7);
  CHECK(r.weights_only_reason.empty());
  // --weights-only: a release checkpoint of the same weights
  const mt::MegatronImportResult w = mt::import_megatron(tmp / "megatron", std::nullopt, tmp / "weights", true);
  CHECK_FALSE(w.resumable);
  CHECK(mt::CheckpointReader(tmp / "weights").iteration() == 0);
  CHECK_FALSE(mt::CheckpointReader(tmp / "weights").has("output_layer.weight.exp_avg", mt::CheckpointKind::optimizer));

  mt::CheckpointReader reader(tmp / "ckpt");
  CHECK(reader.iteration() == 7);
  const mt::RunState& rs = reader.run_state();
  CHECK(rs.consumed_train_samples == 28);
  CHECK(rs.lr_scheduler.at("num_steps") == 28);
  CHECK(rs.lr_scheduler.at("lr_decay_style") == "cosine");
  CHECK(rs.lr_scheduler.at("lr_warmup_steps").get<double>() == 8);
  CHECK(rs.extra.at("optimizer").at("successful_steps") == 7);
  CHECK(rs.num_floating_point_operations_so_far == 1.5e12);
  // every array, by the writer's float64 sum and first element
  int checked = 0;
  for (const auto& [key, want] : expected.items()) {
    INFO(key);
    const std::string state = key.substr(0, key.find('/')), name = key.substr(key.find('/') + 1);
    mt::CheckpointKind kind = mt::CheckpointKind::model;
    std::string stored = name;
    if (state == "exp_avg" || state == "exp_avg_sq") {
      kind = mt::CheckpointKind::optimizer;
      stored = name + "." + state;
    } else if (state == "fp32_param") {
      kind = mt::CheckpointKind::main_params;
    }
    REQUIRE(reader.has(stored, kind));
    const mt::CheckpointTensorInfo& info = reader.info(stored, kind);
    CHECK(info.global_shape == want.at("shape").get<std::vector<int64_t>>());
    CHECK(info.dtype == (kind == mt::CheckpointKind::model ? mt::DType::bf16 : mt::DType::f32));
    const int64_t n = info.global_shape.size() == 2 ? info.global_shape[0] * info.global_shape[1] : info.global_shape[0];
    std::vector<float> values(static_cast<size_t>(n));
    const int64_t rows = info.global_shape[0], cols = info.global_shape.size() == 2 ? info.global_shape[1] : 1;
    reader.read(stored, kind, mt::ShardSlice::whole(mt::ShardIndex::whole(rows, cols)),
                mt::Tensor(values.data(), mt::DType::f32, mt::Device::cpu, {n}));
    double sum = 0;
    for (float v : values) sum += v;
    CHECK(values[0] == want.at("first").get<float>());
    CHECK(sum == Approx(want.at("sum").get<double>()).margin(1e-9).epsilon(1e-9));
    ++checked;
  }
  CHECK(checked == 4 * 15);

  // and training resumes from it at iteration 8
  const std::string flags =
      "--device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 60 --make-vocab-size-divisible-by 32 "
      "--seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --train-iters 8 "
      "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 --lr-decay-iters 20 --weight-decay 0.01 "
      "--attention-dropout 0 --hidden-dropout 0 --log-interval 1 --eval-iters 0 --num-layers 2 --hidden-size 32 "
      "--ffn-hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
      "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
      "--untie-embeddings-and-output-weights";
  std::string out;
  const int code = run_command(std::string(MEGATRAIN_BINARY) + " " + flags + " --load " + (tmp / "ckpt"), &out);
  INFO(out);
  REQUIRE(code == 0);
  CHECK_THAT(out, Catch::Contains("at iteration 7") && Catch::Contains("iteration        8/       8") &&
                      Catch::Contains("consumed samples:           32"));
}

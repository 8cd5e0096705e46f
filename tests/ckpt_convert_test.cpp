// --ckpt-convert-format / --ckpt-convert-save (app/checkpoint_convert.h): Megatron-LM's offline
// conversion with a run's flags, against export-megatron and against Megatron-LM's own conversion of
// a fixture (tests/fixtures/megatron/README.md: llama/tp2pp2/torch is tp1_dist converted by
// Megatron-LM's --ckpt-convert-format torch at TP 2 x PP 2).
#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <set>

#include "app/checkpoint_convert.h"
#include "app/export_megatron.h"
#include "app/import_megatron.h"
#include "ckpt_compare.h"
#include "ckpt_test_util.h"
#include "cli_test_util.h"

namespace fs = std::filesystem;
using mt_test::read_bytes;
using mt_test::run_command;
using mt_test::TempDir;

namespace {

const std::string kData =
    "--device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 60 --make-vocab-size-divisible-by 32 "
    "--seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --min-lr 1e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 1 --attention-dropout 0 --hidden-dropout 0 --seed 1234 "
    "--eval-iters 0 --eval-interval 1000 --train-iters 3";
// The model of tests/fixtures/megatron/llama.
const std::string kLlama =
    "--num-layers 4 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
    "--untie-embeddings-and-output-weights --qk-layernorm";

std::vector<std::string> files_under(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) out.push_back(fs::relative(e.path(), dir).string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST_CASE("checkpoint conversion (--ckpt-convert-format) writes what export-megatron writes, in the run's layout", "[ckpt-convert][binary]") {
  TempDir tmp;
  std::string out;
  REQUIRE(run_command(std::string(MEGATRAIN_BINARY) + " " + kData + " " + kLlama + " --save " + (tmp / "ckpt") +
                          " --save-interval 3",
                      &out) == 0);
  for (const std::string format : {"torch", "torch_dist"}) {
    INFO(format);
    // Data parallel 2 with the distributed optimizer in 3000-element buckets: rank 0 of the run writes.
    const mt::Config cfg = mt::test::parse(
        mt::test::words(kData + " " + kLlama + " --load " + (tmp / "ckpt") + " --use-distributed-optimizer " +
                        "--overlap-grad-reduce --ddp-bucket-size 3000 --ckpt-convert-format " + format +
                        " --ckpt-convert-save " + (tmp / ("conv_" + format))),
        2);
    REQUIRE(mt::convert_checkpoint(cfg) == 0);
    // export-megatron writes to the same path (the args record it), the conversion moved aside.
    const std::string conv = tmp / ("moved_" + format);
    fs::rename(tmp / ("conv_" + format + "/" + format), conv);
    mt::MegatronExportOptions o;
    o.load = tmp / "ckpt";
    o.save = tmp / ("conv_" + format + "/" + format);
    o.format = format;
    o.tp = o.pp = 1;
    o.dp = 2;
    o.ep = 1;
    o.distributed_optimizer = true;
    o.overlap_grad_reduce = true;
    o.ddp_bucket_size = 3000;
    o.make_vocab_size_divisible_by = 32;
    const mt::MegatronExportResult r = mt::export_megatron(o);
    CHECK_FALSE(r.release);
    const std::vector<std::string> files = files_under(conv);
    REQUIRE(files == files_under(o.save));
    CHECK(files.size() >= 3);
    for (const std::string& f : files) {
      INFO(f);
      CHECK(read_bytes(conv + "/" + f) == read_bytes(o.save + "/" + f));
    }
    CHECK_FALSE(fs::exists(tmp / ("conv_" + format + "/.megatrain-convert-import")));
  }
  // The binary: rank 0 of one process converts, says so as Megatron-LM does, trains nothing.
  REQUIRE(run_command(std::string(MEGATRAIN_BINARY) + " " + kData + " " + kLlama + " --load " + (tmp / "ckpt") +
                          " --no-save-optim --ckpt-convert-format torch --ckpt-convert-save " + (tmp / "bin"),
                      &out) == 0);
  INFO(out);
  CHECK_THAT(out, Catch::Contains("> converted checkpoint: megatrain -> torch.") && Catch::Contains("weights only"));
  CHECK_THAT(out, !Catch::Contains("iteration        1/"));
  CHECK(read_bytes(tmp / "bin/torch/latest_checkpointed_iteration.txt") == "release");
}

TEST_CASE("checkpoint conversion (--ckpt-convert-format) of a Megatron-LM checkpoint equals Megatron-LM's own conversion", "[ckpt-convert]") {
  const std::string fixtures = std::string(MEGATRAIN_SOURCE_DIR) + "/tests/fixtures/megatron/llama";
  TempDir tmp;
  // tp1_dist (torch_dist, weights only) to torch at TP 2 x PP 2, as the fixture's conversion ran.
  const mt::Config cfg = mt::test::parse(
      mt::test::words(kData + " " + kLlama + " --load " + fixtures + "/tp1_dist --tensor-model-parallel-size 2 " +
                      "--pipeline-model-parallel-size 2 --ckpt-convert-format torch --ckpt-convert-save " + (tmp / "conv")),
      4);
  REQUIRE(mt::convert_checkpoint(cfg) == 0);
  std::set<std::string> ours, theirs;
  for (const auto& e : fs::directory_iterator(tmp / "conv/torch/release")) ours.insert(e.path().filename());
  const std::string megatron = fixtures + "/tp2pp2/torch";
  const std::string tracker = read_bytes(megatron + "/latest_checkpointed_iteration.txt");
  const std::string iter_dir = tracker == "release" ? "release" : fmt::format("iter_{:07d}", std::stoi(tracker));
  for (const auto& e : fs::directory_iterator(megatron + "/" + iter_dir)) theirs.insert(e.path().filename());
  CHECK(ours == theirs);  // mp_rank_00_000 ... mp_rank_01_001
  // The weights, read back, are Megatron-LM's conversion's.
  mt::import_megatron(tmp / "conv/torch", std::nullopt, tmp / "ours", true);
  mt::import_megatron(megatron, std::nullopt, tmp / "theirs", true);
  mt_test::require_same_state(tmp / "ours", tmp / "theirs", false);
  CHECK_FALSE(fs::exists(tmp / "conv/.megatrain-convert-import"));
}

TEST_CASE("checkpoint conversion (--ckpt-convert-format): missing directories and a different model are refused in one line",
          "[ckpt-convert][cli]") {
  using mt::test::parse_error;
  using mt::test::words;
  CHECK_THAT(parse_error(words(kData + " " + kLlama + " --load x --ckpt-convert-format torch")),
             Catch::Contains("--ckpt-convert-format torch needs --ckpt-convert-save DIR"));
  CHECK_THAT(parse_error(words(kData + " " + kLlama + " --ckpt-convert-format torch_dist --ckpt-convert-save y")),
             Catch::Contains("pass --load"));
  CHECK_THAT(parse_error(words(kData + " " + kLlama + " --ckpt-convert-format zarr --ckpt-convert-save y --load x")),
             Catch::Contains("--ckpt-convert-format"));
  TempDir tmp;
  const mt::Config empty = mt::test::parse(words(kData + " " + kLlama + " --load " + (tmp / "none") +
                                                 " --ckpt-convert-format torch --ckpt-convert-save " + (tmp / "o")));
  CHECK_THROWS_WITH(mt::convert_checkpoint(empty), Catch::Contains("holds no checkpoint"));
  const std::string fixtures = std::string(MEGATRAIN_SOURCE_DIR) + "/tests/fixtures/megatron/llama";
  const mt::Config other = mt::test::parse(
      words(kData + " --num-layers 4 --hidden-size 64 --num-attention-heads 4 --load " + fixtures +
            "/tp1_dist --ckpt-convert-format torch --ckpt-convert-save " + (tmp / "o")));
  CHECK_THROWS_WITH(mt::convert_checkpoint(other), Catch::Contains("hidden"));
  CHECK_FALSE(fs::exists(tmp / "o/torch"));
}

// The --fim-* flags: Megatron's defaults and asserts, megatrain's refusals, and a run's training
// data with FIM samples (tests/fixtures/fim: a small GPT-2-style vocabulary and dataset).
#include <catch2/catch.hpp>

#include "app/training_data.h"
#include "data/batch.h"
#include "tests/cli_test_util.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;

namespace {

Args fim_gpt() {
  const std::string f = std::string(MEGATRAIN_SOURCE_DIR) + "/tests/fixtures/fim/";
  return words("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
               "--micro-batch-size 2 --lr 1e-3 --train-iters 10 --split 949,50,1 --tokenizer-type GPT2BPETokenizer") +
         Args{"--data-path", f + "text_document", "--vocab-file", f + "vocab.json", "--merge-file", f + "merges.txt"};
}

}  // namespace

TEST_CASE("FIM flags: Megatron's defaults, and the tokens of the vocabulary", "[cli][fim]") {
  std::vector<SetupMessage> ms;
  const Config c = parse(fim_gpt() + words("--fim-data"), 1, &ms);
  CHECK(c.data.fim_data);
  CHECK(c.data.fim_rate == 0.5);
  CHECK(c.data.fim_spm_rate == 0.5);
  CHECK_FALSE(c.data.fim_split_sample);
  CHECK_FALSE(c.data.fim_fragment_rate);
  CHECK_FALSE(c.data.fim_no_prefix);
  CHECK(c.data.fim_prefix_token == "<fim_prefix>");
  CHECK(c.data.fim_middle_token == "<fim_middle>");
  CHECK(c.data.fim_suffix_token == "<fim_suffix>");
  CHECK(c.data.fim_pad_token == "<fim_pad>");
  CHECK(c.data.fim_eod_token == "<|endoftext|>");
  CHECK(c.data.num_workers == 2);
  CHECK_FALSE(has_message(ms, SetupMessage::Kind::note, "is not in the"));
  CHECK_FALSE(has_message(ms, SetupMessage::Kind::note, "--num-workers has no effect"));

  // A token the vocabulary lacks becomes the unknown token, with a note.
  ms.clear();
  parse(fim_gpt() + words("--fim-data --fim-prefix-token <PRE> --num-workers 3"), 1, &ms);
  CHECK(has_message(ms, SetupMessage::Kind::note,
                    "--fim-prefix-token '<PRE>' is not in the GPT2BPETokenizer vocabulary: as in Megatron, it is the "
                    "unknown token (id 277)"));
}

TEST_CASE("FIM flags: Megatron's asserts and what Megatron's FIM dataset cannot run", "[cli][fim]") {
  CHECK_THAT(parse_error(small_gpt() + words("--fim-data")), Contains("Mock dataset is not supported with FIM dataset."));
  CHECK_THAT(parse_error(fim_gpt() + words("--fim-data --fim-rate 0")), Contains("--fim-rate should be specified."));
  CHECK_THAT(parse_error(fim_gpt() + words("--fim-data --fim-spm-rate 0")),
             Contains("--fim-spm-rate should be specified."));
  CHECK_THAT(parse_error(fim_gpt() + words("--fim-data --fim-rate 1.5")),
             Contains("--fim-rate must be a probability in [0, 1] (got 1.5)"));
  CHECK_THAT(parse_error(fim_gpt() + words("--fim-data --fim-fragment-rate -0.5")),
             Contains("--fim-fragment-rate must be a probability"));
  CHECK_THAT(parse_error(fim_gpt() + words("--fim-data --fim-split-sample ,")),
             Contains("--fim-split-sample needs --fim-fragment-rate"));
  CHECK_THAT(parse_error(fim_gpt() + words("--fim-data --num-workers -1")), Contains("--num-workers must be >= 0"));
  const std::string f = std::string(MEGATRAIN_SOURCE_DIR) + "/tests/fixtures/fim/";
  CHECK_THAT(parse_error(words("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                               "--max-position-embeddings 32 --micro-batch-size 2 --lr 1e-3 --train-iters 10 --split "
                               "949,50,1 --tokenizer-type NullTokenizer --vocab-size 1000 --fim-data") +
                         Args{"--data-path", f + "text_document"}),
             Contains("--fim-data needs a tokenizer with text: NullTokenizer"));
  CHECK_THAT(parse_error(fim_gpt() + words("--fim-data --tokenizer-special-tokens <a>")),
             Contains("megatrain does not support --tokenizer-special-tokens with --fim-data yet"));
  // Without --fim-data the FIM flags change nothing, and say so.
  std::vector<SetupMessage> ms;
  parse(small_gpt() + words("--fim-rate 0.3 --num-workers 4"), 1, &ms);
  CHECK(has_message(ms, SetupMessage::Kind::warning, "--fim-rate has no effect without --fim-data"));
  CHECK(has_message(ms, SetupMessage::Kind::note, "--num-workers has no effect in megatrain"));
}

TEST_CASE("FIM flags: a run's training micro-batches hold FIM samples", "[cli][fim]") {
  TempDir cache;  // the index cache, away from the fixture
  const auto read = [&](const Args& extra) {
    const Config c = parse(fim_gpt() + words("--split 100,0,0") + Args{"--data-cache-path", cache.str("c")} + extra);
    TrainingData t = build_training_data(c, 0, 1, 0, 0);
    std::vector<int32_t> tokens;
    MicroBatch mb;
    for (int i = 0; i < 4 && t.train->next(mb); ++i) tokens.insert(tokens.end(), mb.tokens.begin(), mb.tokens.end());
    return std::make_pair(tokens, t.description);
  };
  const auto [plain, plain_text] = read({});
  const auto [fim, fim_text] = read(words("--fim-data --fim-rate 1"));
  REQUIRE(plain.size() == 4u * 2 * 32);
  REQUIRE(fim.size() == plain.size());
  CHECK(fim != plain);
  // <fim_prefix> (id 273 of the fixture's vocabulary) opens FIM samples; plain text never holds it.
  CHECK(std::count(fim.begin(), fim.end(), 273) > 0);
  CHECK(std::count(plain.begin(), plain.end(), 273) == 0);
  CHECK_THAT(fim_text, Contains("GPTFIMDataset(") && Contains("FIM rate 1, SPM rate 0.5"));
  CHECK_THAT(plain_text, !Contains("GPTFIMDataset("));
}

// Command-line problems all reported at once, suggestions only for near misses, and flags
// accepted without effect.
#include "tests/cli_test_util.h"

#include "app/suggest.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;

namespace {

std::vector<std::string> all_flag_names() {
  std::vector<std::string> names;
  for (const cli::FlagSpec& f : cli::flag_table().flags())
    for (const auto& n : f.all_names()) names.push_back(n);
  return names;
}

}  // namespace

TEST_CASE("cli: Megatron-LM's DeepSeek sparse attention and Gated DeltaNet 2 are refused by their switch, their "
          "settings noted", "[cli]") {
  for (const char* variant : {"dsa", "gdn2"}) {
    INFO(variant);
    CHECK(unsupported_error(small_gpt() + words(std::string("--experimental-attention-variant ") + variant +
                                                " --linear-attention-freq 4")) ==
          fmt::format("megatrain does not support --experimental-attention-variant {} yet (Gated DeltaNet 2 and "
                      "DeepSeek sparse attention layers (gated_delta_net / gdn is built))", variant));
  }
  // (A distillation config that is not there is named by its flag; distillation: tests/distill_test.cpp.)
  CHECK(parse_error(small_gpt() + words("--export-kd-teacher-load /ckpt --export-kd-cfg /no/kd.yaml "
                                        "--export-te-mcore-model")) ==
        "--export-kd-cfg: distillation config /no/kd.yaml not found");
  std::vector<SetupMessage> notes;
  parse(small_gpt() + words("--dsa-indexer-topk 8 --export-te-mcore-model"), 1, &notes);
  for (const char* flag : {"--dsa-indexer-topk", "--export-te-mcore-model"}) {
    INFO(flag);
    CHECK(std::any_of(notes.begin(), notes.end(), [&](const SetupMessage& m) {
      return m.text.starts_with(std::string(flag) + " has no effect in megatrain");
    }));
  }
  CHECK_THAT(parse_error(small_gpt() + words("--export-kd-teacher-ckpt-format zip")),
             Contains("--export-kd-teacher-ckpt-format must be one of torch, torch_dist, torch_dcp"));
}

TEST_CASE("cli: every unknown, removed and unsupported flag in one error", "[cli]") {
  const std::string e =
      parse_error(small_gpt() + words("--frobnicate-topk 8 --zebra-stripe-count 4 --num-layer 3 --checkpoint-activations "
                                      "--fp8-format e4m3 --fp8-recipe mxfp8 --use-sharp"));
  CHECK(e ==
        "6 problems with the command line:\n"
        "  unrecognized argument --frobnicate-topk\n"
        "  unrecognized argument --zebra-stripe-count\n"
        "  unrecognized argument --num-layer (did you mean --num-layers?)\n"
        "  --checkpoint-activations is no longer valid, use --recompute-activations, or, for more control, "
        "--recompute-granularity and --recompute-method.\n"
        "  megatrain does not support --use-sharp yet\n"
        "  megatrain does not support --fp8-recipe mxfp8 yet (FP8 recipes built: delayed, tensorwise)");
  // Unknown flags among the problems: an Error; only unsupported flags: Unsupported.
  CHECK_THROWS_AS(parse(small_gpt() + words("--frobnicate-topk 8 --fp4-param-gather")), Error);
  bool unsupported = false;
  try {
    parse(small_gpt() + words("--fp4-param-gather --moe-use-upcycling"));
  } catch (const Unsupported& u) {
    unsupported = true;
    CHECK_THAT(u.what(), Contains("2 problems with the command line:\n"));
  }
  CHECK(unsupported);
  // A word after a known flag's value is still a stray argument of its own.
  CHECK(parse_error(small_gpt() + words("--frobnicate-topk 2 --lr 0.1 stray")) ==
        "2 problems with the command line:\n"
        "  unrecognized argument --frobnicate-topk\n"
        "  unrecognized arguments: stray (a value containing spaces must be quoted as one argument)");
  // One problem: its line alone.
  CHECK(parse_error(small_gpt() + words("--frobnicate-topk 8")) == "unrecognized argument --frobnicate-topk");
}

TEST_CASE("cli: flag suggestions only for near misses", "[cli]") {
  const std::vector<std::string> names = all_flag_names();
  // Near misses get the flag meant.
  CHECK(cli::closest("--num-layer", names) == "--num-layers");
  CHECK(cli::closest("--hiden-size", names) == "--hidden-size");
  CHECK(cli::closest("--seq-lenght", names) == "--seq-length");
  CHECK(cli::closest("--micro-batchsize", names) == "--micro-batch-size");
  CHECK(cli::closest("--num_layers", names) == "--num-layers");
  CHECK(cli::closest("--no-bias-linear", names) == "--disable-bias-linear");
  CHECK(cli::closest("--tensor-parallel-size", names) == "--tensor-model-parallel-size");
  // Unrelated flags are not suggested, however close the nearest one happens to be.
  CHECK(cli::closest("--frobnicate-topk", names).empty());
  CHECK(cli::closest("--mup-base", names).empty());
  CHECK(cli::closest("--hidden", names).empty());
  CHECK(cli::closest("--foo", names).empty());
  CHECK(cli::near_miss_limit("--mscale") == 2);
  CHECK(cli::near_miss_limit("--tensor-parallel-size") == 6);
  CHECK_THAT(parse_error(small_gpt() + words("--hiden-size 64")),
             Contains("unrecognized argument --hiden-size (did you mean --hidden-size?)"));
  CHECK(parse_error(small_gpt() + words("--frobnicate-topk 8")) == "unrecognized argument --frobnicate-topk");
}

TEST_CASE("cli: --ckpt-assume-constant-structure is accepted with a note", "[cli]") {
  std::vector<SetupMessage> ms;
  CHECK_NOTHROW(parse(small_gpt() + words("--ckpt-assume-constant-structure"), 1, &ms));
  CHECK(has_message(ms, SetupMessage::Kind::note,
                    "--ckpt-assume-constant-structure has no effect in megatrain: megatrain's checkpoint writer has "
                    "no save plan to reuse"));
  CHECK_THAT(parse_error(small_gpt() + words("--ckpt-assume-constant-structure=1")), Contains("takes no value"));
}

TEST_CASE("cli: --rerun-mode and error injection are Megatron's rerun state machine flags with its defaults",
          "[cli]") {
  for (const char* mode : {"validate_results", "disabled", "report_stats"})
    CHECK(parse(small_gpt() + words(std::string("--rerun-mode ") + mode)).train.rerun_mode == mode);
  CHECK(parse(small_gpt()).train.rerun_mode == "validate_results");
  CHECK(parse(small_gpt()).train.error_injection_rate == 0);
  CHECK(parse(small_gpt()).train.error_injection_type == "transient_error");
  CHECK(parse_error(small_gpt() + words("--rerun-mode validate")) ==
        "--rerun-mode must be one of disabled, validate_results, report_stats; got 'validate'");
  const Config c = parse(small_gpt() + words("--error-injection-rate 100 --error-injection-type persistent_error "
                                             "--check-for-spiky-loss --check-for-large-grads"));
  CHECK(c.train.error_injection_rate == 100);
  CHECK(c.train.error_injection_type == "persistent_error");
  CHECK(c.train.check_for_spiky_loss);
  CHECK(c.train.check_for_large_grads);
  // Transformer Engine's op fuser: accepted with a note.
  std::vector<SetupMessage> ms;
  CHECK_NOTHROW(parse(small_gpt() + words("--use-transformer-engine-op-fuser"), 1, &ms));
  CHECK(has_message(ms, SetupMessage::Kind::note, "--use-transformer-engine-op-fuser has no effect in megatrain"));
}

// The flag table must not call a flag "supported" that the engine refuses later. For every
// supported switch, and every value a supported choice flag lists (less those unsupported.cpp
// refuses at parse time), this parses a small GPT with it, builds the model on the reference
// backend for one rank (build_model_chunks) and the training data, and fails on any Unsupported or "not supported"
// error: such a flag must be refused at parse time (app/unsupported.cpp) or implemented.
#include <catch2/catch.hpp>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "app/flags.h"
#include "app/training_data.h"
#include "app/unsupported.h"
#include "engine/backend.h"
#include "engine/gpt_model.h"
#include "engine/model_chunks.h"
#include "parallel/parallel_state.h"
#include "tests/cli_test_util.h"

using namespace mt;
using namespace mt::test;

namespace {

// Companion flags a switch (or a choice value, "--flag value") needs to pass Megatron's validation.
const std::map<std::string, std::string>& companions() {
  static const std::map<std::string, std::string> m = {
      {"--fp32-residual-connection", "--bf16"},
      {"--grad-reduce-in-bf16", "--bf16"},
      {"--fine-grained-activation-offloading", "--offload-modules core_attn"},
      {"--no-position-embedding", "--position-embedding-type rope"},
      {"--squared-relu", "--no-bias-gelu-fusion"},
      {"--use-precision-aware-optimizer", "--bf16 --use-distributed-optimizer"},
      {"--fp8-param-gather", "--bf16 --fp8-format hybrid --use-distributed-optimizer"},
      {"--weight-decay-incr-style linear", "--start-weight-decay 0.01 --end-weight-decay 0.1"},
      {"--weight-decay-incr-style cosine", "--start-weight-decay 0.01 --end-weight-decay 0.1"},
      {"--lr-decay-style WSD", "--lr-wsd-decay-iters 2"},
      {"--main-grads-dtype bf16", "--bf16 --use-precision-aware-optimizer --use-distributed-optimizer"},
      {"--exp-avg-dtype bf16", "--bf16 --use-precision-aware-optimizer --use-distributed-optimizer"},
      {"--exp-avg-sq-dtype bf16", "--bf16 --use-precision-aware-optimizer --use-distributed-optimizer"},
      {"--recompute-granularity full", "--recompute-method uniform --recompute-num-layers 1"},
      {"--overlap-param-gather", "--use-distributed-optimizer --overlap-grad-reduce"},
      {"--fp8-format e4m3", "--bf16"},
      {"--fp8-format hybrid", "--bf16"},
      {"--moe-router-padding-for-fp8", "--bf16 --fp8-format hybrid --moe-token-dispatcher-type alltoall"},
      {"--moe-router-enable-expert-bias", "--moe-router-score-function sigmoid"},
      {"--rope-type yarn", "--multi-latent-attention"},
      {"--use-megatron-fsdp", "--ckpt-format fsdp_dtensor"},
      {"--ckpt-format fsdp_dtensor", "--use-megatron-fsdp"},
      {"--use-torch-fsdp2", "--no-gradient-accumulation-fusion --untie-embeddings-and-output-weights"},
      {"--ckpt-format torch_dcp", "--use-torch-fsdp2 --no-gradient-accumulation-fusion --untie-embeddings-and-output-weights"},
      {"--outer-dp-sharding-strategy optim", "--use-megatron-fsdp --ckpt-format fsdp_dtensor"},
      {"--ckpt-convert-format torch", "--load ckpt --ckpt-convert-save converted"},
      {"--ckpt-convert-format torch_dist", "--load ckpt --ckpt-convert-save converted"},
      {"--experimental-attention-variant gdn",
       "--linear-attention-freq 2 --swiglu --linear-num-key-heads 2 --linear-num-value-heads 4"},
      {"--experimental-attention-variant gated_delta_net",
       "--linear-attention-freq 2 --swiglu --linear-num-key-heads 2 --linear-num-value-heads 4"},
  };
  return m;
}

// Switches and choice values this test cannot exercise on one rank, with the reason.
const std::map<std::string, std::string>& not_exercised() {
  static const std::map<std::string, std::string> m = {
      {"--attention-backend local", "Megatron accepts it only with --spec local, which megatrain refuses"},
      {"--use-checkpoint-args", "needs a checkpoint to load"},
      {"--no-initialization", "needs a checkpoint to load"},
      {"--log-energy", "needs NVML (a GPU driver)"},
      {"--fim-data", "needs a GPT-2 tokenizer and real data (Megatron refuses mock data with it): tests/fim_test.cpp"},
      {"--overlap-param-gather-with-optimizer-step", "needs an interleaved pipeline schedule (several ranks)"},
      {"--tokenizer-type GPT2BPETokenizer", "needs tokenizer files a checkout does not ship"},
      {"--tokenizer-type HuggingFaceTokenizer", "needs tokenizer files a checkout does not ship"},
      {"--tokenizer-type SentencePieceTokenizer", "needs tokenizer files a checkout does not ship"},
      {"--tokenizer-type GPTSentencePieceTokenizer", "needs tokenizer files a checkout does not ship"},
      {"--tokenizer-type Llama2Tokenizer", "needs tokenizer files a checkout does not ship"},
  };
  return m;
}

// "{a,b,c}" -> {a, b, c}; empty for a metavar that is not a choice list.
std::vector<std::string> choices_of(const cli::FlagSpec& f) {
  std::vector<std::string> out;
  if (f.metavar.size() < 2 || f.metavar.front() != '{' || f.metavar.back() != '}') return out;
  std::string cur;
  for (size_t i = 1; i + 1 < f.metavar.size(); ++i) {
    if (f.metavar[i] == ',') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(f.metavar[i]);
    }
  }
  out.push_back(cur);
  return out;
}

// Refused by the flag table, at parse time or after Megatron's rules (unsupported.cpp's
// after_validation rules): listed as not supported yet.
bool refused_at_parse(const std::string& flag, const std::vector<std::string>& values) {
  std::map<std::string, cli::FlagValue> given;
  given[flag] = cli::FlagValue{values};
  return !cli::unsupported_problems(given).empty() || !cli::unsupported_problems(given, /*after_validation=*/true).empty();
}

// Parses small_gpt() + `extra`, builds one rank's model on the reference backend and the training
// data. Returns "" or what went wrong.
std::string parse_and_build(const Args& extra) {
  try {
    const Config cfg = parse(small_gpt() + extra);
    ParallelState ps = make_single_process_state();
    std::unique_ptr<Backend> be = make_reference_backend(1);
    // (The reference backend computes in float32 whatever --bf16 / --fp16 ask for.)
    const std::vector<std::unique_ptr<GptModel>> chunks = build_model_chunks(cfg, ps, *be, DType::f32);
    // The reference backend runs any attention; the CUDA backend runs only these three
    // (cuda/attention.cpp refuses the others when the model reserves its attention).
    for (const auto& m : chunks) {
      const AttentionBackend a = m->options().attention_backend;
      if (a != AttentionBackend::auto_ && a != AttentionBackend::flash && a != AttentionBackend::fused)
        return "the model asks the backend for an attention the CUDA backend refuses";
    }
    const TrainingData data = build_training_data(cfg, 0, 1, 0, 0);
    (void)data;
  } catch (const Unsupported& e) {
    return std::string("Unsupported: ") + e.what();
  } catch (const std::exception& e) {
    return std::string("error: ") + e.what();
  }
  return "";
}

void check_case(const std::string& key, const Args& use) {
  if (not_exercised().count(key)) return;
  Args extra = use;
  const auto c = companions().find(key);
  if (c != companions().end()) extra = extra + words(c->second);
  const std::string what = parse_and_build(extra);
  INFO("megatrain <small GPT> " << key << (c != companions().end() ? " " + c->second : std::string()));
  CHECK(what == "");
}

}  // namespace

TEST_CASE("every supported switch parses and builds on the reference backend", "[cli][flag-table]") {
  int checked = 0;
  for (const cli::FlagSpec& f : cli::flag_table().flags()) {
    if (f.kind != cli::FlagKind::supported || f.arity != cli::Arity::none) continue;
    if (refused_at_parse(f.name, {})) continue;  // listed as "not supported yet"
    check_case(f.name, {f.name});
    ++checked;
  }
  CHECK(checked > 50);
}

TEST_CASE("every value a supported choice flag lists parses and builds on the reference backend", "[cli][flag-table]") {
  int checked = 0;
  for (const cli::FlagSpec& f : cli::flag_table().flags()) {
    if (f.kind != cli::FlagKind::supported || f.arity != cli::Arity::one) continue;
    for (const std::string& v : choices_of(f)) {
      if (refused_at_parse(f.name, {v})) continue;  // listed as "values ... not supported yet"
      check_case(f.name + " " + v, {f.name, v});
      ++checked;
    }
  }
  CHECK(checked > 20);
}

TEST_CASE("the flag-table test's own tables name flags that exist", "[cli][flag-table]") {
  for (const auto* m : {&companions(), &not_exercised()})
    for (const auto& [key, why] : *m) {
      INFO(key);
      const std::string flag = key.substr(0, key.find(' '));
      CHECK(cli::flag_table().find(flag) != nullptr);
    }
}

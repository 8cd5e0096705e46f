// --experimental-attention-variant gated_delta_net on the command line: Megatron-LM's rules for
// its settings, the layer map --linear-attention-freq gives, the combinations not built yet, and
// the parameter count against the model's own parameters.
#include "tests/cli_test_util.h"

#include <cstdlib>

#include "data/batch.h"
#include "engine/backend.h"
#include "engine/gpt_model.h"
#include "engine/param_count.h"
#include "engine/param_layout.h"
#include "parallel/parallel_state.h"
#include "parallel/pipeline_layout.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;

namespace {

Args gdn_model(const std::string& extra = "") {
  return small_gpt() + words("--swiglu --disable-bias-linear --experimental-attention-variant gated_delta_net "
                             "--linear-num-key-heads 2 --linear-num-value-heads 4 --linear-key-head-dim 16 "
                             "--linear-value-head-dim 8 " + extra);
}

}  // namespace

TEST_CASE("cli: Gated DeltaNet's layer map from --linear-attention-freq (an int or a list)", "[cli][gdn]") {
  Config c = parse(gdn_model("--linear-attention-freq 2"));
  CHECK(c.model.gated_delta_net);
  CHECK(c.model.linear_layer == std::vector<char>{1, 0});
  c = parse(gdn_model("--num-layers 4 --linear-attention-freq ([0]+[1]*3)"));
  CHECK(c.model.linear_layer == std::vector<char>{0, 1, 1, 1});
  // "gdn" is the same variant.
  c = parse(small_gpt() + words("--swiglu --experimental-attention-variant gdn --linear-attention-freq 1 "
                                "--linear-num-key-heads 2 --linear-num-value-heads 2"));
  CHECK(c.model.linear_layer == std::vector<char>{0, 0});
}

TEST_CASE("cli: Gated DeltaNet's rules (Megatron-LM's) and what is not built with it", "[cli][gdn]") {
  CHECK_THAT(parse_error(gdn_model()), Contains("needs --linear-attention-freq"));
  CHECK_THAT(parse_error(gdn_model("--linear-attention-freq 2 --linear-num-value-heads 3")),
             Contains("--linear-num-value-heads 3 must be a multiple of --linear-num-key-heads 2"));
  CHECK_THAT(parse_error(gdn_model("--linear-attention-freq [1,0,1]")),
             Contains("--linear-attention-freq gives 3 layers but --num-layers is 2"));
  CHECK_THAT(parse_error(gdn_model("--linear-attention-freq 0")), Contains("--linear-attention-freq 0 must be > 0"));
  CHECK_THAT(parse_error(gdn_model("--linear-attention-freq 2 --tensor-model-parallel-size 4"), 4),
             Contains("must be multiples of --tensor-model-parallel-size x --context-parallel-size (4)"));
  CHECK(unsupported_error(gdn_model("--linear-attention-freq 2 --context-parallel-size 2"), 2) ==
        "megatrain does not support --experimental-attention-variant gated_delta_net with --context-parallel-size 2 "
        "yet");
  CHECK(unsupported_error(small_gpt() + words("--experimental-attention-variant gated_delta_net "
                                              "--linear-attention-freq 2 --linear-num-key-heads 2 "
                                              "--linear-num-value-heads 4")) ==
        "megatrain does not support --experimental-attention-variant gated_delta_net without --swiglu yet (its "
        "convolution and output gate take the model's activation: megatrain builds SiLU)");
  CHECK_THAT(unsupported_error(gdn_model("--linear-attention-freq 2 --bf16 --fp8-format hybrid")),
             Contains("gated_delta_net with --fp8-format yet"));
  // Megatron-LM restarts the recurrence at each of the data loader's documents; megatrain does not yet.
  CHECK_THAT(unsupported_error(gdn_model("--linear-attention-freq 2 --dataloader-inter-document-masking")),
             Contains("--dataloader-inter-document-masking with Gated DeltaNet layers"));
  CHECK_THAT(parse_error(small_gpt() + words("--recompute-granularity selective --recompute-modules gdn_norm_out")),
             Contains("gdn_norm_out in recompute_modules is only supported with experimental_attention_variant"));
  std::vector<SetupMessage> notes;
  parse(gdn_model("--linear-attention-freq 2 --recompute-granularity selective --recompute-modules gdn_norm_out"), 1,
        &notes);
  CHECK(std::any_of(notes.begin(), notes.end(),
                    [](const SetupMessage& m) { return m.text.starts_with("--recompute-modules gdn_norm_out:"); }));
  // Without the variant its settings are Megatron-LM's no-ops.
  notes.clear();
  parse(small_gpt() + words("--linear-attention-freq 4"), 1, &notes);
  CHECK(std::any_of(notes.begin(), notes.end(), [](const SetupMessage& m) {
    return m.text.starts_with("--linear-attention-freq has no effect without");
  }));
}

TEST_CASE("Gated DeltaNet parameter counts equal the model's parameters, on every TP rank", "[cli][gdn]") {
  // (With a multi-token prediction depth too: its layer is Gated DeltaNet, as the last decoder layer.)
  for (int tp : {1, 2, -1}) {
    const std::string mtp = tp < 0 ? " --mtp-num-layers 1 --position-embedding-type rope" : "";
    tp = std::abs(tp);
    const Config c = parse(gdn_model("--num-layers 3 --linear-attention-freq 2 --tensor-model-parallel-size " +
                                     std::to_string(tp) + " --sequence-parallel" + mtp),
                           tp);
    const ParamCounts counts = count_parameters(c.model);
    CHECK(counts.num_gdn_layers == 2);
    int64_t global = 0, rank0 = 0;
    for (int r = 0; r < tp; ++r) {
      const ModelDims d = ModelDims::from_config(c, RankPosition::split(c, tp, r));
      for (const ParamDesc& p : build_param_descs(d, nullptr)) {
        if (r == 0) rank0 += p.numel();
        if (r == 0 || !p.tp_duplicated) global += p.numel();
        // The convolution's taps are AdamW's under Muon (a 3-D tensor in Megatron-LM).
        if (p.name.ends_with("conv1d.weight")) CHECK(p.muon_excluded);
      }
    }
    CHECK(global == counts.total);
    const std::vector<ModelChunk> chunks{ModelChunk{0, 0, 0, 3, true, true}};
    CHECK(rank0 == stage_parameters_per_rank(c.model, chunks, tp, 1));
  }
}

TEST_CASE("Gated DeltaNet with --reset-attention-mask: its layers run over the whole sequence, as Megatron-LM's",
          "[gdn][model]") {
  // Megatron-LM's GatedDeltaNet reads no attention mask: with packed documents only the softmax
  // layers keep to each document. A model of Gated DeltaNet layers only has the same loss with and
  // without documents; the hybrid (a softmax layer too) does not.
  std::vector<SetupMessage> notes;
  parse(gdn_model("--linear-attention-freq 2 --reset-attention-mask"), 1, &notes);
  CHECK(std::any_of(notes.begin(), notes.end(), [](const SetupMessage& m) {
    return m.text.starts_with("--reset-attention-mask with Gated DeltaNet layers:");
  }));
  for (const char* pattern : {"[1,1]", "[1,0]"}) {
    INFO(pattern);
    double loss[2];
    for (int documents = 0; documents < 2; ++documents) {
      Config c = parse(gdn_model(std::string("--linear-attention-freq ") + pattern + " --device cpu"));
      c.data.reset_attention_mask = documents == 1;
      ParallelState ps = make_single_process_state();
      std::unique_ptr<Backend> be = make_reference_backend(1);
      const ModelDims d = ModelDims::from_config(c, ps);
      GptModel model(d, ModelOptions::from_config(c, d, DType::f64), ps, *be);
      model.init_parameters();
      MicroBatch mb;
      mb.resize(d.micro_batch, d.seq);
      for (size_t k = 0; k < mb.tokens.size(); ++k) {
        mb.tokens[k] = static_cast<int32_t>((k * 13 + 5) % 997);
        mb.labels[k] = static_cast<int32_t>((k * 29 + 3) % 997);
        mb.loss_mask[k] = 1.0f;
        mb.positions[k] = static_cast<int32_t>(k % static_cast<size_t>(d.seq));
        mb.segments[k] = static_cast<int32_t>(k % static_cast<size_t>(d.seq) / 10);  // documents of 10 tokens
      }
      be->fill(model.loss_sums(false), 0.0);
      model.stage_micro_batch(0, mb, 1.0, false, 42, true);
      model.forward(0);
      double s[2];
      be->copy_to_host(s, model.loss_sums(false));
      loss[documents] = s[0] / s[1];
    }
    if (std::string(pattern) == "[1,1]") CHECK(loss[1] == loss[0]);
    else CHECK(loss[1] != loss[0]);
  }
}

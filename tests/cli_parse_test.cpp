// Parsing Megatron's command line: spellings, values, unknown/removed/unsupported/no-effect flags.
#include "tests/cli_test_util.h"

#include <fstream>

#include "app/flags.h"
#include "app/suggest.h"
#include "app/unsupported.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;

TEST_CASE("a small GPT parses with Megatron's defaults", "[cli]") {
  const Config c = parse(small_gpt());
  CHECK(c.model.num_layers == 2);
  CHECK(c.model.hidden_size == 64);
  CHECK(c.model.rotary_base == 10000);
  CHECK(c.model.make_vocab_size_divisible_by == 128);
  CHECK(c.train.weight_decay == 0.01);
  CHECK(c.train.adam_beta2 == 0.999);
  CHECK(c.train.clip_grad == 1.0);
  CHECK(c.model.normalization == Normalization::layernorm);
  CHECK(c.train.seed == 1234);
  CHECK(c.logging.log_interval == 100);
  CHECK(c.checkpoint.ckpt_format == "torch_dist");
}

TEST_CASE("values are written the way Megatron users write them", "[cli]") {
  Args a = small_gpt() + words("--lr 6.0e-5 --min-lr 6.0e-6 --lr-warmup-fraction .001 --adam-eps 1e-8");
  a.push_back("--split");
  a.push_back("'99,1,0'");  // the quotes arrive inside the argument (unquoted array expansion)
  const Config c = parse(a);
  CHECK(*c.train.lr == 6.0e-5);
  CHECK(c.train.min_lr == 6.0e-6);
  CHECK(*c.train.lr_warmup_fraction == 0.001);
  CHECK(c.train.adam_eps == 1e-8);
  CHECK(*c.data.split == "'99,1,0'");
  REQUIRE(c.data.split_weights.size() == 3);
  CHECK(c.data.split_weights[0] == Approx(0.99));
  CHECK(c.data.split_weights[1] == Approx(0.01));
  CHECK(c.data.split_weights[2] == 0.0);
  // Python int() accepts underscores and signs; float() accepts "inf".
  CHECK(parse(small_gpt() + words("--train-iters 1_000")).train.train_iters == 1000);
  CHECK(parse(small_gpt() + words("--seed +7")).train.seed == 7);
}

TEST_CASE("rotary base is an integer as in Megatron: 1e6 is refused with a hint", "[cli]") {
  const std::string e = parse_error(small_gpt() + words("--position-embedding-type rope --rotary-base 1e6"));
  CHECK_THAT(e, Contains("--rotary-base expects an integer"));
  CHECK_THAT(e, Contains("write 1000000"));
  CHECK(parse(small_gpt() + words("--position-embedding-type rope --rotary-base 1000000")).model.rotary_base == 1000000);
  CHECK_THAT(parse_error(small_gpt() + words("--num-layers 2.0")), Contains("--num-layers expects an integer"));
  CHECK_THAT(parse_error(small_gpt() + words("--lr fast")), Contains("--lr expects a number, got 'fast'"));
}

TEST_CASE("the last occurrence of a flag wins, lists included", "[cli]") {
  CHECK(parse(small_gpt() + words("--seed 1 --seed 2")).train.seed == 2);
  CHECK(parse(small_gpt() + words("--recompute-activations --recompute-modules mlp --recompute-modules layernorm"))
            .train.recompute_modules == std::vector<std::string>{"layernorm"});
}

TEST_CASE("choices are checked and named", "[cli]") {
  CHECK(parse(small_gpt() + words("--normalization RMSNorm")).model.normalization == Normalization::rmsnorm);
  CHECK_THAT(parse_error(small_gpt() + words("--normalization rmsnorm")),
             Contains("--normalization must be one of LayerNorm, RMSNorm; got 'rmsnorm'"));
}

TEST_CASE("unknown flags name the closest known flag, no prefix abbreviations", "[cli]") {
  CHECK_THAT(parse_error(small_gpt() + words("--num-layer 4")),
             Contains("unrecognized argument --num-layer (did you mean --num-layers?)"));
  CHECK_THAT(parse_error(small_gpt() + words("--hidden 4")), Contains("unrecognized argument --hidden"));
  CHECK_THAT(parse_error(small_gpt() + words("--tensor-parallel-size 2")),
             Contains("did you mean --tensor-model-parallel-size?"));
  CHECK_THAT(parse_error(small_gpt() + words("--num_layers=3")), Contains("did you mean --num-layers?"));
  CHECK_THAT(parse_error(small_gpt() + words("--retro-project-dir x")), Contains("Retro was removed"));
  CHECK_THAT(parse_error(small_gpt() + words("stray words")), Contains("unrecognized arguments: stray words"));
  CHECK(cli::edit_distance("kitten", "sitting") == 3);
}

TEST_CASE("a flag's value cannot be another flag, a switch takes no value", "[cli]") {
  CHECK_THAT(parse_error(small_gpt() + words("--lr --bf16")), Contains("--lr expects a value (got the flag --bf16)"));
  CHECK_THAT(parse_error(small_gpt() + words("--bf16=1")), Contains("--bf16 takes no value"));
  CHECK(parse_error(small_gpt() + words("--lr")) == "--lr expects a value");
  CHECK(parse_error(small_gpt() + words("--rampup-batch-size 1 2")) == "--rampup-batch-size expects 3 values, got 2");
  CHECK(*parse(small_gpt() + words("--lr -0.5 --min-lr -1")).train.lr == -0.5);  // negative numbers are values
}

TEST_CASE("no-X and disable-X spellings both work where Megatron HEAD has both", "[cli]") {
  CHECK_FALSE(parse(small_gpt() + words("--no-mmap-bin-files")).data.mmap_bin_files);
  CHECK_FALSE(parse(small_gpt() + words("--disable-mmap-bin-files")).data.mmap_bin_files);
  CHECK(parse(small_gpt()).data.mmap_bin_files);
  CHECK_FALSE(parse(small_gpt() + words("--disable-check-for-nan-in-loss-and-grad")).train.check_for_nan_in_loss_and_grad);
  CHECK_FALSE(parse(small_gpt() + words("--disable-log-loss-scale-to-tensorboard")).logging.log_loss_scale_to_tensorboard);
  // Only Megatron's own spelling for flags whose names it fixes explicitly.
  CHECK_FALSE(parse(small_gpt() + words("--disable-bias-linear")).model.add_bias_linear);
  CHECK_THAT(parse_error(small_gpt() + words("--no-bias-linear")), Contains("did you mean --disable-bias-linear?"));
  // Aliases with underscores (Megatron's historical spelling) and dashes.
  CHECK(parse(small_gpt() + words("--override-opt_param-scheduler")).train.override_opt_param_scheduler);
  CHECK(parse(small_gpt() + words("--override-opt-param-scheduler")).train.override_opt_param_scheduler);
  CHECK(*parse(small_gpt() + words("--persistent-save-interval 5")).checkpoint.save_interval == 5);
}

TEST_CASE("flags without effect are accepted with one note each on rank 0", "[cli]") {
  const Args flags = words(
      "--use-mcore-models --transformer-impl local --no-gradient-accumulation-fusion --use-flash-attn "
      "--no-persist-layer-norm --no-masked-softmax-fusion --no-bias-swiglu-fusion "
      "--no-bias-dropout-fusion --no-rope-fusion --cross-entropy-loss-fusion --num-workers 4 --manual-gc "
      "--empty-unused-memory-level 1 --no-create-attention-mask-in-dataloader --distributed-backend nccl --profile "
      "--profile-step-start 4 --profile-step-end 6 --disable-bias-swiglu-fusion");
  std::vector<SetupMessage> ms;
  parse(small_gpt() + flags, 1, &ms);
  int notes = 0;
  for (const auto& m : ms)
    if (m.kind == SetupMessage::Kind::note && m.text.find("has no effect in megatrain") != std::string::npos) ++notes;
  CHECK(notes == 18);  // --no-bias-swiglu-fusion and its --disable- spelling are one flag
  CHECK(has_message(ms, SetupMessage::Kind::note, "--use-mcore-models has no effect in megatrain"));
  CHECK(has_message(ms, SetupMessage::Kind::note, "--num-workers has no effect in megatrain"));
  // --no-mmap-bin-files has an effect: parsed, no note.
  std::vector<SetupMessage> ms2;
  parse(small_gpt() + words("--no-mmap-bin-files"), 1, &ms2);
  CHECK_FALSE(has_message(ms2, SetupMessage::Kind::note, "--no-mmap-bin-files"));
}

TEST_CASE("the GeLU form follows Megatron: fused bias-GeLU is tanh, unfused or bias-free GeLU is exact", "[cli]") {
  std::vector<SetupMessage> ms;
  const Config fused = parse(small_gpt(), 1, &ms);
  CHECK(gelu_is_tanh(fused.model));  // Megatron's default bias_gelu_impl: the tanh approximation
  CHECK_FALSE(has_message(ms, SetupMessage::Kind::note, "--no-bias-gelu-fusion"));
  std::vector<SetupMessage> ms2;
  const Config unfused = parse(small_gpt() + words("--no-bias-gelu-fusion"), 1, &ms2);
  CHECK_FALSE(gelu_is_tanh(unfused.model));  // F.gelu
  CHECK_FALSE(has_message(ms2, SetupMessage::Kind::note, "--no-bias-gelu-fusion"));
  CHECK_FALSE(gelu_is_tanh(parse(small_gpt() + words("--disable-bias-gelu-fusion")).model));
  CHECK_FALSE(gelu_is_tanh(parse(small_gpt() + words("--disable-bias-linear")).model));  // fusion needs a bias
  CHECK(gelu_is_tanh(parse(small_gpt() + words("--disable-bias-linear --openai-gelu")).model));
}

TEST_CASE("removed and fatal Megatron flags fail with Megatron's advice", "[cli]") {
  CHECK_THAT(parse_error(small_gpt() + words("--batch-size 8")),
             Contains("--batch-size argument is no longer valid, use --micro-batch-size instead"));
  CHECK_THAT(parse_error(small_gpt() + words("--warmup 10")),
             Contains("--warmup argument is no longer valid, use --lr-warmup-fraction instead"));
  CHECK_THAT(parse_error(small_gpt() + words("--model-parallel-size 2")),
             Contains("--model-parallel-size is no longer valid, use --tensor-model-parallel-size instead"));
  CHECK_THAT(parse_error(small_gpt() + words("--checkpoint-activations")),
             Contains("--checkpoint-activations is no longer valid, use --recompute-activations, or, for more control, "
                      "--recompute-granularity and --recompute-method."));
  CHECK_THAT(parse_error(small_gpt() + words("--data-impl mmap")), Contains("--data-impl was removed from Megatron-LM"));
  CHECK_THAT(parse_error(small_gpt() + words("--use-legacy-models")), Contains("--use-legacy-models was removed"));
  CHECK_THAT(parse_error(small_gpt() + words("--tiktoken-special-tokens a")),
             Contains("renamed --tokenizer-special-tokens"));
}

TEST_CASE("unsupported Megatron flags are refused naming them, unless left at their default", "[cli]") {
  std::string e;
  try {
    parse(small_gpt() + words("--moe-latent-size 8 --moe-use-upcycling --fp8-format hybrid --fp4-param-gather"));
  } catch (const Unsupported& u) {
    e = u.what();
  }
  CHECK(e == "3 problems with the command line:\n"
             "  megatrain does not support --moe-latent-size 8 yet\n"
             "  megatrain does not support --moe-use-upcycling yet\n"
             "  megatrain does not support --fp4-param-gather yet");
  // Defaults / off values are accepted.
  CHECK_NOTHROW(parse(small_gpt() + words("--num-experts 0 --moe-router-topk 2 --expert-model-parallel-size 1 "
                                          "--fp8-recipe delayed --moe-aux-loss-coeff 0.0 --context-parallel-size 1 "
                                          "--cp-comm-type p2p --softmax-type vanilla --kv-lora-rank 32")));
  CHECK_THAT(parse_error(small_gpt() + words("--context-parallel-size 2 --cp-comm-type a2a+p2p "
                                             "--hierarchical-context-parallel-sizes 1 1 2"), 2),
             Contains("megatrain does not support --hierarchical-context-parallel-sizes with 3 levels yet"));
  CHECK_NOTHROW(parse(small_gpt() + words("--position-embedding-type yarn --rotary-scaling-factor 4")));
  CHECK_THAT(parse_error(small_gpt() + words("--position-embedding-type yarn --rotary-interleaved")),
             Contains("Yarn RoPE does not support interleaved rotary embeddings"));
  CHECK_THAT(parse_error(small_gpt() + words("--position-embedding-type mrope")), Contains("--position-embedding-type mrope"));
  CHECK_NOTHROW(parse(small_gpt() + words("--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8")));
  CHECK_THAT(parse_error(small_gpt() + words("--multi-latent-attention --rotary-interleaved")),
             Contains("--rotary-interleaved does not work with --multi-latent-attention"));
  CHECK_THAT(parse_error(small_gpt() + words("--multi-latent-attention --position-embedding-type rope --rope-type rope")),
             Contains("apply_rope_fusion for MLA only works with YARN RoPE"));
  CHECK_NOTHROW(parse(small_gpt() + words("--multi-latent-attention --position-embedding-type rope --rope-type rope "
                                          "--no-rope-fusion")));
  CHECK_THAT(parse_error(small_gpt() + words("--mtp-num-layers 1")),
             Contains("Multi-Token Prediction (MTP) is not supported with learned_absolute position embedding type"));
  CHECK_NOTHROW(parse(small_gpt() + words("--mtp-num-layers 2 --position-embedding-type rope --mtp-loss-scaling-factor 0.3")));
  CHECK(parse(small_gpt() + words("--mtp-num-layers 2 --position-embedding-type none")).model.mtp_num_layers == 2);
  CHECK_THAT(parse_error(small_gpt() + words("--recompute-granularity selective --recompute-modules mla_up_proj")),
             Contains("mla_up_proj in recompute_modules is only supported with multi_latent_attention"));
  // gpt-oss's gated unit: built, with Megatron's rules (an offset needs quick-GeGLU or the unfused GLU;
  // SwiGLU's clamp only with experts).
  CHECK(parse(small_gpt() + words("--quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0"))
            .model.quick_geglu);
  CHECK_THAT(parse_error(small_gpt() + words("--swiglu --glu-linear-offset 1.0")),
             Contains("glu_linear_offset is non-zero, activation function must be quick_gelu") &&
                 Contains("--no-bias-swiglu-fusion"));
  CHECK(parse(small_gpt() + words("--swiglu --glu-linear-offset 1.0 --no-bias-swiglu-fusion")).model.glu_linear_offset ==
        1.0);
  CHECK_THAT(parse_error(small_gpt() + words("--swiglu --activation-func-clamp-value 7.0")),
             Contains("activation_func_clamp_value for SwiGLU is only supported with MoE"));
  // gpt-oss's gated unit in FP8 (its casts of fc2's input and of fc1's output gradient take the unit).
  CHECK(parse(small_gpt() + words("--quick-geglu --glu-linear-offset 1.0 --bf16 --fp8-format hybrid")).model.quick_geglu);
  // Attention sinks (also with MLA and context parallelism). ModelOpt's --enable-gpt-oss changes
  // nothing in pretraining (a note says so).
  CHECK(parse(small_gpt() + words("--softmax-type learnable")).model.softmax_type == SoftmaxType::learnable);
  CHECK(parse(small_gpt() + words("--softmax-type off-by-one")).model.softmax_type == SoftmaxType::off_by_one);
  CHECK_THAT(parse_error(small_gpt() + words("--softmax-type sinks")), Contains("--softmax-type"));
  CHECK(parse(small_gpt() + words("--softmax-type off-by-one --context-parallel-size 2"), 2).model.softmax_type ==
        SoftmaxType::off_by_one);
  {
    std::vector<SetupMessage> notes;
    parse(small_gpt() + words("--enable-gpt-oss"), 1, &notes);
    CHECK(has_message(notes, SetupMessage::Kind::note, "--enable-gpt-oss"));
  }
  CHECK_THAT(parse_error(small_gpt() + words("--init-method-xavier-uniform")),
             Contains("fails on it too: TransformerConfig has no scaled_init_method"));
  CHECK_THAT(parse_error(small_gpt() + words("--ckpt-format zarr")),
             Contains("megatrain does not support --ckpt-format zarr"));
  // Megatron's two formats save megatrain's own, and say so; the default says nothing.
  for (const char* format : {"torch", "torch_dist"}) {
    std::vector<SetupMessage> notes;
    CHECK(parse(small_gpt() + words(std::string("--ckpt-format ") + format), 1, &notes).checkpoint.ckpt_format == format);
    bool noted = false;
    for (const SetupMessage& m : notes)
      noted = noted || m.text.find(std::string("--ckpt-format ") + format + ": megatrain saves and loads its own") == 0;
    CHECK(noted);
  }
  std::vector<SetupMessage> quiet;
  parse(small_gpt(), 1, &quiet);
  for (const SetupMessage& m : quiet) CHECK(m.text.find("--ckpt-format") == std::string::npos);
  // (moe and shared_experts are built: without MoE layers they recompute nothing, with a note.)
  std::vector<SetupMessage> moe_notes;
  parse(small_gpt() + words("--recompute-granularity selective --recompute-modules core_attn moe"), 1, &moe_notes);
  CHECK(std::any_of(moe_notes.begin(), moe_notes.end(), [](const SetupMessage& m) {
    return m.text == "--recompute-modules moe: no MoE layers, nothing to recompute";
  }));
  CHECK_THAT(parse_error(small_gpt() + words("--tokenizer-type TikTokenizer")),
             Contains("megatrain does not support --tokenizer-type TikTokenizer"));
  // Muon's settings (and the layer-wise optimizer's layout switch) change nothing with adam, as in
  // Megatron-LM: a note each; their values are checked as Megatron-LM's argparse checks them.
  std::vector<SetupMessage> muon;
  parse(small_gpt() + words("--muon-momentum 0.95 --muon-tp-mode blockwise --muon-num-ns-steps 6 --muon-nesterov "
                            "--no-use-layer-wise-param-layout"),
        1, &muon);
  for (const char* flag : {"--muon-momentum", "--muon-tp-mode", "--muon-num-ns-steps", "--muon-nesterov"}) {
    INFO(flag);
    CHECK(std::any_of(muon.begin(), muon.end(), [&](const SetupMessage& m) {
      return m.text == std::string(flag) + " has no effect without --optimizer muon (as in Megatron-LM)";
    }));
  }
  CHECK(std::any_of(muon.begin(), muon.end(), [&](const SetupMessage& m) {
    return m.text.starts_with("--no-use-layer-wise-param-layout has no effect in megatrain");
  }));
  CHECK_THAT(parse_error(small_gpt() + words("--muon-scale-mode bogus")),
             Contains("--muon-scale-mode must be one of spectral, unit_rms_norm, shape_scaling; got 'bogus'"));
  CHECK_THROWS(parse(small_gpt() + words("--muon-num-ns-steps five")));
}

TEST_CASE("every recognised-only flag has a refusal rule and every rule names a known flag", "[cli]") {
  const cli::FlagTable& t = cli::flag_table();
  for (const cli::UnsupportedRule& r : cli::unsupported_rules()) {
    INFO(r.flag);
    CHECK(t.find(r.flag) != nullptr);
  }
  for (const cli::FlagSpec& f : t.flags()) {
    INFO(f.name);
    if (f.kind == cli::FlagKind::recognised) CHECK_FALSE(cli::unsupported_summary(f.name).empty());
    if (f.kind == cli::FlagKind::supported) CHECK(f.apply);
    if (f.kind == cli::FlagKind::no_effect) CHECK_FALSE(f.note.empty());
  }
}

// Every spelling Megatron-LM's parser takes (tests/fixtures/megatron_flags.txt, from
// bench/megatron_flags.py): none is an "unrecognized argument" to megatrain.
TEST_CASE("every flag Megatron-LM's pretrain_gpt.py parses is known", "[cli]") {
  std::ifstream in(MEGATRAIN_SOURCE_DIR "/tests/fixtures/megatron_flags.txt");
  REQUIRE(in.good());
  const cli::FlagTable& t = cli::flag_table();
  int n = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    INFO(line);
    CHECK(t.find(line) != nullptr);
    ++n;
  }
  CHECK(n > 800);
  // A flag of another Megatron-LM program is accepted with a note; a feature megatrain lacks is
  // refused by name unless left at Megatron-LM's default.
  std::vector<SetupMessage> ms;
  parse(small_gpt() + words("--inference-max-requests 8 --rl-default-top-k 4 --dino-teacher-temp 0.1"), 1, &ms);
  CHECK(has_message(ms, SetupMessage::Kind::note, "--inference-max-requests"));
  CHECK(has_message(ms, SetupMessage::Kind::note, "--rl-default-top-k"));
  CHECK_THAT(parse_error(small_gpt() + words("--experimental-attention-variant dsa --enable-mhc-connections --sft")),
             Contains("3 problems with the command line"));
  CHECK_THAT(parse_error(small_gpt() + words("--experimental-attention-variant gdn2")),
             Contains("megatrain does not support --experimental-attention-variant gdn2 yet"));
  parse(small_gpt() + words("--glu-linear-offset 0.0 --sample-rate 1.0 --null-tokenizer-pad-id -1"));
  CHECK_THAT(parse_error(small_gpt() + words("--pipeline-model-parallel-comm-backend ucc")),
             Contains("--pipeline-model-parallel-comm-backend ucc"));
  parse(small_gpt() + words("--pipeline-model-parallel-comm-backend nccl"));
  // --dataloader-inter-document-masking: built; with the EOD-based flags a note says they change nothing.
  ms.clear();
  const Config inter = parse(small_gpt() + words("--dataloader-inter-document-masking --reset-attention-mask"), 1, &ms);
  CHECK(inter.data.documents());
  CHECK(inter.data.document_positions());
  CHECK(has_message(ms, SetupMessage::Kind::note, "--dataloader-inter-document-masking: the document parts"));
  // --dataloader-type cyclic, and --no-data-sharding (which changes nothing with single, as in Megatron-LM).
  ms.clear();
  const Config cyclic = parse(small_gpt() + words("--dataloader-type cyclic --no-data-sharding"), 1, &ms);
  CHECK(cyclic.data.dataloader_type == "cyclic");
  CHECK_FALSE(cyclic.data.data_sharding);
  CHECK_FALSE(has_message(ms, SetupMessage::Kind::note, "--no-data-sharding has no effect"));
  CHECK(parse(small_gpt()).data.data_sharding);
  ms.clear();
  parse(small_gpt() + words("--no-data-sharding"), 1, &ms);
  CHECK(has_message(ms, SetupMessage::Kind::note, "--no-data-sharding has no effect with --dataloader-type single"));
  CHECK_THAT(parse_error(small_gpt() + words("--dataloader-type external")),
             Contains("megatrain does not support --dataloader-type external yet"));
  // --no-rope-freq: every N-th layer (N dividing the layers) or a 0/1 list, Megatron-LM's rules.
  CHECK(parse(small_gpt() + words("--position-embedding-type rope --no-rope-freq 2")).model.nope_layer ==
        std::vector<char>{0, 1});
  CHECK(parse(small_gpt() + words("--position-embedding-type rope --no-rope-freq [1,0]")).model.nope_layer ==
        std::vector<char>{1, 0});
  CHECK_THAT(parse_error(small_gpt() + words("--position-embedding-type rope --no-rope-freq 3")),
             Contains("no_rope_freq=3 should be divisible by num_layers=2"));
  CHECK_THAT(parse_error(small_gpt() + words("--position-embedding-type rope --no-rope-freq [1,0,1]")),
             Contains("Length of no_rope list (3) must match the number of layers (2)"));
  ms.clear();
  parse(small_gpt() + words("--no-rope-freq 2"), 1, &ms);
  CHECK(has_message(ms, SetupMessage::Kind::note, "--no-rope-freq has no effect without --position-embedding-type rope"));
  // A checked no-effect value is still checked.
  CHECK_THAT(parse_error(small_gpt() + words("--async-ckpt-io-priority high")), Contains("--async-ckpt-io-priority"));
}

TEST_CASE("every flag of Megatron's tables 1.1 to 1.10 is known", "[cli]") {
  const char* flags[] = {
      "--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--kv-channels",
      "--group-query-attention", "--num-query-groups", "--max-position-embeddings", "--position-embedding-type",
      "--use-rotary-position-embeddings", "--no-position-embedding", "--rotary-base", "--rotary-percent",
      "--rotary-interleaved", "--rotary-seq-len-interpolation-factor", "--use-rope-scaling", "--rope-scaling-factor",
      "--rope-type", "--normalization", "--norm-epsilon", "--apply-layernorm-1p",
      "--apply-residual-connection-post-layernorm", "--swiglu", "--squared-relu", "--quick-geglu", "--openai-gelu",
      "--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm", "--qk-l2-norm",
      "--untie-embeddings-and-output-weights", "--make-vocab-size-divisible-by", "--seq-length", "--encoder-num-layers",
      "--decoder-num-layers", "--window-size", "--softmax-type", "--attention-backend", "--transformer-impl",
      "--use-flash-attn", "--multi-latent-attention", "--mtp-num-layers", "--fp32-residual-connection",
      // 1.2
      "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size", "--cp-comm-type",
      "--sequence-parallel", "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
      "--microbatch-group-size-per-virtual-pipeline-stage", "--decoder-first-pipeline-num-layers",
      "--decoder-last-pipeline-num-layers", "--pipeline-model-parallel-layout",
      "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
      "--no-overlap-p2p-communication", "--overlap-p2p-communication-warmup-flush", "--use-tp-pp-dp-mapping",
      "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--model-parallel-size",
      // 1.3
      "--micro-batch-size", "--global-batch-size", "--batch-size", "--rampup-batch-size", "--step-batch-size-schedule",
      "--decrease-batch-size-if-needed", "--train-iters", "--train-samples", "--eval-iters", "--eval-interval",
      "--skip-train", "--exit-interval", "--exit-duration-in-mins", "--exit-signal-handler", "--optimizer", "--lr",
      "--min-lr", "--lr-decay-style", "--lr-decay-iters", "--lr-decay-samples", "--lr-warmup-iters",
      "--lr-warmup-samples", "--lr-warmup-fraction", "--lr-warmup-init", "--lr-wsd-decay-style", "--lr-wsd-decay-iters",
      "--lr-wsd-decay-samples", "--decoupled-lr", "--decoupled-min-lr", "--override-opt_param-scheduler",
      "--override-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
      "--warmup", "--weight-decay", "--start-weight-decay", "--end-weight-decay", "--weight-decay-incr-style",
      "--clip-grad", "--adam-beta1", "--adam-beta2", "--adam-eps", "--sgd-momentum", "--calculate-per-token-loss",
      "--dataloader-type", "--no-check-for-nan-in-loss-and-grad", "--check-for-spiky-loss", "--check-for-large-grads",
      "--deterministic-mode", "--iterations-to-skip", "--train-sync-interval", "--empty-unused-memory-level",
      "--manual-gc", "--manual-gc-interval",
      // 1.4
      "--fp16", "--bf16", "--loss-scale", "--initial-loss-scale", "--min-loss-scale", "--loss-scale-window",
      "--hysteresis", "--accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16", "--attention-softmax-in-fp32",
      "--apply-query-key-layer-scaling", "--fp16-lm-cross-entropy", "--use-precision-aware-optimizer",
      "--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype",
      // 1.5
      "--data-path", "--split", "--train-data-path", "--valid-data-path", "--test-data-path", "--data-args-path",
      "--per-split-data-args-path", "--mock-data", "--data-cache-path", "--no-mmap-bin-files", "--num-workers",
      "--num-dataset-builder-threads", "--mid-level-dataset-surplus", "--reset-position-ids", "--reset-attention-mask",
      "--eod-mask-loss", "--no-create-attention-mask-in-dataloader", "--tokenizer-type", "--vocab-file",
      "--merge-file", "--tokenizer-model", "--vocab-size", "--padded-vocab-size", "--vocab-extra-ids",
      "--tiktoken-pattern", "--tiktoken-num-special-tokens", "--tokenizer-special-tokens", "--trust-remote-code",
      "--legacy-tokenizer",
      // 1.6
      "--save", "--save-interval", "--persistent-save-interval", "--save-retain-interval", "--load", "--ckpt-format",
      "--auto-detect-ckpt-format", "--use-dist-ckpt", "--dist-ckpt-format", "--no-save-optim", "--no-save-rng",
      "--no-load-optim", "--no-load-rng", "--finetune", "--pretrained-checkpoint", "--ckpt-step",
      "--exit-on-missing-checkpoint", "--use-checkpoint-args", "--use-mp-args-from-checkpoint-args",
      "--no-initialization", "--async-save", "--no-ckpt-fully-parallel-save", "--ckpt-fully-parallel-load",
      "--ckpt-fully-parallel-save", "--ckpt-assume-constant-structure", "--dist-ckpt-strictness", "--non-persistent-save-interval",
      "--non-persistent-ckpt-type", "--ckpt-convert-format", "--ckpt-convert-save", "--override-ckpt-iteration",
      // 1.7
      "--log-interval", "--log-throughput", "--log-params-norm", "--log-num-zeros-in-grad", "--log-progress",
      "--log-energy", "--timing-log-level", "--timing-log-option", "--no-barrier-with-level-1-timing",
      "--tensorboard-dir", "--tensorboard-log-interval", "--tensorboard-queue-size", "--log-timers-to-tensorboard",
      "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard", "--log-world-size-to-tensorboard",
      "--no-log-loss-scale-to-tensorboard", "--wandb-project", "--wandb-exp-name", "--wandb-save-dir",
      "--wandb-entity", "--logging-level", "--profile", "--profile-step-start", "--profile-step-end", "--profile-ranks",
      "--use-pytorch-profiler", "--record-memory-history", "--memory-snapshot-path",
      // 1.8
      "--recompute-activations", "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
      "--recompute-modules", "--distribute-saved-activations", "--checkpoint-activations",
      // 1.9
      "--attention-dropout", "--hidden-dropout", "--seed", "--init-method-std", "--embedding-init-method-std",
      "--init-method-xavier-uniform", "--data-parallel-random-init", "--use-cpu-initialization",
      // 1.10
      "--distributed-backend", "--distributed-timeout-minutes", "--local-rank", "--use-distributed-optimizer",
      "--num-distributed-optimizer-instances", "--overlap-grad-reduce", "--overlap-param-gather",
      "--overlap-param-gather-with-optimizer-step", "--no-align-grad-reduce", "--no-align-param-gather",
      "--ddp-bucket-size", "--ddp-num-buckets", "--ddp-average-in-collective", "--tp-comm-overlap",
      "--tp-comm-overlap-cfg", "--disable-tp-comm-overlap-ag", "--disable-tp-comm-overlap-rs",
      "--disable-tp-comm-bulk-dgrad", "--disable-tp-comm-bulk-wgrad", "--disable-tp-comm-split-ag",
      "--disable-tp-comm-split-rs", "--tp-comm-overlap-rs-dgrad", "--no-tp-comm-overlap-ag",
      "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "--no-gradient-accumulation-fusion",
      "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
      "--no-rope-fusion", "--no-persist-layer-norm", "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl",
      "--use-torch-fsdp2", "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--disable-gloo-process-groups",
      "--nccl-communicator-config-path", "--use-sharp", "--sharp-enabled-group",
  };
  for (const char* f : flags) {
    INFO(f);
    CHECK(cli::flag_table().find(f) != nullptr);
  }
}

TEST_CASE("flag --apply-wd-to-qk-layernorm and Megatron's deprecated --no-weight-decay-cond-type", "[cli]") {
  CHECK_FALSE(parse(small_gpt()).train.apply_wd_to_qk_layernorm);
  CHECK(parse(small_gpt() + words("--qk-layernorm --apply-wd-to-qk-layernorm")).train.apply_wd_to_qk_layernorm);
  std::vector<SetupMessage> ms;
  const Config c = parse(small_gpt() + words("--no-weight-decay-cond-type apply_wd_to_qk_layernorm"), 1, &ms);
  CHECK(c.train.apply_wd_to_qk_layernorm);
  CHECK(has_message(ms, SetupMessage::Kind::warning,
                    "--no-weight-decay-cond-type is deprecated. Please use --apply-wd-to-qk-layernorm instead."));
  CHECK_THAT(parse_error(small_gpt() + words("--no-weight-decay-cond-type other")),
             Catch::Contains("--no-weight-decay-cond-type") && Catch::Contains("apply_wd_to_qk_layernorm"));
}

TEST_CASE("flag --num-distributed-optimizer-instances: Megatron's partial distributed optimizer rules", "[cli]") {
  const Args distopt = small_gpt() + words("--use-distributed-optimizer");
  CHECK(parse(distopt, 4).parallel.num_distributed_optimizer_instances == 1);
  CHECK(parse(distopt + words("--num-distributed-optimizer-instances 2"), 4).parallel.num_distributed_optimizer_instances == 2);
  CHECK(parse(distopt + words("--num-distributed-optimizer-instances 4"), 4).parallel.num_distributed_optimizer_instances == 4);
  CHECK(parse_error(small_gpt() + words("--num-distributed-optimizer-instances 2"), 4) ==
        "Partial DistOpt cannot be used without DistOpt (--num-distributed-optimizer-instances 2 needs "
        "--use-distributed-optimizer)");
  CHECK_THAT(parse_error(distopt + words("--num-distributed-optimizer-instances 3"), 4),
             Contains("Data parallel size should be divisible by partial DistOpt shard factor") &&
                 Contains("--num-distributed-optimizer-instances 3"));
  CHECK(parse_error(distopt + words("--num-distributed-optimizer-instances 0"), 4) ==
        "--num-distributed-optimizer-instances must be >= 1 (got 0)");
}

// Derived values, computed as Megatron derives them, and rank 0's setup messages.
#include "tests/cli_test_util.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;

TEST_CASE("derive: data-parallel size, global batch default, micro-batches", "[cli][derive]") {
  std::vector<SetupMessage> ms;
  const Config c = parse(small_gpt() + words("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"), 16, &ms);
  CHECK(c.parallel.data_parallel_size == 4);
  CHECK(c.train.global_batch == 8);  // micro-batch 2 x DP 4
  CHECK(c.train.num_microbatches == 1);
  CHECK(has_message(ms, SetupMessage::Kind::info, "setting global batch size to 8"));
  CHECK(has_message(ms, SetupMessage::Kind::info, "setting number of microbatches to constant 1"));
  CHECK(has_message(ms, SetupMessage::Kind::info,
                    "using world size: 16, data-parallel size: 4, context-parallel size: 1, hierarchical context-parallel "
                    "sizes: None, tensor-model-parallel size: 2, pipeline-model-parallel size: 2"));
  const Config d = parse(small_gpt() + words("--global-batch-size 64"), 4);
  CHECK(d.train.num_microbatches == 8);
}

TEST_CASE("derive: ffn size, kv channels, query groups", "[cli][derive]") {
  CHECK(parse(small_gpt()).model.ffn_size == 256);  // 4h
  // SwiGLU: int((4h * 2/3) / 64) * 64; h = 4096 gives 10880.
  const Config c = parse(small_gpt() + words("--hidden-size 4096 --num-attention-heads 32 --swiglu"));
  CHECK(c.model.ffn_size == 10880);
  CHECK(c.model.head_dim == 128);
  CHECK(c.model.query_groups == 32);
  CHECK(parse(small_gpt() + words("--swiglu")).model.ffn_size == 128);  // int(170.67 / 64) * 64
  CHECK(parse(small_gpt() + words("--ffn-hidden-size 100")).model.ffn_size == 100);
  CHECK(parse(small_gpt() + words("--kv-channels 32")).model.head_dim == 32);
  CHECK(parse(small_gpt() + words("--group-query-attention")).model.query_groups == 1);  // MQA: Megatron's default 1
  CHECK(parse(small_gpt() + words("--group-query-attention --num-query-groups 2")).model.query_groups == 2);
}

TEST_CASE("derive: biases, softmax precision, position embedding aliases", "[cli][derive]") {
  CHECK(parse(small_gpt()).model.add_qkv_bias);  // forced by the default bias
  CHECK_FALSE(parse(small_gpt() + words("--disable-bias-linear")).model.add_qkv_bias);
  CHECK(parse(small_gpt() + words("--disable-bias-linear --add-qkv-bias")).model.add_qkv_bias);
  CHECK(parse(small_gpt() + words("--apply-query-key-layer-scaling --transformer-impl local")).model.attention_softmax_in_fp32);
  CHECK(parse(small_gpt() + words("--use-rotary-position-embeddings")).model.position_embedding_type == PositionEmbedding::rope);
}

TEST_CASE("derive: padded vocabulary (multiple of make-vocab-size-divisible-by x TP)", "[cli][derive]") {
  auto padded = [](int vocab, int tp, const std::string& extra = "") {
    return parse(small_gpt() + words("--vocab-size " + std::to_string(vocab) + " --num-attention-heads 8 --hidden-size 128 "
                                     "--tensor-model-parallel-size " + std::to_string(tp) + " " + extra),
                 tp)
        .model.padded_vocab_size;
  };
  CHECK(padded(50257, 1) == 50304);
  CHECK(padded(50257, 2) == 50432);
  CHECK(padded(50257, 4) == 50688);
  CHECK(padded(50257, 8) == 51200);
  CHECK(padded(128256, 1) == 128256);
  CHECK(padded(128256, 2) == 128256);
  CHECK(padded(128256, 4) == 128512);
  CHECK(padded(128256, 8) == 129024);
  CHECK(padded(1000, 1, "--make-vocab-size-divisible-by 1") == 1000);
  CHECK(padded(1000, 1, "--padded-vocab-size 4096") == 4096);
  std::vector<SetupMessage> ms;
  const Config c = parse(small_gpt() + words("--vocab-size 50257"), 1, &ms);
  CHECK(c.model.vocab_size == 50257);
  CHECK(c.data.eod_id == 50256);  // NullTokenizer (HEAD): eod = V - 1
  CHECK(has_message(ms, SetupMessage::Kind::info, " > padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)"));
  CHECK(parse(small_gpt() + words("--null-tokenizer-eod-id 5")).data.eod_id == 5);
}

TEST_CASE("derive: GPT-2 BPE is the default tokenizer, its vocabulary comes from --vocab-file", "[cli][derive]") {
  MT_REQUIRE_SHARED_DATA(dir);
  Args a;
  const Args base = small_gpt();
  for (size_t i = 0; i < base.size(); ++i) {
    if (base[i] == "--tokenizer-type" || base[i] == "--vocab-size") {
      ++i;
      continue;
    }
    a.push_back(base[i]);
  }
  std::vector<SetupMessage> ms;
  const Config c =
      parse(a + words("--vocab-file " + dir + "/gpt2/gpt2-vocab.json --merge-file " + dir + "/gpt2/gpt2-merges.txt"), 1, &ms);
  CHECK(*c.data.tokenizer_type == "GPT2BPETokenizer");
  CHECK(c.model.vocab_size == 50257);
  CHECK(c.data.eod_id == 50256);
  CHECK(c.model.padded_vocab_size == 50304);
  CHECK(has_message(ms, SetupMessage::Kind::info, " > padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)"));
  // Without the files: the error names the flags (Megatron's GPT entry point defaults to this tokenizer).
  CHECK_THAT(parse_error(a), Contains("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"));
  CHECK_THAT(parse_error(a + words("--vocab-file /nonexistent/vocab.json --merge-file " + dir + "/gpt2/gpt2-merges.txt")),
             Contains("--vocab-file /nonexistent/vocab.json: no such file"));
}

TEST_CASE("derive: Hugging Face tokenizer vocabulary (model vocabulary + added tokens)", "[cli][derive]") {
  MT_REQUIRE_SHARED_DATA(dir);
  Args a;
  const Args base = small_gpt();
  for (size_t i = 0; i < base.size(); ++i) {
    if (base[i] == "--tokenizer-type" || base[i] == "--vocab-size") {
      ++i;
      continue;
    }
    a.push_back(base[i]);
  }
  const Config c = parse(a + words("--tokenizer-type HuggingFaceTokenizer --tokenizer-model " + dir + "/llama3"));
  CHECK(c.model.vocab_size == 128256);
  CHECK(c.model.padded_vocab_size == 128256);
  CHECK(c.data.eod_id == 128001);  // <|end_of_text|>, the eos_token of tokenizer_config.json
  const Config l2 = parse(a + words("--tokenizer-type HuggingFaceTokenizer --tokenizer-model " + dir + "/llama2/tokenizer.json"));
  CHECK(l2.model.vocab_size == 32000);
  CHECK(l2.data.eod_id == 2);  // </s>
  CHECK_THAT(parse_error(a + words("--tokenizer-type HuggingFaceTokenizer --tokenizer-model meta-llama/Llama-3-8B")),
             Contains("no tokenizer.json there"));
  CHECK_THAT(parse_error(a + words("--tokenizer-type HuggingFaceTokenizer")), Contains("needs --tokenizer-model"));
}

TEST_CASE("derive: train iterations from samples, LR/WD horizons in samples", "[cli][derive]") {
  Args no_len;
  for (const auto& a : small_gpt())
    if (a != "--train-iters" && a != "10") no_len.push_back(a);
  // Iteration-based: steps = iterations x global batch (32).
  const Config it = parse(small_gpt() + words("--global-batch-size 32 --train-iters 1000 --lr-decay-iters 800 "
                                              "--lr-warmup-fraction .001 --lr-wsd-decay-iters 100"), 4);
  CHECK(it.train.total_iters == 1000);
  CHECK(it.train.lr_decay_steps == 800 * 32);
  CHECK(it.train.lr_warmup_steps == Approx(0.001 * 800 * 32));
  CHECK(it.train.wd_incr_steps == 1000 * 32);
  CHECK(*it.train.lr_wsd_decay_steps == 100 * 32);
  const Config it2 = parse(small_gpt() + words("--global-batch-size 32 --train-iters 1000 --lr-warmup-iters 10"), 4);
  CHECK(it2.train.lr_decay_steps == 1000 * 32);  // --lr-decay-iters defaults to --train-iters
  CHECK(it2.train.lr_warmup_steps == 320);
  // Sample-based: samples as given; train iterations = samples // global batch.
  const Config s = parse(no_len + words("--global-batch-size 32 --train-samples 1000 --lr-warmup-samples 64"), 4);
  CHECK(s.train.total_iters == 31);
  CHECK(s.train.lr_decay_steps == 1000);
  CHECK(s.train.lr_warmup_steps == 64);
  CHECK(s.train.wd_incr_steps == 1000);
}

TEST_CASE("derive: precision settings", "[cli][derive]") {
  std::vector<SetupMessage> ms;
  const Config b = parse(small_gpt() + words("--bf16"), 1, &ms);
  CHECK(b.train.precision == Precision::bf16);
  CHECK(b.parallel.accumulate_allreduce_grads_in_fp32);
  CHECK(has_message(ms, SetupMessage::Kind::info, "accumulate and all-reduce gradients in fp32 for bfloat16 data type."));
  CHECK(has_message(ms, SetupMessage::Kind::info, "using torch.bfloat16 for parameters ..."));
  CHECK_FALSE(parse(small_gpt() + words("--bf16 --grad-reduce-in-bf16")).parallel.accumulate_allreduce_grads_in_fp32);
  const Config h = parse(small_gpt() + words("--fp16"));
  CHECK_FALSE(h.train.check_for_nan_in_loss_and_grad);  // dynamic loss scaling
  CHECK(parse(small_gpt() + words("--fp16 --loss-scale 1024")).train.check_for_nan_in_loss_and_grad);
}

TEST_CASE("derive: recompute shorthand and pipeline p2p overlap", "[cli][derive]") {
  const Config r = parse(small_gpt() + words("--recompute-activations"));
  CHECK(r.train.recompute_granularity == RecomputeGranularity::selective);
  CHECK(r.train.recompute_modules == std::vector<std::string>{"core_attn"});
  std::vector<SetupMessage> ms;
  const Config p = parse(small_gpt() + words("--pipeline-model-parallel-size 2"), 2, &ms);
  CHECK_FALSE(p.parallel.overlap_p2p_communication);  // forced off without interleaving
  CHECK(has_message(ms, SetupMessage::Kind::warning, "Setting args.overlap_p2p_comm and args.align_param_gather to False"));
  const Config v = parse(small_gpt() + words("--num-layers 4 --pipeline-model-parallel-size 2 "
                                             "--num-layers-per-virtual-pipeline-stage 1 --global-batch-size 8"), 2);
  CHECK(v.parallel.virtual_pipeline_size == 2);
  CHECK(v.parallel.overlap_p2p_communication);
}

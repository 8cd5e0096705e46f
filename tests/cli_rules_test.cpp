// Each validation rule (Megatron's validate_args and its size rules) with a passing and a
// failing case; failures are checked on the message naming the flags.
#include "tests/cli_test_util.h"

#include <array>
#include <optional>

#include "app/reporters.h"
#include "data/dataset_builder.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;

TEST_CASE("rule: world size divisible by TP x PP x CP", "[cli][rules]") {
  CHECK(parse(small_gpt() + words("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"), 8)
            .parallel.data_parallel_size == 2);
  CHECK_THAT(parse_error(small_gpt() + words("--tensor-model-parallel-size 4 --num-attention-heads 8"), 6),
             Contains("world size 6 is not divisible by --tensor-model-parallel-size 4 x --pipeline-model-parallel-size 1 "
                      "x --context-parallel-size 1 = 4"));
}

TEST_CASE("rule: attention heads divisible by TP", "[cli][rules]") {
  CHECK_NOTHROW(parse(small_gpt() + words("--tensor-model-parallel-size 4"), 4));
  CHECK_THAT(parse_error(small_gpt() + words("--hidden-size 960 --num-attention-heads 30 --tensor-model-parallel-size 4"), 4),
             Contains("--num-attention-heads 30 is not divisible by --tensor-model-parallel-size 4"));
}

TEST_CASE("rule: hidden size divisible by heads unless --kv-channels", "[cli][rules]") {
  CHECK_THAT(parse_error(small_gpt() + words("--hidden-size 66")),
             Contains("--hidden-size 66 is not divisible by --num-attention-heads 4"));
  CHECK(parse(small_gpt() + words("--hidden-size 66 --kv-channels 16")).model.head_dim == 16);
}

TEST_CASE("rule: layers divisible by PP, with the account-for flags", "[cli][rules]") {
  const Args pp2 = words("--pipeline-model-parallel-size 2");
  CHECK_NOTHROW(parse(small_gpt() + pp2 + words("--num-layers 4"), 2));
  CHECK_THAT(parse_error(small_gpt() + pp2 + words("--num-layers 3"), 2),
             Contains("--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"));
  CHECK_NOTHROW(parse(small_gpt() + pp2 + words("--num-layers 3 --account-for-embedding-in-pipeline-split"), 2));
  CHECK_THAT(parse_error(small_gpt() + pp2 + words("--num-layers 4 --account-for-loss-in-pipeline-split"), 2),
             Contains("--num-layers 4 plus 1 (--account-for-loss-in-pipeline-split) = 5 is not divisible by "
                      "--pipeline-model-parallel-size 2"));
}

TEST_CASE("rule: uneven first/last pipeline stages", "[cli][rules]") {
  const Args pp3 = words("--pipeline-model-parallel-size 3 --num-layers 7");
  CHECK_NOTHROW(parse(small_gpt() + pp3 + words("--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 2"), 3));
  CHECK_THAT(parse_error(small_gpt() + pp3 + words("--decoder-first-pipeline-num-layers 2"), 3),
             Contains("the 5 layers left for the 2 middle pipeline stages"));
  CHECK_THAT(parse_error(small_gpt() + pp3 + words("--decoder-first-pipeline-num-layers 0"), 3),
             Contains("--decoder-first-pipeline-num-layers must be > 0"));
  CHECK_THAT(parse_error(small_gpt() + words("--num-layers 3 --decoder-first-pipeline-num-layers 1")),
             Contains("need --pipeline-model-parallel-size > 1"));
  CHECK_THAT(parse_error(small_gpt() + pp3 + words("--decoder-last-pipeline-num-layers 1 "
                                                   "--account-for-embedding-in-pipeline-split"), 3),
             Contains("cannot be combined with --account-for-embedding-in-pipeline-split"));
}

TEST_CASE("rule: virtual pipeline sizes", "[cli][rules]") {
  const Args base = small_gpt() + words("--num-layers 8 --pipeline-model-parallel-size 2 --global-batch-size 8");
  const Config c = parse(base + words("--num-layers-per-virtual-pipeline-stage 2"), 2);
  CHECK(c.parallel.virtual_pipeline_size == 2);
  CHECK(parse(base + words("--num-virtual-stages-per-pipeline-rank 4"), 2).parallel.virtual_pipeline_size == 4);
  CHECK_THAT(parse_error(base + words("--num-layers-per-virtual-pipeline-stage 3"), 2),
             Contains("the 4 layers per pipeline stage are not divisible by --num-layers-per-virtual-pipeline-stage 3"));
  CHECK_THAT(parse_error(base + words("--num-virtual-stages-per-pipeline-rank 3"), 2),
             Contains("not divisible by the virtual pipeline size 3 (--num-virtual-stages-per-pipeline-rank)"));
  CHECK_THAT(parse_error(base + words("--num-layers-per-virtual-pipeline-stage 2 --num-virtual-stages-per-pipeline-rank 2"), 2),
             Contains("no more than one of --num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank"));
  CHECK_THAT(parse_error(base + words("--num-layers-per-virtual-pipeline-stage 2 --decoder-first-pipeline-num-layers 2"), 2),
             Contains("use --num-virtual-stages-per-pipeline-rank"));
  CHECK_THAT(parse_error(small_gpt() + words("--num-layers 4 --num-virtual-stages-per-pipeline-rank 2")),
             Contains("needs --pipeline-model-parallel-size > 1"));
  CHECK_THAT(parse_error(base + words("--num-virtual-stages-per-pipeline-rank 2 --no-overlap-p2p-communication"), 2),
             Contains("--no-overlap-p2p-communication needs --pipeline-model-parallel-size > 2"));
  // Micro-batch groups: P <= N <= M and M % N == 0 or >= P.
  CHECK_THAT(parse_error(base + words("--num-virtual-stages-per-pipeline-rank 2 --global-batch-size 2"), 2),
             Contains("needs at least 2 micro-batches"));
  CHECK_THAT(parse_error(base + words("--num-virtual-stages-per-pipeline-rank 2 --global-batch-size 10 "
                                      "--microbatch-group-size-per-virtual-pipeline-stage 4"), 2),
             Contains("leave a remainder of at least --pipeline-model-parallel-size 2 (remainder 1)"));
  CHECK_THAT(parse_error(base + words("--num-virtual-stages-per-pipeline-rank 2 "
                                      "--microbatch-group-size-per-virtual-pipeline-stage 1"), 2),
             Contains("--microbatch-group-size-per-virtual-pipeline-stage 1 is smaller than --pipeline-model-parallel-size 2"));
  CHECK_NOTHROW(parse(base + words("--num-virtual-stages-per-pipeline-rank 2 --global-batch-size 12 "
                                   "--microbatch-group-size-per-virtual-pipeline-stage 4"), 2));
}

TEST_CASE("rule: global batch divisible by micro-batch x DP", "[cli][rules]") {
  CHECK(parse(small_gpt() + words("--global-batch-size 16"), 4).train.num_microbatches == 2);
  CHECK_THAT(parse_error(small_gpt() + words("--global-batch-size 12"), 4),
             Contains("--global-batch-size 12 is not divisible by --micro-batch-size 2 x data-parallel size 4 = 8"));
  std::vector<SetupMessage> ms;
  const Config c = parse(small_gpt() + words("--global-batch-size 12 --decrease-batch-size-if-needed"), 4, &ms);
  CHECK(c.train.global_batch == 8);
  CHECK(has_message(ms, SetupMessage::Kind::warning, "decreasing it to 8"));
  CHECK_THAT(parse_error(small_gpt() + words("--micro-batch-size 0")), Contains("--micro-batch-size must be > 0"));
}

// Megatron-LM's arguments.py: the evaluation batch defaults to the global batch and must be a
// multiple of micro-batch x DP; the validation and test splits are sized with it.
TEST_CASE("rule: --eval-global-batch-size is a multiple of micro-batch x DP and sizes the evaluation splits",
          "[cli][rules]") {
  const Config c = parse(small_gpt() + words("--global-batch-size 4 --eval-global-batch-size 12"), 2);
  CHECK(c.train.eval_global_batch_size == std::optional<int>(12));
  CHECK(samples_per_split(c) == std::array<int64_t, 3>{40, 100 * 12, 100 * 12});  // --eval-iters 100
  CHECK(samples_per_split(parse(small_gpt() + words("--global-batch-size 4"), 2)) ==
        std::array<int64_t, 3>{40, 100 * 4, 100 * 4});
  CHECK_THAT(parse_error(small_gpt() + words("--eval-global-batch-size 6"), 2),
             Contains("--eval-global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2 = 4"));
  CHECK_THAT(parse_error(small_gpt() + words("--eval-global-batch-size 0")), Contains("--eval-global-batch-size"));
}

TEST_CASE("rule: exactly one of --train-iters and --train-samples, no mixing of iter/sample LR flags", "[cli][rules]") {
  Args no_len;
  for (const auto& a : small_gpt())
    if (a != "--train-iters" && a != "10") no_len.push_back(a);
  CHECK_THAT(parse_error(no_len), Contains("pass --train-iters or --train-samples"));
  CHECK_THAT(parse_error(small_gpt() + words("--train-samples 100")), Contains("--train-iters and --train-samples are exclusive"));
  CHECK_NOTHROW(parse(no_len + words("--train-samples 100 --lr-decay-samples 80 --lr-warmup-samples 8")));
  CHECK_THAT(parse_error(small_gpt() + words("--lr-decay-samples 80")), Contains("--lr-decay-samples goes with --train-samples"));
  CHECK_THAT(parse_error(small_gpt() + words("--lr-warmup-samples 8")), Contains("--lr-warmup-samples goes with --train-samples"));
  CHECK_THAT(parse_error(no_len + words("--train-samples 100 --lr-decay-iters 5")),
             Contains("--lr-decay-iters goes with --train-iters"));
  CHECK_THAT(parse_error(no_len + words("--train-samples 100 --lr-warmup-iters 5")),
             Contains("--lr-warmup-iters goes with --train-iters"));
}

TEST_CASE("rule: --lr-warmup-fraction excludes --lr-warmup-iters/--lr-warmup-samples", "[cli][rules]") {
  CHECK_NOTHROW(parse(small_gpt() + words("--lr-warmup-fraction 0.1")));
  CHECK_THAT(parse_error(small_gpt() + words("--lr-warmup-fraction 0.1 --lr-warmup-iters 2")),
             Contains("can only specify one of --lr-warmup-fraction and --lr-warmup-iters"));
  Args samples;
  for (const auto& a : small_gpt())
    if (a != "--train-iters" && a != "10") samples.push_back(a);
  CHECK_THAT(parse_error(samples + words("--train-samples 100 --lr-warmup-fraction 0.1 --lr-warmup-samples 2")),
             Contains("can only specify one of --lr-warmup-fraction and --lr-warmup-samples"));
}

TEST_CASE("rule: warmup shorter than decay, WSD needs its decay length", "[cli][rules]") {
  CHECK_THAT(parse_error(small_gpt() + words("--lr-warmup-iters 10")),
             Contains("must be shorter than the decay horizon"));
  CHECK_THAT(parse_error(small_gpt() + words("--lr-decay-style WSD")), Contains("--lr-decay-style WSD needs --lr-wsd-decay-iters"));
  CHECK_NOTHROW(parse(small_gpt() + words("--lr-decay-style WSD --lr-wsd-decay-iters 3")));
}

TEST_CASE("rule: start/end weight decay go with a non-constant increment style", "[cli][rules]") {
  CHECK_THAT(parse_error(small_gpt() + words("--start-weight-decay 0.1")),
             Contains("--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or cosine"));
  CHECK_THAT(parse_error(small_gpt() + words("--weight-decay-incr-style linear --start-weight-decay 0.1")),
             Contains("--weight-decay-incr-style linear needs both --start-weight-decay and --end-weight-decay"));
  const Config c = parse(small_gpt() + words("--weight-decay-incr-style cosine --start-weight-decay 0.0 --end-weight-decay 0.1"));
  CHECK(*c.train.end_weight_decay == 0.1);
  const Config d = parse(small_gpt() + words("--weight-decay 0.1"));
  CHECK(*d.train.start_weight_decay == 0.1);
  CHECK(*d.train.end_weight_decay == 0.1);
}

TEST_CASE("rule: recompute granularity, method and layer count", "[cli][rules]") {
  CHECK_NOTHROW(parse(small_gpt() + words("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")));
  CHECK_THAT(parse_error(small_gpt() + words("--recompute-granularity full --recompute-num-layers 1")),
             Contains("--recompute-granularity full needs --recompute-method uniform or block"));
  CHECK_THAT(parse_error(small_gpt() + words("--recompute-granularity full --recompute-method block")),
             Contains("needs --recompute-num-layers between 1 and the layers per pipeline stage (2)"));
  CHECK_THAT(parse_error(small_gpt() + words("--recompute-granularity full --recompute-method block --recompute-num-layers 3")),
             Contains("--recompute-num-layers 3 must be between 1 and the layers per pipeline stage (2)"));
  CHECK_THAT(parse_error(small_gpt() + words("--recompute-granularity selective --recompute-method uniform")),
             Contains("--recompute-method is not supported with --recompute-granularity selective"));
  CHECK_THAT(parse_error(small_gpt() + words("--recompute-activations --recompute-num-layers 1")),
             Contains("--recompute-num-layers must not be set with --recompute-granularity selective"));
  // Without a granularity Megatron-LM checks neither (TransformerConfig checks them only with one):
  // accepted, each with a note that it does nothing, and nothing is recomputed.
  std::vector<SetupMessage> ms;
  const Config c = parse(small_gpt() + words("--recompute-method uniform --recompute-num-layers 1"), 1, &ms);
  CHECK(c.train.recompute_granularity == RecomputeGranularity::none);
  CHECK(has_message(ms, SetupMessage::Kind::note, "--recompute-method has no effect without --recompute-granularity full"));
  CHECK(has_message(ms, SetupMessage::Kind::note,
                    "--recompute-num-layers has no effect without --recompute-granularity full"));
  std::vector<SetupMessage> only_layers;
  parse(small_gpt() + words("--recompute-num-layers 7"), 1, &only_layers);  // not checked against the stage either
  CHECK(has_message(only_layers, SetupMessage::Kind::note,
                    "--recompute-num-layers has no effect without --recompute-granularity full"));
  CHECK_FALSE(has_message(only_layers, SetupMessage::Kind::note,
                          "--recompute-method has no effect without --recompute-granularity full"));
  CHECK_THAT(parse_error(small_gpt() + words("--recompute-method sideways")), Contains("--recompute-method"));
  CHECK_THAT(parse_error(small_gpt() + words("--recompute-activations --recompute-modules attention")),
             Contains("--recompute-modules attention: not one of"));
}

TEST_CASE("rule: --fp16 and --bf16 are exclusive", "[cli][rules]") {
  CHECK_NOTHROW(parse(small_gpt() + words("--bf16")));
  CHECK_THAT(parse_error(small_gpt() + words("--fp16 --bf16")), Contains("--fp16 and --bf16 are exclusive"));
}

TEST_CASE("rule: --save needs --save-interval", "[cli][rules]") {
  CHECK_NOTHROW(parse(small_gpt() + words("--save /tmp/ckpt --save-interval 100")));
  CHECK_THAT(parse_error(small_gpt() + words("--save /tmp/ckpt")), Contains("--save needs --save-interval"));
  CHECK_THAT(parse_error(small_gpt() + words("--save /tmp/ckpt --save-interval 0")), Contains("--save-interval must be > 0"));
}

TEST_CASE("rule: --min-lr at most --lr", "[cli][rules]") {
  CHECK_NOTHROW(parse(small_gpt() + words("--min-lr 1e-3")));
  CHECK_THAT(parse_error(small_gpt() + words("--min-lr 1e-2")), Contains("--min-lr 0.01 is larger than --lr 0.001"));
  Args no_lr;
  for (const auto& a : small_gpt())
    if (a != "--lr" && a != "1e-3") no_lr.push_back(a);
  CHECK_THAT(parse_error(no_lr), Contains("--lr is required"));
}

TEST_CASE("rule: --max-position-embeddings at least --seq-length", "[cli][rules]") {
  CHECK_NOTHROW(parse(small_gpt() + words("--max-position-embeddings 64")));
  CHECK_THAT(parse_error(small_gpt() + words("--seq-length 64")),
             Contains("--max-position-embeddings 32 is smaller than --seq-length 64"));
}

TEST_CASE("rule: query groups divide the heads and are a multiple or divisor of TP", "[cli][rules]") {
  const Args gqa = words("--hidden-size 128 --num-attention-heads 8 --group-query-attention");
  CHECK(parse(small_gpt() + gqa + words("--num-query-groups 2 --tensor-model-parallel-size 4"), 4).model.query_groups == 2);
  CHECK(parse(small_gpt() + gqa + words("--num-query-groups 4 --tensor-model-parallel-size 2"), 2).model.query_groups == 4);
  CHECK_THAT(parse_error(small_gpt() + gqa + words("--num-query-groups 3")),
             Contains("--num-attention-heads 8 is not divisible by --num-query-groups 3"));
  CHECK_THAT(parse_error(small_gpt() + words("--hidden-size 192 --num-attention-heads 12 --group-query-attention "
                                             "--num-query-groups 6 --tensor-model-parallel-size 4"), 4),
             Contains("--num-query-groups 6 must be a multiple or a divisor of --tensor-model-parallel-size 4"));
  std::vector<SetupMessage> ms;
  CHECK(parse(small_gpt() + words("--num-query-groups 2"), 1, &ms).model.query_groups == 4);
  CHECK(has_message(ms, SetupMessage::Kind::warning, "--num-query-groups 2 is ignored without --group-query-attention"));
}

TEST_CASE("rule: MLP size divisible by TP", "[cli][rules]") {
  CHECK_NOTHROW(parse(small_gpt() + words("--ffn-hidden-size 128 --tensor-model-parallel-size 4"), 4));
  CHECK_THAT(parse_error(small_gpt() + words("--ffn-hidden-size 102 --tensor-model-parallel-size 4 --num-attention-heads 4"), 4),
             Contains("--ffn-hidden-size 102 is not divisible by --tensor-model-parallel-size 4"));
}

TEST_CASE("rule: overlap-param-gather needs the distributed optimizer and overlap-grad-reduce", "[cli][rules]") {
  CHECK_NOTHROW(parse(small_gpt() + words("--overlap-param-gather --use-distributed-optimizer --overlap-grad-reduce")));
  CHECK_THAT(parse_error(small_gpt() + words("--overlap-param-gather --overlap-grad-reduce")),
             Contains("--overlap-param-gather is only supported with --use-distributed-optimizer"));
  CHECK_THAT(parse_error(small_gpt() + words("--overlap-param-gather --use-distributed-optimizer")),
             Contains("--overlap-param-gather needs --overlap-grad-reduce"));
}

TEST_CASE("rule: --tp-comm-overlap needs sequence parallelism, SP is switched off at TP 1", "[cli][rules]") {
  std::vector<SetupMessage> ms;
  CHECK(parse(small_gpt() + words("--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap"), 2, &ms)
            .parallel.tp_comm_overlap);
  CHECK(has_message(ms, SetupMessage::Kind::note, "--tp-comm-overlap has no effect in megatrain"));
  CHECK_THAT(parse_error(small_gpt() + words("--tensor-model-parallel-size 2 --tp-comm-overlap"), 2),
             Contains("--tp-comm-overlap needs --sequence-parallel"));
  CHECK_THAT(parse_error(small_gpt() + words("--sequence-parallel --tp-comm-overlap")),
             Contains("--tp-comm-overlap needs --sequence-parallel"));
  std::vector<SetupMessage> ms2;
  CHECK_FALSE(parse(small_gpt() + words("--sequence-parallel"), 1, &ms2).parallel.sequence_parallel);
  CHECK(has_message(ms2, SetupMessage::Kind::warning, "Disabling sequence parallelism because tensor model parallelism is disabled"));
  CHECK(parse(small_gpt() + words("--sequence-parallel --tensor-model-parallel-size 2"), 2).parallel.sequence_parallel);
  CHECK_THAT(parse_error(small_gpt() + words("--sequence-parallel --tensor-model-parallel-size 4 --seq-length 30"), 4),
             Contains("--sequence-parallel needs --seq-length 30"));
}

TEST_CASE("rule: one data source", "[cli][rules]") {
  TempDir d;
  write_dataset(d.str("ds"));
  CHECK_THAT(parse_error(small_gpt() + words("--data-path " + d.str("ds"))),
             Contains("--mock-data, --data-path and --train-data-path/--valid-data-path/--test-data-path are exclusive"));
  Args no_data;
  for (const auto& a : small_gpt())
    if (a != "--mock-data") no_data.push_back(a);
  CHECK_THAT(parse_error(no_data), Contains("no training data"));
  std::vector<SetupMessage> ms;
  const Config c = parse(no_data + words("--data-path " + d.str("ds")), 1, &ms);
  CHECK(*c.data.split == "969, 30, 1");  // Megatron's legacy default, with its warning
  CHECK(has_message(ms, SetupMessage::Kind::warning, "Please specify --split when using --data-path"));
  CHECK_NOTHROW(parse(no_data + words("--train-data-path " + d.str("ds") + " --valid-data-path 1 " + d.str("ds"))));
  CHECK_THAT(parse_error(no_data + words("--data-path " + d.str("ds") + " --train-data-path " + d.str("ds"))),
             Contains("a single data source must be provided"));
}

TEST_CASE("rule: --data-args-path and --per-split-data-args-path read the blends from files", "[cli][rules]") {
  TempDir d;
  write_dataset(d.str("a"));
  write_dataset(d.str("b"));
  Args no_data;
  for (const auto& a : small_gpt())
    if (a != "--mock-data") no_data.push_back(a);
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(d.str(name)) << text;
    return d.str(name);
  };
  // The file's words are --data-path's list, newlines and runs of spaces alike.
  const std::string blend = write("blend.txt", "0.3 " + d.str("a") + "\n\n   0.7\t" + d.str("b") + "\n");
  const Config c = parse(no_data + words("--split 99,1,0 --data-args-path " + blend));
  CHECK(c.data.data_path == std::vector<std::string>{"0.3", d.str("a"), "0.7", d.str("b")});
  CHECK(*c.data.split == "99,1,0");
  CHECK_THAT(parse_error(no_data + words("--data-args-path " + blend)), Contains("--data-args-path needs --split"));
  CHECK_THAT(parse_error(no_data + words("--split 99,1,0 --data-path " + d.str("a") + " --data-args-path " + blend)),
             Contains("--data-path and --data-args-path are exclusive"));
  CHECK_THAT(parse_error(small_gpt() + words("--split 99,1,0 --data-args-path " + blend)),
             Contains("a single data source must be provided"));  // with --mock-data
  CHECK_THAT(parse_error(no_data + words("--split 99,1,0 --data-args-path " + d.str("absent.txt"))),
             Contains("--data-args-path '" + d.str("absent.txt") + "': cannot open it"));
  CHECK_THAT(parse_error(no_data + words("--split 99,1,0 --data-args-path " + write("empty.txt", " \n"))),
             Contains("--data-args-path '" + d.str("empty.txt") + "' needs at least one dataset prefix"));
  CHECK_THAT(parse_error(no_data + words("--split 99,1,0 --data-args-path " + write("gone.txt", d.str("gone")))),
             Contains("gone.idx not found"));

  // Per split: a string (split at whitespace), a list, or null.
  const std::string per_split = write("split.json", "{\"train\": \"0.5 " + d.str("a") + " 0.5 " + d.str("b") +
                                                        "\", \"valid\": [1, \"" + d.str("b") + "\"], \"test\": null}");
  const Config p = parse(no_data + words("--per-split-data-args-path " + per_split));
  CHECK(p.data.train_data_path == std::vector<std::string>{"0.5", d.str("a"), "0.5", d.str("b")});
  CHECK(p.data.valid_data_path == std::vector<std::string>{"1", d.str("b")});
  CHECK(p.data.test_data_path.empty());
  CHECK_THAT(parse_error(no_data + words("--per-split-data-args-path " + per_split + " --train-data-path " + d.str("a"))),
             Contains("--per-split-data-args-path and --train-data-path/--valid-data-path/--test-data-path are exclusive"));
  CHECK_THAT(parse_error(no_data + words("--per-split-data-args-path " + write("nokey.json", R"({"train": null, "valid": null})"))),
             Contains("has no \"test\" key"));
  CHECK_THAT(parse_error(no_data + words("--per-split-data-args-path " +
                                         write("nulls.json", R"({"train": null, "valid": null, "test": null})"))),
             Contains("are all null: no data"));
  CHECK_THAT(parse_error(no_data + words("--per-split-data-args-path " + write("bad.json", R"({"train": [)"))),
             Contains("not valid JSON"));
  CHECK_THAT(parse_error(no_data + words("--per-split-data-args-path " + write("num.json", R"({"train": 3, "valid": null, "test": null})"))),
             Contains("\"train\" is number"));
  CHECK_THAT(parse_error(no_data + words("--per-split-data-args-path " + write("arr.json", R"([1])"))),
             Contains("expected a JSON object"));
  CHECK_THAT(parse_error(no_data + words("--per-split-data-args-path " +
                                         write("emptytrain.json", R"({"train": "", "valid": null, "test": null})"))),
             Contains("\"train\" needs at least one dataset prefix"));
}

TEST_CASE("rule: dataset files exist and their .idx header is valid", "[cli][rules]") {
  TempDir d;
  write_dataset(d.str("good"));
  Args no_data;
  for (const auto& a : small_gpt())
    if (a != "--mock-data") no_data.push_back(a);
  CHECK_NOTHROW(parse(no_data + words("--split 99,1,0 --data-path 0.3 " + d.str("good") + " 0.7 " + d.str("good"))));
  CHECK_THAT(parse_error(no_data + words("--data-path " + d.str("missing"))), Contains("missing.idx not found"));
  write_dataset(d.str("nobin"));
  std::filesystem::remove(d.str("nobin.bin"));
  CHECK_THAT(parse_error(no_data + words("--data-path " + d.str("nobin"))), Contains("nobin.bin not found"));
  write_dataset(d.str("bad"));
  {
    std::fstream f(d.str("bad.idx"), std::ios::in | std::ios::out | std::ios::binary);
    f.write("NOTANIDX", 8);
  }
  CHECK_THAT(parse_error(no_data + words("--data-path " + d.str("bad"))), Contains("not a Megatron indexed dataset"));
  write_dataset(d.str("v2"));
  {
    std::fstream f(d.str("v2.idx"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(9);
    const uint64_t v = 2;
    f.write(reinterpret_cast<const char*>(&v), 8);
  }
  CHECK_THAT(parse_error(no_data + words("--data-path " + d.str("v2"))), Contains(".idx version 2"));
  CHECK_THAT(parse_error(no_data + words("--data-path -1 " + d.str("good"))), Contains("is negative"));
}

TEST_CASE("rule: --device cpu refuses --bf16 and --fp16", "[cli][rules]") {
  CHECK(parse(small_gpt() + words("--device cpu")).train.device == DeviceKind::cpu);
  CHECK_THAT(parse_error(small_gpt() + words("--device cpu --bf16")),
             Contains("--device cpu (the float32 reference backend) does not support --bf16"));
  CHECK_THAT(parse_error(small_gpt() + words("--device cpu --fp16")), Contains("does not support --fp16"));
}

TEST_CASE("refused at parse time: flags the engine does not implement", "[cli][rules]") {
  CHECK_THAT(parse_error(small_gpt() + words("--fp32-residual-connection --bf16")),
             Contains("megatrain does not support --fp32-residual-connection yet"));
  CHECK_THAT(parse_error(small_gpt() + words("--apply-residual-connection-post-layernorm")),
             Contains("megatrain does not support --apply-residual-connection-post-layernorm yet"));
  // --reset-attention-mask: built, also under pipeline and context parallelism.
  CHECK(parse(small_gpt() + words("--reset-attention-mask")).data.reset_attention_mask);
  CHECK_NOTHROW(parse(small_gpt() + words("--reset-attention-mask --pipeline-model-parallel-size 2"), 2));
  CHECK_NOTHROW(parse(small_gpt() + words("--reset-attention-mask --context-parallel-size 2"), 2));
  CHECK_THAT(parse_error(small_gpt() + words("--dataloader-type external")),
             Contains("megatrain does not support --dataloader-type external yet"));
  CHECK_NOTHROW(parse(small_gpt() + words("--dataloader-type cyclic")));
  CHECK_NOTHROW(parse(small_gpt() + words("--dataloader-type single")));
}

TEST_CASE("no effect, Megatron's rules kept: softmax precision, p2p overlap, averaging in the collective",
          "[cli][rules]") {
  std::vector<SetupMessage> ms;
  const Config c = parse(small_gpt() + words("--attention-softmax-in-fp32 --ddp-average-in-collective"), 1, &ms);
  CHECK(c.model.attention_softmax_in_fp32);
  CHECK(has_message(ms, SetupMessage::Kind::note, "--attention-softmax-in-fp32 has no effect in megatrain"));
  CHECK(has_message(ms, SetupMessage::Kind::note, "--ddp-average-in-collective has no effect in megatrain"));
  // Megatron's DistributedDataParallel refuses averaging with per-token loss.
  CHECK_THAT(parse_error(small_gpt() + words("--ddp-average-in-collective --calculate-per-token-loss")),
             Contains("Cannot average in collective when calculating per-token loss"));
  CHECK_NOTHROW(parse(small_gpt() + words("--calculate-per-token-loss")));
  std::vector<SetupMessage> ms2;
  parse(small_gpt() + words("--num-layers 8 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
                            "--global-batch-size 8 --overlap-p2p-communication-warmup-flush"), 2, &ms2);
  CHECK(has_message(ms2, SetupMessage::Kind::note, "--overlap-p2p-communication-warmup-flush has no effect in megatrain"));
}

TEST_CASE("flag --apply-query-key-layer-scaling: no effect, Transformer Engine's NVTE_APPLY_QK_LAYER_SCALING rule kept",
          "[cli][rules]") {
  const Args qk = small_gpt() + words("--apply-query-key-layer-scaling");
  std::vector<SetupMessage> ms;
  CHECK(parse(qk + words("--transformer-impl local"), 1, &ms).model.attention_softmax_in_fp32);
  CHECK(has_message(ms, SetupMessage::Kind::note, "--apply-query-key-layer-scaling has no effect in megatrain"));
  Environment env = torchrun_env(1);
  env["NVTE_APPLY_QK_LAYER_SCALING"] = "1";
  CHECK_NOTHROW(parse_env(qk, env));
  CHECK_THAT(parse_error(qk), Contains("apply_query_key_layer_scaling is True but environment variable "
                                       "NVTE_APPLY_QK_LAYER_SCALING is None"));
  try {  // the other way round: the variable set, the flag absent
    parse_env(small_gpt(), env);
    FAIL_CHECK("expected an error");
  } catch (const Error& e) {
    CHECK_THAT(std::string(e.what()), Contains("apply_query_key_layer_scaling is False"));
  }
  CHECK_NOTHROW(parse_env(small_gpt() + words("--transformer-impl local"), env));
}

TEST_CASE("flag --attention-backend unfused runs megatrain's flash attention, with a note", "[cli][rules]") {
  std::vector<SetupMessage> ms;
  CHECK(parse(small_gpt() + words("--attention-backend unfused"), 1, &ms).model.attention_backend ==
        AttentionBackend::unfused);
  CHECK(has_message(ms, SetupMessage::Kind::note, "--attention-backend unfused runs megatrain's flash attention"));
}

TEST_CASE("rule: position embedding flags", "[cli][rules]") {
  CHECK(parse(small_gpt() + words("--use-rotary-position-embeddings --no-position-embedding")).model.position_embedding_type ==
        PositionEmbedding::rope);
  CHECK_THAT(parse_error(small_gpt() + words("--no-position-embedding")),
             Contains("--no-position-embedding is deprecated, use --position-embedding-type"));
  CHECK_NOTHROW(parse(small_gpt() + words("--position-embedding-type rope --rope-type rope")));
  CHECK_THAT(parse_error(small_gpt() + words("--attention-backend local")),
             Contains("--attention-backend local is only supported with --spec local"));
  CHECK_THAT(parse_error(small_gpt() + words("--position-embedding-type rope --rotary-percent 1.5")),
             Contains("--rotary-percent must be in (0, 1]"));
}

TEST_CASE("rule: --window-size and --window-attn-skip-freq", "[cli][rules]") {
  // Megatron's tuple_type: "L,R" or "(L,R)"; layers 1-based as in is_layer_window_attention.
  const Args four = words("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                          "--max-position-embeddings 32 --micro-batch-size 2 --lr 1e-3 --train-iters 10 --mock-data "
                          "--tokenizer-type NullTokenizer --vocab-size 1000");
  Config c = parse(four + words("--window-size 7,0"));
  REQUIRE(c.model.window_size == std::make_pair(7, 0));
  for (int layer = 0; layer < 4; ++layer) CHECK(attention_window_left(c.model, layer) == 7);
  c = parse(four + words("--window-size (15,0) --window-attn-skip-freq 2"));
  CHECK(attention_window_left(c.model, 0) == 15);
  CHECK(attention_window_left(c.model, 1) == -1);  // layer number 2: full attention
  CHECK(attention_window_left(c.model, 2) == 15);
  CHECK(attention_window_left(c.model, 3) == -1);
  c = parse(four + Args{"--window-size", "3,0", "--window-attn-skip-freq", "([1] * 1 + [0]) + 2*[1]"});
  CHECK(c.model.window_attn_pattern == std::vector<int>{1, 0, 1, 1});
  CHECK(attention_window_left(c.model, 1) == -1);
  CHECK(attention_window_left(c.model, 3) == 3);
  c = parse(four + Args{"--window-size", "3,0", "--window-attn-skip-freq", "[1,0]*2"});
  CHECK(c.model.window_attn_pattern == std::vector<int>{1, 0, 1, 0});
  CHECK(parse(small_gpt()).model.window_size == std::nullopt);
  CHECK(attention_window_left(parse(small_gpt()).model, 0) == -1);

  std::vector<SetupMessage> ms;
  c = parse(four + words("--window-size 5,3"), 1, &ms);
  CHECK(attention_window_left(c.model, 0) == 5);
  CHECK(has_message(ms, SetupMessage::Kind::warning, "megatrain uses (5, 0)"));
  ms.clear();
  c = parse(four + words("--window-attn-skip-freq 2"), 1, &ms);
  CHECK(attention_window_left(c.model, 0) == -1);
  CHECK(has_message(ms, SetupMessage::Kind::warning, "--window-attn-skip-freq has no effect without --window-size"));
  ms.clear();
  c = parse(four + words("--window-size (-1,-1)"), 1, &ms);  // (argparse reads a bare -1,-1 as a flag)
  CHECK(attention_window_left(c.model, 0) == -1);
  CHECK(has_message(ms, SetupMessage::Kind::note, "LEFT -1 is no sliding window"));

  CHECK_THAT(parse_error(four + words("--window-size 5")), Contains("--window-size takes two integers LEFT,RIGHT"));
  CHECK_THAT(parse_error(four + words("--window-size 5,x")), Contains("--window-size"));
  CHECK_THAT(parse_error(four + words("--window-size (-3,0)")), Contains("each bound is -1 (unbounded)"));
  CHECK_THAT(parse_error(four + words("--window-size (-1,4)")), Contains("causal attention takes (LEFT, 0) or (-1, 0)"));
  CHECK_THAT(parse_error(four + words("--window-size 5,0 --window-attn-skip-freq 0")),
             Contains("--window-attn-skip-freq 0 must be > 0"));
  CHECK_THAT(parse_error(four + Args{"--window-size", "5,0", "--window-attn-skip-freq", "[1,0]*3"}),
             Contains("--window-attn-skip-freq gives 6 layers but --num-layers is 4"));
  CHECK_THAT(parse_error(four + Args{"--window-size", "5,0", "--window-attn-skip-freq", "[1,0]*[2]"}),
             Contains("'*' needs a list and a number"));
  CHECK_THAT(parse_error(four + Args{"--window-size", "5,0", "--window-attn-skip-freq", "[1]*0"}),
             Contains("is an empty list"));
  CHECK(parse(four + Args{"--window-size", "5,0", "--window-attn-skip-freq", " ( ( [1] ) ) * 4 "}).model.window_attn_pattern ==
        std::vector<int>{1, 1, 1, 1});
  CHECK_THAT(parse_error(four + Args{"--window-size", "5,0", "--window-attn-skip-freq", "[1,0"}),
             Contains("a list is not closed"));
  CHECK_THAT(parse_error(four + Args{"--window-size", "5,0", "--window-attn-skip-freq", "[1,0]-[1]"}),
             Contains("unexpected '-[1]'"));
}

TEST_CASE("rule: --qk-l2-norm", "[cli][rules]") {
  CHECK(parse(small_gpt() + words("--qk-l2-norm")).model.qk_l2_norm);
  std::vector<SetupMessage> ms;
  const Config c = parse(small_gpt() + words("--qk-l2-norm --qk-layernorm"), 1, &ms);
  CHECK(c.model.qk_l2_norm);
  CHECK(has_message(ms, SetupMessage::Kind::note, "queries and keys get the L2 norm"));
}

TEST_CASE("rule: --num-layers and --encoder-num-layers, --seq-length and --encoder-seq-length", "[cli][rules]") {
  CHECK_THAT(parse_error(small_gpt() + words("--encoder-num-layers 2")),
             Contains("cannot have both --num-layers and --encoder-num-layers"));
  CHECK_THAT(parse_error(small_gpt() + words("--encoder-seq-length 32")),
             Contains("cannot have both --seq-length and --encoder-seq-length"));
  Args no_layers;
  const Args base = small_gpt();
  for (size_t i = 0; i < base.size(); ++i) {
    if (base[i] == "--num-layers") {
      ++i;
      continue;
    }
    no_layers.push_back(base[i]);
  }
  CHECK(parse(no_layers + words("--encoder-num-layers 4")).model.num_layers == 4);
  CHECK_THAT(parse_error(no_layers), Contains("--num-layers is required"));
}

TEST_CASE("rule: required flags", "[cli][rules]") {
  const Args base = small_gpt();
  for (const char* req : {"--hidden-size", "--num-attention-heads", "--max-position-embeddings", "--micro-batch-size",
                          "--seq-length"}) {
    Args a;
    for (size_t i = 0; i < base.size(); ++i) {
      if (base[i] == req) {
        ++i;
        continue;
      }
      a.push_back(base[i]);
    }
    INFO(req);
    CHECK_THAT(parse_error(a), Contains(std::string(req) + " is required"));
  }
}

TEST_CASE("rule: padded vocabulary override", "[cli][rules]") {
  CHECK(parse(small_gpt() + words("--padded-vocab-size 1024 --tensor-model-parallel-size 2"), 2).model.padded_vocab_size == 1024);
  CHECK_THAT(parse_error(small_gpt() + words("--padded-vocab-size 999")),
             Contains("--padded-vocab-size 999 is smaller than the tokenizer's vocabulary (1000)"));
  CHECK_THAT(parse_error(small_gpt() + words("--padded-vocab-size 1001 --tensor-model-parallel-size 2"), 2),
             Contains("--padded-vocab-size 1001 is not divisible by --tensor-model-parallel-size 2"));
}

TEST_CASE("rule: checkpoint and logging values", "[cli][rules]") {
  std::vector<SetupMessage> ms;
  // megatrain's --async-save is a background thread: no --use-persistent-ckpt-worker needed.
  CHECK(parse(small_gpt() + words("--async-save --save /tmp/x --save-interval 5"), 1, &ms).checkpoint.async_save);
  CHECK_FALSE(has_message(ms, SetupMessage::Kind::warning, "--async-save"));
  CHECK(parse(small_gpt() + words("--async-save"), 1, &ms).checkpoint.async_save);
  CHECK(has_message(ms, SetupMessage::Kind::warning, "--async-save has no effect without --save"));
  CHECK_THAT(parse_error(small_gpt() + words("--timing-log-level 3")), Contains("--timing-log-level must be 0, 1 or 2"));
  CHECK_THAT(parse_error(small_gpt() + words("--log-interval 0")), Contains("--log-interval must be > 0"));
}

// Megatron-LM's --async-strategy is a choice of nvrx and mcore (argparse refuses other values);
// megatrain's --async-save has one writer of its own, which does what both ask and what
// --async-ckpt-use-cpu-shm asks (host copies in the training process, no worker process).
TEST_CASE("rule: --async-strategy and --async-ckpt-use-cpu-shm are accepted with a note", "[cli][rules]") {
  const Args async = words("--async-save --save /tmp/x --save-interval 5");
  for (const char* strategy : {"nvrx", "mcore"}) {
    std::vector<SetupMessage> ms;
    CHECK(parse(small_gpt() + async + words(std::string("--async-strategy ") + strategy), 1, &ms).checkpoint.async_save);
    CHECK(has_message(ms, SetupMessage::Kind::note, "--async-strategy has no effect in megatrain: megatrain's "
                                                    "--async-save has one writer of its own"));
  }
  CHECK_THAT(parse_error(small_gpt() + async + words("--async-strategy torch")),
             Contains("--async-strategy must be one of nvrx, mcore; got 'torch'"));
  std::vector<SetupMessage> ms;
  CHECK(parse(small_gpt() + async + words("--async-ckpt-use-cpu-shm"), 1, &ms).checkpoint.async_save);
  CHECK(has_message(ms, SetupMessage::Kind::note, "--async-ckpt-use-cpu-shm has no effect in megatrain: megatrain's "
                                                  "--async-save already copies the tensors to host memory"));
  CHECK_THAT(parse_error(small_gpt() + words("--async-ckpt-use-cpu-shm=1")), Contains("takes no value"));
}

// Megatron-LM's distributed optimizer checkpoints are DP-reshardable unless this flag asks for
// TP/PP too; megatrain's always are (tests/mpi/parallel_train.cmake resumes them on another layout).
TEST_CASE("rule: --dist-ckpt-optim-fully-reshardable is accepted with a note", "[cli][rules]") {
  std::vector<SetupMessage> ms;
  CHECK(parse(small_gpt() + words("--use-distributed-optimizer --dist-ckpt-optim-fully-reshardable"), 2, &ms)
            .parallel.use_distributed_optimizer);
  CHECK(has_message(ms, SetupMessage::Kind::note, "--dist-ckpt-optim-fully-reshardable has no effect in megatrain: "
                                                  "megatrain's checkpoints are always fully reshardable"));
}

// Megatron-LM's _set_wandb_writer (megatron/training/global_vars.py): an empty project is no W&B,
// an empty run name is refused, the directory is --wandb-save-dir or <save>/wandb. megatrain writes
// its TensorBoard event files there (or to --tensorboard-dir) and prints the `wandb sync` command.
TEST_CASE("rule: W&B flags: the event directory, the wandb sync command, Megatron-LM's refusals", "[cli][rules]") {
  std::vector<SetupMessage> ms;
  const Config all = parse(small_gpt() + words("--wandb-project p --wandb-exp-name run-1 --wandb-save-dir /tmp/w "
                                               "--wandb-entity team"), 1, &ms);
  CHECK(*all.logging.wandb_project == "p");
  CHECK(tensorboard_events_dir(all) == std::optional<std::string>("/tmp/w"));
  CHECK(wandb_sync_command(all) == std::optional<std::string>("wandb sync --project p --entity team --id run-1 /tmp/w"));
  CHECK_FALSE(has_message(ms, SetupMessage::Kind::warning, "wandb"));
  // Without --wandb-save-dir: <save>/wandb, as Megatron-LM.
  const Config in_save = parse(small_gpt() + words("--wandb-project p --save /tmp/s --save-interval 5"));
  CHECK(tensorboard_events_dir(in_save) == std::optional<std::string>("/tmp/s/wandb"));
  CHECK(wandb_sync_command(in_save) == std::optional<std::string>("wandb sync --project p /tmp/s/wandb"));
  // --tensorboard-dir keeps the event files where it says.
  const Config tb = parse(small_gpt() + words("--wandb-project p --wandb-save-dir /tmp/w --tensorboard-dir /tmp/tb"));
  CHECK(tensorboard_events_dir(tb) == std::optional<std::string>("/tmp/tb"));
  CHECK(wandb_sync_command(tb) == std::optional<std::string>("wandb sync --project p /tmp/tb"));
  // Words the shell would split are quoted; a name that cannot be a run ID gets none.
  const Config odd = parse(small_gpt() + Args{"--wandb-project", "my project", "--wandb-exp-name", "gpt/8b",
                                              "--wandb-save-dir", "/tmp/it's"});
  CHECK(wandb_sync_command(odd) == std::optional<std::string>("wandb sync --project 'my project' '/tmp/it'\\''s'"));
  // Megatron-LM's refusals.
  CHECK_THAT(parse_error(small_gpt() + Args{"--wandb-project", "p", "--wandb-exp-name", "", "--wandb-save-dir", "/tmp/w"}),
             Contains("Please specify the wandb experiment name!"));
  CHECK_THAT(parse_error(small_gpt() + words("--wandb-project p")),
             Contains("pass --wandb-save-dir DIR or --save"));
  CHECK_THAT(parse_error(small_gpt() + Args{"--wandb-project", "p", "--wandb-save-dir", ""}),
             Contains("pass --wandb-save-dir DIR or --save"));
  // An empty project is no W&B: the other W&B flags say they have no effect.
  const Config off = parse(small_gpt() + Args{"--wandb-project", "", "--wandb-exp-name", "x", "--wandb-entity", "e"}, 1, &ms);
  CHECK_FALSE(tensorboard_events_dir(off));
  CHECK_FALSE(wandb_sync_command(off));
  CHECK(has_message(ms, SetupMessage::Kind::warning, "--wandb-exp-name has no effect without --wandb-project"));
  CHECK(has_message(ms, SetupMessage::Kind::warning, "--wandb-entity has no effect without --wandb-project"));
  CHECK_FALSE(has_message(ms, SetupMessage::Kind::warning, "--wandb-save-dir"));
}

TEST_CASE("rule: retain interval, progress log, energy, load-only flags", "[cli][rules]") {
  std::vector<SetupMessage> ms;
  const Args save = words("--save /tmp/x --save-interval 5");
  CHECK(parse(small_gpt() + save + words("--save-retain-interval 20 --log-progress"), 1, &ms).checkpoint.save_retain_interval == 20);
  CHECK_THAT(parse_error(small_gpt() + save + words("--save-retain-interval 12")),
             Contains("--save-retain-interval 12 is not a multiple of --save-interval 5"));
  CHECK_THAT(parse_error(small_gpt() + save + words("--save-retain-interval 0")), Contains("must be > 0"));
  CHECK(parse(small_gpt() + words("--log-progress --save-retain-interval 5"), 1, &ms).logging.log_progress);
  CHECK(has_message(ms, SetupMessage::Kind::warning, "--log-progress writes <save>/progress.txt"));
  CHECK(has_message(ms, SetupMessage::Kind::warning, "--save-retain-interval has no effect without --save"));
  // --log-energy reads NVML: refused on the CPU reference backend (small_gpt trains there).
  CHECK_THAT(parse_error(small_gpt() + words("--device cpu --log-energy")),
             Contains("--log-energy reads the GPUs' energy counters"));
  CHECK(parse(small_gpt() + words("--log-energy")).logging.log_energy);
  // Flags that only mean something when a checkpoint is loaded.
  CHECK_THAT(parse_error(small_gpt() + words("--no-initialization")), Contains("a checkpoint must be loaded"));
  CHECK_FALSE(parse(small_gpt() + words("--no-initialization --load /tmp/x")).checkpoint.perform_initialization);
  CHECK_FALSE(parse(small_gpt() + words("--no-initialization --pretrained-checkpoint /tmp/x")).checkpoint.perform_initialization);
  CHECK_THAT(parse_error(small_gpt() + words("--override-ckpt-iteration 5")), Contains("it needs --load"));
  CHECK_THAT(parse_error(small_gpt() + words("--override-ckpt-iteration 5 --load /tmp/x --finetune")),
             Contains("Cannot override checkpoint iteration together with finetune flag."));
  CHECK_THAT(parse_error(small_gpt() + words("--override-ckpt-iteration -1 --load /tmp/x")), Contains("must be >= 0"));
  CHECK(*parse(small_gpt() + words("--override-ckpt-iteration 7 --load /tmp/x")).checkpoint.override_ckpt_iteration == 7);
  CHECK_THAT(parse_error(small_gpt() + words("--use-checkpoint-args")),
             Contains("--use-checkpoint-args requires --load or --pretrained-checkpoint argument"));
  CHECK(parse(small_gpt() + words("--use-mp-args-from-checkpoint-args"), 1, &ms).checkpoint.use_mp_args_from_checkpoint_args);
  CHECK(has_message(ms, SetupMessage::Kind::warning, "has no effect without --use-checkpoint-args"));
}

TEST_CASE("rule: --world-size and --json belong to --dry-run", "[cli][rules]") {
  CHECK_THAT(parse_error(small_gpt() + words("--world-size 8")), Contains("--world-size 8 is for --dry-run only"));
  CHECK_THAT(parse_error(small_gpt() + words("--json")), Contains("--json goes with --dry-run"));
  CHECK(parse_env(small_gpt() + words("--dry-run --world-size 16"), {}).parallel.world_size == 16);
}

// Rules about flags the refusal table currently shadows: checked on the validation step itself so
// that they hold the day the flag's refusal line is deleted.
TEST_CASE("rules behind refused flags hold in validation", "[cli][rules]") {
  auto state = [](const Args& extra, int world = 1) {
    cli::CliState st = cli::parse_flags(small_gpt() + extra);
    cli::resolve_launch(st, torchrun_env(world));
    cli::derive(st);
    return st;
  };
  auto error_of = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  {
    cli::CliState st = state({});
    st.cfg.train.fp16_lm_cross_entropy = true;
    CHECK_THAT(error_of([&] { cli::validate_training(st); }), Contains("--fp16-lm-cross-entropy needs --fp16"));
    cli::CliState ok = state(words("--fp16"));
    ok.cfg.train.fp16_lm_cross_entropy = true;
    CHECK_NOTHROW(cli::validate_training(ok));
  }
  {
    cli::CliState st = state(words("--swiglu"));
    st.cfg.model.squared_relu = true;
    CHECK_THAT(error_of([&] { cli::validate_model(st); }), Contains("--squared-relu and --swiglu are exclusive"));
    st.cfg.model.squared_relu = false;
    st.cfg.model.quick_geglu = true;
    CHECK_THAT(error_of([&] { cli::validate_model(st); }), Contains("--quick-geglu and --swiglu are exclusive"));
  }
  {
    // Megatron-LM's bias-activation fusion refuses squared ReLU: biased layers need the fusion off.
    cli::CliState st = state(words("--squared-relu"));
    CHECK_THAT(error_of([&] { cli::validate_model(st); }),
               Contains("--squared-relu with biased linear layers needs --no-bias-gelu-fusion"));
    cli::CliState unfused = state(words("--squared-relu --no-bias-gelu-fusion"));
    CHECK_NOTHROW(cli::validate_model(unfused));
    cli::CliState no_bias = state(words("--squared-relu --disable-bias-linear"));
    CHECK_NOTHROW(cli::validate_model(no_bias));
  }
  {
    cli::CliState st = state(words("--group-query-attention"));
    st.cfg.model.multi_latent_attention = true;
    CHECK_THAT(error_of([&] { cli::validate_model(st); }),
               Contains("--multi-latent-attention and --group-query-attention are exclusive"));
  }
  {
    cli::CliState st = state(words("--tensor-model-parallel-size 2"), 2);
    st.cfg.train.distribute_saved_activations = true;
    CHECK_THAT(error_of([&] { cli::validate_parallel(st); }),
               Contains("--distribute-saved-activations needs --recompute-granularity full"));
    cli::CliState one = state({});
    one.cfg.train.distribute_saved_activations = true;
    CHECK_THAT(error_of([&] { cli::validate_parallel(one); }), Contains("needs --tensor-model-parallel-size > 1"));
    cli::CliState sp = state(words("--tensor-model-parallel-size 2 --sequence-parallel --recompute-granularity full "
                                   "--recompute-method uniform --recompute-num-layers 1"), 2);
    sp.cfg.train.distribute_saved_activations = true;
    CHECK_THAT(error_of([&] { cli::validate_parallel(sp); }), Contains("cannot be combined with --sequence-parallel"));
  }
  {
    cli::CliState st = state(words("--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"));
    st.cfg.parallel.overlap_param_gather_with_optimizer_step = true;
    CHECK_THAT(error_of([&] { cli::validate_parallel(st); }),
               Contains("only supported with an interleaved pipeline schedule"));
  }
  {
    cli::CliState st = state(words("--save /tmp/x --save-interval 10"));
    st.cfg.checkpoint.save_retain_interval = 15;
    CHECK_THAT(error_of([&] { cli::validate_checkpoint_and_logging(st); }),
               Contains("--save-retain-interval 15 is not a multiple of --save-interval 10"));
  }
  {
    cli::CliState st = state({});
    st.cfg.parallel.context_parallel_size = 3;
    CHECK_THAT(error_of([&] { cli::validate_model(st); }), Contains("--seq-length 32 is not a multiple of 2 x --context-parallel-size 3"));
  }
}

TEST_CASE("rule: builder threads, p2p warmup overlap, DDP buckets", "[cli][rules]") {
  CHECK_NOTHROW(parse(small_gpt() + words("--num-dataset-builder-threads 4")));
  CHECK_THAT(parse_error(small_gpt() + words("--num-dataset-builder-threads 0")),
             Contains("--num-dataset-builder-threads must be > 0"));
  const Args vpp = words("--num-layers 8 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
                         "--global-batch-size 8");
  CHECK_NOTHROW(parse(small_gpt() + vpp + words("--overlap-p2p-communication-warmup-flush"), 2));
  CHECK_THAT(parse_error(small_gpt() + words("--overlap-p2p-communication-warmup-flush")),
             Contains("--overlap-p2p-communication-warmup-flush needs the interleaved schedule"));
  CHECK(*parse(small_gpt() + words("--ddp-bucket-size 1000000")).parallel.ddp_bucket_size == 1000000);
  CHECK_THAT(parse_error(small_gpt() + words("--ddp-bucket-size 0")), Contains("--ddp-bucket-size must be > 0"));
}

TEST_CASE("rule: --defer-embedding-wgrad-compute keeps Megatron's conditions", "[cli][rules]") {
  const Args pp2 = small_gpt() + words("--pipeline-model-parallel-size 2 --defer-embedding-wgrad-compute");
  CHECK_NOTHROW(parse(pp2 + words("--wgrad-deferral-limit 2"), 2));
  CHECK_THAT(parse_error(small_gpt() + words("--defer-embedding-wgrad-compute")),
             Contains("Cannot defer embedding wgrad compute when pipeline model parallel is not used"));
  CHECK_THAT(parse_error(pp2 + words("--no-gradient-accumulation-fusion"), 2),
             Contains("Cannot defer embedding wgrad compute when gradient accumulation fusion is not used"));
  CHECK_THAT(parse_error(pp2 + words("--wgrad-deferral-limit -1"), 2),
             Contains("--wgrad-deferral-limit should be greater than or equal to 0"));
  CHECK_THAT(parse_error(pp2 + words("--wgrad-deferral-limit two"), 2),
             Contains("argument --wgrad-deferral-limit: invalid int value: 'two'"));
}

TEST_CASE("rule: --overlap-param-gather-with-optimizer-step keeps Megatron's conditions", "[cli][rules]") {
  const Args base = small_gpt() + words("--num-layers 4 --pipeline-model-parallel-size 2 "
                                        "--num-virtual-stages-per-pipeline-rank 2 --use-distributed-optimizer "
                                        "--overlap-grad-reduce --overlap-param-gather "
                                        "--overlap-param-gather-with-optimizer-step --global-batch-size 8");
  std::vector<SetupMessage> notes;
  CHECK(parse(base + words("--ckpt-format torch"), 4, &notes).parallel.overlap_param_gather_with_optimizer_step);
  bool noted = false;
  for (const SetupMessage& m : notes)
    noted = noted || m.text.find("--overlap-param-gather-with-optimizer-step: megatrain starts every bucket's") == 0;
  CHECK(noted);
  CHECK_THAT(parse_error(base, 4), Contains("not supported with distributed checkpointing yet"));
  CHECK_THAT(parse_error(small_gpt() + words("--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
                                             "--overlap-param-gather-with-optimizer-step --ckpt-format torch")),
             Contains("only supported with an interleaved pipeline schedule"));
}

TEST_CASE("rule: --pipeline-model-parallel-layout sets the virtual pipeline size and excludes the other split flags",
          "[cli][rules]") {
  const Args base = small_gpt() + words("--num-layers 6 --pipeline-model-parallel-size 2 --global-batch-size 4");
  const Config c = parse(base + words("--pipeline-model-parallel-layout Et|tt|t|ttL"), 2);
  CHECK(c.parallel.virtual_pipeline_size == 2);
  CHECK(parse(base + words("--pipeline-model-parallel-layout Ettt|tttL"), 2).parallel.virtual_pipeline_size == 1);
  CHECK_THAT(parse_error(base + words("--pipeline-model-parallel-layout Et|tt|ttL"), 2),
             Contains("The length of pipeline_model_parallel_layout must be divisible by pipeline_model_parallel_size"));
  CHECK_THAT(parse_error(base + words("--pipeline-model-parallel-layout Et|tt|t|ttL --num-virtual-stages-per-pipeline-rank 2"), 2),
             Contains("no more than one of"));
  CHECK_THAT(parse_error(base + words("--pipeline-model-parallel-layout Et|tt|t|ttL --decoder-first-pipeline-num-layers 2"), 2),
             Contains("cannot be set with other pipeline layout arguments"));
  CHECK_THAT(parse_error(base + words("--pipeline-model-parallel-layout Et|tt|t|tL"), 2),
             Contains("it holds 5 decoder layers (t), --num-layers is 6"));
}

TEST_CASE("rule: --distributed-timeout-seconds-after-init is a positive number of seconds", "[cli][rules]") {
  CHECK_FALSE(parse(small_gpt()).parallel.distributed_timeout_seconds_after_init.has_value());
  CHECK(*parse(small_gpt() + words("--distributed-timeout-seconds-after-init 90"))
             .parallel.distributed_timeout_seconds_after_init == 90);
  CHECK_THAT(parse_error(small_gpt() + words("--distributed-timeout-seconds-after-init 0")),
             Contains("--distributed-timeout-seconds-after-init must be > 0"));
}

TEST_CASE("rule: --eval-micro-batch-size is taken at the training micro-batch size only", "[cli][rules]") {
  const Config c = parse(small_gpt() + words("--micro-batch-size 2 --global-batch-size 8 --eval-micro-batch-size 2"));
  CHECK(*c.train.eval_micro_batch_size == 2);
  CHECK_THAT(parse_error(small_gpt() + words("--micro-batch-size 2 --global-batch-size 8 --eval-micro-batch-size 4")),
             Contains("megatrain does not support --eval-micro-batch-size 4 other than --micro-batch-size 2 yet"));
  CHECK_THAT(parse_error(small_gpt() + words("--eval-micro-batch-size 0")), Contains("--eval-micro-batch-size"));
}

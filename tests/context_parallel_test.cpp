// Context parallelism's set-up: the flags and their refusals, this rank's positions of a sequence,
// the memory plan. (Training equals one rank's: tests/mpi/parallel_train.cmake, parallel_train_cp*.)
#include <string>
#include <vector>

#include "tests/cli_test_util.h"
#include "app/plan.h"
#include "engine/model_chunks.h"
#include "engine/model_dims.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;

TEST_CASE("context parallelism: --cp-comm-type takes one of Megatron's four values or one per layer", "[cli][cp]") {
  const Args cp2 = small_gpt() + words("--context-parallel-size 2");
  CHECK(parse(cp2 + words("--cp-comm-type allgather"), 2).parallel.cp_comm_type == std::vector<std::string>{"allgather"});
  CHECK(parse(cp2 + words("--cp-comm-type p2p allgather"), 2).parallel.cp_comm_type.size() == 2);
  CHECK(parse(cp2, 2).parallel.cp_comm_type == std::vector<std::string>{"p2p"});
  CHECK_THAT(parse_error(cp2 + words("--cp-comm-type p2p allgather p2p"), 2),
             Contains("--cp-comm-type takes one value or one per layer (2 for --num-layers 2), got 3"));
  CHECK_THAT(parse_error(cp2 + words("--cp-comm-type ring"), 2), Contains("--cp-comm-type: unknown value 'ring'"));
  // a2a+p2p: the hierarchical sizes are required and multiply to CP (Megatron-LM's rules).
  const Args cp4 = small_gpt() + words("--context-parallel-size 4");
  CHECK(parse(cp4 + words("--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2"), 4)
            .parallel.hierarchical_context_parallel_sizes == std::vector<int64_t>{2, 2});
  CHECK_THAT(parse_error(cp4 + words("--cp-comm-type a2a+p2p"), 4),
             Contains("--hierarchical-context-parallel-sizes must be set when a2a+p2p is used in --cp-comm-type"));
  CHECK_THAT(parse_error(cp4 + words("--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 4"), 4),
             Contains("--hierarchical-context-parallel-sizes multiply to 8, not --context-parallel-size 4"));
  // a2a splits each TP rank's heads and query groups over the a2a ranks.
  CHECK(parse(cp4 + words("--cp-comm-type a2a"), 4).parallel.cp_comm_type == std::vector<std::string>{"a2a"});
  CHECK_THAT(parse_error(cp4 + words("--cp-comm-type a2a --tensor-model-parallel-size 2"), 8),
             Contains("--cp-comm-type a2a splits each tensor-parallel rank's 2 query heads and 2 query groups over 4 ranks"));
  CHECK_THAT(parse_error(cp4 + words("--cp-comm-type a2a --group-query-attention --num-query-groups 2"), 4),
             Contains("4 query heads and 2 query groups over 4 ranks"));
  CHECK(parse(cp4 + words("--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2 --group-query-attention "
                          "--num-query-groups 2"), 4).parallel.cp_comm_type.size() == 1);
  CHECK_THAT(parse_error(small_gpt() + words("--context-parallel-size 3"), 3),
             Contains("--seq-length 32 is not a multiple of 2 x --context-parallel-size 3"));
  // Distributed-optimizer instances split DP x CP (here 1 x 2: two instances of one replica each).
  CHECK(parse(cp2 + words("--use-distributed-optimizer --num-distributed-optimizer-instances 2"), 2)
            .parallel.num_distributed_optimizer_instances == 2);
  CHECK_THAT(parse_error(cp2 + words("--use-distributed-optimizer --num-distributed-optimizer-instances 4"), 2),
             Contains("Data parallel size should be divisible by partial DistOpt shard factor"));
}

TEST_CASE("context parallelism: rank r holds chunks r and 2 CP - 1 - r of each sequence", "[engine][cp]") {
  const Config c = parse(small_gpt() + words("--context-parallel-size 4"), 4);  // 8 chunks of 4 positions
  for (int r = 0; r < 4; ++r) {
    ModelDims d = ModelDims::from_config(c, RankPosition::split(c, 1, 0));
    d.cp_rank = r;
    CHECK(d.seq == 8);
    CHECK(d.seq_total() == 32);
    CHECK(d.global_position(0) == 4 * r);
    CHECK(d.global_position(3) == 4 * r + 3);
    CHECK(d.global_position(4) == 4 * (7 - r));
    CHECK(d.global_position(7) == 4 * (7 - r) + 3);
  }
  // Every position of the sequence is exactly one rank's.
  std::vector<int> seen(32, 0);
  for (int r = 0; r < 4; ++r) {
    ModelDims d = ModelDims::from_config(c, RankPosition::split(c, 1, 0));
    d.cp_rank = r;
    for (int t = 0; t < d.seq; ++t) ++seen.at(static_cast<size_t>(d.global_position(t)));
  }
  CHECK(seen == std::vector<int>(32, 1));
}

TEST_CASE("context parallelism: each rank plans the activations of its part of the sequence", "[engine][cp]") {
  const Config one = parse(small_gpt() + words("--seq-length 256 --max-position-embeddings 256"), 1);
  const Config cp4 = parse(small_gpt() + words("--seq-length 256 --max-position-embeddings 256 --context-parallel-size 4"), 4);
  const MemoryPlan a = plan_rank_memory(one, RankPosition::stage(one, 0), DType::bf16);
  const MemoryPlan b = plan_rank_memory(cp4, RankPosition::stage(cp4, 0), DType::bf16);
  CHECK(b.of(MemoryCategory::activations) * 4 == a.of(MemoryCategory::activations));
  CHECK(b.of(MemoryCategory::parameters) == a.of(MemoryCategory::parameters));
  // The ring's key/value buffers are in the workspace; the whole is still smaller.
  CHECK(b.of(MemoryCategory::workspace) < a.of(MemoryCategory::workspace));
}

TEST_CASE("dry run: the longest sequence that fits the memory limit, and what CP buys", "[cli][cp][plan]") {
  const Args llama = words(
      "--num-layers 2 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
      "--seq-length 1024 --max-position-embeddings 1024 --position-embedding-type rope --swiglu --ffn-hidden-size 512 "
      "--micro-batch-size 1 --global-batch-size 8 --lr 1e-4 --train-iters 10 --mock-data --tokenizer-type NullTokenizer "
      "--vocab-size 1000 --bf16 --dry-run --gpu-memory-gib 0.25");
  auto longest = [&](const std::string& extra, int world) {
    const Config c = parse(llama + words(extra), world);
    const Plan p = make_plan(c);
    // The plan at the answer fits; one step more does not.
    const int64_t step = c.parallel.context_parallel_size > 1 ? 2 * c.parallel.context_parallel_size : 1;
    auto peak = [&](int64_t seq) {
      Config d = c;
      d.model.seq_length = static_cast<int>(seq);
      d.model.max_position_embeddings = static_cast<int>(seq);
      return stage_memory(d, 0).total;
    };
    CHECK(p.longest_seq > 0);
    CHECK(peak(p.longest_seq) <= p.limit->bytes);
    CHECK(peak(p.longest_seq + step) > p.limit->bytes);
    return p.longest_seq;
  };
  const int64_t one = longest("", 1), cp2 = longest("--context-parallel-size 2", 2);
  CHECK(cp2 > one * 3 / 2);  // the activations split over two ranks (the weights do not)
  // Learned absolute positions: the embedding table bounds it.
  const Config learned = parse(llama + words("--position-embedding-type learned_absolute --gpu-memory-gib 100"), 1);
  const Plan p = make_plan(learned);
  CHECK(p.longest_seq == 1024);
  CHECK(p.longest_seq_capped_by_positions);
}

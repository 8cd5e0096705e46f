// Parallelism rules.
#include <algorithm>
#include <cstdlib>
#include <utility>
#include <vector>

#include "app/cli_internal.h"
#include "parallel/pipeline_layout.h"

namespace mt::cli {

void validate_parallel(CliState& st) {
  const Config& c = st.cfg;
  const ParallelConfig& p = c.parallel;
  const int P = p.pipeline_model_parallel_size, V = p.virtual_pipeline_size;
  // The numbers of micro-batches per iteration: the constant one, or each of a
  // --step-batch-size-schedule's batches (Megatron checks the interleaved schedule's rule at every
  // step; megatrain plans every schedule up front, so checks them here).
  std::vector<std::pair<int, int>> counts;  // (M, global batch)
  const int per_step = c.train.micro_batch_size * p.data_parallel_size;
  for (const auto& [threshold, batch] : c.train.batch_size_schedule)
    if (batch % per_step == 0) counts.emplace_back(batch / per_step, batch);
  if (counts.empty()) counts.emplace_back(c.train.num_microbatches, c.train.global_batch);

  // Layer divisibility, uneven first/last stages, virtual stages (throws naming the flags).
  pipeline_chunks(PipelineSplit::from_config(c));

  if (V > 1) {
    const int N = p.microbatch_group_size_per_virtual_pipeline_stage.value_or(P);
    const std::string n_name = p.microbatch_group_size_per_virtual_pipeline_stage
                                   ? fmt::format("--microbatch-group-size-per-virtual-pipeline-stage {}", N)
                                   : fmt::format("the micro-batch group size {} (= --pipeline-model-parallel-size)", N);
    if (N < P)
      fail("{} is smaller than --pipeline-model-parallel-size {}", n_name, P);
    for (const auto& [M, global_batch] : counts) {
      if (N > M)
        fail("the interleaved schedule needs at least {} micro-batches ({}), got {} (--global-batch-size {} / "
             "(--micro-batch-size {} x data-parallel size {}))", N, n_name, M, global_batch,
             c.train.micro_batch_size, p.data_parallel_size);
      if (M % N != 0 && M % N < P)
        fail("the interleaved schedule needs the number of micro-batches ({}) to be a multiple of {}, or leave a "
             "remainder of at least --pipeline-model-parallel-size {} (remainder {})", M, n_name, P, M % N);
    }
  } else if (p.microbatch_group_size_per_virtual_pipeline_stage) {
    st.warn("--microbatch-group-size-per-virtual-pipeline-stage has no effect without an interleaved schedule "
            "(--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank)");
  }
  if (p.overlap_p2p_communication_warmup_flush && !(V > 1 && p.overlap_p2p_communication))
    fail("--overlap-p2p-communication-warmup-flush needs the interleaved schedule with p2p overlap (and no "
         "--no-overlap-p2p-communication)");

  // Megatron's rules for --defer-embedding-wgrad-compute (ModelParallelConfig), kept although the
  // deferral itself changes nothing in megatrain.
  if (st.has("--defer-embedding-wgrad-compute")) {
    if (P == 1) fail("Cannot defer embedding wgrad compute when pipeline model parallel is not used "
                     "(--defer-embedding-wgrad-compute needs --pipeline-model-parallel-size > 1)");
    if (st.has("--no-gradient-accumulation-fusion"))
      fail("Cannot defer embedding wgrad compute when gradient accumulation fusion is not used "
           "(--defer-embedding-wgrad-compute with --no-gradient-accumulation-fusion)");
    if (st.has("--wgrad-deferral-limit")) {
      const std::string& v = st.given.at("--wgrad-deferral-limit").one();
      char* end = nullptr;
      const long long limit = std::strtoll(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0') fail("argument --wgrad-deferral-limit: invalid int value: '{}'", v);
      if (limit < 0)
        fail("--wgrad-deferral-limit should be greater than or equal to 0 when --defer-embedding-wgrad-compute is on");
    }
  }
  // Megatron-LM's partial distributed optimizer: parallel_state.py's check at initialisation,
  // then DistributedDataParallel's.
  {
    const int n = p.num_distributed_optimizer_instances;
    if (n < 1) fail("--num-distributed-optimizer-instances must be >= 1 (got {})", n);
    if (p.data_parallel_size * p.context_parallel_size % n != 0)
      fail("Data parallel size should be divisible by partial DistOpt shard factor (data-parallel size {} x "
           "--context-parallel-size {}, --num-distributed-optimizer-instances {})",
           p.data_parallel_size, p.context_parallel_size, n);
    if (n > 1 && !p.use_distributed_optimizer)
      fail("Partial DistOpt cannot be used without DistOpt (--num-distributed-optimizer-instances {} needs "
           "--use-distributed-optimizer)", n);
  }
  // Context parallelism: one comm type for every layer or
  // one per layer (Megatron indexes the list by layer number).
  {
    static const char* const kCommTypes[] = {"p2p", "a2a", "allgather", "a2a+p2p"};
    for (const std::string& v : p.cp_comm_type)
      if (std::find(std::begin(kCommTypes), std::end(kCommTypes), v) == std::end(kCommTypes))
        fail("--cp-comm-type: unknown value '{}' (choose from p2p, a2a, allgather, a2a+p2p)", v);
    if (p.cp_comm_type.empty() ||
        (p.cp_comm_type.size() != 1 && p.cp_comm_type.size() != static_cast<size_t>(c.model.num_layers)))
      fail("--cp-comm-type takes one value or one per layer ({} for --num-layers {}), got {}",
           c.model.num_layers, c.model.num_layers, p.cp_comm_type.size());
    const std::vector<int64_t>& hier = p.hierarchical_context_parallel_sizes;
    const bool a2a_p2p = std::find(p.cp_comm_type.begin(), p.cp_comm_type.end(), "a2a+p2p") != p.cp_comm_type.end();
    const bool a2a = std::find(p.cp_comm_type.begin(), p.cp_comm_type.end(), "a2a") != p.cp_comm_type.end();
    if (p.context_parallel_size > 1 && a2a_p2p && hier.empty())
      fail("--hierarchical-context-parallel-sizes must be set when a2a+p2p is used in --cp-comm-type");
    if (!hier.empty()) {
      int64_t product = 1;
      for (int64_t n : hier) product *= n;
      if (product != p.context_parallel_size)
        fail("--hierarchical-context-parallel-sizes multiply to {}, not --context-parallel-size {}", product,
             p.context_parallel_size);
      if (hier.size() != 2 || hier[0] < 1)
        fail("megatrain does not support --hierarchical-context-parallel-sizes with {} levels yet (two: the a2a size, "
             "then the p2p size)", hier.size());
    }
    // Ulysses splits each tensor-parallel rank's heads (and query groups) over the a2a ranks.
    const int tp = p.tensor_model_parallel_size;
    const ModelConfig& m = c.model;
    const int groups = m.group_query_attention ? m.query_groups : m.num_attention_heads;
    auto check_heads = [&](const char* type, int64_t size) {
      if (m.num_attention_heads / tp % size != 0 || groups / tp % size != 0)
        fail("--cp-comm-type {} splits each tensor-parallel rank's {} query heads and {} query groups over {} ranks: "
             "both must be divisible by it", type, m.num_attention_heads / tp, groups / tp, size);
    };
    if (p.context_parallel_size > 1 && a2a) check_heads("a2a", p.context_parallel_size);
    if (p.context_parallel_size > 1 && a2a_p2p) check_heads("a2a+p2p", hier[0]);
  }
  if (p.overlap_param_gather) {
    if (!p.use_distributed_optimizer)
      fail("--overlap-param-gather is only supported with --use-distributed-optimizer");
    if (!p.overlap_grad_reduce) fail("--overlap-param-gather needs --overlap-grad-reduce");
  }
  if (p.overlap_param_gather_with_optimizer_step) {
    if (!p.use_distributed_optimizer)
      fail("--overlap-param-gather-with-optimizer-step is only supported with --use-distributed-optimizer");
    if (!p.overlap_param_gather)
      fail("--overlap-param-gather-with-optimizer-step needs --overlap-param-gather");
    if (V == 1)
      fail("--overlap-param-gather-with-optimizer-step is only supported with an interleaved pipeline schedule");
    // Megatron-LM: use_dist_ckpt = ckpt_format != "torch".
    if (c.checkpoint.ckpt_format != "torch")
      fail("--overlap-param-gather-with-optimizer-step not supported with distributed checkpointing yet (Megatron-LM's "
           "rule: it needs --ckpt-format torch)");
    st.note("--overlap-param-gather-with-optimizer-step: megatrain starts every bucket's parameter all-gather on the "
            "communication stream as soon as the optimizer step has updated this rank's shards, so the gathers already "
            "overlap what follows the step");
  }
  if (p.tp_comm_overlap) {
    if (!p.sequence_parallel)
      fail("--tp-comm-overlap needs --sequence-parallel (tensor-parallel communication/GEMM overlap works only with "
           "sequence parallelism, which needs --tensor-model-parallel-size > 1)");
  }
  // Megatron's DistributedDataParallel refuses this pair (its gradients are summed, not averaged,
  // under per-token loss), although averaging in the collective changes nothing in megatrain.
  if (p.ddp_average_in_collective && c.train.calculate_per_token_loss)
    fail("Cannot average in collective when calculating per-token loss! (--ddp-average-in-collective with "
         "--calculate-per-token-loss)");
  const TrainConfig& t = c.train;
  if (t.distribute_saved_activations) {
    if (p.tensor_model_parallel_size <= 1)
      fail("--distribute-saved-activations needs --tensor-model-parallel-size > 1");
    if (t.recompute_granularity != RecomputeGranularity::full)
      fail("--distribute-saved-activations needs --recompute-granularity full");
    if (t.recompute_method == RecomputeMethod::none)
      fail("--distribute-saved-activations needs --recompute-method");
    if (p.sequence_parallel) fail("--distribute-saved-activations cannot be combined with --sequence-parallel");
  }
  if (p.ddp_bucket_size && *p.ddp_bucket_size <= 0) fail("--ddp-bucket-size must be > 0 (got {})", *p.ddp_bucket_size);
  if (p.ddp_num_buckets && *p.ddp_num_buckets <= 0) fail("--ddp-num-buckets must be > 0 (got {})", *p.ddp_num_buckets);
  if (p.distributed_timeout_minutes <= 0)
    fail("--distributed-timeout-minutes must be > 0 (got {})", p.distributed_timeout_minutes);
  if (p.distributed_timeout_seconds_after_init && *p.distributed_timeout_seconds_after_init <= 0)
    fail("--distributed-timeout-seconds-after-init must be > 0 (got {})", *p.distributed_timeout_seconds_after_init);
}

}  // namespace mt::cli

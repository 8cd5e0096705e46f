// Parallelism flags.
#include "app/flags.h"

namespace mt::cli {

void add_parallel_flags(FlagTable& t) {
  t.set_group(FlagGroup::parallelism);
  t.value("--tensor-model-parallel-size", "tensor parallel size TP", MT_FIELD(parallel.tensor_model_parallel_size));
  t.value("--pipeline-model-parallel-size", "pipeline parallel size PP", MT_FIELD(parallel.pipeline_model_parallel_size));
  t.value("--context-parallel-size", "context parallel size CP", MT_FIELD(parallel.context_parallel_size));
  t.value("--cp-comm-type",
          "context parallelism's key/value exchange: p2p (a ring), allgather, a2a (heads) or a2a+p2p; one value, or one "
          "per layer",
          MT_FIELD(parallel.cp_comm_type));
  t.value("--hierarchical-context-parallel-sizes", "a2a+p2p: the a2a and p2p sizes (product CP)",
          MT_FIELD(parallel.hierarchical_context_parallel_sizes));
  t.flag("--sequence-parallel", "Megatron sequence parallelism inside the TP group (off when TP = 1)",
         MT_FIELD(parallel.sequence_parallel));
  t.value("--num-layers-per-virtual-pipeline-stage", "interleaved schedule: layers per model chunk",
          MT_FIELD(parallel.num_layers_per_virtual_pipeline_stage));
  t.value("--num-virtual-stages-per-pipeline-rank", "interleaved schedule: model chunks per pipeline rank",
          MT_FIELD(parallel.num_virtual_stages_per_pipeline_rank));
  t.value("--microbatch-group-size-per-virtual-pipeline-stage",
          "interleaved schedule: contiguous micro-batches per chunk (default PP)",
          MT_FIELD(parallel.microbatch_group_size_per_virtual_pipeline_stage));
  t.value("--decoder-first-pipeline-num-layers", "uneven pipeline: layers on the first stage",
          MT_FIELD(parallel.decoder_first_pipeline_num_layers));
  t.value("--decoder-last-pipeline-num-layers", "uneven pipeline: layers on the last stage",
          MT_FIELD(parallel.decoder_last_pipeline_num_layers));
  t.value("--pipeline-model-parallel-layout",
          "explicit pipeline layout: stages split by '|' in model order (PP x VPP of them), E embedding, t a layer, L "
          "the loss, (..)*n and x*n repeat, commas ignored",
          MT_FIELD(parallel.pipeline_model_parallel_layout));
  t.flag("--account-for-embedding-in-pipeline-split", "count the embedding as a layer when splitting the pipeline",
         MT_FIELD(parallel.account_for_embedding_in_pipeline_split));
  t.flag("--account-for-loss-in-pipeline-split", "count the loss as a layer when splitting the pipeline",
         MT_FIELD(parallel.account_for_loss_in_pipeline_split));
  // Megatron's p2p overlap changes when pipeline transfers run, not what they carry.
  t.without_effect(t.negative_flag("--no-overlap-p2p-communication",
                                   "interleaved schedule: do not overlap pipeline send/recv",
                                   MT_FIELD(parallel.overlap_p2p_communication)),
                   "megatrain runs each step's pipeline sends and receives as one group between computations, "
                   "never overlapped with them (the same results either way)");
  t.without_effect(t.flag("--overlap-p2p-communication-warmup-flush", "also overlap pipeline send/recv in warmup and flush",
                          MT_FIELD(parallel.overlap_p2p_communication_warmup_flush)),
                   "megatrain runs each step's pipeline sends and receives as one group between computations, "
                   "never overlapped with them (the same results either way)");
  t.flag("--use-tp-pp-dp-mapping", "rank order tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp",
         MT_FIELD(parallel.use_tp_pp_dp_mapping));
  t.value("--expert-model-parallel-size", "expert parallel size EP (MoE): the ranks an MoE layer's experts are split over",
          MT_FIELD(parallel.expert_model_parallel_size));
  t.value("--expert-tensor-parallel-size", "tensor parallel size inside the experts (MoE)",
          MT_FIELD(parallel.expert_tensor_parallel_size))
      .default_text = "None (= TP)";
  t.removed("--no-async-tensor-model-parallel-allreduce", Arity::none,
            "--no-async-tensor-model-parallel-allreduce was removed from Megatron-LM: drop it");
  t.removed("--no-scatter-gather-tensors-in-pipeline", Arity::none,
            "--no-scatter-gather-tensors-in-pipeline was removed from Megatron-LM: drop it");
  t.removed("--model-parallel-size", Arity::one,
            "--model-parallel-size is no longer valid, use --tensor-model-parallel-size instead");
}

}  // namespace mt::cli

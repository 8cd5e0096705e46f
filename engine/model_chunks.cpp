#include "engine/model_chunks.h"

#include <cstdlib>
#include <string>

#include "engine/pipeline_runner.h"
#include "parallel/grad_buckets.h"
#include "parallel/parallel_state.h"
#include "parallel/pipeline_layout.h"

namespace mt {

std::vector<ChunkSpec> model_chunk_specs(const Config& cfg, const RankPosition& r, DType compute) {
  const std::vector<ModelChunk> layout = stage_chunks(PipelineSplit::from_config(cfg), r.pp_rank);
  const std::vector<int> slots = pipeline_slots_needed(cfg, r.pp_rank);
  std::vector<ModelDims> dims;
  int64_t params = 0;  // of this rank, over all its chunks (Megatron sizes buckets from it)
  for (const ModelChunk& c : layout) {
    const ModelDims d = ModelDims::for_chunk(cfg, r, c.first_layer, c.num_layers, c.has_embedding, c.has_output);
    dims.push_back(d);
    int64_t total = 0;
    for (const ParamDesc& p : build_param_descs(dims.back(), &total)) params += p.numel();
  }
  const ParallelConfig& p = cfg.parallel;
  const std::optional<int64_t> bucket = resolve_ddp_bucket_size(p.ddp_bucket_size, p.ddp_num_buckets,
                                                                p.overlap_grad_reduce, r.replicas_size(), params);
  std::vector<ChunkSpec> out;
  for (size_t c = 0; c < layout.size(); ++c) {
    ModelOptions o = ModelOptions::from_config(cfg, dims[c], compute);
    o.num_slots = slots.at(c);
    // The distributed optimizer shards over this rank's instance (--num-distributed-optimizer-instances:
    // DP / N consecutive DP ranks; the whole DP group by default).
    const int instances = p.use_distributed_optimizer ? p.num_distributed_optimizer_instances : 1;
    // With context parallelism the replicas are the DP x CP ranks (ParallelState::replicas; one
    // optimizer instance: checked by the parser).
    o.shard_size = r.replicas_size() / instances;
    o.shard_rank = r.replicas_rank() % o.shard_size;
    if (dims[c].experts_own_grid()) {  // (sharded over an instance of the experts' DP group)
      o.expert_shard_size = r.edp_size / instances;
      o.expert_shard_rank = r.edp_rank % o.expert_shard_size;
    }
    o.bucket_size = bucket;
    o.shard_optimizer_state = p.use_distributed_optimizer;
    // (One rank per optimizer instance: nothing to shard.)
    o.shard_grads = unsharded_gradients_reason(cfg) == std::optional<std::string>("") && o.shard_optimizer_state &&
                    o.shard_size > 1;
    o.shard_params = o.shard_grads && unsharded_params_reason(cfg) == std::optional<std::string>("");
    // Megatron-FSDP's overlap flags: the parameter gathers prefetched a layer ahead, the gradients'
    // reduce-scatters finished a layer later (a third unit slot holds the transfer in flight).
    o.prefetch_units = o.shard_params && p.overlap_param_gather;
    o.unit_slots = o.prefetch_units || (o.shard_grads && p.overlap_grad_reduce) ? 3 : 2;
    // Megatron's bf16 main grads, whatever the DP size. (With float32 parameters Megatron keeps
    // float32 ones and ignores the flag; megatrain honours it there too: its CPU runs test this path.)
    // --main-grads-dtype bf16 (precision-aware optimizer) is the same buffer, with --bf16 only: elsewhere
    // Megatron's gradient buffer has the parameters' dtype whatever the flag says.
    const bool bf16_main_grads = p.grad_reduce_in_bf16 || (cfg.train.main_grads_dtype == StateDtype::bf16 &&
                                                           cfg.train.precision == Precision::bf16);
    if (bf16_main_grads && !p.accumulate_allreduce_grads_in_fp32) o.grad = DType::bf16;
    // Megatron's precision-aware optimizer keeps float32 master weights as remainders of bf16
    // parameters (Transformer Engine's store_param_remainders). Not with FP8 parameters, whose
    // only full-precision values are the master weights.
    const bool bf16_master = compute == DType::bf16 && o.accum == DType::f32 && !cfg.train.fp8_param_gather;
    if (cfg.train.use_precision_aware_optimizer) {
      o.master_remainders = bf16_master && o.shard_optimizer_state;
    } else {
      // Elsewhere the master weights of AdamW (and Muon: engine/muon.h) are remainders rounded to
      // nearest even (with a bit per element for the ties): the bits of a separate float32 copy,
      // 2 bytes per parameter less. Not for SGD, nor Megatron-FSDP's sharded parameters; without
      // the distributed optimizer the set-up stages full values in the gradient buffer, so its
      // gradients must be float32.
      o.master_remainders = o.master_tie_bits = bf16_master && cfg.train.optimizer != OptimizerKind::sgd &&
                                                !o.shard_params && (o.shard_optimizer_state || o.grad == o.accum);
    }
    // One micro-batch per step: a layer's activations may lie in gradient memory that the backward
    // writes after it is done with them (GptModel::plan_acts_over_grads; the same numbers).
    o.acts_over_grads = cfg.train.num_microbatches == 1 && o.num_slots == 1 && !o.shard_grads;
    // ... and the experts' weight gradients are final when their GEMM writes them, unless another
    // rank's are added (their data-parallel group: DP x CP, or the experts' own) or FP8 GEMMs
    // (cuBLASLt's, per expert) write them: the GEMM sums their squares for the gradient norm.
    const int expert_replicas = dims[c].experts_own_grid() ? r.edp_size : r.replicas_size();
    o.expert_grad_sumsq = o.acts_over_grads && dims[c].any_moe() && expert_replicas == 1 && !o.fp8.enabled();
    out.push_back({dims[c], o});
  }
  return out;
}

std::optional<std::string> unsharded_gradients_reason(const Config& cfg) {
  const std::string strategy = fsdp_strategy(cfg.parallel);
  if (strategy != "optim_grads" && strategy != "optim_grads_params") return std::nullopt;
  return std::string();
}

std::optional<std::string> unsharded_params_reason(const Config& cfg) {
  if (fsdp_strategy(cfg.parallel) != "optim_grads_params") return std::nullopt;
  const std::optional<std::string> grads = unsharded_gradients_reason(cfg);
  if (grads && !grads->empty()) return grads;
  if (cfg.train.use_precision_aware_optimizer && cfg.train.precision == Precision::bf16)
    return std::string("--use-precision-aware-optimizer (master weights kept as remainders of the parameters)");
  if (cfg.train.check_weight_hash_across_dp_replicas_interval) return std::string("the replica weight check");
  if (cfg.train.test_mode) return std::string("--test-mode (it compares the layers' q/k norm weights across ranks)");
  return std::string();
}

Config distill_teacher_config(const Config& cfg) {
  MT_CHECK(cfg.train.distill.enabled() && cfg.train.distill.teacher, "distill_teacher_config without a teacher");
  Config t = cfg;
  t.model = *cfg.train.distill.teacher;
  t.train.distill = DistillConfig{};
  t.checkpoint = CheckpointConfig{};
  t.checkpoint.load = cfg.train.distill.teacher_load;
  t.checkpoint.finetune = true;  // the weights only
  t.checkpoint.dist_ckpt_strictness = "raise_all";  // every tensor of the teacher, and nothing else
  return t;
}

std::optional<ChunkSpec> teacher_chunk_spec(const Config& cfg, const RankPosition& r, DType compute) {
  if (!cfg.train.distill.enabled()) return std::nullopt;
  const Config t = distill_teacher_config(cfg);
  std::vector<ChunkSpec> specs = model_chunk_specs(t, r, compute);
  MT_CHECK(specs.size() == 1 && specs[0].dims.first_stage && specs[0].dims.last_stage,
           "a distillation teacher on {} chunks (one stage only)", specs.size());
  ChunkSpec& s = specs[0];
  ModelOptions& o = s.options;
  o.frozen = true;
  o.distill = ModelOptions::Distill{};
  o.num_slots = 1;
  o.shard_size = 1;
  o.shard_rank = 0;
  o.expert_shard_size = 0;
  o.expert_shard_rank = 0;
  o.bucket_size.reset();
  o.shard_optimizer_state = o.shard_grads = o.shard_params = o.prefetch_units = false;
  o.unit_slots = 2;
  o.grad = o.accum;
  o.master_remainders = o.master_tie_bits = false;
  o.acts_over_grads = o.expert_grad_sumsq = false;
  o.logits_chunk_rows = 1;  // (its logits are the student head's to compute)
  // Every layer a recompute group of its own: the forward keeps each layer's input only.
  const int L = s.dims.decoder_layers();
  o.recompute = RecomputePlan{};
  o.recompute.group_of.assign(static_cast<size_t>(s.dims.stage_layers()), -1);
  for (int l = 0; l < L; ++l) {
    o.recompute.groups.emplace_back(l, l + 1);
    o.recompute.group_of[static_cast<size_t>(l)] = l;
  }
  o.recompute.max_group_size = L > 0 ? 1 : 0;
  return s;
}

MemoryPlan plan_rank_memory(const Config& cfg, const RankPosition& r, DType compute) {
  MemoryPlan total;
  for (const ChunkSpec& s : model_chunk_specs(cfg, r, compute)) total += GptModel::plan_memory(s.dims, s.options);
  if (const std::optional<ChunkSpec> t = teacher_chunk_spec(cfg, r, compute))
    total += GptModel::plan_memory(t->dims, t->options);
  return total;
}

DType precision_dtype(const Config& cfg) {
  switch (cfg.train.precision) {
    case Precision::fp32: return DType::f32;
    case Precision::bf16: return DType::bf16;
    case Precision::fp16: return DType::f16;
  }
  return DType::f32;
}

std::vector<std::unique_ptr<GptModel>> build_model_chunks(const Config& cfg, ParallelState& ps, Backend& backend,
                                                          DType compute) {
  std::vector<std::unique_ptr<GptModel>> out;
  for (const ChunkSpec& s : model_chunk_specs(cfg, ps, compute)) {
    out.push_back(std::make_unique<GptModel>(s.dims, s.options, ps, backend));
    out.back()->init_parameters(cfg.checkpoint.perform_initialization);
  }
  return out;
}

std::vector<GptModel*> chunk_pointers(const std::vector<std::unique_ptr<GptModel>>& chunks) {
  std::vector<GptModel*> out;
  for (const auto& c : chunks) out.push_back(c.get());
  return out;
}

MemoryPlan total_memory_plan(const std::vector<GptModel*>& chunks) {
  MemoryPlan total;
  for (const GptModel* m : chunks) total += m->memory_plan();
  return total;
}

}  // namespace mt

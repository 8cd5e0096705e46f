#include "engine/model_chunks.h"

#include "engine/pipeline_runner.h"
#include "parallel/grad_buckets.h"
#include "parallel/parallel_state.h"
#include "parallel/pipeline_layout.h"

namespace mt {

std::vector<std::unique_ptr<GptModel>> build_model_chunks(const Config& cfg, ParallelState& ps, Backend& backend,
                                                          DType compute) {
  const std::vector<ModelChunk> layout = stage_chunks(PipelineSplit::from_config(cfg), ps.pp_rank);
  const PipelinePlan plan = PipelinePlan::build(cfg, ps.pp_rank);
  std::vector<ModelDims> dims;
  int64_t params = 0;  // of this rank, over all its chunks (Megatron sizes buckets from it)
  for (const ModelChunk& c : layout) {
    dims.push_back(ModelDims::for_chunk(cfg, ps, c.first_layer, c.num_layers, c.has_embedding, c.has_output));
    int64_t total = 0;
    for (const ParamDesc& p : build_param_descs(dims.back(), &total)) params += p.numel();
  }
  const ParallelConfig& p = cfg.parallel;
  const int dp = ps.dp_size * ps.cp_size;
  const std::optional<int64_t> bucket =
      resolve_ddp_bucket_size(p.ddp_bucket_size, p.ddp_num_buckets, p.overlap_grad_reduce, dp, params);
  std::vector<std::unique_ptr<GptModel>> out;
  for (size_t c = 0; c < layout.size(); ++c) {
    ModelOptions o = ModelOptions::from_config(cfg, dims[c], compute);
    o.num_slots = plan.num_slots.at(c);
    o.dp_size = ps.dp_size;
    o.dp_rank = ps.dp_rank;
    o.bucket_size = bucket;
    o.shard_optimizer_state = p.use_distributed_optimizer;
    o.grad_reduce_bf16 = p.grad_reduce_in_bf16 && ps.dp_size > 1;
    out.push_back(std::make_unique<GptModel>(dims[c], o, ps, backend));
    out.back()->init_parameters();
  }
  return out;
}

std::vector<GptModel*> chunk_pointers(const std::vector<std::unique_ptr<GptModel>>& chunks) {
  std::vector<GptModel*> out;
  for (const auto& c : chunks) out.push_back(c.get());
  return out;
}

}  // namespace mt

#include "app/plan.h"

#include <cstdio>

#include "engine/flops.h"

namespace mt {

Plan make_plan(const Config& cfg) {
  Plan p;
  p.grid = RankGrid::from_config(cfg);
  const PipelineSplit split = PipelineSplit::from_config(cfg);
  p.chunks = pipeline_chunks(split);
  p.params = count_parameters(cfg.model);
  const int tp = cfg.parallel.tensor_model_parallel_size, pp = cfg.parallel.pipeline_model_parallel_size;
  for (int r = 0; r < pp; ++r) {
    StagePlan s;
    s.pp_rank = r;
    for (const ModelChunk& c : p.chunks)
      if (c.pp_rank == r) {
        s.chunks.push_back(c);
        s.num_layers += c.num_layers;
      }
    s.params_per_rank = stage_parameters_per_rank(cfg.model, s.chunks, tp, pp);
    s.memory = stage_memory(cfg, r);
    p.stages.push_back(std::move(s));
  }
  p.flops_per_iteration = num_floating_point_operations(cfg.model, cfg.train.global_batch);
  p.flops_per_token = flops_per_token(cfg.model);
  return p;
}

int run_dry_run(const Config& cfg, const std::vector<SetupMessage>& messages) {
  const Plan plan = make_plan(cfg);
  const std::string out = cfg.run.json ? plan_json(cfg, plan, messages).dump(2) : plan_text(cfg, plan, messages);
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
  return 0;
}

}  // namespace mt

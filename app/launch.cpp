// The launcher's environment -> Config::parallel (see parallel/launch_env.h for the precedence).
#include "app/cli_internal.h"
#include "parallel/launch_env.h"

namespace mt::cli {

void resolve_launch(CliState& st, const Environment& env) {
  Config& c = st.cfg;
  ParallelConfig& p = c.parallel;
  st.nvte_apply_qk_layer_scaling = env_get(env, "NVTE_APPLY_QK_LAYER_SCALING");  // (validate_model)
  if (p.nproc_per_node && *p.nproc_per_node < 1) fail("--nproc-per-node must be >= 1 (got {})", *p.nproc_per_node);
  if (c.run.dry_run_world_size) {
    if (!c.run.dry_run)
      fail("--world-size {} is for --dry-run only (a real run takes the world size from its launcher)",
           *c.run.dry_run_world_size);
    if (*c.run.dry_run_world_size < 1) fail("--world-size must be >= 1 (got {})", *c.run.dry_run_world_size);
    p.launcher = Launcher::none;
    p.world_size = *c.run.dry_run_world_size;
    p.rank = 0;
    p.local_rank = 0;
    p.local_world_size = std::min(p.world_size, p.nproc_per_node.value_or(p.world_size));
    return;
  }
  if (c.run.json && !c.run.dry_run) fail("--json goes with --dry-run (training logs are text; see --metrics-jsonl)");
  LaunchInfo l = detect_launch(env, p.nproc_per_node, c.train.device);
  if (st.local_rank) {
    if (*st.local_rank < 0 || *st.local_rank >= l.local_world_size)
      fail("--local-rank {} is outside this node's {} processes", *st.local_rank, l.local_world_size);
    l.local_rank = *st.local_rank;
  }
  if (l.world_size == 0) {
    if (!c.run.dry_run)
      fail("no GPU is visible ({}): pass --device cpu to train on the CPU reference backend, or --dry-run "
           "--world-size N to plan a run", l.source);
    st.note("no GPU is visible: planning for 1 rank (pass --world-size N to plan for more)");
    l.world_size = 1;
    l.local_world_size = 1;
  }
  p.launcher = l.launcher;
  p.world_size = l.world_size;
  p.rank = l.rank;
  p.local_rank = l.local_rank;
  p.local_world_size = l.local_world_size;
  p.node_rank = l.node_rank;
  p.master_addr = l.master_addr;
  p.master_port = l.master_port;
}

}  // namespace mt::cli

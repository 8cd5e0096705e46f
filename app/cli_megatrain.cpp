// megatrain's own flags (not in Megatron-LM).
#include "app/flags.h"

namespace mt::cli {

namespace {
FlagSpec handled_by_main(const char* name, const char* help) {
  FlagSpec s;
  s.name = name;
  s.group = FlagGroup::megatrain;
  s.arity = Arity::none;
  s.kind = FlagKind::megatrain;
  s.help = help;
  return s;
}
}  // namespace

void add_megatrain_flags(FlagTable& t) {
  t.set_group(FlagGroup::megatrain);
  t.choice("--device", "gpu (CUDA) or cpu (the float32 reference backend, over MPI for several ranks)",
           std::vector<std::pair<std::string, DeviceKind>>{{"gpu", DeviceKind::gpu}, {"cpu", DeviceKind::cpu}},
           MT_FIELD(train.device))
      .kind = FlagKind::megatrain;
  t.value("--nproc-per-node", "bare launch: worker processes to start on this machine (default: the visible GPUs)",
          MT_FIELD(parallel.nproc_per_node))
      .kind = FlagKind::megatrain;
  t.flag("--dry-run", "validate everything and print the plan (ranks, layers, parameters, FLOPs, memory); no GPU needed",
         MT_FIELD(run.dry_run))
      .kind = FlagKind::megatrain;
  t.flag("--json", "with --dry-run: print the plan as one JSON object", MT_FIELD(run.json)).kind = FlagKind::megatrain;
  t.value("--world-size", "with --dry-run: plan for this many ranks without a launcher", MT_FIELD(run.dry_run_world_size))
      .kind = FlagKind::megatrain;
  t.value("--gpu-memory-gib",
          "with --dry-run: each GPU's memory in GiB; a plan above it fails (default: the local GPU's memory when "
          "one is visible, else no check)",
          MT_FIELD(run.gpu_memory_gib))
      .kind = FlagKind::megatrain;
  t.value("--metrics-jsonl", "append one JSON object per logged iteration to this file", MT_FIELD(logging.metrics_jsonl))
      .kind = FlagKind::megatrain;
  t.value("--benchmark-warmup-iters",
          "iterations left out of the end-of-run summary line (mean tokens/s, TFLOP/s, MFU, peak memory)",
          MT_FIELD(logging.benchmark_warmup_iters))
      .kind = FlagKind::megatrain;
  t.value("--gpu-sniff-test-interval",
          "every N iterations (outside the timed interval) each rank runs a short GEMM, an all-gather and a ring "
          "send/receive; the ranks slower than the mean by more than a standard deviation are named (0: off)",
          MT_FIELD(logging.gpu_sniff_test_interval))
      .kind = FlagKind::megatrain;
  t.flag("--full-data-check", "scan every token id of the data files against the padded vocabulary at start-up "
         "(default: the first/last MiB and 64 sampled sequences)",
         MT_FIELD(data.full_data_check))
      .kind = FlagKind::megatrain;
  t.add(handled_by_main("--list-flags", "print the flag reference (docs/flags.md) as markdown"));
  FlagSpec help = handled_by_main("--help", "print this help");
  help.aliases.push_back("-h");
  t.add(std::move(help));
  t.add(handled_by_main("--version", "print the version"));
}

}  // namespace mt::cli

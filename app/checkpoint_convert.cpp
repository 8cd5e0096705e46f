#include "app/checkpoint_convert.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "app/checkpoint_args.h"
#include "app/export_megatron.h"
#include "app/import_megatron.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/file_io.h"
#include "core/error.h"
#include "core/log.h"

namespace mt {

int convert_checkpoint(const Config& cfg) {
  const CheckpointConfig& k = cfg.checkpoint;
  MT_CHECK(k.ckpt_convert_format && k.ckpt_convert_save && k.load, "checkpoint conversion without its flags");
  if (cfg.parallel.rank != 0) return 0;
  const std::string& format = *k.ckpt_convert_format;
  const std::string out = join_path(*k.ckpt_convert_save, format);
  std::string source = *k.load;
  std::optional<int64_t> step = k.ckpt_step;
  std::string from = "megatrain";
  // A Megatron-LM checkpoint goes through import-megatron first (into a directory beside the output,
  // removed afterwards), as Megatron-LM's conversion reads any format it can load.
  const std::string imported = join_path(*k.ckpt_convert_save, ".megatrain-convert-import");
  const bool from_megatron = is_megatron_checkpoint(source, step);
  if (!from_megatron && !locate_checkpoint(source, step)) {
    fail("--ckpt-convert-format {}: --load {} holds no checkpoint{} (Megatron-LM exits there too)", format, source,
         step ? fmt::format(" of iteration {}", *step) : std::string());
  }
  MegatronExportResult r;
  try {
    if (from_megatron) {
      remove_tree(imported);
      const MegatronImportResult in = import_megatron(source, step, imported, k.no_save_optim);
      from = "Megatron-LM " + in.format;
      source = imported;
      step.reset();
    }
    // The model the flags describe must be the checkpoint's (Megatron-LM builds it from them, then loads).
    CheckpointReader reader = CheckpointReader::open_directory(locate_checkpoint(source, step)->directory);
    if (reader.run_state().config.contains("model"))
      check_checkpoint_model(reader.run_state().config.at("model"), cfg.model,
                             fmt::format("--load {}", *k.load));
    MegatronExportOptions o;
    o.load = source;
    o.ckpt_step = step;
    o.save = out;
    o.format = format;
    const ParallelConfig& p = cfg.parallel;
    o.tp = p.tensor_model_parallel_size;
    o.pp = p.pipeline_model_parallel_size;
    if (p.virtual_pipeline_size > 1) o.vpp = p.virtual_pipeline_size;
    o.first_stage_layers = p.decoder_first_pipeline_num_layers;
    o.last_stage_layers = p.decoder_last_pipeline_num_layers;
    o.dp = p.data_parallel_size;
    o.ep = p.expert_model_parallel_size;
    o.distributed_optimizer = p.use_distributed_optimizer;
    o.overlap_grad_reduce = p.overlap_grad_reduce;
    o.ddp_bucket_size = p.ddp_bucket_size;
    o.make_vocab_size_divisible_by = cfg.model.make_vocab_size_divisible_by;
    o.weights_only = k.no_save_optim;
    r = export_megatron(o);
  } catch (...) {
    if (from_megatron) remove_tree(imported);
    throw;
  }
  if (from_megatron) remove_tree(imported);
  log::write_stdout(fmt::format("> converted checkpoint: {} -> {}.", from, format));
  log::write_stdout(fmt::format("  {} ({}, TP {} x PP {}{}, DP {}, {} files)", r.directory,
                                r.release ? "weights only: " + (r.weights_only_reason.empty()
                                                                    ? std::string("--no-save-optim")
                                                                    : r.weights_only_reason)
                                          : fmt::format("iteration {} with the optimizer state", r.iteration),
                                r.tp, r.pp, r.vpp > 1 ? fmt::format(" with {} virtual stages", r.vpp) : "", r.dp,
                                r.files.size()));
  return 0;
}

}  // namespace mt

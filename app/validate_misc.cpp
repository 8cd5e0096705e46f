// Checkpointing, logging and megatrain-specific rules.
#include <filesystem>

#include "app/cli_internal.h"

namespace mt::cli {

namespace {

// Whether two paths name the same directory (also before it exists: compared as absolute paths).
bool same_directory(const std::string& a, const std::string& b) {
  auto normal = [](const std::string& p) {
    std::error_code e;
    std::filesystem::path n = std::filesystem::weakly_canonical(std::filesystem::absolute(p), e);
    if (e) n = std::filesystem::absolute(p);
    n = n.lexically_normal();
    return n.has_filename() ? n : n.parent_path();  // "dir/" and "dir" alike
  };
  return normal(a) == normal(b);
}

}  // namespace

void validate_checkpoint_and_logging(CliState& st) {
  Config& c = st.cfg;
  CheckpointConfig& k = c.checkpoint;
  // Megatron's two formats both become megatrain's own (sharded per parameter under global names,
  // resumable on any layout, as torch_dist is); a Megatron-LM checkpoint is one command away.
  if (st.has("--ckpt-format") && (k.ckpt_format == "torch" || k.ckpt_format == "torch_dist"))
    st.note(fmt::format("--ckpt-format {}: megatrain saves and loads its own checkpoint format, which resumes on any "
                        "parallel layout as torch_dist does; `megatrain export-megatron --load CKPT --save DIR` writes "
                        "one as a Megatron-LM torch-format checkpoint, `megatrain import-megatron` reads Megatron-LM's",
                        k.ckpt_format));
  // The FSDP formats (Megatron-LM allows them only with its FSDP: app/validate_fsdp.cpp) likewise.
  if (k.ckpt_format == "fsdp_dtensor" || k.ckpt_format == "torch_dcp")
    st.note(fmt::format("--ckpt-format {}: megatrain saves and loads its own checkpoint format (each parameter and "
                        "its optimizer state under its global name), which resumes under any sharding strategy, "
                        "data-parallel size and parallel layout; `megatrain import-megatron` reads Megatron-LM's {} "
                        "files{}",
                        k.ckpt_format, k.ckpt_format,
                        k.ckpt_format == "fsdp_dtensor"
                            ? ", `megatrain export-megatron --ckpt-format fsdp_dtensor` writes them from one"
                            : " (megatrain does not write them)"));
  // Megatron-LM's CheckpointConfig (megatron/training/config/training_config.py) asserts this.
  if (k.verify_integrity && k.ckpt_format != "torch_dist")
    fail("`verify_integrity` is only supported with torch_dist checkpoint format.");
  if (k.save) {
    if (!k.save_interval) fail("--save needs --save-interval N (iterations between checkpoints)");
    if (*k.save_interval <= 0) fail("--save-interval must be > 0 (got {})", *k.save_interval);
  }
  if (k.save_retain_interval) {
    if (*k.save_retain_interval <= 0) fail("--save-retain-interval must be > 0 (got {})", *k.save_retain_interval);
    if (k.save_interval && *k.save_retain_interval % *k.save_interval != 0)
      fail("--save-retain-interval {} is not a multiple of --save-interval {}", *k.save_retain_interval,
           *k.save_interval);
    if (!k.save) st.warn("--save-retain-interval has no effect without --save");
  }
  // --async-save: Megatron HEAD needs --use-persistent-ckpt-worker for it (else it saves
  // synchronously with a warning); megatrain's asynchronous save is always a background thread of
  // the training process (app/checkpointing.h), so it needs no worker flag.
  if (k.async_save && !k.save) st.warn("--async-save has no effect without --save");
  // Non-persistent checkpoints ("local" is refused as unsupported before this).
  if (k.non_persistent_save_interval) {
    if (*k.non_persistent_save_interval <= 0)
      fail("--non-persistent-save-interval must be > 0 (got {})", *k.non_persistent_save_interval);
    // (Megatron stops at the first non-persistent save without a type.)
    if (!k.non_persistent_ckpt_type)
      fail("--non-persistent-save-interval needs --non-persistent-ckpt-type global (where the non-persistent "
           "checkpoints go)");
    if (!k.save) st.warn("--non-persistent-save-interval has no effect without --save");
  }
  // Only the newest iteration stays in the non-persistent directory: sharing --save's would delete
  // its checkpoints.
  if (k.non_persistent_global_ckpt_dir && k.save && same_directory(*k.non_persistent_global_ckpt_dir, *k.save))
    fail("--non-persistent-global-ckpt-dir {} is --save's directory: only the newest non-persistent checkpoint is "
         "kept there, so --save's checkpoints would be deleted; give it a directory of its own", *k.save);
  if (k.non_persistent_global_ckpt_dir && k.non_persistent_ckpt_type != "global")
    st.warn("--non-persistent-global-ckpt-dir has no effect without --non-persistent-ckpt-type global");
  if (k.non_persistent_ckpt_type == "global" && !k.non_persistent_save_interval && !k.load &&
      !k.non_persistent_global_ckpt_dir)
    st.warn("--non-persistent-ckpt-type global has no effect without --non-persistent-save-interval, --load or "
            "--non-persistent-global-ckpt-dir");
  if (k.ckpt_step && *k.ckpt_step < 0) fail("--ckpt-step must be >= 0 (got {})", *k.ckpt_step);
  // Megatron-LM's checkpoint conversion (validate_args asserts both directories).
  if (k.ckpt_convert_format) {
    if (!k.ckpt_convert_save)
      fail("--ckpt-convert-format {} needs --ckpt-convert-save DIR: the directory the converted checkpoint goes "
           "to (as DIR/{})", *k.ckpt_convert_format, *k.ckpt_convert_format);
    if (!k.load) fail("--ckpt-convert-format {} converts the checkpoint --load names: pass --load", *k.ckpt_convert_format);
  } else if (k.ckpt_convert_save) {
    st.warn("--ckpt-convert-save has no effect without --ckpt-convert-format");
  }
  const bool loads = k.load || k.pretrained_checkpoint;
  if (k.override_ckpt_iteration) {
    if (k.finetune) fail("Cannot override checkpoint iteration together with finetune flag.");
    if (*k.override_ckpt_iteration < 0)
      fail("--override-ckpt-iteration must be >= 0 (got {})", *k.override_ckpt_iteration);
    if (!k.load) fail("--override-ckpt-iteration changes where a resumed run starts: it needs --load");
  }
  // Megatron leaves the weights uninitialized (torch.empty); megatrain refuses to train on them.
  if (!k.perform_initialization && !loads)
    fail("--no-initialization leaves the weights undrawn, so a checkpoint must be loaded: pass --load (or "
         "--pretrained-checkpoint), or drop --no-initialization");
  if (k.use_mp_args_from_checkpoint_args && !k.use_checkpoint_args)
    st.warn("--use-mp-args-from-checkpoint-args has no effect without --use-checkpoint-args");
  const LoggingConfig& l = c.logging;
  if (l.log_interval <= 0) fail("--log-interval must be > 0 (got {})", l.log_interval);
  if (l.gpu_sniff_test_interval < 0)
    fail("--gpu-sniff-test-interval must be >= 0 (0: off; got {})", l.gpu_sniff_test_interval);
  if (l.log_memory_interval && *l.log_memory_interval <= 0)
    fail("--log-memory-interval must be > 0 (got {})", *l.log_memory_interval);
  if (l.timing_log_level < 0 || l.timing_log_level > 2)
    fail("--timing-log-level must be 0, 1 or 2 (got {})", l.timing_log_level);
  if (l.tensorboard_log_interval <= 0)
    fail("--tensorboard-log-interval must be > 0 (got {})", l.tensorboard_log_interval);
  if (l.tensorboard_queue_size <= 0) fail("--tensorboard-queue-size must be > 0 (got {})", l.tensorboard_queue_size);
  if (l.metrics_jsonl && l.metrics_jsonl->empty()) fail("--metrics-jsonl needs a file path");
  // W&B (megatron/training/global_vars.py, _set_wandb_writer): an empty --wandb-project means none;
  // with one, an empty --wandb-exp-name is refused and the W&B directory is --wandb-save-dir, else
  // <save>/wandb (without --save Megatron-LM fails joining the path). megatrain writes its
  // TensorBoard event files there (app/reporters.h).
  auto set = [](const std::optional<std::string>& s) { return s && !s->empty(); };
  if (set(l.wandb_project)) {
    if (l.wandb_exp_name && l.wandb_exp_name->empty())
      fail("Please specify the wandb experiment name! (--wandb-exp-name is empty with --wandb-project {})",
           *l.wandb_project);
    if (!set(l.wandb_save_dir) && !k.save)
      fail("--wandb-project puts the W&B directory in <save>/wandb without --wandb-save-dir: pass --wandb-save-dir "
           "DIR or --save (Megatron-LM fails here too)");
  } else {
    for (const auto& [flag, value] : {std::pair{"--wandb-exp-name", &l.wandb_exp_name},
                                      std::pair{"--wandb-save-dir", &l.wandb_save_dir},
                                      std::pair{"--wandb-entity", &l.wandb_entity}})
      if (set(*value)) st.warn(fmt::format("{} has no effect without --wandb-project", flag));
  }
  if (l.log_progress && !k.save) st.warn("--log-progress writes <save>/progress.txt: it has no effect without --save");
  if (l.log_energy && c.train.device == DeviceKind::cpu)
    fail("--log-energy reads the GPUs' energy counters (NVML) and the CPU reference backend has none: drop "
         "--log-energy, or train on --device gpu");
}

void validate_megatrain(CliState& st) {
  const Config& c = st.cfg;
  if (c.train.device == DeviceKind::cpu) {
    // The reference backend computes in float32 (float64 accumulation): refuse rather than emulate.
    if (c.train.precision == Precision::bf16)
      fail("--device cpu (the float32 reference backend) does not support --bf16: drop it, or train on --device gpu");
    if (c.train.precision == Precision::fp16)
      fail("--device cpu (the float32 reference backend) does not support --fp16: drop it, or train on --device gpu");
  }
  if (c.run.json && !c.run.dry_run) fail("--json goes with --dry-run");
  if (c.run.gpu_memory_gib) {
    if (!c.run.dry_run)
      fail("--gpu-memory-gib is for --dry-run only (a real run has the GPU's memory itself)");
    if (!(*c.run.gpu_memory_gib > 0)) fail("--gpu-memory-gib must be > 0 (got {})", format_float(*c.run.gpu_memory_gib));
  }
}

}  // namespace mt::cli

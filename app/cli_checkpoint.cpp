// Checkpointing flags.
#include "app/flags.h"

namespace mt::cli {

void add_checkpoint_flags(FlagTable& t) {
  t.set_group(FlagGroup::checkpointing);
  t.value("--save", "checkpoint directory to save to (needs --save-interval)", MT_FIELD(checkpoint.save));
  t.alias(t.value("--save-interval", "iterations between checkpoints", MT_FIELD(checkpoint.save_interval)),
          "--persistent-save-interval");
  t.value("--save-retain-interval", "keep only checkpoints at multiples of this", MT_FIELD(checkpoint.save_retain_interval));
  t.value("--load", "checkpoint directory to resume from", MT_FIELD(checkpoint.load));
  t.choice("--ckpt-format", "checkpoint format: all save megatrain's own (a note says so; export-megatron writes "
           "Megatron-LM's torch_dist, torch and fsdp_dtensor formats, import-megatron reads them and torch_dcp)",
           std::vector<std::pair<std::string, std::string>>{{"torch_dist", "torch_dist"}, {"torch", "torch"},
                                                            {"torch_dcp", "torch_dcp"}, {"fsdp_dtensor", "fsdp_dtensor"},
                                                            {"zarr", "zarr"}},
           MT_FIELD(checkpoint.ckpt_format));
  t.flag("--verify-integrity", "write a SHA-256 manifest of the checkpoint's files (integrity.json) at save and check "
         "the files against it at load (torch_dist format)", MT_FIELD(checkpoint.verify_integrity));
  t.no_effect("--auto-detect-ckpt-format", Arity::none,
              "megatrain loads its own checkpoint format and names Megatron-LM's (torch, torch_dist, fsdp_dtensor, "
              "torch_dcp) when --load holds one");
  t.no_effect("--use-dist-ckpt", Arity::none, "deprecated in Megatron-LM and without effect there: use --ckpt-format");
  t.no_effect("--dist-ckpt-format", Arity::one, "deprecated in Megatron-LM and without effect there: use --ckpt-format");
  t.flag("--no-save-optim", "do not save the optimizer state", MT_FIELD(checkpoint.no_save_optim));
  t.flag("--no-save-rng", "do not save the RNG state", MT_FIELD(checkpoint.no_save_rng));
  t.flag("--no-load-optim", "do not load the optimizer (and scheduler) state", MT_FIELD(checkpoint.no_load_optim));
  t.flag("--no-load-rng", "do not load the RNG state", MT_FIELD(checkpoint.no_load_rng));
  t.flag("--finetune", "load weights only; iteration and consumed samples restart at 0", MT_FIELD(checkpoint.finetune));
  t.value("--pretrained-checkpoint", "load directory for finetuning when --load holds no checkpoint",
          MT_FIELD(checkpoint.pretrained_checkpoint));
  t.value("--ckpt-step", "load this iteration instead of the tracker's", MT_FIELD(checkpoint.ckpt_step));
  t.flag("--exit-on-missing-checkpoint", "exit if --load has no checkpoint", MT_FIELD(checkpoint.exit_on_missing_checkpoint));
  t.flag("--use-checkpoint-args", "take the model's arguments from the checkpoint being loaded",
         MT_FIELD(checkpoint.use_checkpoint_args));
  t.flag("--use-mp-args-from-checkpoint-args", "with --use-checkpoint-args: also its TP/PP sizes",
         MT_FIELD(checkpoint.use_mp_args_from_checkpoint_args));
  t.negative_flag("--no-use-tokenizer-model-from-checkpoint-args",
                  "with --use-checkpoint-args: keep this command line's tokenizer",
                  MT_FIELD(checkpoint.use_tokenizer_model_from_checkpoint_args));
  t.negative_flag("--no-initialization", "do not draw the initial weights (a checkpoint must be loaded)",
                  MT_FIELD(checkpoint.perform_initialization));
  t.flag("--async-save", "write checkpoints from a background thread: training pauses only to copy the shards to host "
         "memory", MT_FIELD(checkpoint.async_save));
  // Megatron-LM's ModelOpt (post-training) flags for knowledge distillation (app/distill_args.h).
  t.value("--export-kd-teacher-load",
          "train by knowledge distillation from the teacher checkpoint in this directory (megatrain's or "
          "Megatron-LM's)",
          MT_FIELD(train.distill.teacher_load));
  t.value("--export-kd-cfg",
          "the distillation config (YAML: logit_layers, intermediate_layer_pairs of decoder.layers.N and "
          "decoder.final_layernorm, skip_lm_loss, kd_loss_scale, logit_kl_temperature); default: logits only, "
          "skip_lm_loss true",
          MT_FIELD(train.distill.cfg_path));
  t.value("--export-kd-teacher-model-config",
          "YAML of the teacher's model arguments that differ from the student's (Megatron's argument names); "
          "default: <--export-kd-teacher-load>/model_config.yaml where it exists",
          MT_FIELD(train.distill.teacher_model_config));
  t.no_effect_checked("--export-kd-teacher-ckpt-format", "", {"torch", "torch_dist", "torch_dcp"},
                      "megatrain reads the teacher from its own checkpoint format, whatever this names",
                      "");
  t.no_effect("--export-te-mcore-model", Arity::none,
              "megatrain reads Megatron-LM checkpoints in the fused Transformer-Engine layout (layernorm weights "
              "inside the linear layers) as they are: there is no remapping to ask for");
  t.no_effect("--use-persistent-ckpt-worker", Arity::none,
              "megatrain's --async-save always writes from a background thread of the training process");
  // Megatron-LM's CheckpointConfig (megatron/training/config/training_config.py): which library's
  // asynchronous writer --async-save uses (a choice, so other values are argparse errors there).
  t.no_effect_checked("--async-strategy", "", {"nvrx", "mcore"},
                      "megatrain's --async-save has one writer of its own, whichever strategy is named: the training "
                      "process copies the shards to host memory and a background thread of that process writes them "
                      "(neither nvidia-resiliency-ext's nor Megatron-Core's worker)",
                      "nvrx");
  t.no_effect("--async-ckpt-use-cpu-shm", Arity::none,
              "megatrain's --async-save already copies the tensors to host memory in the training process and writes "
              "them from a thread of that process: there is no worker process to hand device memory to");
  t.negative_alias(t.no_effect("--no-ckpt-fully-parallel-save", Arity::none,
                               "megatrain decides how ranks share checkpoint writes itself"));
  t.no_effect("--ckpt-fully-parallel-save", Arity::none, "deprecated in Megatron-LM and without effect there");
  t.no_effect("--ckpt-fully-parallel-load", Arity::none, "megatrain decides how ranks share checkpoint reads itself");
  // Megatron-LM's distributed optimizer saves its states DP-reshardable by default; this flag makes
  // them reshardable over TP/PP too. megatrain's are always (checkpoint/FORMAT.md).
  t.no_effect("--dist-ckpt-optim-fully-reshardable", Arity::none,
              "megatrain's checkpoints are always fully reshardable: master weights and optimizer states are stored "
              "per parameter under their global names, with or without --use-distributed-optimizer, so a run resumes "
              "them under any tensor, pipeline or data-parallel layout");
  t.no_effect("--ckpt-assume-constant-structure", Arity::none,
              "megatrain's checkpoint writer has no save plan to reuse: each save writes every rank's shards and "
              "rank 0 builds the manifest from what the ranks wrote");
  t.choice("--dist-ckpt-strictness",
           "what a load does with tensors the run loads that the checkpoint lacks (*_unexpected) and also with "
           "tensors the checkpoint holds that the run does not load (*_all): log, raise, return or ignore them; "
           "assume_ok_unexpected: a lacking tensor fails its read",
           std::vector<std::pair<std::string, std::string>>{
               {"assume_ok_unexpected", "assume_ok_unexpected"}, {"log_unexpected", "log_unexpected"},
               {"log_all", "log_all"}, {"raise_unexpected", "raise_unexpected"}, {"raise_all", "raise_all"},
               {"return_unexpected", "return_unexpected"}, {"return_all", "return_all"}, {"ignore_all", "ignore_all"}},
           MT_FIELD(checkpoint.dist_ckpt_strictness));
  t.value("--non-persistent-save-interval", "iterations between non-persistent (scratch) checkpoints",
          MT_FIELD(checkpoint.non_persistent_save_interval));
  t.choice("--non-persistent-ckpt-type", "non-persistent checkpoint type (global: a checkpoint directory of its own)",
           std::vector<std::pair<std::string, std::string>>{{"global", "global"}, {"local", "local"}},
           MT_FIELD(checkpoint.non_persistent_ckpt_type));
  t.value("--non-persistent-global-ckpt-dir", "directory of the global non-persistent checkpoints (default "
          "<save>/non_persistent, <load>/non_persistent when loading)", MT_FIELD(checkpoint.non_persistent_global_ckpt_dir));
  t.recognised("--non-persistent-local-ckpt-dir", Arity::one, "PATH", "None", "directory of local non-persistent checkpoints");
  t.recognised("--non-persistent-local-ckpt-algo", Arity::one, "{fully_parallel,atomic}", "fully_parallel",
               "local non-persistent checkpoint algorithm");
  t.choice("--ckpt-convert-format",
           "offline conversion: write the --load checkpoint as a Megatron-LM checkpoint of this format in "
           "--ckpt-convert-save/FORMAT, in the run's parallel layout, and exit without training",
           std::vector<std::pair<std::string, std::string>>{{"torch", "torch"}, {"torch_dist", "torch_dist"}},
           MT_FIELD(checkpoint.ckpt_convert_format));
  t.value("--ckpt-convert-save", "where --ckpt-convert-format writes (a FORMAT directory under it)",
          MT_FIELD(checkpoint.ckpt_convert_save));
  t.value("--override-ckpt-iteration", "resume at this iteration instead of the checkpoint's",
          MT_FIELD(checkpoint.override_ckpt_iteration));
}

}  // namespace mt::cli

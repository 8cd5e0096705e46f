// Logging and profiling flags.
#include "app/flags.h"

namespace mt::cli {

void add_logging_flags(FlagTable& t) {
  t.set_group(FlagGroup::logging);
  t.value("--log-interval", "iterations between log lines", MT_FIELD(logging.log_interval));
  t.flag("--log-throughput", "add TFLOP/s/GPU to the log line", MT_FIELD(logging.log_throughput));
  t.flag("--log-params-norm", "add the parameter norm to the log line", MT_FIELD(logging.log_params_norm));
  t.flag("--log-num-zeros-in-grad", "add the number of zero gradients to the log line",
         MT_FIELD(logging.log_num_zeros_in_grad));
  t.flag("--log-progress", "append progress to <save>/progress.txt", MT_FIELD(logging.log_progress));
  t.flag("--log-energy", "energy and power per GPU in the log line (NVML)", MT_FIELD(logging.log_energy));
  // Megatron-LM's StragglerDetectionConfig (megatron/training/config/resilience_config.py).
  t.flag("--log-straggler", "every --log-interval iterations, the ranks with the shortest and longest forward "
         "time, GPU power, temperature, utilization and clock (NVML) and estimated throughput",
         MT_FIELD(logging.log_straggler));
  t.flag("--disable-straggler-on-startup", "start --log-straggler switched off (megatrain has no runtime toggle: it "
         "stays off)", MT_FIELD(logging.disable_straggler_on_startup));
  t.value("--straggler-minmax-count", "--log-straggler also lists this many ranks of lowest and highest throughput "
          "(when 1 < N < world size)", MT_FIELD(logging.straggler_minmax_count));
  t.without_effect(t.value("--straggler-ctrlr-port", "port of Megatron's straggler toggle server",
                           MT_FIELD(logging.straggler_ctrlr_port)),
                   "megatrain runs no server to toggle --log-straggler at run time: the detector is on from the start, "
                   "or off with --disable-straggler-on-startup");
  t.value("--timing-log-level", "0: iteration time; 1: + main phases; 2: + fine-grained", MT_FIELD(logging.timing_log_level));
  t.choice("--timing-log-option", "how timers are reduced over ranks",
           std::vector<std::pair<std::string, std::string>>{{"max", "max"}, {"minmax", "minmax"}, {"all", "all"}},
           MT_FIELD(logging.timing_log_option));
  t.negative_alias(t.no_effect("--no-barrier-with-level-1-timing", Arity::none,
                               "megatrain's level-1 timers synchronise on their own streams"));
  t.value("--tensorboard-dir", "write TensorBoard event files here", MT_FIELD(logging.tensorboard_dir));
  t.value("--tensorboard-log-interval", "iterations between TensorBoard records", MT_FIELD(logging.tensorboard_log_interval));
  t.value("--tensorboard-queue-size", "TensorBoard write queue size", MT_FIELD(logging.tensorboard_queue_size));
  t.flag("--log-timers-to-tensorboard", "timers to TensorBoard", MT_FIELD(logging.log_timers_to_tensorboard));
  t.flag("--log-validation-ppl-to-tensorboard", "validation perplexity to TensorBoard",
         MT_FIELD(logging.log_validation_ppl_to_tensorboard));
  t.flag("--log-device-memory-used", "add the device's memory in use (all processes', as nvidia-smi reports it) to the "
         "report_memory line", MT_FIELD(logging.log_device_memory_used));
  t.value("--log-memory-interval", "print the report_memory line every N iterations (at log lines)",
          MT_FIELD(logging.log_memory_interval));
  t.flag("--log-memory-to-tensorboard", "memory use to TensorBoard", MT_FIELD(logging.log_memory_to_tensorboard));
  t.flag("--log-world-size-to-tensorboard", "world size to TensorBoard", MT_FIELD(logging.log_world_size_to_tensorboard));
  t.negative_flag("--no-log-loss-scale-to-tensorboard", "no loss scale in TensorBoard",
                  MT_FIELD(logging.log_loss_scale_to_tensorboard));
  t.value("--wandb-project",
          "Weights & Biases project: megatrain has no W&B client, so the TensorBoard event files go to the W&B "
          "directory (--wandb-save-dir, default <save>/wandb; --tensorboard-dir when given) and the last rank prints "
          "the `wandb sync` command that uploads them",
          MT_FIELD(logging.wandb_project));
  t.value("--wandb-exp-name", "Weights & Biases run name: the run ID (--id) of the printed `wandb sync` command",
          MT_FIELD(logging.wandb_exp_name));
  t.value("--wandb-save-dir", "Weights & Biases directory (default <save>/wandb): where --wandb-project's TensorBoard "
          "event files go", MT_FIELD(logging.wandb_save_dir)).metavar = "PATH";
  t.value("--wandb-entity", "Weights & Biases entity (--entity of the printed `wandb sync` command)",
          MT_FIELD(logging.wandb_entity));
  t.no_effect("--logging-level", Arity::one, "a Python logging level", "None");
  t.no_effect("--profile", Arity::none, "megatrain sets no profiler capture range: profile the whole run with nsys or ncu (its kernels are named by op)");
  t.no_effect("--profile-step-start", Arity::one, "see --profile", "10");
  t.no_effect("--profile-step-end", Arity::one, "see --profile", "12");
  t.no_effect("--profile-ranks", Arity::one_or_more, "see --profile", "[0]");
  t.no_effect("--use-pytorch-profiler", Arity::none, "there is no PyTorch in megatrain");
  t.no_effect("--record-memory-history", Arity::none, "megatrain plans its memory up front (see --dry-run)");
  t.no_effect("--memory-snapshot-path", Arity::one, "megatrain plans its memory up front (see --dry-run)");
}

void add_recompute_flags(FlagTable& t) {
  t.set_group(FlagGroup::recompute);
  {
    FlagSpec s;
    s.name = "--recompute-activations";
    s.group = FlagGroup::recompute;
    s.arity = Arity::none;
    s.help = "shorthand for --recompute-granularity selective";
    s.apply = [](CliState& st, const FlagValue&) { st.recompute_activations = true; };
    t.add(std::move(s));
  }
  t.choice("--recompute-granularity", "activation recompute: full (whole layers) or selective (modules)",
           std::vector<std::pair<std::string, RecomputeGranularity>>{{"full", RecomputeGranularity::full},
                                                                     {"selective", RecomputeGranularity::selective}},
           MT_FIELD(train.recompute_granularity));
  t.choice("--recompute-method", "full recompute: uniform (groups of N layers) or block (first N layers per stage)",
           std::vector<std::pair<std::string, RecomputeMethod>>{{"uniform", RecomputeMethod::uniform},
                                                                {"block", RecomputeMethod::block}},
           MT_FIELD(train.recompute_method));
  t.value("--recompute-num-layers", "N for --recompute-method", MT_FIELD(train.recompute_num_layers));
  t.value("--recompute-modules", "selective recompute targets (default core_attn)", MT_FIELD(train.recompute_modules))
      .arity = Arity::zero_or_more;
  t.flag("--distribute-saved-activations", "shard recomputed layers' inputs over TP",
         MT_FIELD(train.distribute_saved_activations));
  t.removed("--checkpoint-activations", Arity::none,
            "--checkpoint-activations is no longer valid, use --recompute-activations, or, for more control, "
            "--recompute-granularity and --recompute-method.");
}

void add_regularization_flags(FlagTable& t) {
  t.set_group(FlagGroup::regularization);
  t.value("--attention-dropout", "dropout on attention probabilities", MT_FIELD(model.attention_dropout)).model_setting("attention_dropout");
  t.value("--hidden-dropout", "dropout after attention/MLP and on embeddings", MT_FIELD(model.hidden_dropout)).model_setting("hidden_dropout");
  t.value("--seed", "random seed", MT_FIELD(train.seed));
  t.value("--init-method-std", "standard deviation of the weight initialisation", MT_FIELD(model.init_method_std)).model_setting("init_method_std", CheckpointTake::no);
  t.value("--embedding-init-method-std", "embedding initialisation std (default --init-method-std)",
          MT_FIELD(model.embedding_init_method_std))
      .model_setting("embedding_init_method_std", CheckpointTake::no);
  t.recognised("--init-method-xavier-uniform", Arity::none, "", "off", "Xavier-uniform initialisation");
  // Megatron seeds each DP rank differently, then broadcasts DP rank 0's parameters: the same
  // weights everywhere and per-rank dropout streams, which is how megatrain always runs.
  t.no_effect("--data-parallel-random-init", Arity::none,
              "megatrain's parameters are the same on every data-parallel rank by construction (Megatron broadcasts "
              "them after this flag's per-rank init), and each rank already draws its own dropout masks");
  t.no_effect("--use-cpu-initialization", Arity::none,
              "megatrain's initialisation is layout-independent already (the same weights for any TP/PP)");
}

}  // namespace mt::cli

// Training loop, batch and optimizer flags.
#include "app/flags.h"
#include "core/exit_signals.h"

namespace mt::cli {

void add_training_flags(FlagTable& t) {
  t.set_group(FlagGroup::training);
  t.value("--micro-batch-size", "micro-batch size per rank b (required)", MT_FIELD(train.micro_batch_size)).default_text =
      "None (required)";
  t.value("--global-batch-size", "global batch B (default b * DP)", MT_FIELD(train.global_batch_size));
  t.removed("--batch-size", Arity::one, "--batch-size argument is no longer valid, use --micro-batch-size instead");
  t.no_effect("--rampup-batch-size", Arity::three,
              "deprecated in Megatron-LM and ignored there too (its replacement is --step-batch-size-schedule)",
              "None");
  {
    // One string in Megatron ("THRESH:BS THRESH:BS ..."). Launch scripts often expand it unquoted,
    // so the words arrive separately: taking them all keeps the refusal about this flag.
    FlagSpec s;
    s.name = "--step-batch-size-schedule";
    s.group = FlagGroup::training;
    s.arity = Arity::one_or_more;
    s.metavar = "\"THRESH:BS ...\"";
    s.help = "global batch size by consumed tokens, thresholds with K/M/B/T suffixes (\"0:16 2.4B:320\"; Megatron "
             "HEAD; instead of --global-batch-size)";
    s.apply = [](CliState& st, const FlagValue& v) {
      std::string joined;
      for (const auto& w : v.values) joined += (joined.empty() ? "" : " ") + w;
      st.cfg.train.step_batch_size_schedule = joined;
    };
    s.value = [](const Config& c) {
      return c.train.step_batch_size_schedule ? nlohmann::json(*c.train.step_batch_size_schedule) : nlohmann::json();
    };
    t.add(std::move(s));
  }
  t.flag("--decrease-batch-size-if-needed", "round the global batch down to a multiple of b * DP",
         MT_FIELD(train.decrease_batch_size_if_needed));
  t.value("--train-iters", "total iterations (or --train-samples)", MT_FIELD(train.train_iters));
  t.value("--train-samples", "total samples (or --train-iters)", MT_FIELD(train.train_samples));
  t.value("--eval-iters", "batches per evaluation", MT_FIELD(train.eval_iters));
  t.value("--eval-global-batch-size", "samples per evaluation batch (default --global-batch-size; a multiple of "
          "micro-batch x DP)", MT_FIELD(train.eval_global_batch_size));
  t.value("--eval-micro-batch-size", "micro-batch size of evaluation (default --micro-batch-size; megatrain takes only "
          "that value)", MT_FIELD(train.eval_micro_batch_size));
  t.value("--eval-interval", "evaluate every N iterations", MT_FIELD(train.eval_interval));
  t.value("--start-eval-at-iter", "no evaluation before this iteration (nor validation samples for those evaluations)",
          MT_FIELD(train.start_eval_at_iter));
  t.flag("--skip-train", "only evaluate", MT_FIELD(train.skip_train));
  t.flag("--test-mode", "check that the q/k layernorm parameters are identical on every DP and TP rank before each "
         "forward pass (Megatron's real-time test; with --qk-layernorm)", MT_FIELD(train.test_mode));
  t.value("--check-weight-hash-across-dp-replicas-interval",
          "compare a hash of every parameter across the data-parallel replicas before training and every N "
          "iterations; replicas that differ stop the run", MT_FIELD(train.check_weight_hash_across_dp_replicas_interval));
  t.value("--exit-interval", "exit when iteration % N == 0", MT_FIELD(train.exit_interval));
  t.value("--exit-duration-in-mins", "exit after this many minutes (saving a checkpoint first)",
          MT_FIELD(train.exit_duration_in_mins));
  t.flag("--exit-signal-handler", "save and exit on the --exit-signal (SIGTERM)", MT_FIELD(train.exit_signal_handler));
  {
    std::vector<std::pair<std::string, std::string>> signals;
    for (const auto& [name, number] : exit_signals()) signals.emplace_back(name, name);
    t.choice("--exit-signal", "the signal --exit-signal-handler catches (Python's signal.Signals name)", signals,
             MT_FIELD(train.exit_signal));
  }
  t.flag("--exit-signal-handler-for-training", "on SIGINT or SIGTERM stop after the step, without saving, and exit 0 "
         "(Megatron-LM's orderly shutdown)", MT_FIELD(train.exit_signal_handler_for_training));
  {
    FlagSpec& s = t.choice("--optimizer",
                           "optimizer: adam is AdamW; muon orthogonalizes the momentum of the 2-D weights (the word "
                           "embeddings, output layer, norms and biases take AdamW); dist_muon is Megatron's deprecated "
                           "spelling of muon with --use-distributed-optimizer (lion, soap, adaptive_muon not built)",
                           std::vector<std::pair<std::string, OptimizerKind>>{{"adam", OptimizerKind::adam},
                                                                              {"sgd", OptimizerKind::sgd},
                                                                              {"muon", OptimizerKind::muon},
                                                                              {"dist_muon", OptimizerKind::muon}},
                           MT_FIELD(train.optimizer));
    s.apply = [inner = s.apply](CliState& st, const FlagValue& v) {
      inner(st, v);
      if (v.one() == "dist_muon") {
        st.warn("optimizer='dist_muon' is deprecated. Use --optimizer muon --use-distributed-optimizer instead.");
        st.cfg.parallel.use_distributed_optimizer = true;
      }
    };
  }
  // Megatron-LM's Muon settings (emerging_optimizers 0.3's TensorParallelMuon; engine/muon.h). With
  // adam or sgd they change nothing, as in Megatron-LM; with muon they are checked as it checks them.
  t.value("--muon-momentum", "Muon: momentum of the internal SGD (EMA)", MT_FIELD(train.muon.momentum));
  t.flag("--muon-no-split-qkv", "Muon: orthogonalize the fused QKV weight whole, not its query, key and value parts "
         "separately", MT_FIELD(train.muon.split_qkv), false);
  t.flag("--muon-nesterov", "Muon: Nesterov-style momentum", MT_FIELD(train.muon.nesterov));
  t.choice("--muon-scale-mode", "Muon: the update's scale for a [m, n] matrix: spectral sqrt(max(m, n)), "
           "unit_rms_norm sqrt(m / n), shape_scaling sqrt(max(1, m / n))",
           std::vector<std::pair<std::string, MuonScaleMode>>{{"spectral", MuonScaleMode::spectral},
                                                              {"unit_rms_norm", MuonScaleMode::unit_rms_norm},
                                                              {"shape_scaling", MuonScaleMode::shape_scaling}},
           MT_FIELD(train.muon.scale_mode));
  t.choice("--muon-fp32-matmul-prec", "Muon: the Newton-Schulz products: medium rounds every product to bfloat16 "
           "(Megatron-LM's bf16 GEMMs), high keeps float32",
           std::vector<std::pair<std::string, MuonMatmulPrecision>>{{"low", MuonMatmulPrecision::low},
                                                                    {"medium", MuonMatmulPrecision::medium},
                                                                    {"high", MuonMatmulPrecision::high}},
           MT_FIELD(train.muon.fp32_matmul_prec));
  t.value("--muon-coefficient-type", "Muon: Newton-Schulz coefficients: simple, quintic, polar_express, cans, aol "
          "or deepseekv4", MT_FIELD(train.muon.coefficient_type));
  t.value("--muon-num-ns-steps", "Muon: Newton-Schulz iterations", MT_FIELD(train.muon.num_ns_steps));
  t.choice("--muon-tp-mode", "Muon under TP: duplicated and distributed orthogonalize the whole matrix (the same "
           "update as one rank; megatrain gathers it on every TP rank for both), blockwise each rank's shard alone",
           std::vector<std::pair<std::string, MuonTpMode>>{{"blockwise", MuonTpMode::blockwise},
                                                           {"duplicated", MuonTpMode::duplicated},
                                                           {"distributed", MuonTpMode::distributed}},
           MT_FIELD(train.muon.tp_mode));
  t.without_effect(t.flag("--muon-use-syrk", "Muon: Megatron-LM's Triton SYRK kernel for the Gram matrices",
                          MT_FIELD(train.muon.use_syrk)),
                   "a kernel choice of Megatron-LM's (the same Gram matrices, computed as symmetric products): "
                   "megatrain's products are its backend's GEMMs either way");
  t.value("--muon-extra-scale-factor", "Muon: an extra factor on the update", MT_FIELD(train.muon.extra_scale_factor));
  t.choice("--muon-scalar-optimizer", "Muon: the optimizer of the parameters Muon does not take (adam; lion not built)",
           std::vector<std::pair<std::string, std::string>>{{"adam", "adam"}, {"lion", "lion"}},
           MT_FIELD(train.muon.scalar_optimizer));
  t.no_effect("--no-use-layer-wise-param-layout", Arity::none,
              "the parameter layout of Megatron-LM's layer-wise distributed optimizer (Muon's): megatrain's Muon "
              "shards its state as the distributed optimizer shards AdamW's, so there is no other layout to choose");
  t.value("--weight-decay", "AdamW weight decay (not on biases and 1-D parameters)", MT_FIELD(train.weight_decay));
  t.flag("--apply-wd-to-qk-layernorm",
         "apply weight decay to the q/k layernorm parameters too (by default 1-D parameters and biases get none)",
         MT_FIELD(train.apply_wd_to_qk_layernorm));
  {
    // Megatron's deprecated spelling of the flag above; its one choice turns it on.
    FlagSpec s;
    s.name = "--no-weight-decay-cond-type";
    s.group = FlagGroup::training;
    s.arity = Arity::one;
    s.metavar = "{apply_wd_to_qk_layernorm}";
    s.help = "deprecated: apply_wd_to_qk_layernorm is --apply-wd-to-qk-layernorm";
    s.apply = [](CliState& st, const FlagValue& v) {
      parse_choice_arg("--no-weight-decay-cond-type", v.one(), {"apply_wd_to_qk_layernorm"});
      st.warn("--no-weight-decay-cond-type is deprecated. Please use --apply-wd-to-qk-layernorm instead.");
      st.cfg.train.apply_wd_to_qk_layernorm = true;
    };
    t.add(std::move(s));
  }
  t.value("--start-weight-decay", "weight decay at the start (non-constant --weight-decay-incr-style)",
          MT_FIELD(train.start_weight_decay));
  t.value("--end-weight-decay", "weight decay at the end (non-constant --weight-decay-incr-style)",
          MT_FIELD(train.end_weight_decay));
  t.choice("--weight-decay-incr-style", "weight decay schedule",
           std::vector<std::pair<std::string, WeightDecayIncrStyle>>{{"constant", WeightDecayIncrStyle::constant},
                                                                     {"linear", WeightDecayIncrStyle::linear},
                                                                     {"cosine", WeightDecayIncrStyle::cosine}},
           MT_FIELD(train.weight_decay_incr_style));
  t.value("--clip-grad", "global L2 gradient-norm clip", MT_FIELD(train.clip_grad));
  t.value("--adam-beta1", "Adam beta1", MT_FIELD(train.adam_beta1));
  t.value("--adam-beta2", "Adam beta2", MT_FIELD(train.adam_beta2));
  t.value("--adam-eps", "Adam epsilon", MT_FIELD(train.adam_eps));
  t.value("--sgd-momentum", "SGD momentum", MT_FIELD(train.sgd_momentum));
  t.flag("--calculate-per-token-loss", "normalise the loss by the global batch's non-padded tokens",
         MT_FIELD(train.calculate_per_token_loss));
  t.choice("--dataloader-type", "sample order (single: sequential and resumable, cyclic: reshuffled per epoch)",
           std::vector<std::pair<std::string, std::string>>{{"single", "single"}, {"cyclic", "cyclic"}, {"external", "external"}},
           MT_FIELD(data.dataloader_type));
  t.negative_flag("--no-data-sharding",
                  "with --dataloader-type cyclic: every rank draws from one shuffle of the whole split instead of "
                  "shuffling its own contiguous bucket (no effect with single, as in Megatron-LM)",
                  MT_FIELD(data.data_sharding));
  t.negative_flag("--no-check-for-nan-in-loss-and-grad", "do not check the loss and gradients for NaN/Inf",
                  MT_FIELD(train.check_for_nan_in_loss_and_grad));
  // Megatron-LM's rerun state machine (megatron/core/rerun_state_machine.py; engine/rerun_state_machine.h).
  t.flag("--check-for-spiky-loss",
         "rerun state machine: flag an iteration whose lm loss is >= 10x the largest of the first 100 validated "
         "iterations' losses (not fatal: re-run once, then continue)",
         MT_FIELD(train.check_for_spiky_loss));
  t.flag("--check-for-large-grads",
         "rerun state machine: flag an iteration whose gradient norm (before clipping) is >= 10x the largest of the "
         "first 100 validated iterations' norms (not fatal: re-run once, then continue)",
         MT_FIELD(train.check_for_large_grads));
  {
    FlagSpec& s = t.choice("--rerun-mode",
                           "rerun state machine: validate_results re-runs an iteration whose loss or gradient norm "
                           "fails a check (NaN/Inf, spiky loss, large grads, injected error) from the same state "
                           "before the optimizer step, exiting 17 or saving a checkpoint and exiting 16 as Megatron "
                           "does; report_stats re-runs every iteration and logs the run-to-run variation; disabled "
                           "stops at a NaN/Inf. megatrain saves no rerun state in checkpoints: a resumed run "
                           "validates the iteration afresh",
                           std::vector<std::pair<std::string, std::string>>{{"disabled", "disabled"},
                                                                            {"validate_results", "validate_results"},
                                                                            {"report_stats", "report_stats"}},
                           MT_FIELD(train.rerun_mode));
    (void)s;
  }
  t.value("--error-injection-rate",
          "rerun state machine: inject an unexpected result into about 1 in N validations (0: never), drawn from "
          "a generator seeded by --seed (not Python's random stream)",
          MT_FIELD(train.error_injection_rate));
  t.choice("--error-injection-type", "rerun state machine: the kind of error injected (how the re-run compares)",
           std::vector<std::pair<std::string, std::string>>{{"correct_result", "correct_result"},
                                                            {"transient_error", "transient_error"},
                                                            {"persistent_error", "persistent_error"}},
           MT_FIELD(train.error_injection_type));
  t.flag("--fine-grained-activation-offloading",
         "what the --offload-modules keep for backward goes to host memory after each layer's forward and comes back "
         "before its backward",
         MT_FIELD(train.fine_grained_activation_offloading));
  t.value("--offload-modules",
          "modules whose kept activations are offloaded: attn_norm qkv_linear core_attn attn_proj mlp_norm expert_fc1 "
          "moe_act",
          MT_FIELD(train.offload_modules))
      .arity = Arity::one_or_more;
  t.value("--min-offloaded-tensor-size", "activation offloading: kept tensors of fewer elements stay on the device",
          MT_FIELD(train.min_offloaded_tensor_size));
  t.value("--activation-offload-fraction",
          "activation offloading: the fraction of the eligible (layer, module) groups offloaded, the first in forward "
          "order",
          MT_FIELD(train.activation_offload_fraction));
  t.value("--delta-offload-bytes-across-pp-ranks",
          "activation offloading: pipeline rank r keeps r x this many of its offloadable bytes on the device",
          MT_FIELD(train.delta_offload_bytes_across_pp_ranks));
  t.value("--fine-grained-offloading-max-inflight-offloads",
          "activation offloading: per module, the copies to host the compute may run ahead of (0: wait after each)",
          MT_FIELD(train.fine_grained_offloading_max_inflight_offloads));
  t.flag("--deterministic-mode", "deterministic kernels", MT_FIELD(train.deterministic_mode));
  t.value("--iterations-to-skip", "1-indexed iterations whose batch is consumed without an update",
          MT_FIELD(train.iterations_to_skip));
  t.no_effect("--train-sync-interval", Arity::one, "a PyTorch CPU-GPU synchronisation knob", "None");
  t.no_effect("--empty-unused-memory-level", Arity::one,
              "megatrain plans its memory up front and never returns it to a caching allocator", "0");
  t.no_effect("--manual-gc", Arity::none, "Python garbage-collector control");
  t.no_effect("--manual-gc-interval", Arity::one, "Python garbage-collector control", "0");
  t.negative_alias(t.no_effect("--no-manual-gc-eval", Arity::none, "Python garbage-collector control"));
  t.removed("--warmup", Arity::one, "--warmup argument is no longer valid, use --lr-warmup-fraction instead");
}

void add_learning_rate_flags(FlagTable& t) {
  t.set_group(FlagGroup::learning_rate);
  t.value("--lr", "peak learning rate", MT_FIELD(train.lr));
  t.value("--min-lr", "learning-rate floor", MT_FIELD(train.min_lr));
  t.choice("--lr-decay-style", "learning-rate decay",
           std::vector<std::pair<std::string, LrDecayStyle>>{{"constant", LrDecayStyle::constant},
                                                             {"linear", LrDecayStyle::linear},
                                                             {"cosine", LrDecayStyle::cosine},
                                                             {"inverse-square-root", LrDecayStyle::inverse_square_root},
                                                             {"WSD", LrDecayStyle::wsd}},
           MT_FIELD(train.lr_decay_style));
  t.value("--lr-decay-iters", "decay horizon in iterations (default --train-iters)", MT_FIELD(train.lr_decay_iters));
  t.value("--lr-decay-samples", "decay horizon in samples (default --train-samples)", MT_FIELD(train.lr_decay_samples));
  t.value("--lr-warmup-iters", "linear warmup in iterations", MT_FIELD(train.lr_warmup_iters));
  t.value("--lr-warmup-samples", "linear warmup in samples", MT_FIELD(train.lr_warmup_samples));
  t.value("--lr-warmup-fraction", "warmup as a fraction of the decay horizon", MT_FIELD(train.lr_warmup_fraction));
  t.value("--lr-warmup-init", "learning rate at the start of warmup", MT_FIELD(train.lr_warmup_init));
  t.choice("--lr-wsd-decay-style", "WSD anneal shape",
           std::vector<std::pair<std::string, WsdDecayStyle>>{{"exponential", WsdDecayStyle::exponential},
                                                              {"linear", WsdDecayStyle::linear},
                                                              {"cosine", WsdDecayStyle::cosine},
                                                              {"minus_sqrt", WsdDecayStyle::minus_sqrt}},
           MT_FIELD(train.lr_wsd_decay_style));
  t.value("--lr-wsd-decay-iters", "WSD anneal length in iterations", MT_FIELD(train.lr_wsd_decay_iters));
  t.value("--lr-wsd-decay-samples", "WSD anneal length in samples", MT_FIELD(train.lr_wsd_decay_samples));
  t.value("--decoupled-lr", "separate learning rate for the embedding and output layer", MT_FIELD(train.decoupled_lr));
  t.value("--decoupled-min-lr", "separate minimum learning rate for the embedding and output layer",
          MT_FIELD(train.decoupled_min_lr));
  t.alias(t.flag("--override-opt_param-scheduler", "ignore the scheduler state stored in the checkpoint",
                 MT_FIELD(train.override_opt_param_scheduler)),
          "--override-opt-param-scheduler");
  t.alias(t.flag("--use-checkpoint-opt_param-scheduler", "take the scheduler state from the checkpoint",
                 MT_FIELD(train.use_checkpoint_opt_param_scheduler)),
          "--use-checkpoint-opt-param-scheduler");
}

}  // namespace mt::cli

// Config: the one validated, immutable description of a run. app/ fills it from Megatron-style
// flags (defaults below are Megatron-LM's, megatron/training/arguments.py), validates it
// and computes the derived values (marked "derived"); nothing downstream re-derives them.
//
// std::optional marks flags whose Megatron default is None (unset).
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace mt {

enum class Normalization { layernorm, rmsnorm };
enum class PositionEmbedding { learned_absolute, rope, yarn, none };
enum class Precision { fp32, bf16, fp16 };
// FP8 training (--fp8-format, Transformer Engine's recipes). hybrid: e4m3 forward (activations,
// weights), e5m2 gradients; e4m3: e4m3 everywhere. Only delayed and tensorwise are built;
// the other recipes are refused by app/unsupported.cpp.
enum class Fp8Format { e4m3, hybrid };
enum class Fp8Recipe { delayed, tensorwise, mxfp8, blockwise, custom };
enum class Fp8AmaxAlgo { most_recent, max };
enum class OptimizerKind { adam, sgd, muon };
// --optimizer muon's settings (Megatron-LM's --muon-* flags; engine/muon.h).
enum class MuonScaleMode { spectral, unit_rms_norm, shape_scaling };
enum class MuonMatmulPrecision { low, medium, high };
enum class MuonTpMode { blockwise, duplicated, distributed };
struct MuonConfig {
  double momentum = 0.9;
  bool split_qkv = true;  // --muon-no-split-qkv clears it
  bool nesterov = false;
  MuonScaleMode scale_mode = MuonScaleMode::spectral;
  MuonMatmulPrecision fp32_matmul_prec = MuonMatmulPrecision::medium;
  std::string coefficient_type = "quintic";
  int num_ns_steps = 5;
  MuonTpMode tp_mode = MuonTpMode::duplicated;
  bool use_syrk = false;
  double extra_scale_factor = 1.0;
  std::string scalar_optimizer = "adam";
};
// Storage dtype of an optimizer tensor under --use-precision-aware-optimizer (--main-grads-dtype,
// --main-params-dtype, --exp-avg-dtype, --exp-avg-sq-dtype). fp8 is Megatron's torch.uint8 (e4m3).
enum class StateDtype { fp32, fp16, bf16, fp8 };
enum class LrDecayStyle { constant, linear, cosine, inverse_square_root, wsd };
enum class WsdDecayStyle { exponential, linear, cosine, minus_sqrt };
enum class WeightDecayIncrStyle { constant, linear, cosine };
enum class RecomputeGranularity { none, full, selective };
enum class RecomputeMethod { none, uniform, block };
enum class AttentionBackend { auto_, flash, fused, unfused, local };
// --softmax-type: the attention softmax's denominator gets exp(s_h) of a sink logit per query head
// (Megatron-Core's SoftmaxOne): none (vanilla), s_h = 0 (off-by-one) or a trained s_h (learnable).
enum class SoftmaxType { vanilla, off_by_one, learnable };
enum class DeviceKind { gpu, cpu };
enum class Launcher { none, torchrun, openmpi, mpich, slurm, workstation };
// Mixture of experts (--num-experts ...; Megatron-Core's TopKRouter and MoELayer).
// Router scores: softmax over the experts, or a gated score per expert, sigmoid(z) or
// sqrt(softplus(z)) (Megatron-Core's "sqrtsoftplus"), normalized over the top k.
enum class MoeScoreFunction { softmax, sigmoid, sqrtsoftplus };
enum class MoeLoadBalancing { aux_loss, seq_aux_loss, global_aux_loss, sinkhorn, none };
enum class MoeDispatcher { allgather, alltoall, flex };
enum class MoeDropPolicy { probs, position };

// Megatron-LM's MoE flags (defaults are its CLI defaults). A model has MoE layers iff
// num_experts > 0; which layers are MoE is moe_layer (derived from --moe-layer-freq).
struct MoeConfig {
  int num_experts = 0;                     // --num-experts (None / 0: no MoE)
  std::optional<int> ffn_hidden_size;      // --moe-ffn-hidden-size (None: --ffn-hidden-size)
  // --moe-layer-freq: an int N (layer i is MoE iff i % N == 0), or a 0/1 list with one entry per
  // layer (Megatron's Python list expression, e.g. "([0]*3+[1]*29)").
  int layer_freq = 1;
  std::vector<int> layer_pattern;
  int router_topk = 2;                     // --moe-router-topk
  MoeScoreFunction score_function = MoeScoreFunction::softmax;
  bool router_pre_softmax = false;
  // --moe-apply-probs-on-input (Llama 4's MoE, top-1): the routing weight scales the expert's input
  // instead of its activation.
  bool apply_probs_on_input = false;
  std::optional<double> router_topk_scaling_factor;  // None or 0: no scaling
  std::optional<int> router_num_groups, router_group_topk;
  std::optional<std::string> router_dtype;            // --moe-router-dtype fp32|fp64
  std::vector<MoeLoadBalancing> load_balancing_type = {MoeLoadBalancing::aux_loss};
  std::vector<double> aux_loss_coeff = {0.0};
  std::optional<double> z_loss_coeff;
  std::optional<double> input_jitter_eps;
  bool router_enable_expert_bias = false;
  double router_bias_update_rate = 1e-3;
  std::optional<int> shared_expert_intermediate_size;
  bool shared_expert_gate = false;
  bool shared_expert_overlap = false;
  std::optional<double> expert_capacity_factor;
  bool pad_expert_input_to_capacity = false;
  MoeDropPolicy token_drop_policy = MoeDropPolicy::probs;
  MoeDispatcher token_dispatcher_type = MoeDispatcher::allgather;
  bool grouped_gemm = false;               // our experts always run as grouped GEMMs
  bool permute_fusion = false;             // our permutation is always fused
  bool router_fusion = false;
  bool router_padding_for_fp8 = false;
  bool per_layer_logging = false;
  bool router_force_load_balancing = false;
  std::optional<double> router_force_biased;  // --moe-router-force-biased: the bias's std (sign: redrawn or not)
  bool layer_recompute = false;            // deprecated: --recompute-modules moe
  bool overlap_expert_parallel_comm = false;  // --overlap-moe-expert-parallel-comm (performance only)

  // derived
  int expert_ffn = 0;                      // ffn_hidden_size or the model's ffn size
  std::vector<char> moe_layer;             // per global layer: 1 = MoE layer
  bool enabled() const { return num_experts > 0; }
  bool is_moe_layer(int layer) const {
    return enabled() && layer >= 0 && static_cast<size_t>(layer) < moe_layer.size() && moe_layer[layer];
  }
  // The aux_loss coefficient (0 when the type list has no aux_loss).
  double aux_loss_coeff_of(MoeLoadBalancing t) const {
    for (size_t i = 0; i < load_balancing_type.size(); ++i)
      if (load_balancing_type[i] == t) return i < aux_loss_coeff.size() ? aux_loss_coeff[i] : aux_loss_coeff.back();
    return 0.0;
  }
};

struct ModelConfig {
  int num_layers = 0;                 // required
  int hidden_size = 0;                // required
  int num_attention_heads = 0;        // required
  std::optional<int> ffn_hidden_size;
  std::optional<int> kv_channels;
  bool group_query_attention = false;
  int num_query_groups = 1;           // used only with group_query_attention
  int max_position_embeddings = 0;    // required
  PositionEmbedding position_embedding_type = PositionEmbedding::learned_absolute;
  bool add_position_embedding = true;  // --no-position-embedding (deprecated; only valid with rope)
  std::optional<std::string> rope_type;  // --rope-type: only "rope" for non-MLA attention
  int rotary_base = 10000;
  double rotary_percent = 1.0;
  bool rotary_interleaved = false;
  std::optional<int> rotary_seq_len_interpolation_factor;
  bool use_rope_scaling = false;
  double rope_scaling_factor = 8.0;
  Normalization normalization = Normalization::layernorm;
  double norm_epsilon = 1e-5;
  bool apply_layernorm_1p = false;
  bool apply_residual_connection_post_layernorm = false;
  bool swiglu = false;
  bool openai_gelu = false;
  // --no-bias-gelu-fusion. Megatron's fused bias-GeLU (on by default, and only with biases) is the
  // tanh approximation, so a default GPT launch trains with tanh GeLU; exact (erf) GeLU only with
  // --no-bias-gelu-fusion or --disable-bias-linear. gelu_is_tanh() below says which one a model uses.
  bool bias_gelu_fusion = true;
  bool squared_relu = false;
  // gpt-oss's MLP: --quick-geglu (gated, quick-GeLU x sigmoid(1.702 x) on the gate half),
  // --glu-linear-offset (added to the linear half), --activation-func-clamp-value (the halves
  // clamped before the activation; with SwiGLU only in MoE layers, as Megatron allows). engine/activation.h Glu.
  bool quick_geglu = false;
  double glu_linear_offset = 0.0;
  std::optional<double> activation_func_clamp_value;
  // Whether the gated unit is gpt-oss's variant (any of the three above) rather than plain SwiGLU/GeGLU.
  bool glu_variant() const {
    return quick_geglu || glu_linear_offset != 0.0 || activation_func_clamp_value.has_value();
  }
  // --multi-latent-attention (DeepSeek's MLA; engine/blocks/mla.cpp): queries from a low-rank
  // projection of rank q_lora_rank (none: a direct projection), keys and values from one of rank
  // kv_lora_rank, heads of qk_head_dim values without and qk_pos_emb_head_dim values with RoPE (a
  // key part shared by the heads), values of v_head_dim.
  bool multi_latent_attention = false;
  std::optional<int> q_lora_rank;
  int kv_lora_rank = 32;
  int qk_head_dim = 128;
  int qk_pos_emb_head_dim = 64;
  int v_head_dim = 128;
  // YaRN (--rope-type yarn with MLA, --position-embedding-type yarn otherwise): the scaling
  // factor s, the attention-scale terms, and (GPT YaRN only: MLA keeps Megatron's 4096, 32, 1,
  // true) the original context and the correction range's betas.
  double rotary_scaling_factor = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
  std::optional<int> yarn_original_max_position_embeddings;
  std::optional<double> yarn_beta_fast, yarn_beta_slow;
  std::optional<bool> yarn_correction_range_round_to_int;
  // --mtp-num-layers D (multi-token prediction; engine/blocks/mtp.cpp): D more layers on the last
  // pipeline stage predicting the tokens 2..D+1 ahead, their losses weighted by
  // --mtp-loss-scaling-factor / D.
  std::optional<int> mtp_num_layers;
  double mtp_loss_scaling_factor = 0.1;
  bool add_bias_linear = true;        // --disable-bias-linear turns it off
  bool add_qkv_bias = false;          // forced true when add_bias_linear
  bool qk_layernorm = false;
  // --qk-l2-norm: Megatron's L2Norm of every q and k head (RMS normalization without weights, eps
  // --norm-epsilon), where --qk-layernorm's norms go; it wins over --qk-layernorm, as in Megatron.
  bool qk_l2_norm = false;
  // --attention-output-gate: the QKV projection also gives a gate per query head; the attention
  // output is multiplied by sigmoid(gate) before the output projection (Megatron's gated attention).
  bool attention_output_gate = false;
  SoftmaxType softmax_type = SoftmaxType::vanilla;
  // --window-size LEFT,RIGHT: sliding-window attention (Megatron's tuple; -1 = unbounded on that
  // side). GPT attention is causal, so only LEFT counts: a query sees LEFT earlier keys and itself
  // (Transformer Engine turns (L, R) into (L, 0) for causal masks).
  std::optional<std::pair<int, int>> window_size;
  // --window-attn-skip-freq: which layers attend fully instead. N: every N-th layer (1-based); or
  // a 0/1 pattern, one entry per layer (1 = sliding window). Neither: every layer has the window.
  std::optional<int> window_attn_skip_every;
  std::vector<int> window_attn_pattern;
  // --experimental-attention-variant gated_delta_net (or gdn): Gated DeltaNet linear attention
  // (engine/blocks/gdn.cpp) in the layers --linear-attention-freq marks: every N-th layer (1-based)
  // keeps softmax attention, or a 0/1 list per layer (1 = Gated DeltaNet). Its heads: num_key_heads
  // query/key heads of key_head_dim, num_value_heads value heads of value_head_dim, a causal
  // convolution of conv_kernel_dim taps.
  bool gated_delta_net = false;
  std::optional<int> linear_attention_every;
  std::vector<int> linear_attention_pattern;
  int linear_conv_kernel_dim = 4;
  int linear_key_head_dim = 128;
  int linear_value_head_dim = 128;
  int linear_num_key_heads = 16;
  int linear_num_value_heads = 32;
  std::vector<char> linear_layer;  // derived: per layer, 1 = Gated DeltaNet
  // --no-rope-freq (Llama 4's NoPE layers): every N-th layer (1-based) skips the rotary embedding,
  // or a 0/1 list per layer (1 = no RoPE); multi-token prediction depth j + 1 reads entry j, as
  // Megatron-LM numbers its layer. Multi-latent attention layers keep their RoPE (Megatron-LM's MLA
  // does not read it).
  std::optional<int> no_rope_every;
  std::vector<int> no_rope_pattern;
  std::vector<char> nope_layer;  // derived: per layer, 1 = no RoPE
  bool is_linear_layer(int layer) const {
    return gated_delta_net && layer >= 0 && static_cast<size_t>(layer) < linear_layer.size() && linear_layer[layer];
  }
  // --use-mup: maximal-update parametrization (Megatron-Core's MuP), at width multiplier
  // mup_width_mult = hidden_size / --mup-base-hidden-size (derived): hidden weights' init std over
  // sqrt(width), the output projections' over sqrt(2 L width), attention softmax scale
  // sqrt(--mup-base-head-dim or 1) / kv_channels^--mup-attn-scale-power, embeddings times
  // --mup-embedding-mult, logits times --mup-output-mult (1/width when left at 1), and Adam's
  // hidden matrices at lr / width and eps / width (SGD: the vector-like parameters at lr x width).
  bool use_mup = false;
  std::optional<int> mup_base_hidden_size;
  double mup_width_mult = 1.0;
  double mup_embedding_mult = 1.0;
  double mup_output_mult = 1.0;
  std::optional<double> mup_base_head_dim;
  double mup_attn_scale_power = 1.0;
  bool untie_embeddings_and_output_weights = false;
  int make_vocab_size_divisible_by = 128;
  int seq_length = 0;
  double attention_dropout = 0.1;
  double hidden_dropout = 0.1;
  double init_method_std = 0.02;
  std::optional<double> embedding_init_method_std;
  AttentionBackend attention_backend = AttentionBackend::auto_;
  bool fp32_residual_connection = false;
  bool attention_softmax_in_fp32 = false;
  bool apply_query_key_layer_scaling = false;
  MoeConfig moe;

  // derived
  int ffn_size = 0;           // ffn_hidden_size or Megatron's default (4h; swiglu: int(8h/3/64)*64)
  int head_dim = 0;           // kv_channels or h / n
  int query_groups = 0;       // num_query_groups with GQA, else num_attention_heads
  int vocab_size = 0;         // tokenizer's vocabulary before padding
  int padded_vocab_size = 0;  // Megatron's padding (multiple of make_vocab_size_divisible_by * TP)
};

// The GeLU form a (non-SwiGLU) model computes: tanh with --openai-gelu, or through Megatron's
// fused bias-GeLU (bias_gelu_impl, the tanh approximation) when biases are on and the fusion is
// not switched off; otherwise exact erf GeLU (F.gelu).
inline bool gelu_is_tanh(const ModelConfig& m) { return m.openai_gelu || (m.bias_gelu_fusion && m.add_bias_linear); }

// The sliding window of global layer `layer` (0-based) as AttentionShape::window_left: the
// earlier keys a query sees, -1 for full attention (Megatron's is_layer_window_attention, whose
// layer numbers are 1-based).
inline int attention_window_left(const ModelConfig& m, int layer) {
  if (!m.window_size || m.window_size->first < 0) return -1;
  if (m.window_attn_skip_every) return (layer + 1) % *m.window_attn_skip_every != 0 ? m.window_size->first : -1;
  if (!m.window_attn_pattern.empty()) return m.window_attn_pattern.at(static_cast<size_t>(layer)) ? m.window_size->first : -1;
  return m.window_size->first;
}

// The RoPE of --multi-latent-attention: --rope-type, YaRN by default (MLATransformerConfig's).
inline bool mla_rope_is_yarn(const ModelConfig& m) { return m.rope_type.value_or("yarn") == "yarn"; }

// --cp-comm-type values (ParallelConfig::cp_comm_type; engine/blocks/attention_cp.cpp).
enum class CpCommType { p2p, a2a, allgather, a2a_p2p };

struct ParallelConfig {
  int tensor_model_parallel_size = 1;
  int pipeline_model_parallel_size = 1;
  int context_parallel_size = 1;
  // --cp-comm-type: how attention's keys and values travel between context-parallel ranks, one
  // value for every layer or one per layer (p2p, a2a, allgather, a2a+p2p; ModelDims::cp_comm).
  std::vector<std::string> cp_comm_type{"p2p"};
  // --hierarchical-context-parallel-sizes (a2a+p2p): [a2a size, p2p size], product CP.
  std::vector<int64_t> hierarchical_context_parallel_sizes;
  bool sequence_parallel = false;     // switched off (with a warning) when TP == 1
  std::optional<int> num_layers_per_virtual_pipeline_stage;
  std::optional<int> num_virtual_stages_per_pipeline_rank;
  std::optional<int> microbatch_group_size_per_virtual_pipeline_stage;
  std::optional<int> decoder_first_pipeline_num_layers;
  std::optional<int> decoder_last_pipeline_num_layers;
  bool account_for_embedding_in_pipeline_split = false;
  bool account_for_loss_in_pipeline_split = false;
  // --pipeline-model-parallel-layout: Megatron's layout string ("E|(tt|)*3,tL": stages split by '|',
  // E embedding, t a decoder layer, L the loss; (..)*n and x*n repeat), PP x VPP stages in model
  // order (parallel/pipeline_layout.h).
  std::optional<std::string> pipeline_model_parallel_layout;
  bool overlap_p2p_communication = true;
  bool use_tp_pp_dp_mapping = false;
  bool overlap_p2p_communication_warmup_flush = false;
  bool tp_comm_overlap = false;       // accepted; needs --sequence-parallel (Megatron's rule)
  bool use_distributed_optimizer = false;
  // --num-distributed-optimizer-instances: the DP group split into this many instances of
  // consecutive DP ranks; each shards the optimizer state over its own ranks, gradients are
  // reduce-scattered inside an instance and all-reduced across instances (Megatron's partial
  // distributed optimizer).
  int num_distributed_optimizer_instances = 1;
  // Fully sharded data parallelism (app/validate_fsdp.cpp maps it onto the machinery above):
  // --use-megatron-fsdp (Megatron-FSDP, --megatron-fsdp-version 1 or 2) with
  // --data-parallel-sharding-strategy no_shard | optim | optim_grads | optim_grads_params (DDP and
  // ZeRO-1/2/3), the hybrid outer level --outer-dp-sharding-strategy no_shard | optim over
  // --num-distributed-optimizer-instances, and the dtypes of its main weights, main gradients and
  // gradient reduction (fp32, bf16, fp16 or auto); --use-torch-fsdp2 (PyTorch's fully_shard).
  bool use_megatron_fsdp = false;
  int megatron_fsdp_version = 1;
  bool use_torch_fsdp2 = false;
  std::string data_parallel_sharding_strategy = "optim_grads_params";
  std::string outer_dp_sharding_strategy = "no_shard";
  std::string megatron_fsdp_main_params_dtype = "fp32";
  std::string megatron_fsdp_main_grads_dtype = "auto";
  std::string megatron_fsdp_grad_comm_dtype = "auto";
  // Expert parallelism (MoE): --expert-model-parallel-size, --expert-tensor-parallel-size (None:
  // the tensor-parallel size).
  int expert_model_parallel_size = 1;
  std::optional<int> expert_tensor_parallel_size;
  bool overlap_grad_reduce = false;
  bool overlap_param_gather = false;
  bool overlap_param_gather_with_optimizer_step = false;  // refused (unsupported.cpp); rules kept
  std::optional<int64_t> ddp_bucket_size;
  std::optional<int> ddp_num_buckets;
  bool ddp_average_in_collective = false;
  bool grad_reduce_in_bf16 = false;
  bool accumulate_allreduce_grads_in_fp32 = false;
  int distributed_timeout_minutes = 10;
  std::optional<int> distributed_timeout_seconds_after_init;  // every group's timeout after the first iteration
  std::string distributed_backend = "nccl";

  // launch (from the launcher's environment or the local GPUs)
  Launcher launcher = Launcher::none;
  int world_size = 1;
  int rank = 0;
  int local_rank = 0;
  int local_world_size = 1;
  std::optional<int> nproc_per_node;  // megatrain flag: workers to start bare on a workstation
  // Rendezvous for NCCL: MASTER_ADDR/MASTER_PORT, or SLURM's first host. Empty master_addr under
  // mpirun across nodes without MASTER_ADDR: exchange the NCCL id over MPI instead.
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int node_rank = 0;  // derived from the launcher where it says (GROUP_RANK, SLURM_NODEID, ...)

  // derived
  int data_parallel_size = 1;
  int virtual_pipeline_size = 1;  // model chunks per pipeline rank (1 = no interleaving)
};

// The data-parallel sharding strategy a run asked for with --use-megatron-fsdp (its
// --data-parallel-sharding-strategy) or --use-torch-fsdp2 (optim_grads_params: parameters, gradients
// and optimizer state all sharded); empty without either (app/validate_fsdp.cpp maps them).
inline std::string fsdp_strategy(const ParallelConfig& p) {
  if (p.use_torch_fsdp2) return "optim_grads_params";
  return p.use_megatron_fsdp ? p.data_parallel_sharding_strategy : std::string();
}

// Knowledge distillation, Megatron-LM's ModelOpt path (megatron/post_training, ModelOpt's
// distill plugin for Megatron): a frozen teacher loaded from --export-kd-teacher-load runs forward
// beside the student, and the student trains on the KL divergence of its logits from the
// teacher's, plus intermediate losses between hidden states (engine/distillation.h).
struct DistillConfig {
  std::optional<std::string> teacher_load;          // --export-kd-teacher-load DIR
  std::optional<std::string> cfg_path;              // --export-kd-cfg FILE (YAML)
  std::optional<std::string> teacher_model_config;  // --export-kd-teacher-model-config (default DIR/model_config.yaml)
  // From the distillation config (ModelOpt's DistillationConfig, its defaults here).
  bool skip_lm_loss = true;
  double kd_loss_scale = 1.0;
  double logit_kl_temperature = 1.0;
  struct Pair {
    std::string student, teacher;
    bool mse = false;  // else cosine (the default)
  };
  std::vector<Pair> intermediate_layer_pairs;
  // A pair's layer name as the hidden state it reads: "decoder.layers.N" -> N (the layer's output),
  // "decoder.final_layernorm" -> -1 (the final norm's output); -2 for any other name.
  static int hidden_state_layer(const std::string& name) {
    if (name == "decoder.final_layernorm") return -1;
    const std::string prefix = "decoder.layers.";
    if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size() || name.size() > prefix.size() + 6) return -2;
    int n = 0;
    for (size_t i = prefix.size(); i < name.size(); ++i) {
      if (name[i] < '0' || name[i] > '9') return -2;
      n = n * 10 + (name[i] - '0');
    }
    return n;
  }
  // The teacher's model: the student's with the teacher's model config applied (app/distill_args.h).
  std::optional<ModelConfig> teacher;
  // The teacher model config's keys, as flags (for the startup lines and the plan).
  std::vector<std::string> teacher_flags;
  bool enabled() const { return teacher_load.has_value(); }
};

struct TrainConfig {
  int micro_batch_size = 0;  // required
  std::optional<int> global_batch_size;
  bool decrease_batch_size_if_needed = false;
  // --step-batch-size-schedule "THRESH:BS ...": the global batch by consumed samples (parsed
  // into batch_size_schedule below).
  std::optional<std::string> step_batch_size_schedule;
  std::optional<int64_t> train_iters;
  std::optional<int64_t> train_samples;
  int eval_iters = 100;
  // --eval-global-batch-size: samples per evaluation iteration (default the training global batch);
  // a multiple of micro_batch_size x DP (engine/trainer.cpp evaluate, data/dataset_builder.cpp).
  std::optional<int> eval_global_batch_size;
  // --eval-micro-batch-size (Megatron-LM: default --micro-batch-size): evaluation runs the model's one
  // planned micro-batch, so only that value is taken (app/derive.cpp).
  std::optional<int> eval_micro_batch_size;
  std::optional<int> eval_interval;
  // --start-eval-at-iter: no evaluation at iterations below it (nor the validation samples of those).
  std::optional<int64_t> start_eval_at_iter;
  // The evaluations of a run of `iters` iterations (Megatron's get_train_valid_test_num_samples):
  // one every --eval-interval iterations and one at the end, less those before --start-eval-at-iter;
  // one without an interval or with --skip-train.
  int64_t evaluations(int64_t iters) const {
    if (skip_train || !eval_interval || *eval_interval <= 0) return 1;
    int64_t n = iters / *eval_interval + 1;
    if (start_eval_at_iter) n = std::max<int64_t>(0, n - *start_eval_at_iter / *eval_interval);
    return n;
  }
  bool skip_train = false;
  // --test-mode: replicated q/k layernorm parameters compared across DP and TP before each
  // step's and evaluation's forward passes (engine/replica_check.h).
  bool test_mode = false;
  // --check-weight-hash-across-dp-replicas-interval N: every parameter's hash compared across the
  // data-parallel replicas before training and every N iterations (engine/replica_check.h).
  std::optional<int> check_weight_hash_across_dp_replicas_interval;
  std::optional<int> exit_interval;
  std::optional<int> exit_duration_in_mins;
  bool exit_signal_handler = false;
  std::string exit_signal = "SIGTERM";  // --exit-signal: the signal --exit-signal-handler catches
  // --exit-signal-handler-for-training: SIGINT or SIGTERM stops the run after its step, without a save.
  bool exit_signal_handler_for_training = false;

  OptimizerKind optimizer = OptimizerKind::adam;
  std::optional<double> lr;
  double min_lr = 0.0;
  LrDecayStyle lr_decay_style = LrDecayStyle::linear;
  std::optional<int64_t> lr_decay_iters;
  std::optional<int64_t> lr_decay_samples;
  int64_t lr_warmup_iters = 0;
  int64_t lr_warmup_samples = 0;
  std::optional<double> lr_warmup_fraction;
  double lr_warmup_init = 0.0;
  WsdDecayStyle lr_wsd_decay_style = WsdDecayStyle::exponential;
  std::optional<int64_t> lr_wsd_decay_iters;
  std::optional<int64_t> lr_wsd_decay_samples;
  std::optional<double> decoupled_lr;
  std::optional<double> decoupled_min_lr;
  bool override_opt_param_scheduler = false;
  bool use_checkpoint_opt_param_scheduler = false;
  double weight_decay = 0.01;
  // --apply-wd-to-qk-layernorm: the q/k layernorm weights (and biases) are decayed too; by
  // default every 1-D parameter and bias is not.
  bool apply_wd_to_qk_layernorm = false;
  std::optional<double> start_weight_decay;
  std::optional<double> end_weight_decay;
  WeightDecayIncrStyle weight_decay_incr_style = WeightDecayIncrStyle::constant;
  double clip_grad = 1.0;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_eps = 1e-8;
  double sgd_momentum = 0.9;
  MuonConfig muon;
  bool calculate_per_token_loss = false;
  bool check_for_nan_in_loss_and_grad = true;
  // Megatron-LM's rerun state machine (engine/rerun_state_machine.h): --rerun-mode
  // (disabled, validate_results, report_stats), --check-for-spiky-loss, --check-for-large-grads,
  // --error-injection-rate (1 in N validations, 0: off) and --error-injection-type.
  std::string rerun_mode = "validate_results";
  bool check_for_spiky_loss = false;
  bool check_for_large_grads = false;
  int error_injection_rate = 0;
  std::string error_injection_type = "transient_error";
  bool deterministic_mode = false;
  std::vector<int64_t> iterations_to_skip;

  Precision precision = Precision::fp32;
  bool fp16_lm_cross_entropy = false;  // refused (unsupported.cpp); rule kept
  std::optional<double> loss_scale;      // static scale; unset = dynamic (fp16)
  double initial_loss_scale = 4294967296.0;  // 2**32
  double min_loss_scale = 1.0;
  double loss_scale_window = 1000;
  int hysteresis = 2;
  // --use-precision-aware-optimizer (Transformer Engine's FusedAdam in Megatron): the optimizer's
  // tensors may be stored narrower than float32; the update still computes in float32. Built:
  // bf16 moments and bf16 main gradients; the others are refused (app/unsupported.cpp).
  bool use_precision_aware_optimizer = false;
  StateDtype main_grads_dtype = StateDtype::fp32;
  StateDtype main_params_dtype = StateDtype::fp32;
  StateDtype exp_avg_dtype = StateDtype::fp32;
  StateDtype exp_avg_sq_dtype = StateDtype::fp32;

  // FP8. fp8_format unset: no FP8. The linear layers of the transformer
  // layers (QKV, proj, fc1, fc2) run as FP8 GEMMs, except the first/last layers kept in bf16.
  std::optional<Fp8Format> fp8_format;          // --fp8-format (Megatron's dest: fp8)
  Fp8Recipe fp8_recipe = Fp8Recipe::delayed;    // --fp8-recipe
  int fp8_margin = 0;                           // --fp8-margin: scale = fp8_max / amax / 2^margin
  int fp8_amax_history_len = 1;                 // --fp8-amax-history-len (delayed)
  Fp8AmaxAlgo fp8_amax_compute_algo = Fp8AmaxAlgo::most_recent;  // --fp8-amax-compute-algo (delayed)
  bool fp8_wgrad = true;                        // --no-fp8-wgrad: weight gradients in higher precision
  // --fp8-param-gather: the FP8 layers' weights exist only as FP8 (no compute-dtype copy); the
  // distributed optimizer casts its float32 master shards into them and all-gathers FP8 bytes.
  bool fp8_param_gather = false;
  bool first_last_layers_bf16 = false;          // --first-last-layers-bf16
  int num_layers_at_start_in_bf16 = 1;          // with --first-last-layers-bf16
  int num_layers_at_end_in_bf16 = 1;
  // Whether global decoder layer `layer` (0-based) runs its linear layers in FP8 (Megatron's
  // is_first_last_bf16_layer, which also uses global layer numbers).
  bool fp8_layer(int layer, int num_layers) const {
    if (!fp8_format) return false;
    if (!first_last_layers_bf16) return true;
    return layer >= num_layers_at_start_in_bf16 && layer < num_layers - num_layers_at_end_in_bf16;
  }

  RecomputeGranularity recompute_granularity = RecomputeGranularity::none;
  RecomputeMethod recompute_method = RecomputeMethod::none;
  std::optional<int> recompute_num_layers;
  std::vector<std::string> recompute_modules;  // selective targets; empty = {"core_attn"}
  bool distribute_saved_activations = false;    // refused (unsupported.cpp); rules kept

  // Fine-grained activation offloading (engine/activation_offload.h): what the named modules keep
  // for backward goes to host memory after each layer's forward and comes back before its backward.
  bool fine_grained_activation_offloading = false;
  std::vector<std::string> offload_modules;           // attn_norm qkv_linear core_attn attn_proj mlp_norm expert_fc1 moe_act
  int64_t min_offloaded_tensor_size = 1024 * 1024;    // elements: smaller kept tensors stay on the device
  double activation_offload_fraction = 1.0;           // of the eligible (layer, module) groups, the first ones in forward order
  int64_t delta_offload_bytes_across_pp_ranks = 0;    // pipeline rank r keeps r x this many offloadable bytes on the device
  std::optional<int> fine_grained_offloading_max_inflight_offloads;  // per module: copies to host not yet waited for

  int seed = 1234;
  DeviceKind device = DeviceKind::gpu;  // megatrain flag --device gpu|cpu (cpu = reference backend)

  // derived
  int global_batch = 0;        // global_batch_size (rounded down with --decrease-batch-size-if-needed) or micro_batch_size * DP
  int num_microbatches = 0;    // global_batch / (micro_batch_size * DP); with a batch-size schedule the largest
  // --step-batch-size-schedule parsed: (threshold in consumed samples, global batch), thresholds
  // strictly ascending from 0; empty without the flag. global_batch is then micro_batch_size * DP
  // (Megatron's args.global_batch_size, which its iteration-based scheduler horizons use).
  std::vector<std::pair<int64_t, int>> batch_size_schedule;
  // The global batch of the iteration that starts after `consumed_samples` samples.
  int global_batch_at(int64_t consumed_samples) const {
    if (batch_size_schedule.empty()) return global_batch;
    int b = batch_size_schedule.front().second;
    for (const auto& [threshold, bs] : batch_size_schedule) {
      if (consumed_samples < threshold) break;
      b = bs;
    }
    return b;
  }
  int64_t total_iters = 0;     // train_iters, or derived from train_samples
  // LR/WD scheduler horizons in SAMPLES, as Megatron's OptimizerParamScheduler counts them
  // (iteration-based flags are multiplied by the global batch; a warmup fraction may be fractional).
  double lr_warmup_steps = 0;
  int64_t lr_decay_steps = 0;
  std::optional<int64_t> lr_wsd_decay_steps;
  int64_t wd_incr_steps = 0;
  DistillConfig distill;
};

struct DataConfig {
  std::vector<std::string> data_path;  // "prefix" or "w1 p1 w2 p2 ..."
  std::optional<std::string> split;
  std::vector<std::string> train_data_path, valid_data_path, test_data_path;
  // --data-args-path / --per-split-data-args-path: files holding the blends above (read into them
  // by the flag validation, as Megatron's get_blend_and_blend_per_split reads them).
  std::optional<std::string> data_args_path, per_split_data_args_path;
  bool mock_data = false;
  std::optional<std::string> data_cache_path;
  bool mmap_bin_files = true;
  int num_workers = 2;
  int num_dataset_builder_threads = 1;
  double mid_level_dataset_surplus = 0.005;
  bool reset_position_ids = false;
  bool reset_attention_mask = false;
  bool eod_mask_loss = false;
  // --dataloader-inter-document-masking: each sample's document parts (the documents it was cut
  // from, not its EOD tokens) bound attention and restart the positions.
  bool inter_document_masking = false;
  // Attention kept within each document (a block-diagonal causal mask), and the positions restarted
  // per document: by EOD tokens (--reset-attention-mask, --reset-position-ids) or by document parts.
  bool documents() const { return reset_attention_mask || inter_document_masking; }
  bool document_positions() const { return reset_position_ids || inter_document_masking; }
  bool create_attention_mask_in_dataloader = true;
  std::string dataloader_type = "single";
  // --no-data-sharding clears it: with --dataloader-type cyclic, every rank draws from one shuffle of
  // the whole split instead of shuffling its own contiguous bucket (data/cyclic_order.h).
  bool data_sharding = true;
  bool full_data_check = false;  // megatrain flag --full-data-check: scan every token id at start-up

  // Megatron's fill-in-the-middle dataset (--fim-data: megatron/training/datasets/fim_dataset.py).
  bool fim_data = false;
  double fim_rate = 0.5;      // probability that a segment is turned into a FIM sample
  double fim_spm_rate = 0.5;  // probability that a FIM sample uses SPM rather than PSM
  std::optional<std::string> fim_split_sample;  // token around which to split a segment into fragments
  std::optional<double> fim_fragment_rate;      // FIM probability of each fragment
  std::optional<std::string> fim_no_prefix;     // no FIM for fragments whose text starts with this
  std::string fim_prefix_token = "<fim_prefix>";
  std::string fim_middle_token = "<fim_middle>";
  std::string fim_suffix_token = "<fim_suffix>";
  std::string fim_pad_token = "<fim_pad>";
  std::string fim_eod_token = "<|endoftext|>";

  std::optional<std::string> tokenizer_type;  // GPT entry point fills GPT2BPETokenizer
  std::optional<std::string> vocab_file;
  std::optional<std::string> merge_file;
  std::optional<std::string> tokenizer_model;
  std::optional<int> vocab_size;
  std::optional<int> padded_vocab_size;
  int vocab_extra_ids = 0;
  std::optional<std::string> tiktoken_pattern;
  int tiktoken_num_special_tokens = 1000;
  std::vector<std::string> tokenizer_special_tokens;
  std::optional<int> null_tokenizer_eod_id;  // NullTokenizer's EOD (HEAD default: vocab_size - 1)
  // --null-tokenizer-pad-id: NullTokenizer's pad id (-1: none); labels equal to it leave the loss.
  int null_tokenizer_pad_id = -1;
  // --allow-ambiguous-pad-tokens: keep a pad id that equals another special token's (Megatron-LM
  // otherwise drops it, with a warning).
  bool allow_ambiguous_pad_tokens = false;

  // derived
  std::vector<double> split_weights;  // normalised train/valid/test proportions
  int eod_id = -1;                    // the tokenizer's end-of-document id
};

struct CheckpointConfig {
  std::optional<std::string> save;
  std::optional<int> save_interval;
  // Older checkpoints whose iteration is not a multiple of this are deleted once a newer one is
  // committed (Megatron's --save-retain-interval; the latest is always kept).
  std::optional<int> save_retain_interval;
  std::optional<std::string> load;
  bool no_save_optim = false;
  bool no_save_rng = false;
  bool no_load_optim = false;
  bool no_load_rng = false;
  bool finetune = false;
  std::optional<int64_t> ckpt_step;
  // Megatron-LM's offline conversion (--ckpt-convert-format torch|torch_dist, --ckpt-convert-save
  // DIR): the --load checkpoint written as a Megatron-LM checkpoint of that format in DIR/FORMAT, in
  // the run's layout, and no training (app/checkpoint_convert.h).
  std::optional<std::string> ckpt_convert_format;
  std::optional<std::string> ckpt_convert_save;
  // Where to load from when --load holds no checkpoint; loading from it is a --finetune.
  std::optional<std::string> pretrained_checkpoint;
  // --override-ckpt-iteration: resume at this iteration (consumed samples = it x global batch).
  std::optional<int64_t> override_ckpt_iteration;
  // --no-initialization: the weights are not drawn (a checkpoint must then be loaded).
  bool perform_initialization = true;
  // --use-checkpoint-args / --use-mp-args-from-checkpoint-args (applied while parsing: app/
  // checkpoint_cli_args.h); kept for the arguments block.
  bool use_checkpoint_args = false;
  bool use_mp_args_from_checkpoint_args = false;
  bool use_tokenizer_model_from_checkpoint_args = true;  // --no-use-tokenizer-model-from-checkpoint-args
  bool exit_on_missing_checkpoint = false;
  bool async_save = false;  // --async-save: a background thread writes the files (app/checkpointing.h)
  // Megatron's non-persistent (scratch) checkpoints: every --non-persistent-save-interval
  // iterations (that are not --save-interval ones) a checkpoint into <save>/non_persistent or
  // --non-persistent-global-ckpt-dir, where only the newest is kept; loading takes it when it is at
  // least as new as --load's (app/non_persistent_checkpoints.h). Type "global" only.
  std::optional<int> non_persistent_save_interval;
  std::optional<std::string> non_persistent_ckpt_type;
  std::optional<std::string> non_persistent_global_ckpt_dir;
  std::string ckpt_format = "torch_dist";
  // --dist-ckpt-strictness: what a load does with tensors the run asks for that the checkpoint
  // lacks (Megatron's "unexpected" keys) and, for the *_all values, tensors the checkpoint holds
  // that no rank asks for ("missing" keys); app/checkpointing.cpp.
  std::string dist_ckpt_strictness = "assume_ok_unexpected";
  // --verify-integrity: a SHA-256 manifest of the checkpoint's files (integrity.json) written at
  // save and checked at load (checkpoint/checkpoint_io.h).
  bool verify_integrity = false;
};

struct LoggingConfig {
  int log_interval = 100;
  bool log_throughput = false;
  bool log_params_norm = false;
  bool log_num_zeros_in_grad = false;
  bool log_progress = false;  // --log-progress: <save>/progress.txt (app/progress_log.h)
  bool log_energy = false;    // --log-energy: the GPUs' energy counters (app/energy_meter.h)
  // --log-straggler (engine/straggler.h): each rank's forward time, GPU readings and estimated
  // throughput, the slowest and fastest ranks logged every --log-interval iterations.
  bool log_straggler = false;
  bool disable_straggler_on_startup = false;
  int straggler_minmax_count = 1;
  int straggler_ctrlr_port = 65535;
  // --gpu-sniff-test-interval N (megatrain's; engine/sniff_test.h): every N iterations each rank's
  // GEMM, all-gather and send/receive probes, the slow ranks named. 0: off.
  int gpu_sniff_test_interval = 0;
  int timing_log_level = 0;
  std::string timing_log_option = "minmax";
  std::optional<std::string> tensorboard_dir;
  int tensorboard_log_interval = 1;
  int tensorboard_queue_size = 1000;
  bool log_timers_to_tensorboard = false;
  bool log_validation_ppl_to_tensorboard = false;
  bool log_memory_to_tensorboard = false;
  bool log_world_size_to_tensorboard = false;
  bool log_loss_scale_to_tensorboard = true;
  // Megatron's Weights & Biases flags. There is no W&B client in megatrain: with a non-empty
  // --wandb-project the TensorBoard event files go to tensorboard_events_dir() (app/reporters.h)
  // and the last rank prints the `wandb sync` command that uploads them.
  std::optional<std::string> wandb_project;
  std::optional<std::string> wandb_exp_name;
  std::optional<std::string> wandb_save_dir;
  std::optional<std::string> wandb_entity;
  std::optional<std::string> metrics_jsonl;  // megatrain flag --metrics-jsonl PATH
  int benchmark_warmup_iters = 3;  // megatrain flag: iterations left out of the end-of-run summary
  bool log_device_memory_used = false;  // --log-device-memory-used: the device's memory in use in report_memory
  std::optional<int> log_memory_interval;  // --log-memory-interval N: report_memory every N iterations (at log lines)
};

struct RunConfig {
  bool dry_run = false;
  bool json = false;                      // --dry-run --json
  std::optional<int> dry_run_world_size;  // --world-size N (dry runs only)
  std::optional<double> gpu_memory_gib;   // --gpu-memory-gib N: the dry run's per-GPU memory limit
};

struct Config {
  ModelConfig model;
  ParallelConfig parallel;
  TrainConfig train;
  DataConfig data;
  CheckpointConfig checkpoint;
  LoggingConfig logging;
  RunConfig run;
};

}  // namespace mt

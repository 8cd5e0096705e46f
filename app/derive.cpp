// Megatron's derived values, computed once (validate_args order),
// with the rules they depend on. Rank 0's setup messages use Megatron's wording.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <sstream>

#include "app/cli_internal.h"
#include "parallel/pipeline_layout.h"
#include "data/vocab_info.h"

namespace mt::cli {
namespace {

void require(const CliState& st, const char* flag) {
  if (!st.has(flag)) fail("{} is required", flag);
}

void positive(int v, const char* flag) {
  if (v <= 0) fail("{} must be > 0 (got {})", flag, v);
}

// Bounds on sizes that no real run reaches, checked before anything is sized by them. Without
// them a mistyped value is accepted and the host work that grows with it (the per-layer parameter
// layouts and buffers of every model chunk, the memory plan of the dry run, per-micro-batch
// schedules, per-sample data indices) runs for tens of seconds into std::bad_alloc.
//
// Layers: the deepest transformers trained have about 1000 layers, and megatrain keeps a few KB of
// host bookkeeping per layer and rank (tensor layouts, names, per-layer state), so 2^16 layers
// plan in under 3 s and 0.5 GB while 10^6 took 3 GB and 14 s into std::bad_alloc.
constexpr int kMaxLayers = 1 << 16;
// Micro-batches per iteration (global batch / (micro batch x DP)): real runs use at most a few
// thousand. The pipeline schedules of one iteration hold per-micro-batch state (about 240 bytes
// each, built in the dry run too): 2^20 plan in about a second and 250 MB, 2^24 took 25 s and
// 3.9 GB, and 2 x 10^9 ended in std::bad_alloc.
constexpr int64_t kMaxMicrobatches = int64_t{1} << 20;
// Samples a run reads (train, valid and test): each costs at least 16 bytes of cached index per
// rank (a sample-index row and a shuffle entry), so 2^40 samples would need 16 TiB on every rank;
// the largest published runs read about 2^31.
constexpr int64_t kMaxSamples = int64_t{1} << 40;
// Widths: every dimension of a weight matrix (--hidden-size, the MLP and expert sizes, the query
// width heads x head size, the vocabulary). The largest models use hidden sizes near 2^14, MLP sizes
// below 2^17 and vocabularies below 2^19; 2^24 is far above them and keeps what is derived from a
// width (Megatron's 4h MLP default, the padded vocabulary, 3 x the fused QKV width, 2 x a gated MLP)
// inside the 32-bit ints of the configuration, the layouts and the kernels. Above 2^29 (4h) and
// near 2^31 those overflowed: the dry run and training stopped on parameters with a negative number
// of elements, or on a padded vocabulary of -2^31.
constexpr int64_t kMaxWidth = int64_t{1} << 24;
// Parameters, counted from the shape before anything is laid out (the weight matrices: embeddings,
// attention projections, the MLPs, the experts' in MoE layers; biases and norms left out): 2^50, about
// 1.1 x 10^15, is some 500 times the largest models trained. Their weights, gradients and Adam
// states (16 bytes a parameter in mixed precision) would need 16 PiB, the memory of the largest
// clusters together, and the memory plan's 64-bit byte counts (up to about 20 bytes a parameter)
// stay far from overflow. Larger models, allowed by the bounds above (2^16 layers of width 2^24),
// overflowed them: the dry run printed a peak smaller than its own parameters and training tried
// to allocate a wrapped-around size.
constexpr double kMaxParameters = 0x1p50;
// Activations of one micro-batch, summed over its ranks: at least 2 bytes for each token's input
// to every layer (all that full recompute keeps) and for each of its logits. 2^50 bytes (1 PiB) is
// hundreds of times what the largest runs hold (a 2^20-token micro-batch of a 128-layer model with
// hidden size 2^14 keeps 4 TiB), and keeps the plan's 64-bit activation bytes (a few tens of bytes
// a token, layer and hidden unit, times the micro-batches a rank holds) from overflowing, which a
// 10^12-token micro-batch did (the dry run printed a peak of -2^63 bytes).
constexpr double kMaxMicrobatchActivationBytes = 0x1p50;

// Bytes in the largest binary unit that leaves at least 1 (up to EiB).
std::string bytes_text(double bytes) {
  static const char* const units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  size_t u = 0;
  while (bytes >= 1024 && u + 1 < std::size(units)) {
    bytes /= 1024;
    ++u;
  }
  return fmt::format("{:.1f} {}", bytes, units[u]);
}

// `what` names the flag (or the flags a width is derived from) and its value.
void check_width(int64_t width, const std::string& what) {
  if (width > kMaxWidth)
    fail("{} is wider than megatrain plans for (at most {} = 2^24 for any dimension of a weight matrix; the largest "
         "models use hidden sizes near 2^14, MLP sizes below 2^17 and vocabularies below 2^19): check the value", what,
         kMaxWidth);
}

void derive_model_shape(CliState& st) {
  Config& c = st.cfg;
  ModelConfig& m = c.model;
  if (st.encoder_num_layers) {
    if (st.has("--num-layers")) fail("cannot have both --num-layers and --encoder-num-layers");
    m.num_layers = *st.encoder_num_layers;
  } else if (!st.has("--num-layers")) {
    fail("--num-layers is required (or --encoder-num-layers)");
  }
  require(st, "--hidden-size");
  require(st, "--num-attention-heads");
  require(st, "--max-position-embeddings");
  positive(m.num_layers, "--num-layers");
  if (m.num_layers > kMaxLayers)
    fail("--num-layers {} is more than megatrain plans for (at most {}; the deepest trained transformers have about "
         "1000): check the value",
         m.num_layers, kMaxLayers);
  positive(m.hidden_size, "--hidden-size");
  check_width(m.hidden_size, fmt::format("--hidden-size {}", m.hidden_size));
  positive(m.num_attention_heads, "--num-attention-heads");
  positive(m.max_position_embeddings, "--max-position-embeddings");
  if (st.encoder_seq_length) {
    if (st.has("--seq-length")) fail("cannot have both --seq-length and --encoder-seq-length");
    m.seq_length = *st.encoder_seq_length;
  } else if (!st.has("--seq-length")) {
    fail("--seq-length is required (or --encoder-seq-length)");
  }
  positive(m.seq_length, "--seq-length");

  if (m.ffn_hidden_size) {
    // (0 too with experts: Megatron's default for a small SwiGLU model, which a Megatron-LM or
    // megatrain MoE checkpoint records; its dense MLPs, if any, are then empty, as there.)
    if (*m.ffn_hidden_size != 0 || m.moe.num_experts <= 0) positive(*m.ffn_hidden_size, "--ffn-hidden-size");
    check_width(*m.ffn_hidden_size, fmt::format("--ffn-hidden-size {}", *m.ffn_hidden_size));
    m.ffn_size = *m.ffn_hidden_size;
  } else {
    // SwiGLU keeps the parameter count near the 4h MLP's, rounded down to a multiple of 64.
    const int64_t ffn = m.swiglu ? static_cast<int64_t>((4.0 * m.hidden_size * 2.0 / 3.0) / 64.0) * 64
                                 : 4 * static_cast<int64_t>(m.hidden_size);
    check_width(ffn, fmt::format("the MLP size {} (Megatron's default for --hidden-size {}{}; --ffn-hidden-size sets "
                                 "it)", ffn, m.hidden_size, m.swiglu ? " with --swiglu" : ""));
    m.ffn_size = static_cast<int>(ffn);
  }
  if (m.kv_channels) {
    positive(*m.kv_channels, "--kv-channels");
    check_width(*m.kv_channels, fmt::format("--kv-channels {}", *m.kv_channels));
    check_width(static_cast<int64_t>(m.num_attention_heads) * *m.kv_channels,
                fmt::format("the query width --num-attention-heads {} x --kv-channels {}", m.num_attention_heads,
                            *m.kv_channels));
    m.head_dim = *m.kv_channels;
  } else {
    if (m.hidden_size % m.num_attention_heads != 0)
      fail("--hidden-size {} is not divisible by --num-attention-heads {} (or pass --kv-channels)", m.hidden_size,
           m.num_attention_heads);
    m.head_dim = m.hidden_size / m.num_attention_heads;
  }
  if (m.group_query_attention) {
    positive(m.num_query_groups, "--num-query-groups");
    m.query_groups = m.num_query_groups;
  } else {
    m.query_groups = m.num_attention_heads;
  }
  if (st.use_rotary_position_embeddings) m.position_embedding_type = PositionEmbedding::rope;
  if (m.add_bias_linear) m.add_qkv_bias = true;  // Megatron keeps the two in sync
  if (m.apply_query_key_layer_scaling) m.attention_softmax_in_fp32 = true;
}

void derive_parallel(CliState& st) {
  Config& c = st.cfg;
  ParallelConfig& p = c.parallel;
  positive(p.tensor_model_parallel_size, "--tensor-model-parallel-size");
  positive(p.pipeline_model_parallel_size, "--pipeline-model-parallel-size");
  positive(p.context_parallel_size, "--context-parallel-size");
  const int model_size = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size;
  if (p.world_size % model_size != 0)
    fail("world size {} is not divisible by --tensor-model-parallel-size {} x --pipeline-model-parallel-size {} x "
         "--context-parallel-size {} = {}",
         p.world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size, model_size);
  p.data_parallel_size = p.world_size / model_size;
  st.info(fmt::format("using world size: {}, data-parallel size: {}, context-parallel size: {}, hierarchical "
                      "context-parallel sizes: None, tensor-model-parallel size: {}, pipeline-model-parallel size: {}",
                      p.world_size, p.data_parallel_size, p.context_parallel_size, p.tensor_model_parallel_size,
                      p.pipeline_model_parallel_size));

  // Virtual pipeline (interleaved schedule).
  const int L = c.model.num_layers, P = p.pipeline_model_parallel_size;
  const bool uneven = p.decoder_first_pipeline_num_layers || p.decoder_last_pipeline_num_layers;
  if (int(p.num_layers_per_virtual_pipeline_stage.has_value()) + int(p.num_virtual_stages_per_pipeline_rank.has_value()) +
          int(p.pipeline_model_parallel_layout.has_value()) > 1)
    fail("no more than one of --num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank and "
         "--pipeline-model-parallel-layout can be set");
  int vpp = 1;
  if (p.pipeline_model_parallel_layout) {
    // Megatron: the layout's stages give the virtual pipeline size; the other split flags conflict.
    if (uneven || p.account_for_embedding_in_pipeline_split || p.account_for_loss_in_pipeline_split)
      fail("--pipeline-model-parallel-layout cannot be set with other pipeline layout arguments "
           "(--decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-in-pipeline-split)");
    const int stages = static_cast<int>(parse_pipeline_layout(*p.pipeline_model_parallel_layout).size());
    if (stages % P != 0)
      fail("The length of pipeline_model_parallel_layout must be divisible by pipeline_model_parallel_size "
           "(--pipeline-model-parallel-layout has {} stages, --pipeline-model-parallel-size {})", stages, P);
    vpp = stages / P;
  } else if (p.num_layers_per_virtual_pipeline_stage) {
    const int per_chunk = *p.num_layers_per_virtual_pipeline_stage;
    positive(per_chunk, "--num-layers-per-virtual-pipeline-stage");
    if (uneven)
      fail("--num-layers-per-virtual-pipeline-stage cannot be combined with --decoder-first/last-pipeline-num-layers: "
           "use --num-virtual-stages-per-pipeline-rank to set the virtual pipeline size with an uneven pipeline");
    const int total = L + (p.account_for_embedding_in_pipeline_split ? 1 : 0) +
                      (p.account_for_loss_in_pipeline_split ? 1 : 0);
    if (total % P != 0) fail("--num-layers {} is not divisible by --pipeline-model-parallel-size {}", total, P);
    if ((total / P) % per_chunk != 0)
      fail("the {} layers per pipeline stage are not divisible by --num-layers-per-virtual-pipeline-stage {}",
           total / P, per_chunk);
    vpp = total / P / per_chunk;
  } else if (p.num_virtual_stages_per_pipeline_rank) {
    positive(*p.num_virtual_stages_per_pipeline_rank, "--num-virtual-stages-per-pipeline-rank");
    vpp = *p.num_virtual_stages_per_pipeline_rank;
  }
  p.virtual_pipeline_size = vpp;
  if (vpp > 1) {
    if (p.overlap_p2p_communication && P <= 1)
      fail("the interleaved schedule (virtual pipeline size {}) needs --pipeline-model-parallel-size > 1", vpp);
    if (!p.overlap_p2p_communication && P <= 2)
      fail("the interleaved schedule with --no-overlap-p2p-communication needs --pipeline-model-parallel-size > 2 "
           "(got {}), to avoid several sends and receives between the same 2 ranks per communication batch", P);
  } else {
    p.overlap_p2p_communication = false;
    if (P > 1)
      st.warn("Setting args.overlap_p2p_comm and args.align_param_gather to False since non-interleaved schedule "
              "does not support overlapping p2p communication and aligned param AG");
  }
  st.info(vpp > 1 ? fmt::format("Number of virtual stages per pipeline stage: {}", vpp)
                  : std::string("Number of virtual stages per pipeline stage: None"));

  if (p.tensor_model_parallel_size == 1) {
    if (p.sequence_parallel) st.warn("Disabling sequence parallelism because tensor model parallelism is disabled");
    p.sequence_parallel = false;
  }
}

// Mixture of experts (Megatron's validate_args and TransformerConfig.__post_init__): None for
// --num-experts 0 and a negative capacity factor, the experts' FFN size, which layers are MoE
// layers (--moe-layer-freq). (--expert-tensor-parallel-size stays None when not given, which
// means the tensor-parallel size.)
void derive_moe(CliState& st) {
  ModelConfig& m = st.cfg.model;
  MoeConfig& e = m.moe;
  if (e.num_experts < 0)
    fail("--num-experts {} must be > 0 (0, the default None, means no MoE layers)", e.num_experts);
  if (e.expert_capacity_factor && *e.expert_capacity_factor < 0) e.expert_capacity_factor.reset();
  e.expert_ffn = 0;
  e.moe_layer.clear();
  if (!e.enabled()) {
    if (e.ffn_hidden_size) {
      const bool mixed = e.layer_pattern.empty()
                             ? e.layer_freq > 1
                             : std::find(e.layer_pattern.begin(), e.layer_pattern.end(), 0) != e.layer_pattern.end();
      if (!mixed)
        fail("--moe-ffn-hidden-size is set but --num-experts is not: set --num-experts or remove "
             "--moe-ffn-hidden-size");
      st.warn("--moe-ffn-hidden-size is ignored without --num-experts (as in Megatron: --moe-layer-freq leaves dense "
              "layers, which keep the dense FFN size)");
      e.ffn_hidden_size.reset();
    }
    return;
  }
  if (e.ffn_hidden_size) {
    positive(*e.ffn_hidden_size, "--moe-ffn-hidden-size");
    check_width(*e.ffn_hidden_size, fmt::format("--moe-ffn-hidden-size {}", *e.ffn_hidden_size));
    e.expert_ffn = *e.ffn_hidden_size;
  } else {
    e.expert_ffn = m.ffn_size;
    st.warn(fmt::format("moe_ffn_hidden_size is not set, using ffn_hidden_size for MoE instead (the experts' FFN size "
                        "is {}; --moe-ffn-hidden-size sets it)", m.ffn_size));
  }
  if (e.shared_expert_intermediate_size)
    check_width(*e.shared_expert_intermediate_size,
                fmt::format("--moe-shared-expert-intermediate-size {}", *e.shared_expert_intermediate_size));
  const int L = m.num_layers;
  if (e.layer_pattern.empty()) {
    if (e.layer_freq <= 0)
      fail("--moe-layer-freq {} must be > 0 (layer i, from 0, is an MoE layer when i % N == 0), or a 0/1 list with one "
           "entry per layer", e.layer_freq);
    for (int l = 0; l < L; ++l) e.moe_layer.push_back(l % e.layer_freq == 0 ? 1 : 0);
  } else {
    if (static_cast<int>(e.layer_pattern.size()) != L)
      fail("--moe-layer-freq gives {} layers but --num-layers is {}: the list needs one 0/1 entry per layer",
           e.layer_pattern.size(), L);
    for (size_t l = 0; l < e.layer_pattern.size(); ++l) {
      const int v = e.layer_pattern[l];
      if (v != 0 && v != 1)
        fail("--moe-layer-freq: entry {} (layer {}) of the list is {}; each entry is 1 (an MoE layer) or 0 (a dense "
             "layer)", l, l, v);
      e.moe_layer.push_back(static_cast<char>(v));
    }
  }
  // Group-limited routing needs a non-zero --moe-router-group-topk (Megatron tests its truth value);
  // without it the groups are unused.
  if (e.router_group_topk && *e.router_group_topk < 0)
    fail("--moe-router-group-topk must be > 0 (got {})", *e.router_group_topk);
  if (e.router_group_topk && *e.router_group_topk == 0) e.router_group_topk.reset();
  if (e.router_num_groups && !e.router_group_topk) {
    st.note("--moe-router-num-groups has no effect without --moe-router-group-topk (as in Megatron: routing is not "
            "group-limited)");
    e.router_num_groups.reset();
  }
  if (e.shared_expert_gate && !e.shared_expert_intermediate_size) {
    st.note("--moe-shared-expert-gate has no effect without --moe-shared-expert-intermediate-size (as in Megatron)");
    e.shared_expert_gate = false;
  }
}

// --no-rope-freq (Megatron's TransformerConfig.__post_init__): the layers without RoPE.
void derive_no_rope(CliState& st) {
  ModelConfig& m = st.cfg.model;
  m.nope_layer.clear();
  if (!m.no_rope_every && m.no_rope_pattern.empty()) return;
  const int L = m.num_layers;
  if (m.no_rope_every) {
    const int n = *m.no_rope_every;
    if (n <= 0) fail("--no-rope-freq {} must be > 0 (every N-th layer, from 1, skips RoPE)", n);
    if (L % n != 0) fail("no_rope_freq={} should be divisible by num_layers={}.", n, L);  // (Megatron's words)
    for (int l = 0; l < L; ++l) m.nope_layer.push_back((l + 1) % n == 0 ? 1 : 0);
  } else {
    if (static_cast<int>(m.no_rope_pattern.size()) != L)
      fail("Length of no_rope list ({}) must match the number of layers ({})", m.no_rope_pattern.size(), L);
    for (size_t l = 0; l < m.no_rope_pattern.size(); ++l) {
      const int v = m.no_rope_pattern[l];
      if (v != 0 && v != 1)
        fail("--no-rope-freq: entry {} of the list is {}; each entry is 1 (no RoPE) or 0 (RoPE)", l, v);
      m.nope_layer.push_back(static_cast<char>(v));
    }
  }
  if (m.position_embedding_type != PositionEmbedding::rope)
    st.note("--no-rope-freq has no effect without --position-embedding-type rope, as in Megatron-LM");
  else if (m.multi_latent_attention)
    st.note("--no-rope-freq has no effect on multi-latent attention layers, as in Megatron-LM (whose MLA keeps its "
            "RoPE)");
}

// Gated DeltaNet (Megatron's TransformerConfig.__post_init__ and get_linear_attention_pattern):
// which layers are linear attention, and the head counts' rules.
void derive_linear_attention(CliState& st) {
  ModelConfig& m = st.cfg.model;
  m.linear_layer.clear();
  if (!m.gated_delta_net) {
    if (m.linear_attention_every || !m.linear_attention_pattern.empty())
      st.note("--linear-attention-freq has no effect without --experimental-attention-variant gated_delta_net (as in "
              "Megatron-LM): every layer keeps softmax attention");
    return;
  }
  if (!m.linear_attention_every && m.linear_attention_pattern.empty())
    fail("--experimental-attention-variant gated_delta_net needs --linear-attention-freq (which layers are Gated "
         "DeltaNet layers): N keeps softmax attention in every N-th layer, or give a 0/1 list per layer");
  positive(m.linear_conv_kernel_dim, "--linear-conv-kernel-dim");
  positive(m.linear_key_head_dim, "--linear-key-head-dim");
  positive(m.linear_value_head_dim, "--linear-value-head-dim");
  positive(m.linear_num_key_heads, "--linear-num-key-heads");
  positive(m.linear_num_value_heads, "--linear-num-value-heads");
  if (m.linear_num_value_heads % m.linear_num_key_heads != 0)
    fail("--linear-num-value-heads {} must be a multiple of --linear-num-key-heads {}", m.linear_num_value_heads,
         m.linear_num_key_heads);
  const int L = m.num_layers;
  if (m.linear_attention_every) {
    const int n = *m.linear_attention_every;
    if (n <= 0)
      fail("--linear-attention-freq {} must be > 0 (every N-th layer, from 1, keeps softmax attention)", n);
    for (int l = 0; l < L; ++l) m.linear_layer.push_back((l + 1) % n == 0 ? 0 : 1);
  } else {
    if (static_cast<int>(m.linear_attention_pattern.size()) != L)
      fail("--linear-attention-freq gives {} layers but --num-layers is {}: the list needs one 0/1 entry per layer",
           m.linear_attention_pattern.size(), L);
    for (size_t l = 0; l < m.linear_attention_pattern.size(); ++l) {
      const int v = m.linear_attention_pattern[l];
      if (v != 0 && v != 1)
        fail("--linear-attention-freq: entry {} of the list is {}; each entry is 1 (Gated DeltaNet) or 0 (softmax "
             "attention)", l, v);
      m.linear_layer.push_back(static_cast<char>(v));
    }
  }
}

// MuP (Megatron's TransformerConfig.__post_init__): the width multiplier and, left at 1, the
// logits' multiplier 1 / width.
void derive_mup(CliState& st) {
  ModelConfig& m = st.cfg.model;
  if (!m.use_mup) {
    for (const char* f : {"--mup-base-hidden-size", "--mup-width-mult", "--mup-embedding-mult", "--mup-output-mult",
                          "--mup-base-head-dim", "--mup-attn-scale-power"})
      if (st.has(f)) st.note(fmt::format("{} has no effect without --use-mup (as in Megatron-LM)", f));
    return;
  }
  if (!m.mup_base_hidden_size) m.mup_base_hidden_size = m.hidden_size;
  if (*m.mup_base_hidden_size <= 0) fail("--mup-base-hidden-size must be positive.");
  m.mup_width_mult = static_cast<double>(m.hidden_size) / *m.mup_base_hidden_size;
  if (m.mup_output_mult == 1.0 && m.mup_width_mult != 1.0) m.mup_output_mult = 1.0 / m.mup_width_mult;
}

void derive_precision(CliState& st) {
  Config& c = st.cfg;
  TrainConfig& t = c.train;
  if (st.has("--fp16") && st.has("--bf16")) fail("--fp16 and --bf16 are exclusive: pick one");
  if (t.precision == Precision::fp16 && !t.loss_scale) {
    t.check_for_nan_in_loss_and_grad = false;
    st.warn("Setting args.check_for_nan_in_loss_and_grad to False since dynamic loss scaling is being used");
  }
  if (t.precision == Precision::bf16) {
    // Megatron: float32 main grads unless --grad-reduce-in-bf16 or --main-grads-dtype bf16 (an
    // explicit --accumulate-allreduce-grads-in-fp32 keeps them float32 with the first, and is
    // refused with the second).
    if (c.parallel.accumulate_allreduce_grads_in_fp32 && t.main_grads_dtype != StateDtype::fp32)
      fail("--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32 is set");
    if (!c.parallel.grad_reduce_in_bf16 && !c.parallel.accumulate_allreduce_grads_in_fp32 &&
        t.main_grads_dtype == StateDtype::fp32) {
      c.parallel.accumulate_allreduce_grads_in_fp32 = true;
      st.info("accumulate and all-reduce gradients in fp32 for bfloat16 data type.");
    }
  }
  const char* dtype = t.precision == Precision::bf16 ? "torch.bfloat16"
                      : t.precision == Precision::fp16 ? "torch.float16"
                                                       : "torch.float32";
  st.info(fmt::format("using {} for parameters ...", dtype));
}

// Megatron's StepBatchsizeNumMicroBatchesCalculator._parse_numeric_value: a number with an
// optional K, M, B or T suffix (powers of 1000), as int(float(text) * multiplier).
int64_t schedule_number(const std::string& raw) {
  constexpr const char* flag = "--step-batch-size-schedule";
  std::string v = raw;
  while (!v.empty() && std::isspace(static_cast<unsigned char>(v.back()))) v.pop_back();
  size_t lead = 0;
  while (lead < v.size() && std::isspace(static_cast<unsigned char>(v[lead]))) ++lead;
  v = v.substr(lead);
  for (char& ch : v) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  double multiplier = 1;
  if (!v.empty()) {
    switch (v.back()) {
      case 'T': multiplier = 1e12; break;
      case 'B': multiplier = 1e9; break;
      case 'M': multiplier = 1e6; break;
      case 'K': multiplier = 1e3; break;
      default: break;
    }
    if (multiplier != 1) v.pop_back();
  }
  char* end = nullptr;
  const double x = v.empty() || v.find_first_of("xX") != std::string::npos ? NAN : std::strtod(v.c_str(), &end);
  if (v.empty() || end != v.c_str() + v.size() || std::isnan(x))
    fail("{}: could not convert string to float: '{}'", flag, v);
  const double value = std::trunc(x * multiplier);
  if (!std::isfinite(value) || std::fabs(value) > 9.0e18)
    fail("{}: cannot convert {} to an integer", flag, raw);
  return static_cast<int64_t>(value);
}

// Digits grouped by thousands, as Python's format(n, ',').
std::string thousands(int64_t n) {
  std::string d = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < d.size(); ++i) {
    if (i > 0 && (d.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(d[i]);
  }
  return n < 0 ? "-" + out : out;
}

// --step-batch-size-schedule "THRESHOLD:BS ..." (Megatron-LM HEAD,
// megatron/core/num_microbatches_calculator.py): entries split on spaces and commas, thresholds in
// tokens (pretrain_gpt always knows --seq-length) turned into samples by floor division, sorted,
// then Megatron's checks. Divisibility by micro-batch x DP is checked when an entry is reached.
void derive_batch_size_schedule(CliState& st) {
  TrainConfig& t = st.cfg.train;
  constexpr const char* flag = "--step-batch-size-schedule";
  const std::string& text = *t.step_batch_size_schedule;
  std::string spaced = text;
  std::replace(spaced.begin(), spaced.end(), ',', ' ');
  std::istringstream in(spaced);
  const int64_t seq = st.cfg.model.seq_length;
  if (seq <= 0) fail("{} needs --seq-length (its thresholds are tokens)", flag);
  std::vector<std::pair<int64_t, int64_t>> entries;
  for (std::string entry; in >> entry;) {
    const size_t colon = entry.find(':');
    if (colon == std::string::npos)
      fail("{}: Invalid schedule entry \"{}\". Expected format: \"THRESHOLD:BATCH_SIZE\"", flag, entry);
    const int64_t tokens = schedule_number(entry.substr(0, colon));
    const int64_t batch = schedule_number(entry.substr(colon + 1));
    // Python's floor division
    const int64_t samples = tokens / seq - ((tokens % seq != 0 && tokens < 0) ? 1 : 0);
    entries.emplace_back(samples, batch);
  }
  std::stable_sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  if (entries.empty()) fail("{}: schedule must have at least one entry", flag);
  if (entries.front().first != 0)
    fail("{}: first schedule entry must have threshold 0, got {}", flag, entries.front().first);
  for (size_t i = 1; i < entries.size(); ++i)
    if (entries[i].first <= entries[i - 1].first)
      fail("{}: schedule thresholds must be strictly increasing, got {} before {}", flag, entries[i - 1].first,
           entries[i].first);
  const int per_step = t.micro_batch_size * st.cfg.parallel.data_parallel_size;
  t.batch_size_schedule.clear();
  int most = 0;
  for (const auto& [threshold, batch] : entries) {
    if (batch <= 0) fail("{}: batch size must be positive, got {}", flag, batch);
    if (batch > std::numeric_limits<int>::max()) fail("{}: batch size {} is too large", flag, batch);
    if (batch / per_step > kMaxMicrobatches)
      fail("{}: batch size {} needs {} micro-batches per iteration (/ (--micro-batch-size {} x data-parallel size {})), "
           "more than megatrain plans for (at most {}): check the value", flag, batch, batch / per_step,
           t.micro_batch_size, st.cfg.parallel.data_parallel_size, kMaxMicrobatches);
    t.batch_size_schedule.emplace_back(threshold, static_cast<int>(batch));
    most = std::max(most, static_cast<int>(batch / per_step));
  }
  // The activation slots and pipeline schedules are planned for the largest batch.
  t.num_microbatches = std::max(1, most);
  st.info(fmt::format("> using step batch size schedule: {}", text));
  st.info(fmt::format("step batch size schedule ({} steps):", t.batch_size_schedule.size()));
  for (const auto& [threshold, batch] : t.batch_size_schedule)
    st.info(fmt::format("  >= {} tokens ({} samples) -> batch_size={}, num_microbatches={}", thousands(threshold * seq),
                        thousands(threshold), batch, batch / per_step));
}

void derive_batch(CliState& st) {
  Config& c = st.cfg;
  TrainConfig& t = c.train;
  require(st, "--micro-batch-size");
  positive(t.micro_batch_size, "--micro-batch-size");
  const int dp = c.parallel.data_parallel_size;
  // The samples of one step (and so the global batch, which is a multiple of them) are 32-bit ints
  // in the configuration and the schedules; real global batches stay below 2^24.
  if (static_cast<int64_t>(t.micro_batch_size) * dp > std::numeric_limits<int>::max())
    fail("--micro-batch-size {} x data-parallel size {} = {} samples per step is more than megatrain plans for (at most "
         "{}): check the value", t.micro_batch_size, dp, static_cast<int64_t>(t.micro_batch_size) * dp,
         std::numeric_limits<int>::max());
  // Megatron-LM HEAD's rules (megatron/training/arguments.py, num_microbatches_calculator.py).
  if (t.step_batch_size_schedule && t.global_batch_size)
    fail("Cannot specify both --step-batch-size-schedule and --global-batch-size");
  if (t.step_batch_size_schedule && t.decrease_batch_size_if_needed)
    fail("Cannot specify both --step-batch-size-schedule and --decrease-batch-size-if-needed");
  if (!t.global_batch_size) {
    t.global_batch = t.micro_batch_size * dp;
    st.info(fmt::format("setting global batch size to {}", t.global_batch));
  } else {
    positive(*t.global_batch_size, "--global-batch-size");
    t.global_batch = *t.global_batch_size;
  }
  const int per_step = t.micro_batch_size * dp;
  if (t.global_batch % per_step != 0) {
    if (!t.decrease_batch_size_if_needed)
      fail("--global-batch-size {} is not divisible by --micro-batch-size {} x data-parallel size {} = {}",
           t.global_batch, t.micro_batch_size, dp, per_step);
    const int rounded = t.global_batch / per_step * per_step;
    if (rounded == 0)
      fail("--global-batch-size {} is smaller than --micro-batch-size {} x data-parallel size {} = {}", t.global_batch,
           t.micro_batch_size, dp, per_step);
    st.warn(fmt::format("--decrease-batch-size-if-needed: global batch size {} is not divisible by micro batch size "
                        "({}) times data parallel size ({}); decreasing it to {}",
                        t.global_batch, t.micro_batch_size, dp, rounded));
    t.global_batch = rounded;
  }
  t.num_microbatches = t.global_batch / per_step;
  if (t.step_batch_size_schedule) derive_batch_size_schedule(st);
  if (t.num_microbatches > kMaxMicrobatches)
    fail("--global-batch-size {} needs {} micro-batches per iteration (/ (--micro-batch-size {} x data-parallel size "
         "{})), more than megatrain plans for (at most {}): check the value, or raise --micro-batch-size",
         t.global_batch, t.num_microbatches, t.micro_batch_size, dp, kMaxMicrobatches);
  // --eval-global-batch-size (megatron/training/arguments.py): the samples of one evaluation
  // iteration, by default the training global batch, a multiple of micro-batch x DP. (Megatron-LM
  // defaults it to --global-batch-size as given, which then fails this check when
  // --decrease-batch-size-if-needed had to round it; megatrain takes the rounded batch.)
  if (t.eval_global_batch_size) {
    positive(*t.eval_global_batch_size, "--eval-global-batch-size");
    if (*t.eval_global_batch_size % per_step != 0)
      fail("--eval-global-batch-size {} is not divisible by --micro-batch-size {} x data-parallel size {} = {}",
           *t.eval_global_batch_size, t.micro_batch_size, dp, per_step);
  }
  // --eval-micro-batch-size: Megatron-LM evaluates in micro-batches of this size (default
  // --micro-batch-size); megatrain's model is planned for one micro-batch size, the training one.
  if (t.eval_micro_batch_size) {
    positive(*t.eval_micro_batch_size, "--eval-micro-batch-size");
    if (*t.eval_micro_batch_size != t.micro_batch_size)
      fail("megatrain does not support --eval-micro-batch-size {} other than --micro-batch-size {} yet (evaluation runs "
           "the training micro-batch): leave it out or give the same value",
           *t.eval_micro_batch_size, t.micro_batch_size);
  }
}

void derive_schedule(CliState& st) {
  TrainConfig& t = st.cfg.train;
  const bool by_iters = t.train_iters.has_value();
  const bool by_samples = t.train_samples.has_value();
  if (by_iters && by_samples) fail("--train-iters and --train-samples are exclusive: pass one");
  if (!by_iters && !by_samples) fail("pass --train-iters or --train-samples (the length of the run)");
  const int64_t B = t.global_batch;
  if (by_iters) {
    if (*t.train_iters < 0) fail("--train-iters must be >= 0 (got {})", *t.train_iters);
    if (*t.train_iters > kMaxSamples / B)
      fail("--train-iters {} x --global-batch-size {} is more samples than megatrain plans for (at most {}): check the "
           "values",
           *t.train_iters, B, kMaxSamples);
    if (t.lr_decay_samples) fail("--lr-decay-samples goes with --train-samples; with --train-iters use --lr-decay-iters");
    if (t.lr_warmup_samples != 0)
      fail("--lr-warmup-samples goes with --train-samples; with --train-iters use --lr-warmup-iters");
    if (t.lr_wsd_decay_samples)
      fail("--lr-wsd-decay-samples goes with --train-samples; with --train-iters use --lr-wsd-decay-iters");
    if (t.lr_warmup_fraction && t.lr_warmup_iters != 0)
      fail("can only specify one of --lr-warmup-fraction and --lr-warmup-iters");
    t.total_iters = *t.train_iters;
    const int64_t decay_iters = t.lr_decay_iters.value_or(*t.train_iters);
    t.lr_decay_steps = decay_iters * B;
    t.wd_incr_steps = *t.train_iters * B;
    if (t.lr_wsd_decay_iters) t.lr_wsd_decay_steps = *t.lr_wsd_decay_iters * B;
    t.lr_warmup_steps = t.lr_warmup_fraction ? *t.lr_warmup_fraction * static_cast<double>(t.lr_decay_steps)
                                             : static_cast<double>(t.lr_warmup_iters * B);
  } else {
    if (*t.train_samples < 0) fail("--train-samples must be >= 0 (got {})", *t.train_samples);
    if (*t.train_samples > kMaxSamples)
      fail("--train-samples {} is more than megatrain plans for (at most {}): check the value", *t.train_samples,
           kMaxSamples);
    if (t.lr_decay_iters) fail("--lr-decay-iters goes with --train-iters; with --train-samples use --lr-decay-samples");
    if (t.lr_warmup_iters != 0)
      fail("--lr-warmup-iters goes with --train-iters; with --train-samples use --lr-warmup-samples");
    if (t.lr_wsd_decay_iters)
      fail("--lr-wsd-decay-iters goes with --train-iters; with --train-samples use --lr-wsd-decay-samples");
    if (t.lr_warmup_fraction && t.lr_warmup_samples != 0)
      fail("can only specify one of --lr-warmup-fraction and --lr-warmup-samples");
    t.total_iters = *t.train_samples / B;  // Megatron's update_train_iters (constant batch)
    if (!t.batch_size_schedule.empty()) {
      // update_train_iters with a schedule: iterations until the scheduled batches reach the samples.
      t.total_iters = 0;
      int64_t consumed = 0;
      while (consumed < *t.train_samples) {
        // the iterations of the batch in force at `consumed`, up to the next threshold
        int64_t next = *t.train_samples;
        for (const auto& [threshold, batch] : t.batch_size_schedule)
          if (threshold > consumed) {
            next = std::min(next, threshold);
            break;
          }
        const int64_t b = t.global_batch_at(consumed);
        const int64_t n = (next - consumed + b - 1) / b;
        consumed += n * b;
        t.total_iters += n;
      }
    }
    t.lr_decay_steps = t.lr_decay_samples.value_or(*t.train_samples);
    t.wd_incr_steps = *t.train_samples;
    if (t.lr_wsd_decay_samples) t.lr_wsd_decay_steps = *t.lr_wsd_decay_samples;
    t.lr_warmup_steps = t.lr_warmup_fraction ? *t.lr_warmup_fraction * static_cast<double>(t.lr_decay_steps)
                                             : static_cast<double>(t.lr_warmup_samples);
  }
  // The validation samples are read (and indexed) like the training samples, under the same bound:
  // --eval-iters per evaluation, one evaluation per --eval-interval iterations and one at the end
  // (data/dataset_builder.cpp samples_per_split; counted in floating point, where int64 overflows).
  const double evaluations = static_cast<double>(t.evaluations(t.total_iters));
  const double eval_batch = t.eval_global_batch_size.value_or(t.global_batch);
  if (evaluations * t.eval_iters * eval_batch > static_cast<double>(kMaxSamples))
    fail("--eval-iters {} x {} evaluation{} (every --eval-interval iterations and at the end) x {} samples is more "
         "validation samples than megatrain plans for (at most {}): check the values", t.eval_iters, evaluations,
         evaluations == 1 ? "" : "s", eval_batch, kMaxSamples);
  if (t.weight_decay_incr_style == WeightDecayIncrStyle::constant) {
    if (t.start_weight_decay || t.end_weight_decay)
      fail("--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or cosine (constant uses "
           "--weight-decay)");
    t.start_weight_decay = t.weight_decay;
    t.end_weight_decay = t.weight_decay;
  } else if (!t.start_weight_decay || !t.end_weight_decay) {
    fail("--weight-decay-incr-style {} needs both --start-weight-decay and --end-weight-decay",
         t.weight_decay_incr_style == WeightDecayIncrStyle::linear ? "linear" : "cosine");
  }
}

void derive_vocab(CliState& st) {
  Config& c = st.cfg;
  DataConfig& d = c.data;
  ModelConfig& m = c.model;
  if (!d.tokenizer_type) d.tokenizer_type = "GPT2BPETokenizer";  // pretrain_gpt.py's args_defaults
  if (m.make_vocab_size_divisible_by < 1)
    fail("--make-vocab-size-divisible-by must be >= 1 (got {})", m.make_vocab_size_divisible_by);
  st.info(fmt::format("> building {} tokenizer ...", *d.tokenizer_type));
  const VocabInfo v = vocab_info(d);
  m.vocab_size = v.size;
  d.eod_id = v.eod;
  const std::string vocab = st.has("--vocab-size") ? fmt::format("--vocab-size {}", v.size)
                                                   : fmt::format("the tokenizer's vocabulary of {}", v.size);
  check_width(v.size, vocab);
  if (d.padded_vocab_size) {
    check_width(*d.padded_vocab_size, fmt::format("--padded-vocab-size {}", *d.padded_vocab_size));
    m.padded_vocab_size = *d.padded_vocab_size;
  } else {
    const int64_t multiple = static_cast<int64_t>(m.make_vocab_size_divisible_by) * c.parallel.tensor_model_parallel_size;
    const int64_t padded = (v.size + multiple - 1) / multiple * multiple;
    check_width(padded, fmt::format("{}, padded to {} (a multiple of --make-vocab-size-divisible-by {} x "
                                    "--tensor-model-parallel-size {}),", vocab, padded,
                                    m.make_vocab_size_divisible_by, c.parallel.tensor_model_parallel_size));
    m.padded_vocab_size = static_cast<int>(padded);
    st.info(fmt::format(" > padded vocab (size: {}) with {} dummy tokens (new size: {})", v.size, padded - v.size, padded));
  }
}

// The totals that the widths, depths and batch sizes give together (kMaxParameters,
// kMaxMicrobatchActivationBytes), from the derived shape, before anything is laid out.
void check_totals(const CliState& st) {
  const ModelConfig& m = st.cfg.model;
  const MoeConfig& e = m.moe;
  const double h = m.hidden_size, layers = m.num_layers, vocab = m.padded_vocab_size;
  const double moe_layers = e.enabled() ? static_cast<double>(std::count(e.moe_layer.begin(), e.moe_layer.end(), 1)) : 0;
  // The weight matrices of engine/param_count.h (biases and norms left out), in floating point.
  const double q = double(m.num_attention_heads) * m.head_dim, kv = double(m.query_groups) * m.head_dim;
  const double mlp_matrices = m.swiglu ? 3 : 2;  // fc1 (doubled by the SwiGLU gate) and fc2
  double params = vocab * h * (m.untie_embeddings_and_output_weights ? 2 : 1);
  if (m.position_embedding_type == PositionEmbedding::learned_absolute) params += double(m.max_position_embeddings) * h;
  params += layers * h * (q + 2 * kv + q);                                  // QKV and output projections
  params += (layers - moe_layers) * mlp_matrices * h * m.ffn_size;          // dense MLPs
  params += moe_layers * double(e.num_experts) * mlp_matrices * h * e.expert_ffn;  // the experts of MoE layers
  if (params > kMaxParameters) {
    const std::string experts =
        e.enabled() ? fmt::format(", --num-experts {} of size {}", e.num_experts, e.expert_ffn) : std::string();
    fail("--num-layers {}, --hidden-size {}, MLP size {}{} and a vocabulary of {} give at least {:.3g} parameters, more "
         "than megatrain plans for (at most 2^50 = {:.3g}, about 500 times the largest models trained): their weights, "
         "gradients and Adam states alone would need {}; check the sizes",
         m.num_layers, m.hidden_size, m.ffn_size, experts, m.padded_vocab_size, params, kMaxParameters,
         bytes_text(16 * params));
  }
  const TrainConfig& t = st.cfg.train;
  const double tokens = double(t.micro_batch_size) * m.seq_length;
  const double activations = 2 * tokens * (h * layers + vocab);
  if (activations > kMaxMicrobatchActivationBytes)
    fail("--micro-batch-size {} x --seq-length {} = {:.3g} tokens per micro-batch: with --hidden-size {} over "
         "--num-layers {} and a vocabulary of {}, their activations need at least {} (2 bytes a token for each layer's "
         "input and for each logit, over all ranks), more than megatrain plans for (at most 1 PiB per micro-batch): "
         "check the values", t.micro_batch_size, m.seq_length, tokens, m.hidden_size, m.num_layers, m.padded_vocab_size,
         bytes_text(activations));
}

}  // namespace

void derive(CliState& st) {
  derive_model_shape(st);
  derive_parallel(st);
  derive_moe(st);
  derive_linear_attention(st);
  derive_no_rope(st);
  derive_mup(st);
  if (st.has("--data-path") && !st.cfg.data.split) {
    st.warn("Please specify --split when using --data-path. Using legacy default value of \"969, 30, 1\"");
    st.cfg.data.split = "969, 30, 1";
  }
  derive_batch(st);
  derive_precision(st);
  derive_schedule(st);
  if (st.recompute_activations) st.cfg.train.recompute_granularity = RecomputeGranularity::selective;
  // Megatron's deprecated --moe-layer-recompute: --recompute-granularity selective with "moe" among
  // the recomputed modules.
  if (st.cfg.model.moe.layer_recompute) {
    st.warn("--moe-layer-recompute is deprecated. Use --recompute-granularity selective --recompute-modules moe "
            "instead.");
    if (st.cfg.train.recompute_granularity == RecomputeGranularity::full)
      fail("Do not set --moe-layer-recompute with full recompute granularity (--recompute-granularity full)");
    st.cfg.train.recompute_granularity = RecomputeGranularity::selective;
  }
  if (st.cfg.train.recompute_granularity == RecomputeGranularity::selective && st.cfg.train.recompute_modules.empty())
    st.cfg.train.recompute_modules = {"core_attn"};
  if (st.cfg.model.moe.layer_recompute) {
    std::vector<std::string>& modules = st.cfg.train.recompute_modules;
    if (std::find(modules.begin(), modules.end(), "moe") == modules.end()) modules.push_back("moe");
  }
  derive_vocab(st);
  check_totals(st);
  const TrainConfig& t = st.cfg.train;
  if (t.batch_size_schedule.empty())
    st.info(fmt::format("setting number of microbatches to constant {}", t.num_microbatches));
}

}  // namespace mt::cli

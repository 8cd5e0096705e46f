// ModelDims: the shapes of one pipeline stage's model on one tensor-parallel rank, computed once
// from the Config and the rank's coordinates (nothing downstream divides by TP again).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/config.h"
#include "engine/activation.h"
#include "parallel/rank_position.h"

namespace mt {

struct ParallelState;
struct GdnShape;

struct ModelDims : RankPosition {
  // Global sizes.
  int num_layers = 0, hidden = 0, heads = 0, groups = 0, head_dim = 0, ffn = 0;
  int vocab = 0;  // padded vocabulary
  int max_positions = 0, seq = 0, micro_batch = 0;

  // This rank: its position (RankPosition, the base: TP, CP, pipeline, the experts' grid), and
  // what of the model it holds.
  int layer_begin = 0, layer_end = 0;  // global layer indices owned by this pipeline stage
  bool first_stage = true, last_stage = true;
  bool pipeline = false;  // PP > 1 (the last stage keeps its own copy of tied output weights)
  // --sequence-parallel with TP > 1: the residual stream, norms and dropout hold this rank's
  // 1/TP of the token rows (rows are sequence-major, so a shard is a contiguous block of s/TP
  // positions of every sample); the TP region in between works on all rows.
  bool sequence_parallel = false;
  // Context parallelism (--context-parallel-size CP > 1): the sequence is split into 2 CP chunks of
  // seq / 2 positions and this rank holds two of them, chunk cp_rank, then chunk 2 CP - 1 - cp_rank
  // (Megatron's load-balanced split for causal attention); `seq` is this rank's part, seq_length /
  // CP. cp_comm: each global layer's key/value exchange (--cp-comm-type).
  std::vector<CpCommType> cp_comm;
  int cp_a2a_size = 1;  // a2a+p2p: the all-to-all's group (--hierarchical-context-parallel-sizes' first)
  int64_t seq_total() const { return static_cast<int64_t>(seq) * cp_size; }
  // The global position of this rank's local position t (of seq).
  int64_t global_position(int64_t t) const {
    if (cp_size == 1) return t;
    const int64_t c = seq / 2;
    const int64_t chunk = t < c ? cp_rank : 2 * int64_t{cp_size} - 1 - cp_rank;
    return chunk * c + t % c;
  }

  // Architecture.
  Normalization norm = Normalization::layernorm;
  float norm_eps = 1e-5f;
  bool norm_1p = false;
  bool swiglu = false;  // a gated MLP ([gate | up] fc1, of width 2f): --swiglu or --quick-geglu
  Glu glu;              // its unit (engine/activation.h): SwiGLU by default
  bool gelu_tanh = false;
  bool squared_relu = false;  // --squared-relu: relu(x)^2 instead of GeLU
  bool linear_bias = true;  // all linears
  bool qkv_bias = true;     // linear_qkv (--add-qkv-bias or linear_bias)
  bool qk_norm = false;  // --qk-layernorm or --qk-l2-norm: q and k heads normalized before RoPE
  bool qk_l2 = false;    // --qk-l2-norm: Megatron's L2Norm, RMS normalization without weights
  // --apply-wd-to-qk-layernorm: the q/k layernorm parameters get weight decay (ParamDesc::weight_decay).
  bool qk_norm_weight_decay = false;
  // --attention-output-gate: the QKV projection's rows per query group are [q | gate | k | v]; the
  // attention output is multiplied by sigmoid(gate).
  bool output_gate = false;
  // --softmax-type: softmax layers' attention sinks (Backend::attention_sink_forward); learnable:
  // a parameter self_attention.core_attention.softmax_offset [heads] per softmax layer.
  SoftmaxType softmax = SoftmaxType::vanilla;
  bool sinks() const { return softmax != SoftmaxType::vanilla; }
  bool tied_embeddings = true;
  PositionEmbedding position = PositionEmbedding::learned_absolute;
  int rot_dim = 0;  // rotated dims per head (rope)
  bool rope_interleaved = false;
  // Multi-latent attention (--multi-latent-attention; engine/blocks/mla.cpp). The attention core
  // then sees heads of head_dim = mla_nope + mla_rope values (groups = heads) and values padded to
  // that width with zeros: q from the input (q_lora = 0) or from a norm of its rank-q_lora
  // projection; [c_kv | k_rope] (kv_lora + mla_rope) from the input; k and v per head from a norm
  // of c_kv; k_rope (rot_dim values turned by RoPE) shared by the heads. softmax_scale: Megatron's
  // mscale^2 / sqrt(head_dim) (0: 1 / sqrt(head_dim)).
  bool mla = false;
  int q_lora = 0, kv_lora = 0, mla_nope = 0, mla_rope = 0, mla_v = 0;
  bool mla_latent_norm = false;  // --qk-layernorm: the latents (and without q_lora the q input) normalized
  float softmax_scale = 0;
  int mla_q_width_local() const { return heads_local() * head_dim; }
  int mla_kv_width_local() const { return heads_local() * (mla_nope + mla_v); }
  int mla_down_width() const { return kv_lora + mla_rope; }
  int proj_width_local() const { return mla ? heads_local() * mla_v : attn_width_local(); }
  // Gated DeltaNet (--experimental-attention-variant gated_delta_net; engine/blocks/gdn.cpp): the
  // global layers linear_layer marks replace softmax attention with it; its heads (global counts)
  // and the causal convolution's width. gdn_shape() gives this rank's layouts (backend.h GdnShape).
  int gdn_key_heads = 0, gdn_value_heads = 0, gdn_dk = 0, gdn_dv = 0, gdn_conv = 0;
  std::vector<char> linear_layer;
  // --no-rope-freq: the global layers (MTP depths after them) whose attention skips the rotary embedding.
  std::vector<char> nope_layer;
  bool is_nope(int layer) const {
    return layer >= 0 && static_cast<size_t>(layer) < nope_layer.size() && nope_layer[layer];
  }
  bool is_gdn(int layer) const {
    return layer >= 0 && static_cast<size_t>(layer) < linear_layer.size() && linear_layer[layer];
  }
  bool any_gdn() const {
    for (int l = layer_begin; l < layer_end; ++l)
      if (is_gdn(l)) return true;
    return false;
  }
  bool any_softmax_attention() const {
    for (int l = layer_begin; l < layer_end; ++l)
      if (!is_gdn(l)) return true;
    return false;
  }
  // The input projection's rows (global): per key head [q | k | v | z | beta | alpha].
  int64_t gdn_proj_width() const {
    const int64_t rep = gdn_key_heads > 0 ? gdn_value_heads / gdn_key_heads : 0;
    return int64_t{gdn_key_heads} * (2 * int64_t{gdn_dk} + 2 * rep * gdn_dv + 2 * rep);
  }
  int64_t gdn_conv_width() const {
    const int64_t rep = gdn_key_heads > 0 ? gdn_value_heads / gdn_key_heads : 0;
    return int64_t{gdn_key_heads} * (2 * int64_t{gdn_dk} + rep * gdn_dv);
  }
  int64_t gdn_value_width() const { return int64_t{gdn_value_heads} * gdn_dv; }
  GdnShape gdn_shape() const;
  // Multi-token prediction (--mtp-num-layers; engine/blocks/mtp.cpp): the chunk with the output
  // layer also holds the mtp layers, global numbers num_layers .. num_layers + mtp - 1, after its
  // decoder layers; each is a decoder layer like the last one (MoE if that one is), with its own
  // norms and input projection. mtp_scale: --mtp-loss-scaling-factor / mtp.
  int mtp = 0;
  float mtp_scale = 0;
  int decoder_end() const { return layer_end < num_layers ? layer_end : num_layers; }
  int decoder_layers() const { return decoder_end() > layer_begin ? decoder_end() - layer_begin : 0; }
  int stage_mtp_layers() const { return layer_end - (decoder_end() > layer_begin ? decoder_end() : layer_begin); }
  bool is_mtp(int layer) const { return layer >= num_layers; }
  // Per global layer: the sliding window (AttentionShape::window_left), -1 for full attention.
  std::vector<int> window_left;

  // Mixture of experts (--num-experts; engine/blocks/moe.cpp): moe_layer[l] marks the global
  // layers whose MLP is an MoE block of `experts` SwiGLU (or GeLU...) experts of width expert_ffn,
  // top-k routing, and optionally a shared expert of width shared_ffn (with a sigmoid gate).
  int experts = 0, topk = 0, expert_ffn = 0, shared_ffn = 0;
  bool shared_gate = false;
  MoeScoreFunction moe_score = MoeScoreFunction::softmax;
  bool moe_pre_softmax = false;
  float moe_scaling = 0;
  int moe_groups = 0, moe_group_topk = 0;
  // The load-balancing losses' coefficients (0: the term is not computed), any of them together
  // (--moe-router-load-balancing-type takes a list): aux_loss (the micro-batch's counts and
  // scores), seq_aux_loss (each sequence's own, averaged over the micro_batch sequences),
  // global_aux_loss (the counts summed over DP, averaged over this step's micro-batches so far,
  // with this rank's scores over the DP x CP tokens), and the z-loss.
  float moe_aux_coeff = 0, moe_seq_coeff = 0, moe_global_coeff = 0, moe_z_coeff = 0;
  // Whether any of them is computed (the router keeps its load-balancing statistics).
  bool moe_aux_terms() const {
    return moe_aux_coeff != 0 || moe_seq_coeff != 0 || moe_global_coeff != 0 || moe_z_coeff != 0;
  }
  // --moe-router-force-load-balancing (benchmarks): the router's logits replaced by standard normal
  // values (the same on a micro-batch's TP ranks), their gradient passed straight to the router
  // (Megatron's RandomSTE).
  bool moe_force_balance = false;
  // --moe-router-force-biased (benchmarks): random logits as above plus a per-expert bias drawn
  // from N(0, |std|), the same on every rank: std > 0 drawn anew for each training micro-batch and layer,
  // std < 0 once per layer for the whole run (Megatron's apply_biased_logits).
  std::optional<float> moe_force_bias;
  float moe_jitter_eps = 0;  // --moe-input-jitter-eps (0: none)
  // Logged, as Megatron-LM's training loop names them: load_balancing_loss ("aux_loss" in the
  // type: with one type a substring test, so seq_aux_loss and global_aux_loss print it too, 0 when
  // no aux_loss term runs), seq_load_balancing_loss, global_load_balancing_loss, z_loss
  // (--moe-z-loss-coeff given).
  bool moe_log_aux = false, moe_log_seq = false, moe_log_global = false, moe_log_z = false;
  // --moe-per-layer-logging: each layer's values too (TensorBoard's moe/<name>_layer_<i>).
  bool moe_per_layer_logging = false;
  // --moe-router-dtype fp32: the gating GEMM and the routing in float32 whatever the compute dtype
  // (Megatron casts the router's input and weight to it).
  bool moe_router_fp32 = false;
  // --moe-router-load-balancing-type sinkhorn: the experts chosen by Sinkhorn load balancing
  // (Backend::moe_sinkhorn_route) instead of moe_route's rule.
  bool moe_sinkhorn = false;
  // --moe-expert-capacity-factor (token dropping; negative: dropless): each expert takes at most
  // ceil(rows * k / E * factor) of the pairs routed to it among the rows one rank routes (its
  // sequence-parallel shard), keeping the largest weights or (moe_drop_by_position) the first rows.
  double moe_capacity_factor = -1;
  // --moe-router-enable-expert-bias (aux-loss-free balancing, sigmoid scoring): a float32 bias per
  // expert added to the scores for the choice only, moved by moe_bias_rate towards balance after
  // every step (GptModel::update_expert_bias).
  bool moe_expert_bias = false;
  float moe_bias_rate = 0;
  bool moe_drop_by_position = false;
  // --moe-pad-expert-input-to-capacity: Megatron fills each expert's capacity with tokens of
  // routing weight 0 (the same results, which megatrain computes without the padding) and counts
  // every expert's whole capacity for the expert bias, which therefore does not move.
  bool moe_pad_to_capacity = false;
  bool moe_drops() const { return moe_capacity_factor >= 0; }
  bool moe_probs_on_input = false;  // --moe-apply-probs-on-input: p x the expert's input, not its activation
  // --moe-token-dispatcher-type alltoall or flex: under expert parallelism each rank sends its
  // (token, slot) pairs to their experts' ranks and takes the outputs back (all-to-all), instead
  // of all-gathering the group's tokens (allgather, Megatron's default).
  bool moe_alltoall = false;
  // Whether that all-to-all applies to experts split over `etp` of the `tp` ranks: every member of
  // the dispatch group must hold experts of its own (ETP = TP, or 1); otherwise the all-gather runs.
  static bool moe_alltoall_applies(int tp, int etp) { return etp == tp || etp == 1; }
  int64_t moe_capacity() const;  // per expert, per block of tokens_local() rows
  std::vector<char> moe_layer;
  bool is_moe(int layer) const {
    return experts > 0 && layer >= 0 && static_cast<size_t>(layer) < moe_layer.size() && moe_layer[layer];
  }
  bool any_moe() const {
    for (int l = layer_begin; l < layer_end; ++l)
      if (is_moe(l)) return true;
    return false;
  }
  // Expert parallelism (--expert-model-parallel-size): this rank holds experts [expert_begin(),
  // expert_begin() + experts_local()) of every MoE layer; ep_rank is its place in the EP group.
  int experts_local() const { return experts / ep_size; }
  int expert_begin() const { return ep_rank * experts_local(); }
  // The experts' tensor-parallel size (--expert-tensor-parallel-size): TP (the experts split over
  // the TP ranks as the dense MLP is; every TP rank dispatches all rows), or a divisor of TP
  // (Megatron's parallel folding: each rank dispatches its own sequence-parallel rows over the
  // experts' tp x ep group, which spans TP ranks): etp_size, etp_rank.
  bool experts_local_rows() const { return etp_size < tp_size; }
  // Whether the experts have a grid of their own (Megatron's parallel folding): their
  // data-parallel group then differs from the dense one.
  bool experts_own_grid() const { return experts > 0 && (ep_size > 1 || etp_size != tp_size); }
  int expert_fc1_width() const { return (swiglu ? 2 : 1) * expert_ffn; }
  int shared_fc1_width() const { return (swiglu ? 2 : 1) * shared_ffn; }
  // Per rank (the experts split over their TP size, the shared expert over TP as the dense MLP is).
  int expert_ffn_local() const { return expert_ffn / etp_size; }
  int expert_fc1_width_local() const { return expert_fc1_width() / etp_size; }
  int shared_ffn_local() const { return shared_ffn / tp_size; }
  int shared_fc1_width_local() const { return shared_fc1_width() / tp_size; }

  float attention_dropout = 0, hidden_dropout = 0;
  float init_std = 0.02f, output_init_std = 0.02f, embedding_init_std = 0.02f;
  float output_layer_init_std = 0.02f;  // an untied output layer's (MuP: the embeddings')
  // --use-mup: the embeddings' output and the logits are multiplied by these; `mup` marks the
  // hidden matrices for their optimizer group (ParamDesc::mup_hidden).
  bool mup = false;
  float embedding_mult = 1.0f, logits_mult = 1.0f;
  uint64_t seed = 1234;

  // Local (per TP rank) sizes.
  int heads_local() const { return heads / tp_size; }
  int groups_local() const { return groups / tp_size; }
  int ffn_local() const { return ffn / tp_size; }
  int vocab_local() const { return vocab / tp_size; }
  int64_t vocab_start() const { return static_cast<int64_t>(tp_rank) * vocab_local(); }
  int qkv_width_local() const { return groups_local() * (heads / groups + 2) * head_dim; }
  int qkv_width() const { return groups * (heads / groups + 2) * head_dim; }
  // The QKV projection's output: the attention's qkv, and with the output gate one gate per query head.
  int qkv_proj_width_local() const { return qkv_width_local() + (output_gate ? attn_width_local() : 0); }
  int qkv_proj_width() const { return qkv_width() + (output_gate ? heads * head_dim : 0); }
  int fc1_width_local() const { return (swiglu ? 2 : 1) * ffn_local(); }
  // The MLP activation, and the elementwise one of an ungated MLP (GeLU or squared ReLU).
  MlpActivation mlp_activation() const {
    return swiglu         ? MlpActivation::swiglu
           : squared_relu ? MlpActivation::squared_relu
           : gelu_tanh    ? MlpActivation::gelu_tanh
                          : MlpActivation::gelu;
  }
  Activation ungated_mlp_activation() const { return ungated_activation(mlp_activation()); }
  int attn_width_local() const { return heads_local() * head_dim; }
  int64_t tokens() const { return static_cast<int64_t>(micro_batch) * seq; }  // rows N of a micro-batch
  // Rows of the residual stream on this rank: N, or N/TP with sequence parallelism; they start at
  // row local_row_begin() of the micro-batch.
  int64_t tokens_local() const { return sequence_parallel ? tokens() / tp_size : tokens(); }
  int64_t local_row_begin() const { return sequence_parallel ? tp_rank * tokens_local() : 0; }
  int stage_layers() const { return layer_end - layer_begin; }

  // From the run's flags for the rank at `r` (a ParallelState, or RankPosition::of / stage /
  // split for ranks that do not exist). Layers are split evenly over the pipeline unless
  // layer_range is given (the pipeline code decides uneven splits).
  static ModelDims from_config(const Config& cfg, const RankPosition& r,
                               std::optional<std::pair<int, int>> layer_range = std::nullopt);
  // One model chunk of that rank (parallel/pipeline_layout.h): its layers, and whether it holds
  // the embedding (first_stage) and the output layer and loss (last_stage). With an interleaved
  // pipeline a rank holds several chunks.
  static ModelDims for_chunk(const Config& cfg, const RankPosition& r, int first_layer, int num_layers,
                             bool has_embedding, bool has_output);
};

}  // namespace mt

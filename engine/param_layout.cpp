#include "engine/param_layout.h"

#include <cmath>

#include "core/philox.h"
#include "engine/backend.h"

namespace mt {

uint64_t ParamDesc::init_key(uint64_t seed) const { return mix_key(seed, fnv1a64(init_name.c_str())); }

namespace {

struct Builder {
  const ModelDims& d;
  std::vector<ParamDesc> out;
  int64_t offset = 0;

  ParamDesc& add(std::string name, std::vector<int64_t> shape, ShardIndex shard, InitKind init, float std,
                 bool tp_duplicated, int layer) {
    ParamDesc p;
    p.name = name;
    p.init_name = std::move(name);
    p.global_shape = std::move(shape);
    p.shard = shard;
    p.init = init;
    p.init_std = std;
    p.tp_duplicated = tp_duplicated && d.tp_size > 1;
    // Megatron's default param groups: no weight decay on 1-D parameters and biases; with
    // --apply-wd-to-qk-layernorm the q/k layernorm parameters keep it (megatron/core/optimizer/
    // __init__.py, get_standard_config_overrides).
    const bool qk_norm_param =
        p.name.find("q_layernorm.") != std::string::npos || p.name.find("k_layernorm.") != std::string::npos;
    p.weight_decay = !(p.global_shape.size() == 1 || p.name.ends_with(".bias")) ||
                     (d.qk_norm_weight_decay && qk_norm_param);
    p.layer = layer;
    p.offset = offset;
    offset += (p.numel() + kParamAlignment - 1) / kParamAlignment * kParamAlignment;
    out.push_back(std::move(p));
    return out.back();
  }

  // Whole tensor on every rank.
  ShardIndex whole(int64_t rows, int64_t cols = 1) const { return ShardIndex::whole(rows, cols); }
  // Rows split over TP (column-parallel weights and biases, vocab-parallel embeddings); over `size`
  // ranks (this one: `rank`) for the experts, whose TP size may differ.
  ShardIndex rows(int64_t rows, int64_t cols = 1, int64_t chunks = 1) const {
    return rows_over(rows, cols, chunks, d.tp_size, d.tp_rank);
  }
  ShardIndex rows_over(int64_t rows, int64_t cols, int64_t chunks, int size, int rank) const {
    const int64_t per_chunk = rows / chunks, local = per_chunk / size;
    return ShardIndex{rows, cols, rank * local, 0, local, cols, chunks};
  }
  // Columns split over TP (row-parallel weights).
  ShardIndex cols(int64_t rows, int64_t cols) const { return cols_over(rows, cols, d.tp_size, d.tp_rank); }
  ShardIndex cols_over(int64_t rows, int64_t cols, int size, int rank) const {
    const int64_t local = cols / size;
    return ShardIndex{rows, cols, 0, rank * local, rows, local, 1};
  }

  // tp_partial: whether TP ranks hold partial gradients of this norm (see ParamDesc).
  void norm(const std::string& prefix, const std::string& weight_name, const std::string& bias_name, int64_t width,
            int layer, bool tp_partial) {
    add(prefix + weight_name, {width}, whole(width), d.norm_1p ? InitKind::zeros : InitKind::ones, 0, true, layer)
        .tp_partial_grad = tp_partial;
    if (d.norm == Normalization::layernorm)
      add(prefix + bias_name, {width}, whole(width), InitKind::zeros, 0, true, layer).tp_partial_grad = tp_partial;
  }

  // --softmax-type learnable: a sink logit per head of a softmax layer, split over TP with the heads
  // (Megatron: config.init_method; 1-D, so no weight decay).
  void sinks(const std::string& p, int l) {
    if (d.softmax == SoftmaxType::learnable)
      add(p + "self_attention.core_attention.softmax_offset", {d.heads}, rows(d.heads), InitKind::normal, d.init_std,
          false, l);
  }

  // Multi-latent attention's parameters before linear_proj (Megatron-Core's MLASelfAttention with
  // Transformer Engine's layer specs): a standalone input norm; the query projection (direct, or
  // down to q_lora, normed by the up projection's fused norm, and up), the key/value down
  // projection [c_kv | k_rope] and the up projection from the normed c_kv to [k_nope | v] per head.
  // Down projections are whole on every TP rank; their gradients (and the latent norms', whose
  // inputs every TP rank holds whole while each takes only its heads' gradient) are TP-partial.
  // Heads are rows of the up projections: [n, d_nope + d_rope] and [n, d_nope + d_v].
  void mla_attention(const std::string& p, int l) {
    const int64_t h = d.hidden, n = d.heads, dq = d.mla_nope + d.mla_rope, dkv = d.mla_nope + d.mla_v;
    const bool partial = d.tp_size > 1;
    norm(p, "input_layernorm.weight", "input_layernorm.bias", h, l, d.sequence_parallel);
    sinks(p, l);
    if (d.q_lora > 0) {
      add(p + "self_attention.linear_q_down_proj.weight", {d.q_lora, h}, whole(d.q_lora, h), InitKind::normal,
          d.init_std, true, l).tp_partial_grad = partial;
      if (d.mla_latent_norm)
        norm(p, "self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.linear_q_up_proj.layer_norm_bias",
             d.q_lora, l, partial);
      add(p + "self_attention.linear_q_up_proj.weight", {n * dq, d.q_lora}, rows(n * dq, d.q_lora), InitKind::normal,
          d.init_std, false, l);
    } else {
      if (d.mla_latent_norm)
        norm(p, "self_attention.linear_q_proj.layer_norm_weight", "self_attention.linear_q_proj.layer_norm_bias", h, l,
             partial);
      add(p + "self_attention.linear_q_proj.weight", {n * dq, h}, rows(n * dq, h), InitKind::normal, d.init_std, false,
          l);
    }
    add(p + "self_attention.linear_kv_down_proj.weight", {d.mla_down_width(), h}, whole(d.mla_down_width(), h),
        InitKind::normal, d.init_std, true, l).tp_partial_grad = partial;
    if (d.mla_latent_norm)
      norm(p, "self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.linear_kv_up_proj.layer_norm_bias",
           d.kv_lora, l, partial);
    add(p + "self_attention.linear_kv_up_proj.weight", {n * dkv, d.kv_lora}, rows(n * dkv, d.kv_lora),
        InitKind::normal, d.init_std, false, l);
  }

  // A Gated DeltaNet layer's attention block (Megatron-Core's GatedDeltaNet, in its registration
  // order): the input norm fused into the input projection, the projection (rows per key head [q |
  // k | v | z | beta | alpha], so that TP splits it by key heads; Megatron keeps the six parts
  // apart in its checkpoints), the depthwise convolution's taps per channel (PyTorch's Conv1d
  // default init: U(-1/sqrt(K), 1/sqrt(K))), dt_bias (ones), A_log (log U(1, 16)), the output norm
  // over one value head (shared by the heads: TP-partial) and the output projection.
  void gdn_attention(const std::string& p, int l) {
    const int64_t h = d.hidden, P = d.gdn_proj_width(), C = d.gdn_conv_width(), nv = d.gdn_value_heads;
    norm(p, "self_attention.in_proj.layer_norm_weight", "self_attention.in_proj.layer_norm_bias", h, l,
         d.sequence_parallel);
    add(p + "self_attention.in_proj.weight", {P, h}, rows(P, h), InitKind::normal, d.init_std, false, l);
    ParamDesc& conv = add(p + "self_attention.conv1d.weight", {C, d.gdn_conv}, rows(C, d.gdn_conv), InitKind::uniform,
                          0, false, l);
    conv.init_hi = 1.0f / std::sqrt(static_cast<float>(d.gdn_conv));
    conv.init_lo = -conv.init_hi;
    conv.muon_excluded = true;
    add(p + "self_attention.dt_bias", {nv}, rows(nv), InitKind::ones, 0, false, l);
    ParamDesc& a_log = add(p + "self_attention.A_log", {nv}, rows(nv), InitKind::log_uniform, 0, false, l);
    a_log.init_lo = 1.0f;
    a_log.init_hi = 16.0f;
    norm(p, "self_attention.out_norm.weight", "self_attention.out_norm.bias", d.gdn_dv, l, d.tp_size > 1);
    add(p + "self_attention.out_proj.weight", {h, d.gdn_value_width()}, cols(h, d.gdn_value_width()),
        InitKind::normal, d.output_init_std, false, l);
  }

  // An MoE layer's MLP (Megatron-Core's MoELayer, --moe-grouped-gemm names): a standalone
  // pre-MLP norm, the router, the experts' fc1 and fc2 stacked along their rows (expert e owns
  // rows [e * rows, (e+1) * rows) of its layer's weight, gate and up halves per expert with
  // SwiGLU), and the shared expert (a dense MLP, optionally gated).
  //
  // Under expert parallelism a rank holds experts [expert_begin, + experts_local): the fc1 chunks
  // (gate, up) of those experts, split inside each over the experts' TP size, and the fc2 rows of
  // those experts.
  void moe_layer(const std::string& p, int l) {
    const int64_t h = d.hidden, E = d.experts, fe = d.expert_ffn, fc1 = d.expert_fc1_width();
    const int64_t halves = d.swiglu ? 2 : 1, El = d.experts_local(), e0 = d.expert_begin();
    norm(p, "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias", h, l, d.sequence_parallel);
    add(p + "mlp.router.weight", {E, h}, whole(E, h), InitKind::normal, d.init_std, true, l).tp_partial_grad =
        d.sequence_parallel;
    // (With linear biases the router has one, drawn by Megatron's init_method as its weight is.)
    if (d.linear_bias)
      add(p + "mlp.router.bias", {E}, whole(E), InitKind::normal, d.init_std, true, l).tp_partial_grad =
          d.sequence_parallel;
    ShardIndex fc1_block = rows_over(E * fc1, h, E * halves, d.etp_size, d.etp_rank);
    fc1_block.chunk_offset = e0 * halves;
    fc1_block.chunk_count = El * halves;
    add(p + "mlp.experts.linear_fc1.weight", {E * fc1, h}, fc1_block, InitKind::normal, d.init_std, false, l).expert =
        true;
    ShardIndex fc2_block = cols_over(E * h, fe, d.etp_size, d.etp_rank);
    fc2_block.row_offset = e0 * h;
    fc2_block.local_rows = El * h;
    add(p + "mlp.experts.linear_fc2.weight", {E * h, fe}, fc2_block, InitKind::normal, d.output_init_std, false, l)
        .expert = true;
    // The experts' linear biases (zeros, as Megatron's expert linears start; 1-D, so no weight
    // decay): fc1's [E * fc1] in fc1's chunks, fc2's [E * h], expert e's bias its e-th block.
    if (d.linear_bias) {
      ShardIndex fc1_bias = rows_over(E * fc1, 1, E * halves, d.etp_size, d.etp_rank);
      fc1_bias.chunk_offset = e0 * halves;
      fc1_bias.chunk_count = El * halves;
      add(p + "mlp.experts.linear_fc1.bias", {E * fc1}, fc1_bias, InitKind::zeros, 0, false, l).expert = true;
      ShardIndex fc2_bias = whole(E * h);
      fc2_bias.row_offset = e0 * h;
      fc2_bias.local_rows = El * h;
      add(p + "mlp.experts.linear_fc2.bias", {E * h}, fc2_bias, InitKind::zeros, 0, false, l).expert = true;
    }
    if (d.shared_ffn > 0) {
      const int64_t fs = d.shared_ffn, fc1s = d.shared_fc1_width();
      add(p + "mlp.shared_experts.linear_fc1.weight", {fc1s, h}, rows(fc1s, h, halves), InitKind::normal, d.init_std,
          false, l);
      add(p + "mlp.shared_experts.linear_fc2.weight", {h, fs}, cols(h, fs), InitKind::normal, d.output_init_std, false,
          l);
      if (d.shared_gate)
        add(p + "mlp.shared_experts.gate_weight", {1, h}, whole(1, h), InitKind::normal, d.init_std, true, l)
            .tp_partial_grad = d.sequence_parallel;
    }
  }
};

}  // namespace

std::vector<ParamDesc> build_param_descs(const ModelDims& d, int64_t* total_elements) {
  Builder b{d, {}, 0};
  const int64_t h = d.hidden, V = d.vocab;
  if (d.first_stage) {
    ParamDesc& wte = b.add("embedding.word_embeddings.weight", {V, h}, b.rows(V, h), InitKind::normal,
                           d.embedding_init_std, false, -1);
    wte.decoupled_lr = true;
    if (d.position == PositionEmbedding::learned_absolute)
      b.add("embedding.position_embeddings.weight", {d.max_positions, h}, b.whole(d.max_positions, h),
            InitKind::normal, d.embedding_init_std, true, -1);
  }
  const int64_t qkv_rows = d.qkv_proj_width(), attn = static_cast<int64_t>(d.heads) * d.head_dim;
  const int64_t fc1_rows = (d.swiglu ? 2 : 1) * static_cast<int64_t>(d.ffn), chunks = d.swiglu ? 2 : 1;
  for (int l = d.layer_begin; l < d.layer_end; ++l) {
    // An mtp layer (Megatron-Core's MultiTokenPredictionLayer, its checkpoint names): the norms of the
    // embedding and of the hidden state, their projection [h, 2h] (column-parallel), the decoder
    // layer as transformer_layer, then its final norm.
    const std::string mtp = "mtp.layers." + std::to_string(l - d.num_layers) + ".";
    const std::string p = d.is_mtp(l) ? mtp + "transformer_layer." : "decoder.layers." + std::to_string(l) + ".";
    if (d.is_mtp(l)) {
      b.norm(mtp, "enorm.weight", "enorm.bias", h, l, d.sequence_parallel);
      b.norm(mtp, "hnorm.weight", "hnorm.bias", h, l, d.sequence_parallel);
      b.add(mtp + "eh_proj.weight", {h, 2 * h}, b.rows(h, 2 * h), InitKind::normal, d.init_std, false, l);
    }
    if (d.is_gdn(l)) {
      b.gdn_attention(p, l);
    } else if (d.mla) {
      b.mla_attention(p, l);
    } else {
      b.norm(p, "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias", h, l,
             d.sequence_parallel);
      b.add(p + "self_attention.linear_qkv.weight", {qkv_rows, h}, b.rows(qkv_rows, h), InitKind::normal, d.init_std,
            false, l);
      if (d.qkv_bias)
        b.add(p + "self_attention.linear_qkv.bias", {qkv_rows}, b.rows(qkv_rows), InitKind::zeros, 0, false, l);
      b.sinks(p, l);
      if (d.qk_norm && !d.qk_l2) {  // (L2Norm has no weights)
        // Shared by all heads of a layer, and TP splits the heads.
        b.norm(p, "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias", d.head_dim, l, d.tp_size > 1);
        b.norm(p, "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias", d.head_dim, l, d.tp_size > 1);
      }
    }
    if (!d.is_gdn(l)) {
      const int64_t proj_cols = d.mla ? int64_t{d.heads} * d.mla_v : attn;
      b.add(p + "self_attention.linear_proj.weight", {h, proj_cols}, b.cols(h, proj_cols), InitKind::normal,
            d.output_init_std, false, l);
      if (d.linear_bias) b.add(p + "self_attention.linear_proj.bias", {h}, b.whole(h), InitKind::zeros, 0, true, l);
    }
    if (d.is_moe(l)) {
      b.moe_layer(p, l);
    } else {
      b.norm(p, "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias", h, l, d.sequence_parallel);
      b.add(p + "mlp.linear_fc1.weight", {fc1_rows, h}, b.rows(fc1_rows, h, chunks), InitKind::normal, d.init_std,
            false, l);
      if (d.linear_bias)
        b.add(p + "mlp.linear_fc1.bias", {fc1_rows}, b.rows(fc1_rows, 1, chunks), InitKind::zeros, 0, false, l);
      b.add(p + "mlp.linear_fc2.weight", {h, d.ffn}, b.cols(h, d.ffn), InitKind::normal, d.output_init_std, false, l);
      if (d.linear_bias) b.add(p + "mlp.linear_fc2.bias", {h}, b.whole(h), InitKind::zeros, 0, true, l);
    }
    if (d.is_mtp(l)) b.norm(mtp, "final_layernorm.weight", "final_layernorm.bias", h, l, d.sequence_parallel);
  }
  if (d.last_stage) {
    if (d.stage_mtp_layers() > 0 && !d.first_stage && !d.tied_embeddings) {
      // The mtp depths' word embeddings on a last pipeline stage with an untied output layer: a copy
      // of the first stage's, drawn from its stream and kept equal by the embedding group's
      // gradient all-reduce (Megatron's MTP stage keeps its own copy too).
      ParamDesc& copy = b.add("embedding.word_embeddings.weight", {V, h}, b.rows(V, h), InitKind::normal,
                              d.embedding_init_std, false, -1);
      copy.decoupled_lr = true;
      copy.shared_copy = true;
    }
    b.norm("decoder.", "final_layernorm.weight", "final_layernorm.bias", h, -1, d.sequence_parallel);
    if (!d.tied_embeddings) {
      ParamDesc& out =
          b.add("output_layer.weight", {V, h}, b.rows(V, h), InitKind::normal, d.output_layer_init_std, false, -1);
      out.decoupled_lr = true;
    } else if (!d.first_stage) {
      // Tied embeddings across pipeline stages: the last stage keeps a copy, drawn from the same
      // stream as the word embeddings (so both start equal) and kept equal by the embedding
      // group's gradient all-reduce.
      ParamDesc& out = b.add("output_layer.weight", {V, h}, b.rows(V, h), InitKind::normal, d.embedding_init_std,
                             false, -1);
      out.init_name = "embedding.word_embeddings.weight";
      out.decoupled_lr = true;
      out.shared_copy = true;
    }
  }
  // MuP's hidden matrix-like parameters (Megatron's get_mup_config_overrides): all but the 1-D
  // ones, the embeddings and the output layer.
  if (d.mup)
    for (ParamDesc& p : b.out)
      p.mup_hidden = !p.is_1d() && !p.name.starts_with("embedding.") && p.name != "output_layer.weight";
  if (total_elements) *total_elements = b.offset;
  return std::move(b.out);
}

void init_param(Backend& be, const ParamDesc& p, Tensor w, uint64_t seed, bool random) {
  switch (p.init) {
    case InitKind::zeros: be.fill(w, 0.0); return;
    case InitKind::ones: be.fill(w, 1.0); return;
    case InitKind::normal:
    case InitKind::uniform:
    case InitKind::log_uniform: break;
  }
  if (!random) return be.fill(w, 0.0);
  if (p.init == InitKind::normal) return be.init_normal(w, p.init_key(seed), p.init_std, p.shard);
  be.init_uniform(w, p.init_key(seed), p.init_lo, p.init_hi, p.init == InitKind::log_uniform, p.shard);
}

int find_param(const std::vector<ParamDesc>& params, const std::string& name) {
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].name == name) return static_cast<int>(i);
  return -1;
}

}  // namespace mt

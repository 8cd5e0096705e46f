#include "engine/gpt_model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/error.h"
#include "core/master_remainder.h"
#include "core/philox.h"
#include "parallel/parallel_state.h"
#include "parallel/parallel_state_builder.h"

namespace mt {

// ---- pieces ------------------------------------------------------------------------------

struct GptModel::LayerParams {
  Tensor ln1_w, ln1_b, qkv_w, qkv_b, q_ln_w, q_ln_b, k_ln_w, k_ln_b, proj_w, proj_b, ln2_w, ln2_b, fc1_w, fc1_b,
      fc2_w, fc2_b;
};

// What a layer keeps from forward for backward. Statistics are in the accum dtype.
// Maybe not kept (the tensors below marked "shared" are then views of workspace buffers every
// layer reuses): the norm outputs (unless norm_kept: ModelOptions::keep_norm_outputs), recomputed
// in backward from the norm inputs and statistics by norm_backward_recompute, and the MLP
// activation (unless act_kept), recomputed from fc1_pre by the fused activation backward
// (linear_backward_input_recompute / swiglu_backward_recompute). Both are bit-identical to what
// forward computed. In FP8 layers with FP8 weight gradients the weight gradients take the inputs'
// FP8 copies kept from forward instead (fp8_xq_t), so neither is recomputed there.
struct GptModel::LayerActs {
  Tensor ln1_out, ln1_mean, ln1_rstd;  // input norm (ln1_out shared unless norm_kept)
  Tensor qkv_raw, qk_mean, qk_rstd;    // --qk-layernorm only: the un-normalized QKV
  Tensor qkv;                          // attention input (after bias, qk norm, rope)
  Tensor attn_out, lse;                // attention output [N, heads*d] and its log-sum-exp
  Tensor h1;                           // residual after attention
  Tensor ln2_out, ln2_mean, ln2_rstd;  // pre-MLP norm (ln2_out shared unless norm_kept)
  bool norm_kept = false;              // ln1_out and ln2_out are this layer's own
  Tensor fc1_pre, fc1_act;             // fc1 output before / after the activation (fc1_act shared
                                       // unless act_kept); backward overwrites fc1_pre (SwiGLU: with
                                       // its gradient; GeLU: with the activation, unless fp8_xq_t
                                       // or fc1_act is kept)
  bool act_kept = false;               // fc1_act is this layer's own (keeps_gelu_activation)
  Tensor out;                          // layer output (the next layer's input)
  // FP8 layers with FP8 weight gradients (GptModel::fp8_kept_inputs): the four linear inputs
  // (ln1_out, attn_out, ln2_out, fc1_act; all N rows) as the forward's cast quantized them,
  // transposed [K, N] for the weight-gradient GEMMs, per Fp8State::Gemm. Tensorwise scaling also
  // keeps those casts' scale_inv [4]: a later micro-batch's forward rewrites the state's.
  Tensor fp8_xq_t[Fp8State::kGemms];
  Tensor fp8_x_scale_inv;
};

struct GptModel::Slot {
  Tensor tokens, labels, positions, mask, dloss;  // [N] (int32 / accum)
  Tensor input;                                   // stage input [N, h]
  std::vector<LayerActs> layers;                  // per local layer
  Tensor d_output;                                // grad of the stage output [N, h]
  // The five inputs live in one device block (`io`) mirrored by one host buffer, so that staging
  // a micro-batch is a single host->device copy. Byte offsets of each part in both:
  Tensor io;
  std::vector<unsigned char> host_io;
  size_t off_tokens = 0, off_labels = 0, off_positions = 0, off_mask = 0, off_dloss = 0;
  uint64_t key = 0;
  bool training = true;
  bool staged = false;
};

struct GptModel::Globals {
  Tensor wte, wpe, final_w, final_b, out_w;     // params (out_w: the tied wte when shared on this stage)
  Tensor dwte, dwpe, dfinal_w, dfinal_b, dout_w;
};

struct GptModel::Workspace {
  Tensor tmp_h;                       // [N, h] row-parallel output before its reduction; also the
                                      // norm outputs ln1_out, ln2_out where not kept (gathered to
                                      // all rows with SP): each is dead before tmp_h is written again
  Tensor gA, gB, gH;                  // [Nl, h] gradients of the residual stream
  Tensor gT;                          // [N, h] column-parallel input gradients, d_fc2 / d_proj with SP
  Tensor act;                         // [N, f] MLP activation (fc2's input); in backward the
                                      // recomputed activation (SwiGLU: first the gradient d fc2 / d act)
  Tensor gFC;                         // GeLU only: fc1's output gradient, the same memory as act
                                      // (SwiGLU's takes the place of fc1_pre)
  Tensor gQKV, gATT;                  // attention backward, in act's block (see layout)
  Tensor logits;                      // [logits_rows, V/tp] one chunk of rows (dlogits in place)
  Tensor y, fmean, frstd;             // final norm output and statistics
  Tensor lse_part, lse_parts, lse, target, loss;  // [N] / [tp, N] accum
};

RecomputePlan RecomputePlan::from_config(const TrainConfig& t, int stage_layers) {
  RecomputePlan p;
  p.group_of.assign(static_cast<size_t>(stage_layers), -1);
  if (t.recompute_granularity != RecomputeGranularity::full) return p;
  if (t.recompute_method == RecomputeMethod::none || !t.recompute_num_layers)
    fail("--recompute-granularity full needs --recompute-method (uniform|block) and --recompute-num-layers");
  const int n = *t.recompute_num_layers;
  if (n < 1) fail("--recompute-num-layers must be >= 1 (got {})", n);
  if (t.recompute_method == RecomputeMethod::uniform) {
    for (int b = 0; b < stage_layers; b += n) p.groups.emplace_back(b, std::min(stage_layers, b + n));
  } else {
    if (n > stage_layers)
      fail("--recompute-num-layers ({}) exceeds the {} layers of this pipeline stage", n, stage_layers);
    for (int b = 0; b < n; ++b) p.groups.emplace_back(b, b + 1);
  }
  for (size_t g = 0; g < p.groups.size(); ++g) {
    for (int l = p.groups[g].first; l < p.groups[g].second; ++l) p.group_of[l] = static_cast<int>(g);
    p.max_group_size = std::max(p.max_group_size, p.groups[g].second - p.groups[g].first);
  }
  return p;
}

ModelOptions ModelOptions::from_config(const Config& cfg, const ModelDims& d, DType compute) {
  ModelOptions o;
  o.compute = compute;
  o.accum = compute == DType::f64 ? DType::f64 : DType::f32;
  o.grad = o.accum;
  o.recompute = RecomputePlan::from_config(cfg.train, d.stage_layers());
  const std::vector<std::string>& modules = cfg.train.recompute_modules;
  o.keep_norm_outputs = !(cfg.train.recompute_granularity == RecomputeGranularity::selective &&
                          std::find(modules.begin(), modules.end(), "layernorm") != modules.end());
  o.optimizer = cfg.train.optimizer;
  o.sgd_momentum = cfg.train.sgd_momentum != 0.0;
  o.rope.base = cfg.model.rotary_base;
  o.rope.llama3_scaling = cfg.model.use_rope_scaling;
  o.rope.scaling_factor = cfg.model.rope_scaling_factor;
  o.rope.seq_len_interpolation_factor = cfg.model.rotary_seq_len_interpolation_factor;
  o.attention_backend = cfg.model.attention_backend;
  o.deterministic = cfg.train.deterministic_mode;
  o.fp8 = Fp8Options::from_config(cfg);
  // --exp-avg-dtype / --exp-avg-sq-dtype bf16 (precision-aware optimizer; the others are refused).
  o.bf16_exp_avg = cfg.train.exp_avg_dtype == StateDtype::bf16;
  o.bf16_exp_avg_sq = cfg.train.exp_avg_sq_dtype == StateDtype::bf16;
  return o;
}

// ---- construction and memory -----------------------------------------------------------

namespace {
// Automatic logits chunk: halve the rows while a chunk of logits takes more than this (and stays a
// whole number of at least 128 rows). Every further chunk costs one more read and write of the
// float32 output-layer gradient (dW += dlogits^T y accumulates), so chunks stay large.
constexpr size_t kLogitsChunkBytes = size_t{512} << 20;

int64_t choose_logits_rows(const ModelDims& d, const ModelOptions& o) {
  const int64_t N = d.tokens();
  if (o.logits_chunk_rows > 0) return std::min(N, o.logits_chunk_rows);
  const size_t row_bytes = static_cast<size_t>(d.vocab_local()) * dtype_size(o.compute);
  int64_t rows = N;
  while (static_cast<size_t>(rows) * row_bytes > kLogitsChunkBytes && rows % 2 == 0 && rows / 2 >= 128) rows /= 2;
  return rows;
}
}  // namespace

GptModel::GptModel(const ModelDims& dims, const ModelOptions& options, ParallelState& ps, Backend& backend)
    : d_(dims), opt_(options), ps_(ps), be_(backend) {
  MT_CHECK(opt_.num_slots >= 1, "num_slots {}", opt_.num_slots);
  MT_CHECK(opt_.accum == DType::f32 || opt_.accum == DType::f64, "accum dtype");
  MT_CHECK(opt_.grad == opt_.accum || opt_.grad == DType::bf16, "main gradients in {} with accum {}",
           dtype_name(opt_.grad), dtype_name(opt_.accum));
  MT_CHECK(!opt_.master_remainders || (opt_.compute == DType::bf16 && opt_.accum == DType::f32 &&
                                       opt_.shard_optimizer_state && !opt_.fp8.param_gather),
           "master-weight remainders need bf16 parameters, float32 master weights, the distributed optimizer and "
           "no FP8 parameters");
  if (opt_.recompute.group_of.size() != static_cast<size_t>(d_.stage_layers()))
    opt_.recompute.group_of.assign(static_cast<size_t>(d_.stage_layers()), -1);
  norm_.kind = d_.norm;
  norm_.eps = d_.norm_eps;
  norm_.one_p = d_.norm_1p;
  qk_l2_norm_.kind = Normalization::rmsnorm;  // Megatron's L2Norm: x * rsqrt(mean(x^2) + eps)
  qk_l2_norm_.eps = d_.norm_eps;
  plan_params();
  globals_ = std::make_unique<Globals>();
  ws_ = std::make_unique<Workspace>();
  logits_rows_ = choose_logits_rows(d_, opt_);
  arena_ = std::make_unique<Arena>(be_);
  layout(*arena_);  // measure
  const bool overlap_sp = d_.sequence_parallel && be_.tp_comm_stream() && d_.stage_layers() > 0;
  if (overlap_sp) {
    // The workspace (where every sequence-parallel all-gather lands) in NCCL symmetric memory, so
    // that those all-gathers run on the copy engines beside the GEMMs (see
    // column_parallel_backward_sp). Every TP rank lays out the same workspace.
    Communicator* tp = ps_.tp.get();
    arena_->place(
        MemoryCategory::workspace, [tp](size_t n) { return tp->allocate_symmetric(n); },
        [tp](void* p) { tp->free_symmetric(p); });
  }
  arena_->allocate();
  layout(*arena_);  // real views
  bind_params();
  plan_grad_zeroing();
  fp8_.initialize(be_);
  if (fp8_.any()) be_.prepare_fp8_gemms();  // the FP8 GEMMs' workspace now, not in the first step
  if (d_.sequence_parallel) {
    tp_overlap_ = ps_.tp.get();
    if (overlap_sp) {
      // Collective over the TP group: every member builds its chunks alike.
      tp_overlap_own_ = ps_.tp->split(0, d_.tp_rank, "tp_overlap", tp_group_options());
      tp_overlap_own_->set_stream(be_.tp_comm_stream());
      tp_overlap_ = tp_overlap_own_.get();
      if (arena_->placed(MemoryCategory::workspace)) {
        const MemoryCategory W = MemoryCategory::workspace;
        const size_t bytes = arena_->plan().of(W);
        // (Where NCCL cannot register it, the all-gathers run on NCCL's kernels: a warning says so.)
        (void)ps_.tp->register_symmetric(arena_->block(W), bytes);
        (void)tp_overlap_own_->register_symmetric(arena_->block(W), bytes);
      }
    }
  }
  // One reservation per distinct window among this stage's layers (each may be its own cuDNN graph).
  std::vector<int> reserved_windows;
  for (int layer = d_.layer_begin; layer < d_.layer_end; ++layer) {
    const AttentionShape shape = attention_shape(nullptr, layer);
    if (std::find(reserved_windows.begin(), reserved_windows.end(), shape.window_left) != reserved_windows.end()) continue;
    reserved_windows.push_back(shape.window_left);
    be_.reserve_attention(shape, opt_.attention_backend, opt_.compute);
  }
  if (d_.qk_l2) be_.fill(qk_l2_ones_, 1.0);
  if (d_.position == PositionEmbedding::rope) {
    RopeTableParams rp = opt_.rope;
    rp.positions = d_.max_positions;
    rp.rot_dim = d_.rot_dim;
    const std::vector<float> table = rope_cos_sin_table(rp);
    be_.copy_from_host(rope_table_, table.data());
    be_.synchronize();  // the host vector goes out of scope
  }
}

GptModel::GptModel(const ModelDims& dims, const ModelOptions& options, ParallelState& ps, Backend& backend,
                   MeasureOnly)
    : d_(dims), opt_(options), ps_(ps), be_(backend) {
  if (opt_.recompute.group_of.size() != static_cast<size_t>(d_.stage_layers()))
    opt_.recompute.group_of.assign(static_cast<size_t>(d_.stage_layers()), -1);
  plan_params();
  globals_ = std::make_unique<Globals>();
  ws_ = std::make_unique<Workspace>();
  logits_rows_ = choose_logits_rows(d_, opt_);
  arena_ = std::make_unique<Arena>(be_);
  layout(*arena_);  // measure only: nothing is allocated
}

// The parameters, their places in the (DP-bucketed) flat buffers and the indices the hooks use.
void GptModel::plan_params() {
  MT_CHECK(opt_.dp_size >= 1 && opt_.dp_rank >= 0 && opt_.dp_rank < opt_.dp_size, "dp {} of {}", opt_.dp_rank,
           opt_.dp_size);
  descs_ = build_param_descs(d_, &total_elements_);
  // --fp8-param-gather: the linear weights of FP8 layers are stored as FP8 only.
  static const char* const kGemmWeights[Fp8State::kGemms] = {".self_attention.linear_qkv.weight",
                                                             ".self_attention.linear_proj.weight",
                                                             ".mlp.linear_fc1.weight", ".mlp.linear_fc2.weight"};
  auto gemm_of = [](const ParamDesc& p) {
    for (int g = 0; g < Fp8State::kGemms; ++g)
      if (p.name.ends_with(kGemmWeights[g])) return g;
    return -1;
  };
  if (opt_.fp8.param_gather) {
    MT_CHECK(opt_.shard_optimizer_state, "FP8 parameters (--fp8-param-gather) need the distributed optimizer");
    for (ParamDesc& p : descs_) p.fp8_storage = opt_.fp8.global_layer_fp8(p.layer) && gemm_of(p) >= 0;
  }
  grad_layout_ = layout_grad_buffer(descs_, opt_.dp_size, opt_.dp_rank, opt_.bucket_size, opt_.shard_optimizer_state,
                                    d_.pipeline && d_.tied_embeddings, &total_elements_);
  const int n = static_cast<int>(descs_.size());
  layer_first_param_.assign(static_cast<size_t>(d_.stage_layers()), n);
  head_first_param_ = n;
  for (int i = n - 1; i >= 0; --i) {
    const ParamDesc& p = descs_[static_cast<size_t>(i)];
    if (p.layer >= 0) layer_first_param_[static_cast<size_t>(p.layer - d_.layer_begin)] = i;
    else if (d_.last_stage && (p.name.starts_with("decoder.final_layernorm") || p.name == "output_layer.weight"))
      head_first_param_ = i;
  }
  tp_partial_ = tp_partial_ranges(descs_);
  fp8_.plan(opt_.fp8, d_.layer_begin, d_.layer_end);
  fp8_fresh_.assign(static_cast<size_t>(d_.stage_layers()), 0);
  fp8_weight_amax_taken_.assign(static_cast<size_t>(d_.stage_layers()), 0);
  fp8_weight_gemm_.assign(descs_.size(), {-1, -1});
  for (size_t i = 0; i < descs_.size(); ++i)
    if (opt_.fp8.global_layer_fp8(descs_[i].layer) && gemm_of(descs_[i]) >= 0)
      fp8_weight_gemm_[i] = {descs_[i].layer - d_.layer_begin, gemm_of(descs_[i])};
}

MemoryPlan GptModel::plan_memory(const ModelDims& dims, const ModelOptions& options) {
  std::unique_ptr<Backend> host = make_reference_backend(1);  // measuring touches no memory
  ParallelState ps = make_single_process_state();
  GptModel m(dims, options, ps, *host, MeasureOnly{});
  return m.memory_plan();
}

GptModel::~GptModel() {
  // Symmetric memory leaves its windows before the arena frees it (collective over TP).
  if (arena_ && arena_->placed(MemoryCategory::workspace) && tp_overlap_own_) {
    char* w = arena_->block(MemoryCategory::workspace);
    ps_.tp->deregister_symmetric(w);
    tp_overlap_own_->deregister_symmetric(w);
  }
}

const MemoryPlan& GptModel::memory_plan() const { return arena_->plan(); }

bool GptModel::keeps_gelu_activation(bool fp8_layer) const {
  // (GeLU or squared ReLU.) FP8 layers never write the activation (fc2's input is cast from fc1's
  // output); SwiGLU's recompute is part of its backward pass anyway.
  return !d_.swiglu && !fp8_layer;
}

bool GptModel::keeps_norm_outputs(bool fp8_inputs) const {
  return opt_.keep_norm_outputs && !d_.sequence_parallel && !fp8_inputs;
}

GptModel::LayerActs GptModel::layout_layer_acts(Arena& a, MemoryCategory c, bool keep_out, bool fp8_inputs,
                                                bool keep_act) {
  // Sequence parallelism: the norm outputs are gathered to all N rows (the GEMMs' inputs); the
  // residual stream (h1, out) and the norm statistics hold this rank's Nl rows.
  const int64_t N = d_.tokens(), Nl = d_.tokens_local(), h = d_.hidden;
  const DType T = opt_.compute, S = opt_.accum;
  LayerActs A;
  A.norm_kept = keeps_norm_outputs(fp8_inputs);
  A.ln1_out = A.norm_kept ? a.take(c, T, {N, h}) : ws_->tmp_h;
  A.ln1_mean = a.take(c, S, {Nl});
  A.ln1_rstd = a.take(c, S, {Nl});
  if (d_.qk_norm) {
    const int64_t heads_normed = d_.groups_local() * (d_.heads / d_.groups + 1);
    A.qkv_raw = a.take(c, T, {N, d_.qkv_width_local()});
    A.qk_mean = a.take(c, S, {N, heads_normed});
    A.qk_rstd = a.take(c, S, {N, heads_normed});
  }
  A.qkv = a.take(c, T, {N, d_.qkv_width_local()});
  A.attn_out = a.take(c, T, {N, d_.attn_width_local()});
  A.lse = a.take(c, S, {d_.micro_batch, d_.heads_local(), d_.seq});
  A.h1 = a.take(c, T, {Nl, h});
  A.ln2_out = A.norm_kept ? a.take(c, T, {N, h}) : ws_->tmp_h;
  A.ln2_mean = a.take(c, S, {Nl});
  A.ln2_rstd = a.take(c, S, {Nl});
  A.fc1_pre = a.take(c, T, {N, d_.fc1_width_local()});
  A.act_kept = keep_act;
  A.fc1_act = keep_act ? a.take(c, T, {N, d_.ffn_local()}) : ws_->act;
  if (keep_out) A.out = a.take(c, T, {Nl, h});
  if (fp8_inputs) {
    const int64_t k[Fp8State::kGemms] = {h, d_.attn_width_local(), h, d_.ffn_local()};  // each GEMM's K
    for (int g = 0; g < Fp8State::kGemms; ++g) A.fp8_xq_t[g] = a.take(c, fp8_.dtype(Fp8State::x), {k[g], N});
    if (opt_.fp8.recipe == Fp8Recipe::tensorwise) A.fp8_x_scale_inv = a.take(c, DType::f32, {Fp8State::kGemms});
  }
  return A;
}

void GptModel::layout(Arena& a) {
  using C = MemoryCategory;
  const DType T = opt_.compute, S = opt_.accum;
  const int64_t N = d_.tokens(), Nl = d_.tokens_local(), h = d_.hidden, total = total_elements_;
  const int64_t state = grad_layout_.state_numel;  // == total unless sharded
  const int64_t fp8_begin = grad_layout_.fp8_begin;  // == total without FP8 parameters
  params_ = a.take(C::parameters, T, {fp8_begin});
  fp8_params_ = fp8_params() ? a.take(C::parameters, fp8_.dtype(Fp8State::w), {total - fp8_begin}) : Tensor();
  grads_ = a.take(C::gradients, opt_.grad, {total});
  master_ = has_master_copy() ? a.take(C::master_weights, opt_.master_remainders ? DType::i16 : S, {state}) : params_;
  state1_ = state2_ = Tensor();
  if (opt_.optimizer == OptimizerKind::adam) {
    state1_ = a.take(C::optimizer_states, opt_.bf16_exp_avg ? DType::bf16 : S, {state});
    state2_ = a.take(C::optimizer_states, opt_.bf16_exp_avg_sq ? DType::bf16 : S, {state});
  } else if (opt_.sgd_momentum) {
    state1_ = a.take(C::optimizer_states, S, {state});
  }
  scalars_ = a.take(C::workspace, S, {16});
  train_loss_ = a.take(C::workspace, S, {2});
  eval_loss_ = a.take(C::workspace, S, {2});
  if (d_.position == PositionEmbedding::rope)
    rope_table_ = a.take(C::workspace, DType::f32, {d_.max_positions, d_.rot_dim});
  qk_l2_ones_ = d_.qk_l2 ? a.take(C::workspace, T, {d_.head_dim}) : Tensor();

  // FP8: scaling state, weight cache of the FP8 layers, quantization workspaces.
  fp8_.layout(a);
  fp8_w_.assign(static_cast<size_t>(d_.stage_layers()), Fp8Weights{});
  fp8_xq_ = fp8_xq_t_ = fp8_dyq_ = fp8_dyq_t_ = fp8_w_compute_ = Tensor();
  if (fp8_.any()) {
    const int64_t qkv = d_.qkv_width_local(), att = d_.attn_width_local(), fc1 = d_.fc1_width_local(), f = d_.ffn_local();
    const int64_t nk[Fp8State::kGemms][2] = {{qkv, h}, {h, att}, {fc1, h}, {h, f}};  // weight [N, K] per GEMM
    const DType e4 = fp8_.dtype(Fp8State::w);
    for (int l = 0; l < d_.stage_layers(); ++l) {
      if (!fp8_.layer_fp8(l)) continue;
      for (int g = 0; g < Fp8State::kGemms; ++g) {
        // An FP8 parameter is its own row-major copy (bind_params points the cache at it).
        if (!opt_.fp8.param_gather) fp8_w_[l].q[g] = a.take(C::parameters, e4, {nk[g][0], nk[g][1]});
        fp8_w_[l].q_t[g] = a.take(C::parameters, e4, {nk[g][1], nk[g][0]});
      }
    }
    if (fp8_params() && opt_.fp8.recipe == Fp8Recipe::delayed) {
      int64_t biggest = 0;
      for (const auto& w : nk) biggest = std::max(biggest, w[0] * w[1]);
      fp8_w_compute_ = a.take(C::workspace, T, {biggest});
    }
    const int64_t k_max = std::max({h, att, f}), n_max = std::max({qkv, h, fc1});
    fp8_xq_ = a.take(C::workspace, fp8_.dtype(Fp8State::x), {N * k_max});
    if (opt_.fp8.wgrad && !fp8_keeps_inputs()) fp8_xq_t_ = a.take(C::workspace, fp8_.dtype(Fp8State::x), {N * k_max});
    fp8_dyq_ = a.take(C::workspace, fp8_.dtype(Fp8State::dy), {N * n_max});
    if (opt_.fp8.wgrad) fp8_dyq_t_ = a.take(C::workspace, fp8_.dtype(Fp8State::dy), {N * n_max});
  }

  // Workspace (first: the layers' shared views point into it). tmp_h and gT hold all N rows
  // (row-parallel outputs and column-parallel input gradients before their reduction over TP,
  // and the gathered norm outputs); gA, gB, gH the residual stream's Nl rows.
  const RecomputePlan& rp = opt_.recompute;
  const int L = d_.stage_layers();
  Workspace& w = *ws_;
  w.tmp_h = a.take(C::workspace, T, {N, h});
  w.gA = a.take(C::workspace, T, {Nl, h});
  w.gB = a.take(C::workspace, T, {Nl, h});
  w.gH = a.take(C::workspace, T, {Nl, h});
  w.gT = a.take(C::workspace, T, {N, h});
  if (L > 0) {
    // One block for the MLP buffers and the attention-backward buffers: a layer's backward is done
    // with act/gFC (MLP part) before gATT/gQKV (attention part) are written, and forward uses
    // neither of the latter.
    const int64_t f = d_.ffn_local(), qkv_n = N * d_.qkv_width_local(), att_n = N * d_.attn_width_local();
    const int64_t att_offset = (qkv_n + 127) / 128 * 128;  // keeps gATT 256-byte aligned
    const Tensor block = a.take(C::workspace, T, {std::max(N * f, att_offset + att_n)});
    w.act = block.flat_slice(0, N * f).view({N, f});
    if (!d_.swiglu) w.gFC = w.act;
    w.gQKV = block.flat_slice(0, qkv_n).view({N, d_.qkv_width_local()});
    w.gATT = block.flat_slice(att_offset, att_n).view({N, d_.attn_width_local()});
  }

  // Per-slot activations.
  slots_.resize(static_cast<size_t>(opt_.num_slots));
  for (Slot& s : slots_) {
    const size_t part_i32 = (static_cast<size_t>(N) * 4 + Arena::kAlignment - 1) / Arena::kAlignment * Arena::kAlignment;
    const size_t part_s =
        (static_cast<size_t>(N) * dtype_size(S) + Arena::kAlignment - 1) / Arena::kAlignment * Arena::kAlignment;
    s.io = a.take(C::activations, DType::u8, {static_cast<int64_t>(3 * part_i32 + 2 * part_s)});
    s.off_tokens = 0;
    s.off_labels = part_i32;
    s.off_positions = 2 * part_i32;
    s.off_mask = 3 * part_i32;
    s.off_dloss = 3 * part_i32 + part_s;
    auto part = [&](size_t off, DType t) { return Tensor(static_cast<char*>(s.io.data) + off, t, s.io.device, {N}); };
    s.tokens = part(s.off_tokens, DType::i32);
    s.labels = part(s.off_labels, DType::i32);
    s.positions = part(s.off_positions, DType::i32);
    s.mask = part(s.off_mask, S);
    s.dloss = part(s.off_dloss, S);
    if (!a.measuring()) s.host_io.assign(static_cast<size_t>(s.io.numel()), 0);
    s.input = a.take(C::activations, T, {Nl, h});
    s.layers.assign(static_cast<size_t>(L), LayerActs{});
    for (int l = 0; l < L; ++l) {
      const int g = rp.group_of[l];
      if (g < 0) {
        s.layers[l] = layout_layer_acts(a, C::activations, true, fp8_keeps_inputs() && fp8_.layer_fp8(l),
                                        keeps_gelu_activation(fp8_.layer_fp8(l)));
      } else if (l == rp.groups[g].second - 1 || l == L - 1) {
        // Recomputed layers keep only what the next group (or the head) needs: their output.
        s.layers[l].out = a.take(C::activations, T, {Nl, h});
      }
    }
    s.d_output = a.take(C::activations, T, {Nl, h});
  }
  // Recompute scratch: the internals of one group, shared by all slots (one backward at a time).
  // Entry j serves layer j of every group: FP8 inputs kept where one of them is an FP8 layer.
  scratch_.clear();
  for (int j = 0; j < rp.max_group_size; ++j) {
    bool fp8_inputs = false;
    for (const auto& [begin, end] : rp.groups) fp8_inputs |= begin + j < end && fp8_.layer_fp8(begin + j);
    scratch_.push_back(layout_layer_acts(a, C::activations, true, fp8_keeps_inputs() && fp8_inputs,
                                         keeps_gelu_activation(fp8_inputs)));
  }

  if (d_.last_stage) {
    w.logits = a.take(C::workspace, T, {logits_rows_, d_.vocab_local()});
    w.y = a.take(C::workspace, T, {N, h});
    w.fmean = a.take(C::workspace, S, {Nl});
    w.frstd = a.take(C::workspace, S, {Nl});
    w.lse_part = a.take(C::workspace, S, {N});
    w.lse_parts = a.take(C::workspace, S, {d_.tp_size, N});
    w.lse = a.take(C::workspace, S, {N});
    w.target = a.take(C::workspace, S, {N});
    w.loss = a.take(C::workspace, S, {N});
  }
}

namespace {
Tensor shaped(Tensor flat, const ParamDesc& p) {
  Tensor t = flat.flat_slice(p.offset, p.numel());
  return p.is_1d() ? t : t.view({p.local_rows(), p.local_cols()});
}
}  // namespace

Tensor GptModel::logits() const {
  MT_CHECK(logits_rows_ == d_.tokens(), "GptModel::logits: the head ran in chunks of {} of {} rows (set "
           "ModelOptions::logits_chunk_rows to keep them all)", logits_rows_, d_.tokens());
  return ws_->logits;
}

Tensor GptModel::param_storage(int64_t offset, int64_t numel) const {
  const int64_t begin = grad_layout_.fp8_begin;
  if (offset >= begin) return fp8_params_.flat_slice(offset - begin, numel);
  MT_CHECK(offset + numel <= begin, "param_storage: [{}, {}) crosses into the FP8 parameters at {}", offset,
           offset + numel, begin);
  return params_.flat_slice(offset, numel);
}

Tensor GptModel::param(int i) const {
  const ParamDesc& p = descs_.at(i);
  const Tensor t = param_storage(p.offset, p.numel());
  return p.is_1d() ? t : t.view({p.local_rows(), p.local_cols()});
}
Tensor GptModel::grad(int i) const { return shaped(grads_, descs_.at(i)); }
Tensor GptModel::master(int i) const {
  MT_CHECK(!(grad_layout_.sharded && has_master_copy()), "master({}) of a sharded master copy", i);
  return shaped(master_, descs_.at(i));
}

void GptModel::bind_params() {
  layer_params_.assign(static_cast<size_t>(d_.stage_layers()), LayerParams{});
  layer_grads_.assign(static_cast<size_t>(d_.stage_layers()), LayerParams{});
  auto find = [&](const std::string& name, Tensor& p, Tensor& g) {
    const int i = find_param(descs_, name);
    if (i < 0) return;
    p = param(i);
    g = grad(i);
  };
  Globals& G = *globals_;
  find("embedding.word_embeddings.weight", G.wte, G.dwte);
  find("embedding.position_embeddings.weight", G.wpe, G.dwpe);
  find("decoder.final_layernorm.weight", G.final_w, G.dfinal_w);
  find("decoder.final_layernorm.bias", G.final_b, G.dfinal_b);
  find("output_layer.weight", G.out_w, G.dout_w);
  if (d_.last_stage && G.out_w.empty()) {  // tied, on a stage that also holds the embedding
    G.out_w = G.wte;
    G.dout_w = G.dwte;
  }
  for (int l = 0; l < d_.stage_layers(); ++l) {
    const std::string p = "decoder.layers." + std::to_string(d_.layer_begin + l) + ".";
    LayerParams &P = layer_params_[l], &Gr = layer_grads_[l];
    find(p + "self_attention.linear_qkv.layer_norm_weight", P.ln1_w, Gr.ln1_w);
    find(p + "self_attention.linear_qkv.layer_norm_bias", P.ln1_b, Gr.ln1_b);
    find(p + "self_attention.linear_qkv.weight", P.qkv_w, Gr.qkv_w);
    find(p + "self_attention.linear_qkv.bias", P.qkv_b, Gr.qkv_b);
    find(p + "self_attention.q_layernorm.weight", P.q_ln_w, Gr.q_ln_w);
    find(p + "self_attention.q_layernorm.bias", P.q_ln_b, Gr.q_ln_b);
    find(p + "self_attention.k_layernorm.weight", P.k_ln_w, Gr.k_ln_w);
    find(p + "self_attention.k_layernorm.bias", P.k_ln_b, Gr.k_ln_b);
    if (d_.qk_l2) P.q_ln_w = P.k_ln_w = qk_l2_ones_;  // weightless: unit weights, no gradients
    find(p + "self_attention.linear_proj.weight", P.proj_w, Gr.proj_w);
    find(p + "self_attention.linear_proj.bias", P.proj_b, Gr.proj_b);
    find(p + "mlp.linear_fc1.layer_norm_weight", P.ln2_w, Gr.ln2_w);
    find(p + "mlp.linear_fc1.layer_norm_bias", P.ln2_b, Gr.ln2_b);
    find(p + "mlp.linear_fc1.weight", P.fc1_w, Gr.fc1_w);
    find(p + "mlp.linear_fc1.bias", P.fc1_b, Gr.fc1_b);
    find(p + "mlp.linear_fc2.weight", P.fc2_w, Gr.fc2_w);
    find(p + "mlp.linear_fc2.bias", P.fc2_b, Gr.fc2_b);
    if (!fp8_.layer_fp8(l) || !opt_.fp8.param_gather) continue;
    const Tensor w[Fp8State::kGemms] = {P.qkv_w, P.proj_w, P.fc1_w, P.fc2_w};
    for (int g = 0; g < Fp8State::kGemms; ++g) fp8_w_[static_cast<size_t>(l)].q[g] = w[g];
  }
}

void GptModel::init_parameters(bool random) {
  fp8_begin_step();  // the FP8 weight cache is stale
  auto draw = [this, random](const ParamDesc& p, Tensor w) {
    switch (p.init) {
      case InitKind::normal:
        if (random) be_.init_normal(w, p.init_key(d_.seed), p.init_std, p.shard);
        else be_.fill(w, 0.0);
        break;
      case InitKind::zeros: be_.fill(w, 0.0); break;
      case InitKind::ones: be_.fill(w, 1.0); break;
    }
  };
  // The full-precision values are drawn into a full-size buffer: the master copy, or with a
  // sharded master copy the (still unused) gradient buffer, from which each rank keeps its shards.
  // bf16 main grads cannot hold them: then one parameter at a time.
  const bool sharded_master = grad_layout_.sharded && has_master_copy();
  if (sharded_master && stages_per_param()) {
    stage_full_params([&](int i, Tensor w) { draw(descs_[static_cast<size_t>(i)], w); }, master_, true);
  } else {
    const Tensor full = sharded_master ? grads_ : master_;
    for (const ParamDesc& p : descs_) draw(p, shaped(full, p));
    if (!has_master_copy()) return;
    params_from_full_master(full);
    if (sharded_master) be_.fill(grads_, 0.0);
  }
  fp8_params_from_master(true);
}

void GptModel::params_from_full_master(Tensor full) {
  MT_CHECK(has_master_copy() && full.dtype == opt_.accum && full.numel() >= params_.numel(),
           "params_from_full_master: a full-size {} buffer", dtype_name(opt_.accum));
  const Tensor values = full.flat_slice(0, params_.numel());
  // (the FP8 parameters: fp8_params_from_master)
  if (opt_.master_remainders) be_.split_master(params_, Tensor(), values);
  else be_.cast(params_, values);
  if (!grad_layout_.sharded) return;  // (then `full` is the master copy)
  for (int b = 0; b < grad_layout_.num_buckets(); ++b) {
    const int64_t n = grad_layout_.shard_numel(b), at = grad_layout_.shard_offset(b);
    const Tensor shard = master_.flat_slice(grad_layout_.state_offset[static_cast<size_t>(b)], n);
    if (opt_.master_remainders) be_.split_master(params_.flat_slice(at, n), shard, full.flat_slice(at, n));
    else be_.cast(shard, full.flat_slice(at, n));  // (a copy: the same dtype)
  }
}

void GptModel::master_to_host(float* out, const void* params_host, const void* master_host) const {
  MT_CHECK(opt_.master_remainders, "master_to_host: the master weights are not kept as remainders");
  const auto* w = static_cast<const uint16_t*>(params_host);
  const auto* r = static_cast<const int16_t*>(master_host);
  for (int b = 0; b < grad_layout_.num_buckets(); ++b) {
    const int64_t n = grad_layout_.shard_numel(b), at = grad_layout_.shard_offset(b);
    const int64_t state = grad_layout_.state_offset[static_cast<size_t>(b)];
    for (int64_t i = 0; i < n; ++i) out[state + i] = join_master_bits(w[at + i], r[state + i]);
  }
}

void GptModel::stage_full_params(const std::function<void(int, Tensor)>& fill, Tensor sharded, bool to_params) {
  MT_CHECK(grad_layout_.sharded, "stage_full_params: the master weights are not sharded");
  std::vector<std::vector<std::pair<int, ShardSegment>>> pieces(descs_.size());  // per parameter: (bucket, piece)
  for (int b = 0; b < grad_layout_.num_buckets(); ++b)
    for (const ShardSegment& s : grad_layout_.shard_segments(b)) pieces.at(static_cast<size_t>(s.param)).emplace_back(b, s);
  int64_t biggest = 1;
  for (const ParamDesc& p : descs_) biggest = std::max(biggest, p.numel());
  void* mem = be_.allocate(static_cast<size_t>(biggest) * dtype_size(opt_.accum));
  const Tensor scratch(mem, opt_.accum, be_.device(), {biggest});
  be_.fill(sharded, 0.0);
  const bool remainders = sharded.dtype == DType::i16;  // the master copy as remainders of the parameters
  for (size_t i = 0; i < descs_.size(); ++i) {
    const ParamDesc& p = descs_[i];
    ParamDesc at_start = p;
    at_start.offset = 0;
    fill(static_cast<int>(i), shaped(scratch, at_start));
    if (to_params && !p.fp8_storage) {
      if (remainders) be_.split_master(shaped(params_, p), Tensor(), shaped(scratch, at_start));
      else be_.cast(shaped(params_, p), shaped(scratch, at_start));
    }
    for (const auto& [b, s] : pieces[i]) {
      const Tensor dst =
          sharded.flat_slice(grad_layout_.state_offset[static_cast<size_t>(b)] + s.shard_offset, s.numel);
      const Tensor src = scratch.flat_slice(s.param_offset, s.numel);
      if (remainders) be_.split_master(params_.flat_slice(p.offset + s.param_offset, s.numel), dst, src);
      else be_.cast(dst, src);  // (a cast: bf16 moments take their rounding)
    }
  }
  be_.synchronize();  // the scratch is freed below
  be_.deallocate(mem);
}

void GptModel::zero_grads() {
  for (FirstWriteGrad& f : first_write_grads_) f.written = false;
  if (first_write_grads_.empty()) be_.fill(grads_, 0.0);
  else be_.fill_ranges(grads_, zeroed_grad_ranges_, 0.0);
}

void GptModel::check_grads_written() const {
  for (const FirstWriteGrad& f : first_write_grads_)
    MT_CHECK(f.written, "the gradient of {} was not written in this step's backward (it is not zeroed before the "
             "step: its first weight-gradient GEMM writes it)", descs_[static_cast<size_t>(f.param)].name);
}

GptModel::FirstWriteGrad* GptModel::first_write_entry(const Tensor& g) {
  for (FirstWriteGrad& f : first_write_grads_) {
    if (f.data != g.data) continue;
    const ParamDesc& p = descs_[static_cast<size_t>(f.param)];
    MT_CHECK(g.numel() == p.numel(), "a gradient op on part of {} ({} of {} elements), which is not zeroed before "
             "the step", p.name, g.numel(), p.numel());
    return &f;
  }
  return nullptr;
}

bool GptModel::accumulate_weight_grad(const Tensor& dw) {
  FirstWriteGrad* f = first_write_entry(dw);
  if (!f) return true;
  const bool accumulate = f->written;
  f->written = true;
  return accumulate;
}

void GptModel::zero_grad_if_unwritten(const Tensor& g) {
  FirstWriteGrad* f = first_write_entry(g);
  if (!f || f->written) return;
  be_.fill(g, 0.0);
  f->written = true;
}

// The linear layers' weights and the output layer get their gradient from GEMMs only, so the
// step's first GEMM can write it. The word embeddings too: with tied embeddings the output layer's
// GEMM writes first on the last stage; the embedding's scatter-add zeroes the gradient itself
// where it comes first (untied, or a first pipeline stage). Everything else (positions, norms,
// biases: sums added by kernels) is zeroed up front; nearly all the bytes are in the former.
void GptModel::plan_grad_zeroing() {
  first_write_grads_.clear();
  zeroed_grad_ranges_.clear();
  auto ends_with = [](const std::string& s, const char* suffix) {
    const size_t n = std::strlen(suffix);
    return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
  };
  std::vector<int> written;
  for (size_t i = 0; i < descs_.size(); ++i) {
    const std::string& n = descs_[i].name;
    if (n == "output_layer.weight" || n == "embedding.word_embeddings.weight" ||
        ends_with(n, ".linear_qkv.weight") || ends_with(n, ".linear_proj.weight") ||
        ends_with(n, ".linear_fc1.weight") || ends_with(n, ".linear_fc2.weight"))
      written.push_back(static_cast<int>(i));
  }
  std::sort(written.begin(), written.end(), [&](int a, int b) { return descs_[a].offset < descs_[b].offset; });
  int64_t next = 0;  // first element not yet assigned to a range
  for (int i : written) {
    const ParamDesc& p = descs_[static_cast<size_t>(i)];
    if (p.offset > next) zeroed_grad_ranges_.push_back({next, p.offset - next});
    next = p.offset + p.numel();
    first_write_grads_.push_back({i, grads_.flat_slice(p.offset, p.numel()).data, true});
  }
  if (grads_.numel() > next) zeroed_grad_ranges_.push_back({next, grads_.numel() - next});
}

// ---- FP8 linear layers -------------------------------------------------------------------

void GptModel::fp8_begin_step() { std::fill(fp8_fresh_.begin(), fp8_fresh_.end(), 0); }

void GptModel::fp8_end_step() {
  fp8_.end_step(be_, ps_);
  std::fill(fp8_fresh_.begin(), fp8_fresh_.end(), 0);  // the optimizer changed the weights
}

Fp8TensorMeta GptModel::fp8_param_meta(int i) const {
  const auto [local, g] = fp8_weight_gemm_.at(static_cast<size_t>(i));
  MT_CHECK(descs_.at(static_cast<size_t>(i)).fp8_storage, "{} is not an FP8 parameter",
           descs_.at(static_cast<size_t>(i)).name);
  Fp8TensorMeta m = fp8_.meta(local, static_cast<Fp8State::Gemm>(g), Fp8State::w);
  // A cast of one shard piece uses the weight's scale as it is (set from the whole weight's amax,
  // Fp8State::set_weight_scales*); tensorwise's own amax of the piece would give each piece its own.
  m.recipe = Fp8Recipe::delayed;
  m.fresh = Tensor();  // (no amax slot: delayed casts take none)
  return m;
}

bool GptModel::weights_amax_from_update() const {
  return opt_.seams.fp8_producer_amax && opt_.fp8.recipe == Fp8Recipe::tensorwise &&
         fp8_.any() && !fp8_params();
}

Tensor GptModel::weight_cast_amax_slot(int i) const {
  const auto [local, g] = fp8_weight_gemm_.at(static_cast<size_t>(i));
  if (local < 0 || !weights_amax_from_update()) return Tensor();
  return fp8_.fresh(local, static_cast<Fp8State::Gemm>(g), Fp8State::w);
}

void GptModel::fp8_weights_updated() {
  if (!weights_amax_from_update()) return;
  // The distributed optimizer's shards: each rank took its pieces' amaxes; the max over DP is the
  // whole weight's (the all-gather brings every rank the weights those pieces became).
  if (grad_layout_.sharded) fp8_.reduce_fresh_over_dp(ps_);
  for (int l = 0; l < d_.stage_layers(); ++l) fp8_weight_amax_taken_[static_cast<size_t>(l)] = fp8_layer(l) ? 1 : 0;
}

void GptModel::fp8_cast_shard(int b) {
  if (!fp8_params() || !grad_layout_.fp8_bucket(b)) return;
  const int64_t state = grad_layout_.state_offset[static_cast<size_t>(b)], flat = grad_layout_.shard_offset(b);
  for (const ShardSegment& s : grad_layout_.shard_segments(b)) {
    // A piece of a weight is a [1, n] matrix to the cast: the row-major copy only, no transpose.
    const Tensor master = master_.flat_slice(state + s.shard_offset, s.numel).view({1, s.numel});
    const Tensor q = param_storage(flat + s.shard_offset, s.numel).view({1, s.numel});
    be_.fp8_quantize(q, Tensor(), master, fp8_param_meta(s.param));
  }
}

void GptModel::fp8_params_from_master(bool fresh_state) {
  if (!fp8_params()) return;
  const GradLayout& L = grad_layout_;
  if (fresh_state) fp8_.initialize(be_);
  if (fresh_state || opt_.fp8.recipe == Fp8Recipe::tensorwise) {
    // A first cast with the scales there are (its bits are overwritten below) records every
    // shard's amax; their max over TP and DP sets each weight's scale, as the first delayed-scaling
    // update would from the weight's amax alone. The amax stays recorded for that update.
    for (int b = 0; b < L.num_buckets(); ++b) fp8_cast_shard(b);
    fp8_.reduce_amax(ps_);
    fp8_.set_weight_scales_from_amax(be_);
  }
  for (int b = 0; b < L.num_buckets(); ++b) fp8_cast_shard(b);
  if (ps_.dp_size > 1)
    for (int b = 0; b < L.num_buckets(); ++b) {
      if (!L.fp8_bucket(b)) continue;
      const GradBucket& k = L.plan.buckets[static_cast<size_t>(b)];
      const Tensor whole = param_storage(k.offset, k.numel);
      ps_.dp->all_gather(whole, whole.flat_slice(L.shard_offset(b) - k.offset, L.shard_numel(b)));
    }
  be_.synchronize();
  fp8_begin_step();  // the transposed copies follow
}

Tensor GptModel::compute_weight(int local, Fp8State::Gemm g, Tensor w) {
  if (!is_fp8(w.dtype)) return w;
  MT_CHECK(!fp8_w_compute_.empty(), "layer {}: an FP8 weight in a compute-dtype GEMM without a workspace",
           d_.layer_begin + local);
  const Tensor out = fp8_w_compute_.flat_slice(0, w.numel()).view({w.rows(), w.cols()});
  be_.fp8_dequantize(out, w, fp8_.scale_inv(local, g, Fp8State::w));
  return out;
}

// Evaluation forwards record no amax (their tensors are not the training step's), so a refresh
// made by one does not count as fresh for training.
Fp8TensorMeta GptModel::fp8_meta(int local, Fp8State::Gemm g, Fp8State::Role r) const {
  Fp8TensorMeta m = fp8_.meta(local, g, r);
  if (!fp8_training_) m.amax = Tensor();
  return m;
}

void GptModel::fp8_refresh_weights(int local) {
  const char fresh = fp8_training_ ? 1 : 2;  // 2: cast by an evaluation forward (no amax recorded)
  if (fp8_fresh_[static_cast<size_t>(local)] == 1 || fp8_fresh_[static_cast<size_t>(local)] == fresh) return;
  const LayerParams& P = layer_params_[static_cast<size_t>(local)];
  const Tensor w[Fp8State::kGemms] = {P.qkv_w, P.proj_w, P.fc1_w, P.fc2_w};
  const Fp8Weights& c = fp8_w_[static_cast<size_t>(local)];
  // The optimizer's last update took the weights' amaxes (weight_cast_amax_slot): this cast uses
  // them, whether a training or an evaluation forward's; a later recast takes its own.
  char& taken = fp8_weight_amax_taken_[static_cast<size_t>(local)];
  for (int g = 0; g < Fp8State::kGemms; ++g) {
    if (is_fp8(w[g].dtype)) {
      be_.fp8_transpose(c.q_t[g], c.q[g]);  // an FP8 parameter: cast by the optimizer
      continue;
    }
    Fp8TensorMeta m = fp8_meta(local, static_cast<Fp8State::Gemm>(g), Fp8State::w);
    m.fresh_taken = taken != 0;
    be_.fp8_quantize(c.q[g], c.q_t[g], w[g], m);
  }
  taken = 0;
  fp8_fresh_[static_cast<size_t>(local)] = fresh;
}

namespace {
// A [rows, cols] view at the start of a flat FP8 workspace.
Tensor fp8_view(Tensor flat, int64_t rows, int64_t cols) { return flat.flat_slice(0, rows * cols).view({rows, cols}); }
}  // namespace

bool GptModel::fp8_norm_cast(int local, const LayerActs& A) const {
  return opt_.seams.fp8_norm_cast && fp8_gemms(local) && !A.norm_kept && !d_.sequence_parallel;
}

bool GptModel::norm_takes_cast_amax(int local, const LayerActs& A) const {
  return opt_.seams.fp8_producer_amax && opt_.fp8.recipe == Fp8Recipe::tensorwise && fp8_norm_cast(local, A);
}

Tensor GptModel::norm_cast_amax(int local, const LayerActs& A, Fp8State::Gemm g) const {
  return norm_takes_cast_amax(local, A) ? fp8_.fresh(local, g, Fp8State::x) : Tensor();
}

// The norm backwards that write proj's and fc2's output gradients: the plain norm_backward (not
// the recomputing one) runs where layer_backward takes it, and the gradient the cast reads is the
// norm's dx itself only without hidden dropout and sequence parallelism (expand_grad). Not the
// final norm's for the last layer: the head's backward runs at the end of the forward, and other
// micro-batches' forwards may come before this one's backward (pipeline schedules).
bool GptModel::dy_amax_from_norm(const Slot& s, int local, Fp8State::Gemm g) const {
  if (!opt_.seams.fp8_producer_amax || opt_.fp8.recipe != Fp8Recipe::tensorwise || !fp8_layer(local) ||
      d_.hidden_dropout > 0 || d_.sequence_parallel)
    return false;
  const auto plain_norm_backward = [&](int l) { return fp8_kept_inputs(l) || acts(s, l).norm_kept; };
  if (g == Fp8State::proj) return plain_norm_backward(local);
  MT_CHECK(g == Fp8State::fc2, "dy_amax_from_norm: GEMM {} has no norm backward writing its output gradient",
           static_cast<int>(g));
  return local + 1 < d_.stage_layers() && plain_norm_backward(local + 1);
}

Tensor GptModel::dy_amax_slot(const Slot& s, int local, Fp8State::Gemm g) const {
  return local >= 0 && dy_amax_from_norm(s, local, g) ? fp8_.fresh(local, g, Fp8State::dy) : Tensor();
}

Tensor GptModel::dy_amax_from_dropout(int local, Fp8State::Gemm g) const {
  if (!opt_.seams.fp8_producer_amax || opt_.fp8.recipe != Fp8Recipe::tensorwise || !fp8_layer(local) ||
      d_.hidden_dropout <= 0 || d_.sequence_parallel)
    return Tensor();
  return fp8_.fresh(local, g, Fp8State::dy);
}

void GptModel::linear_fwd(int local, Fp8State::Gemm g, const LayerActs& A, Tensor y, Tensor x, Tensor w, Tensor bias,
                          Activation act, Tensor pre_act, const NormInput* norm) {
  MT_CHECK(!norm || fp8_gemms(local), "layer {}: an FP8 cast from a norm outside FP8 GEMMs", d_.layer_begin + local);
  if (!fp8_layer(local)) {
    be_.linear_forward(y, x, w, bias, act, pre_act);
    return;
  }
  fp8_refresh_weights(local);  // (calibrating: records the weights' amaxes)
  const Tensor xq = fp8_quantize_input(local, g, A, x, nullptr, norm);
  if (!fp8_gemms(local)) {  // calibrating: the cast above recorded x's amax; its bits go unused
    be_.linear_forward(y, x, compute_weight(local, g, w), bias, act, pre_act);
    return;
  }
  be_.fp8_linear_forward(y, xq, fp8_.scale_inv(local, g, Fp8State::x), fp8_w_[static_cast<size_t>(local)].q[g],
                         fp8_.scale_inv(local, g, Fp8State::w), bias, act, pre_act);
}

void GptModel::fc2_fwd_from_fc1(int local, const LayerActs& A, Tensor y, Tensor fc1_pre, MlpActivation act) {
  MT_CHECK(fp8_gemms(local), "layer {}: fc2's fused FP8 input cast outside FP8 GEMMs", d_.layer_begin + local);
  const Fp8State::Gemm g = Fp8State::fc2;
  fp8_refresh_weights(local);
  const Tensor xq = fp8_quantize_input(local, g, A, fc1_pre, &act);
  be_.fp8_linear_forward(y, xq, fp8_.scale_inv(local, g, Fp8State::x), fp8_w_[static_cast<size_t>(local)].q[g],
                         fp8_.scale_inv(local, g, Fp8State::w), Tensor(), Activation::none, Tensor());
}

// One cast for both FP8 GEMMs that take the input x (or act(x), act not null): the row-major copy
// for the forward GEMM (workspace, returned) and, in training, the transposed one for the weight
// gradient, kept with the layer's activations. (Evaluation forwards have no backward, and a
// recomputed layer's first forward none of its own: the recompute writes them again. Neither
// writes the copy nor its scale_inv.)
Tensor GptModel::fp8_quantize_input(int local, Fp8State::Gemm g, const LayerActs& A, Tensor x, const MlpActivation* act,
                                    const NormInput* norm) {
  if (norm) x = norm->x;
  const int64_t cols = act && *act == MlpActivation::swiglu ? x.cols() / 2 : x.cols();
  const Tensor xq = fp8_view(fp8_xq_, x.rows(), cols);
  const bool keep = fp8_kept_inputs(local) && fp8_training_ && fp8_keep_inputs_now_;
  if (keep) MT_CHECK(!A.fp8_xq_t[g].empty(), "layer {}: no kept FP8 input planned", d_.layer_begin + local);
  const Tensor xq_t = keep ? A.fp8_xq_t[g] : Tensor();
  Fp8TensorMeta meta = fp8_meta(local, g, Fp8State::x);
  if (keep && !A.fp8_x_scale_inv.empty()) meta.scale_inv_copy = A.fp8_x_scale_inv.flat_slice(g, 1);  // (tensorwise)
  if (norm) {
    meta.fresh_taken = norm_takes_cast_amax(local, A);  // the norm's statistics op took it
    be_.fp8_quantize_norm(xq, xq_t, norm->x, norm->mean, norm->rstd, norm->weight, norm->bias, norm_, meta);
  } else if (act) {
    be_.fp8_quantize_activation(xq, xq_t, x, *act, meta);
  } else {
    be_.fp8_quantize(xq, xq_t, x, meta);
  }
  return xq;
}

void GptModel::linear_quantize_dy(int local, Fp8State::Gemm g, Tensor dy, Tensor dbias, bool amax_taken) {
  if (!fp8_layer(local)) return;
  const Tensor dyq = fp8_view(fp8_dyq_, dy.rows(), dy.cols());
  const Tensor dyq_t = opt_.fp8.wgrad ? fp8_view(fp8_dyq_t_, dy.cols(), dy.rows()) : Tensor();
  Fp8TensorMeta meta = fp8_.meta(local, g, Fp8State::dy);
  meta.fresh_taken = amax_taken;
  if (fp8_wgrad(local) && !dbias.empty()) be_.fp8_quantize_with_dbias(dyq, dyq_t, dy, meta, dbias);
  else be_.fp8_quantize(dyq, dyq_t, dy, meta);
}

void GptModel::linear_quantize_dy_activation(int local, Tensor dout, Tensor pre, MlpActivation act, Tensor dbias) {
  const Fp8State::Gemm g = Fp8State::fc1;
  MT_CHECK(fp8_wgrad(local), "layer {}: the fused activation-gradient cast outside FP8 weight gradients",
           d_.layer_begin + local);
  const int64_t cols = act == MlpActivation::swiglu ? 2 * dout.cols() : dout.cols();  // fc1's output width
  be_.fp8_quantize_activation_backward(fp8_view(fp8_dyq_, dout.rows(), cols), fp8_view(fp8_dyq_t_, cols, dout.rows()),
                                       dout, pre, act, fp8_.meta(local, g, Fp8State::dy), dbias);
}

void GptModel::linear_bwd_input(int local, Fp8State::Gemm g, Tensor dx, Tensor dy, Tensor w, Activation act,
                                Tensor pre_act) {
  if (!fp8_gemms(local)) {  // (calibrating: linear_quantize_dy recorded dy's amax)
    be_.linear_backward_input(dx, dy, fp8_layer(local) ? compute_weight(local, g, w) : w, false, act, pre_act);
    return;
  }
  be_.fp8_linear_backward_input(dx, fp8_view(fp8_dyq_, dy.rows(), dy.cols()), fp8_.scale_inv(local, g, Fp8State::dy),
                                fp8_w_[static_cast<size_t>(local)].q_t[g], fp8_.scale_inv(local, g, Fp8State::w), false,
                                act, pre_act);
}

void GptModel::linear_bwd_weight(int local, Fp8State::Gemm g, const LayerActs& A, Tensor dw, Tensor dbias, Tensor dy,
                                 Tensor x) {
  const bool accumulate = accumulate_weight_grad(dw);
  if (!fp8_wgrad(local)) {
    be_.linear_backward_weight(dw, dbias, dy, x, accumulate);
    return;
  }
  Tensor xq_t, x_scale_inv = fp8_.scale_inv(local, g, Fp8State::x);
  if (fp8_kept_inputs(local)) {
    // The forward's transposed copy (delayed scaling: the scales hold still within a step).
    xq_t = A.fp8_xq_t[g];
    if (!A.fp8_x_scale_inv.empty()) x_scale_inv = A.fp8_x_scale_inv.flat_slice(g, 1);
  } else {
    // x was recomputed (or kept) in the compute dtype: quantized again with its forward scale
    // (tensorwise: recomputed from the same x), so the same bits as the forward's cast.
    xq_t = fp8_view(fp8_xq_t_, x.cols(), x.rows());
    be_.fp8_quantize(Tensor(), xq_t, x, fp8_.meta(local, g, Fp8State::x));
  }
  // (The bias gradient was taken by linear_quantize_dy's cast.)
  be_.fp8_linear_backward_weight(dw, Tensor(), Tensor(), fp8_view(fp8_dyq_t_, dy.cols(), dy.rows()),
                                 fp8_.scale_inv(local, g, Fp8State::dy), xq_t, x_scale_inv, accumulate);
}

// ---- micro-batch I/O ---------------------------------------------------------------------

void GptModel::stage_micro_batch(int slot, const MicroBatch& mb, double loss_grad_scale, bool per_token_loss,
                                 uint64_t serial, bool training) {
  Slot& s = slots_.at(static_cast<size_t>(slot));
  const int b = d_.micro_batch, sq = d_.seq;
  if (mb.batch != b || mb.seq != sq)
    fail("a micro-batch of {} x {} tokens does not match --micro-batch-size {} x --seq-length {}", mb.batch,
         mb.seq, b, sq);
  const size_t N = static_cast<size_t>(b) * sq;
  if (mb.tokens.size() != N || mb.labels.size() != N || mb.loss_mask.size() != N ||
      (!mb.positions.empty() && mb.positions.size() != N))
    fail("a micro-batch's arrays do not hold {} x {} entries", b, sq);
  unsigned char* h = s.host_io.data();
  auto* tokens = reinterpret_cast<int32_t*>(h + s.off_tokens);
  auto* labels = reinterpret_cast<int32_t*>(h + s.off_labels);
  auto* positions = reinterpret_cast<int32_t*>(h + s.off_positions);
  double mb_tokens = 0;
  for (float m : mb.loss_mask) mb_tokens += m;
  const double per_row = per_token_loss ? loss_grad_scale : loss_grad_scale / std::max(1.0, mb_tokens);
  const bool f64 = opt_.accum == DType::f64;
  for (int i = 0; i < b; ++i)
    for (int t = 0; t < sq; ++t) {
      const size_t src = static_cast<size_t>(i) * sq + t, dst = static_cast<size_t>(t) * b + i;  // sequence-major
      tokens[dst] = mb.tokens[src];
      labels[dst] = mb.labels[src];
      positions[dst] = mb.positions.empty() ? t : mb.positions[src];
      if (mb.tokens[src] < 0 || mb.tokens[src] >= d_.vocab)
        fail("token id {} is outside the padded vocabulary of {}", mb.tokens[src], d_.vocab);
      if (mb.loss_mask[src] != 0.0f && (mb.labels[src] < 0 || mb.labels[src] >= d_.vocab))
        fail("label id {} is outside the padded vocabulary of {}", mb.labels[src], d_.vocab);
      if (positions[dst] < 0 || positions[dst] >= d_.max_positions)
        fail("position {} is outside [0, {})", positions[dst], d_.max_positions);
      const double m = mb.loss_mask[src];
      if (f64) {
        reinterpret_cast<double*>(h + s.off_mask)[dst] = m;
        reinterpret_cast<double*>(h + s.off_dloss)[dst] = m * per_row;
      } else {
        reinterpret_cast<float*>(h + s.off_mask)[dst] = static_cast<float>(m);
        reinterpret_cast<float*>(h + s.off_dloss)[dst] = static_cast<float>(m * per_row);
      }
    }
  // One copy. (From pageable memory the copy has consumed the host buffer when it returns, so
  // the next micro-batch may overwrite it.)
  be_.copy_from_host(s.io, h);
  set_slot_key(s, serial, training);
}

void GptModel::stage_without_data(int slot, uint64_t serial, bool training) {
  Slot& s = slots_.at(static_cast<size_t>(slot));
  const int b = d_.micro_batch, sq = d_.seq;
  auto* positions = reinterpret_cast<int32_t*>(s.host_io.data() + s.off_positions);
  for (int t = 0; t < sq; ++t)
    for (int i = 0; i < b; ++i) positions[static_cast<size_t>(t) * b + i] = t;
  be_.copy_from_host(s.positions, positions);
  set_slot_key(s, serial, training);
}

void GptModel::set_slot_key(Slot& s, uint64_t serial, bool training) {
  s.key = mix_key(mix_key(d_.seed, 0x64726f706f7574ULL /* "dropout" */), mix_key(serial, ps_.dp_rank));
  s.training = training;
  s.staged = true;
}

Tensor GptModel::stage_input(int slot) const { return slots_.at(static_cast<size_t>(slot)).input; }
Tensor GptModel::stage_output(int slot) const {
  const Slot& s = slots_.at(static_cast<size_t>(slot));
  return d_.stage_layers() ? s.layers.back().out : s.input;
}
Tensor GptModel::output_grad(int slot) const { return slots_.at(static_cast<size_t>(slot)).d_output; }
Tensor GptModel::input_grad() const { return last_input_grad_; }

// Dropout sites: 0 attention probabilities, 1 after the attention projection, 2 after the MLP,
// 3 the embeddings (layer -1).
uint64_t GptModel::site_key(const Slot& s, int layer, int site) const {
  return mix_key(s.key, static_cast<uint64_t>(layer + 1) * 8 + static_cast<uint64_t>(site));
}

// The attention of one layer for one slot (s == nullptr: the shape alone, for set-up).
AttentionShape GptModel::attention_shape(const Slot* s, int layer) const {
  AttentionShape as = AttentionShape::make(d_.micro_batch, d_.seq, d_.heads_local(), d_.groups_local(), d_.head_dim,
                                          /*causal=*/true, (s == nullptr || s->training) ? d_.attention_dropout : 0.0f);
  as.deterministic = opt_.deterministic;
  as.window_left = d_.window_left.at(static_cast<size_t>(layer));
  // The heads differ per TP rank, so their masks come from different streams.
  if (s) as.dropout_key = mix_key(site_key(*s, layer, 0), static_cast<uint64_t>(d_.tp_rank));
  return as;
}

// Dropout in the sequence-parallel regions: each TP rank drops its own rows, so its masks come
// from its own stream (Megatron forks the RNG there too). Without SP all TP ranks draw alike.
uint64_t GptModel::hidden_key(const Slot& s, int layer, int site) const {
  const uint64_t k = site_key(s, layer, site);
  return d_.sequence_parallel ? mix_key(k, 0x7370ULL + static_cast<uint64_t>(d_.tp_rank)) : k;
}

// ---- tensor-parallel row exchanges ---------------------------------------------------------
// With sequence parallelism the residual stream holds Nl = N/TP rows per rank: a column-parallel
// GEMM's input is all-gathered to N rows first, a row-parallel GEMM's output reduce-scattered back
// (instead of all-reduced); both in place, this rank's rows being its block of the full tensor.

// This rank's rows of a full [N, cols] tensor (the tensor itself without SP).
Tensor GptModel::local_rows(Tensor t) const {
  if (!d_.sequence_parallel) return t;
  const int64_t cols = t.numel() / d_.tokens(), nl = d_.tokens_local();
  return t.flat_slice(d_.local_row_begin() * cols, nl * cols).view({nl, cols});
}

// Fills the other ranks' rows of `full` from its local rows (SP only).
void GptModel::gather_rows(Tensor full) {
  if (d_.sequence_parallel) ps_.tp->all_gather(full, local_rows(full));
}

// Sums `full` (partial on each TP rank) over TP: all of it, or with SP only this rank's rows, which
// it returns.
Tensor GptModel::reduce_rows(Tensor full) {
  if (!d_.sequence_parallel) {
    ps_.tp->all_reduce(full);
    return full;
  }
  Tensor mine = local_rows(full);
  ps_.tp->reduce_scatter(mine, full);
  return mine;
}

// The gradient entering a row-parallel linear layer from its bias + dropout + residual output:
// dropout's backward of `local` (p > 0), then with SP gathered to all N rows (in ws_->gT).
Tensor GptModel::expand_grad(Tensor local, float p, uint64_t key, Tensor amax) {
  const Workspace& w = *ws_;
  MT_CHECK(amax.empty() || (p > 0 && !d_.sequence_parallel), "expand_grad: an amax without dropout or with SP");
  if (!d_.sequence_parallel) {
    if (p <= 0) return local;
    be_.dropout_backward(w.gT, local, p, key, amax);
    return w.gT;
  }
  Tensor mine = local_rows(w.gT);
  if (p > 0) be_.dropout_backward(mine, local, p, key);
  else be_.copy(mine, local);
  ps_.tp->all_gather(w.gT, mine);
  return w.gT;
}

// Grad-sync backward: sums the TP-partial gradients of `layer` (-1: the final norm) over TP.
void GptModel::reduce_tp_partial(int layer) {
  for (const auto& [l, r] : tp_partial_)
    if (l == layer) ps_.tp->all_reduce(grads_.flat_slice(r.offset, r.count));
}

void GptModel::grads_final(int first_param) {
  if (on_grads_final) on_grads_final(first_param);
}

void GptModel::params_needed(int end) {
  if (on_params_needed) on_params_needed(end);
}

Tensor GptModel::layer_input(const Slot& s, int local) const {
  return local == 0 ? s.input : acts(s, local - 1).out;
}

GptModel::LayerActs GptModel::acts(const Slot& s, int local) const {
  const int g = opt_.recompute.group_of[local];
  if (g < 0) return s.layers[local];
  // A recomputed layer: internals from the shared scratch, the output kept in the slot when the
  // next group (or the head) needs it.
  LayerActs a = scratch_[local - opt_.recompute.groups[g].first];
  if (!s.layers[local].out.empty()) a.out = s.layers[local].out;
  return a;
}

// ---- forward -----------------------------------------------------------------------------

void GptModel::embedding_forward(Slot& s) {
  const Globals& G = *globals_;
  const bool positions = d_.position == PositionEmbedding::learned_absolute && d_.tp_rank == 0;
  // Vocab-parallel: each rank contributes its vocabulary rows, summed over TP (with SP the sum
  // is reduce-scattered to the sequence shards).
  const Tensor full = d_.sequence_parallel ? ws_->tmp_h : s.input;
  be_.embedding_forward(full, s.tokens, s.positions, G.wte, positions ? G.wpe : Tensor(), d_.vocab_start());
  if (d_.sequence_parallel) ps_.tp->reduce_scatter(s.input, full);
  else ps_.tp->all_reduce(s.input);
  if (s.training && d_.hidden_dropout > 0) be_.dropout_backward(s.input, s.input, d_.hidden_dropout, hidden_key(s, -1, 3));
}

// A layer's output is read first by the norm after it. Where that layer and the next (or the
// head) run their forward only once (no full-recompute group: a group's rerun in backward must not
// write a neighbour's norm, whose statistics may share the group's scratch), the norm is written
// by the layer's closing bias + dropout + residual: one pass over the rows instead of two.
bool GptModel::norm_from_previous(int local) const {
  const auto& g = opt_.recompute.group_of;
  return opt_.seams.fuse_next_norm && local > 0 && g[static_cast<size_t>(local - 1)] < 0 && g[static_cast<size_t>(local)] < 0;
}

GptModel::NextNorm GptModel::next_norm(const Slot& s, int local) const {
  const auto& g = opt_.recompute.group_of;
  if (!opt_.seams.fuse_next_norm || g[static_cast<size_t>(local)] >= 0) return {};
  if (local + 1 < d_.stage_layers()) {
    if (!norm_from_previous(local + 1)) return {};
    const LayerActs n = acts(s, local + 1);
    const LayerParams& P = layer_params_[static_cast<size_t>(local + 1)];
    return {true, fp8_norm_cast(local + 1, n) ? Tensor() : local_rows(n.ln1_out), n.ln1_mean, n.ln1_rstd, P.ln1_w,
            P.ln1_b, norm_cast_amax(local + 1, n, Fp8State::qkv)};
  }
  if (!d_.last_stage) return {};
  const Workspace& w = *ws_;
  return {true, local_rows(w.y), w.fmean, w.frstd, globals_->final_w, globals_->final_b, Tensor()};
}

void GptModel::layer_forward(int local, Slot& s, const LayerActs& A, Tensor x, const NextNorm& next) {
  const LayerParams& P = layer_params_[local];
  const Workspace& w = *ws_;
  const int layer = d_.layer_begin + local;
  const float hp = s.training ? d_.hidden_dropout : 0.0f;
  fp8_training_ = s.training;

  // Attention block: norm -> QKV (column-parallel) -> [qk norm] -> [rope] -> attention ->
  // projection (row-parallel, all-reduce) -> bias + dropout + residual.
  // With fp8_norm_cast the norms write only their statistics and the QKV / fc1 casts read x.
  const bool norm_cast = fp8_norm_cast(local, A);
  if (!norm_from_previous(local))
    be_.norm_forward(norm_cast ? Tensor() : local_rows(A.ln1_out), A.ln1_mean, A.ln1_rstd, x, P.ln1_w, P.ln1_b, norm_,
                     norm_cast_amax(local, A, Fp8State::qkv));
  if (!norm_cast) gather_rows(A.ln1_out);
  const NormInput ln1{x, A.ln1_mean, A.ln1_rstd, P.ln1_w, P.ln1_b};
  const NormInput* ln1_src = norm_cast ? &ln1 : nullptr;
  RopeShape rs{d_.heads_local(), d_.groups_local(), d_.head_dim, d_.rot_dim, d_.rope_interleaved};
  if (d_.qk_norm) {
    linear_fwd(local, Fp8State::qkv, A, A.qkv_raw, A.ln1_out, P.qkv_w, P.qkv_b, Activation::none, Tensor(), ln1_src);
    be_.qk_norm_forward(A.qkv, A.qk_mean, A.qk_rstd, A.qkv_raw, P.q_ln_w, P.q_ln_b, P.k_ln_w, P.k_ln_b, rs,
                        qk_norm_params());
  } else {
    linear_fwd(local, Fp8State::qkv, A, A.qkv, A.ln1_out, P.qkv_w, P.qkv_b, Activation::none, Tensor(), ln1_src);
  }
  if (d_.position == PositionEmbedding::rope) be_.rope_forward(A.qkv, s.positions, rope_table_, rs);
  be_.attention_forward(A.attn_out, A.lse, A.qkv, attention_shape(&s, layer));
  linear_fwd(local, Fp8State::proj, A, w.tmp_h, A.attn_out, P.proj_w, Tensor(), Activation::none, Tensor());
  // The attention block's bias + dropout + residual and the MLP block's norm in one op (one pass
  // over the rows on the GPU; the reference runs bias_dropout_add, then norm_forward).
  be_.bias_dropout_add_norm(A.h1, norm_cast ? Tensor() : local_rows(A.ln2_out), A.ln2_mean, A.ln2_rstd, x,
                            reduce_rows(w.tmp_h), P.proj_b, hp, hidden_key(s, layer, 1), P.ln2_w, P.ln2_b, norm_,
                            norm_cast_amax(local, A, Fp8State::fc1));
  const NormInput ln2{A.h1, A.ln2_mean, A.ln2_rstd, P.ln2_w, P.ln2_b};

  // MLP block: norm (above) -> fc1 (column-parallel) + activation -> fc2 (row-parallel,
  // all-reduce) -> bias + dropout + residual.
  // With FP8 GEMMs, fc1 writes only its output (no GeLU epilogue) and fc2's input is cast to FP8
  // from it (fc2_fwd_from_fc1): the activation is never written in the compute dtype.
  if (!norm_cast) gather_rows(A.ln2_out);
  const MlpActivation mlp_act = d_.mlp_activation();
  if (fp8_gemms(local)) {
    linear_fwd(local, Fp8State::fc1, A, A.fc1_pre, A.ln2_out, P.fc1_w, P.fc1_b, Activation::none, Tensor(),
               norm_cast ? &ln2 : nullptr);
    fc2_fwd_from_fc1(local, A, w.tmp_h, A.fc1_pre, mlp_act);
  } else {
    if (d_.swiglu) {
      linear_fwd(local, Fp8State::fc1, A, A.fc1_pre, A.ln2_out, P.fc1_w, P.fc1_b, Activation::none, Tensor());
      be_.swiglu_forward(A.fc1_act, A.fc1_pre);
    } else {
      linear_fwd(local, Fp8State::fc1, A, A.fc1_act, A.ln2_out, P.fc1_w, P.fc1_b, d_.ungated_mlp_activation(),
                 A.fc1_pre);
    }
    linear_fwd(local, Fp8State::fc2, A, w.tmp_h, A.fc1_act, P.fc2_w, Tensor(), Activation::none, Tensor());
  }
  if (!next.fused)
    be_.bias_dropout_add(A.out, reduce_rows(w.tmp_h), P.fc2_b, A.h1, hp, hidden_key(s, layer, 2));
  else
    be_.bias_dropout_add_norm(A.out, next.out, next.mean, next.rstd, A.h1, reduce_rows(w.tmp_h), P.fc2_b, hp,
                              hidden_key(s, layer, 2), next.weight, next.bias, norm_, next.amax);
}

void GptModel::head_forward(Slot& s, Tensor x, bool norm_done) {
  const Globals& G = *globals_;
  const Workspace& w = *ws_;
  if (!norm_done) be_.norm_forward(local_rows(w.y), w.fmean, w.frstd, x, G.final_w, G.final_b, norm_);
  gather_rows(w.y);
  // The output layer runs over chunks of logits_rows_ rows, so that the logits (and, in place,
  // their gradient) exist for one chunk at a time; the head's whole backward but the final norm
  // happens per chunk. Vocab-parallel cross-entropy: per-shard log-sum-exp, gathered and
  // combined; the target logit lives on one shard (zero elsewhere), so a sum finds it.
  const int64_t N = d_.tokens(), V = d_.vocab_local(), tp = d_.tp_size;
  for (int64_t r0 = 0; r0 < N; r0 += logits_rows_) {
    const int64_t rows = std::min(logits_rows_, N - r0);
    const Tensor logits = w.logits.flat_slice(0, rows * V).view({rows, V});
    const Tensor y = w.y.row_slice(r0, rows), labels = s.labels.flat_slice(r0, rows);
    be_.linear_forward(logits, y, G.out_w, Tensor(), Activation::none, Tensor());
    Tensor lse = w.lse_part.flat_slice(r0, rows);
    // Training on the whole vocabulary (no TP): the loss and dlogits (in place) in one pass.
    const bool fused_ce = s.training && tp == 1;
    if (fused_ce)
      be_.cross_entropy_forward_backward(lse, w.target.flat_slice(r0, rows), logits, labels,
                                         s.dloss.flat_slice(r0, rows));
    else
      be_.cross_entropy_forward(lse, w.target.flat_slice(r0, rows), logits, labels, d_.vocab_start());
    if (tp > 1) {
      const Tensor parts = w.lse_parts.flat_slice(0, tp * rows).view({tp, rows});
      ps_.tp->all_gather(parts, lse);
      lse = w.lse.flat_slice(r0, rows);
      be_.logsumexp_combine(lse, parts);
    }
    if (!s.training) continue;
    // The output layer's backward, now: dlogits in place of the logits.
    if (!fused_ce)
      be_.cross_entropy_backward(logits, logits, labels, lse, s.dloss.flat_slice(r0, rows), d_.vocab_start());
    be_.linear_backward_weight(G.dout_w, Tensor(), logits, y, accumulate_weight_grad(G.dout_w));
    be_.linear_backward_input(w.gT.row_slice(r0, rows), logits, G.out_w, false, Activation::none, Tensor());
  }
  if (tp > 1) ps_.tp->all_reduce(w.target);
  be_.axpby(w.loss, 1.0f, tp > 1 ? w.lse : w.lse_part, -1.0f, w.target);
  be_.masked_loss_sum(s.training ? train_loss_ : eval_loss_, w.loss, s.mask, true);
  if (!s.training) return;
  const int last = d_.stage_layers() - 1;
  const Tensor last_fc2_db = last >= 0 && fc2_bias_grad_from_norm(last) ? layer_grads_[last].fc2_b : Tensor();
  be_.norm_backward(s.d_output, G.dfinal_w, G.dfinal_b, reduce_rows(w.gT), x, w.fmean, w.frstd, G.final_w, Tensor(),
                    last_fc2_db, norm_);
}

void GptModel::forward(int slot) {
  Slot& s = slots_.at(static_cast<size_t>(slot));
  MT_CHECK(s.staged, "forward of slot {} before stage_micro_batch", slot);
  const int L = d_.stage_layers();
  if (d_.first_stage) {
    params_needed(L > 0 ? layer_first_param_[0] : head_first_param_);
    embedding_forward(s);
  }
  bool head_norm_done = false;
  for (int l = 0; l < L; ++l) {
    const NextNorm next = next_norm(s, l);
    // Layer l's parameters; when it also writes the norm after it, that norm's too (the next
    // layer's, or the head's: all of them).
    const auto first_param_of = [&](int layer) {
      return layer < L ? layer_first_param_[static_cast<size_t>(layer)]
                       : layer == L ? head_first_param_ : static_cast<int>(descs_.size());
    };
    params_needed(first_param_of(next.fused ? l + 2 : l + 1));
    fp8_keep_inputs_now_ = opt_.recompute.group_of[static_cast<size_t>(l)] < 0;
    layer_forward(l, s, acts(s, l), layer_input(s, l), next);
    head_norm_done = l == L - 1 && next.fused;
  }
  fp8_keep_inputs_now_ = true;
  if (d_.last_stage) {
    params_needed(static_cast<int>(descs_.size()));
    head_forward(s, stage_output(slot), head_norm_done);
  }
}

// ---- backward ----------------------------------------------------------------------------

// A row-parallel layer's bias gradient is the column sums of its output gradient. Where a norm's
// backward on this stage writes that gradient (no dropout between, whole rows: no sequence
// parallelism), the norm kernel adds them up in the same pass instead of a separate read of it;
// not in FP8 layers, whose casts take the bias gradient. fc2's output gradient is the next layer's
// ln1 backward output (or the final norm's on the last stage); proj's is ln2's of the same layer.
bool GptModel::proj_bias_grad_from_norm(int local) const {
  return d_.linear_bias && d_.hidden_dropout <= 0 && !d_.sequence_parallel && !fp8_layer(local) &&
         opt_.seams.bias_grad_from_norm;
}
bool GptModel::fc2_bias_grad_from_norm(int local) const {
  return proj_bias_grad_from_norm(local) && (local + 1 < d_.stage_layers() || d_.last_stage);
}

void GptModel::layer_backward(int local, Slot& s, const LayerActs& A, Tensor x, Tensor dy, Tensor dx) {
  const LayerParams &P = layer_params_[local], &G = layer_grads_[local];
  const Workspace& w = *ws_;
  const int layer = d_.layer_begin + local;
  const float hp = s.training ? d_.hidden_dropout : 0.0f;

  // MLP block. dy is the gradient of out = h1 + dropout(fc2 + b2) (this rank's rows with SP;
  // d_fc2 has all rows). The activation (fc2's input) is recomputed from fc1_pre by the
  // activation's backward, the norm output (fc1's input), unless kept (A.norm_kept), by the norm's
  // backward (then gathered to all rows with SP, as Megatron re-gathers it), so the weight
  // gradients come after them. FP8 layers with kept inputs (fp8_kept_inputs) need neither for
  // their weight gradients.
  const bool kept = fp8_kept_inputs(local);
  const Tensor fc2_dy_amax = dy_amax_from_dropout(local, Fp8State::fc2);
  const Tensor d_fc2 = expand_grad(dy, hp, hidden_key(s, layer, 2), fc2_dy_amax);
  // fc2's and proj's bias gradients where the norm backwards that produce their output gradients
  // took them (fc2: the next layer's or the final norm's; proj: ln2's below).
  const Tensor fc2_db = fc2_bias_grad_from_norm(local) ? Tensor() : G.fc2_b;
  const bool proj_db_from_norm = proj_bias_grad_from_norm(local);
  const Tensor proj_db = proj_db_from_norm ? Tensor() : G.proj_b;
  Tensor d_fc1;  // gradient of fc1's output
  bool d_fc1_quantized = false;  // FP8: cast to FP8 here, straight from the activation's gradient
  linear_quantize_dy(local, Fp8State::fc2, d_fc2, G.fc2_b,
                     dy_amax_from_norm(s, local, Fp8State::fc2) || !fc2_dy_amax.empty());
  if (d_.swiglu && kept) {
    // FP8 with kept inputs: fc1's output gradient [dgate | dup] is cast to FP8 straight from fc2's
    // input gradient and fc1_pre (the same bits as swiglu_backward, then the cast), after fc2's
    // weight gradient (which still needs the FP8 workspaces of its own output gradient).
    linear_bwd_input(local, Fp8State::fc2, w.act, d_fc2, P.fc2_w, Activation::none, Tensor());
    linear_bwd_weight(local, Fp8State::fc2, A, G.fc2_w, fc2_db, d_fc2, w.act);
    linear_quantize_dy_activation(local, w.act, A.fc1_pre, MlpActivation::swiglu, G.fc1_b);
    d_fc1 = A.fc1_pre;  // (its shape: the FP8 GEMMs below read only the quantized copies)
    d_fc1_quantized = true;
  } else if (d_.swiglu) {
    linear_bwd_input(local, Fp8State::fc2, w.act, d_fc2, P.fc2_w, Activation::none, Tensor());
    // In place: fc1_pre becomes its gradient and the activation gradient becomes the activation.
    be_.swiglu_backward_recompute(A.fc1_pre, w.act, w.act, A.fc1_pre);
    d_fc1 = A.fc1_pre;
    linear_bwd_weight(local, Fp8State::fc2, A, G.fc2_w, fc2_db, d_fc2, w.act);
  } else if (fp8_wgrad(local)) {
    // FP8 GEMMs with FP8 weight gradients: fc2's input gradient comes out plain (no DGELU epilogue)
    // into gFC, and fc1's output gradient gFC * act'(fc1_pre) is cast to FP8 (with fc1's bias
    // gradient) straight from it: never written in the compute dtype. Without kept inputs fc1_pre
    // must first become the activation (in place) for fc2's weight gradient, so fc1's output
    // gradient is formed by activation_backward in gFC and cast after it (the same bits as the
    // fused cast).
    const Activation act = d_.ungated_mlp_activation();
    linear_bwd_input(local, Fp8State::fc2, w.gFC, d_fc2, P.fc2_w, Activation::none, Tensor());
    if (kept) {
      linear_bwd_weight(local, Fp8State::fc2, A, G.fc2_w, fc2_db, d_fc2, A.fc1_pre);
      linear_quantize_dy_activation(local, w.gFC, A.fc1_pre, d_.mlp_activation(), G.fc1_b);
    } else {
      be_.activation_backward(w.gFC, w.gFC, A.fc1_pre, act);
      be_.activation_forward(A.fc1_pre, A.fc1_pre, act);
      linear_bwd_weight(local, Fp8State::fc2, A, G.fc2_w, fc2_db, d_fc2, A.fc1_pre);
      linear_quantize_dy(local, Fp8State::fc1, w.gFC, G.fc1_b);
    }
    d_fc1 = w.gFC;  // (its shape: the FP8 GEMMs below read only the quantized copies)
    d_fc1_quantized = true;
  } else if (A.act_kept && !fp8_gemms(local)) {
    // The activation kept from forward: fc2's input gradient takes the activation's backward
    // (cuBLASLt's DGELU epilogue for the tanh GeLU) into gFC, and its weight gradient the kept
    // activation.
    const Activation act = d_.ungated_mlp_activation();
    linear_bwd_input(local, Fp8State::fc2, w.gFC, d_fc2, P.fc2_w, act, A.fc1_pre);
    d_fc1 = w.gFC;
    linear_bwd_weight(local, Fp8State::fc2, A, G.fc2_w, fc2_db, d_fc2, A.fc1_act);
  } else {
    // fc1_pre becomes the activation (in place, unless kept); the gradient goes to gFC.
    const Activation act = d_.ungated_mlp_activation();
    if (fp8_gemms(local)) {
      linear_bwd_input(local, Fp8State::fc2, w.gFC, d_fc2, P.fc2_w, act, A.fc1_pre);
      if (!kept) be_.activation_forward(A.fc1_pre, A.fc1_pre, act);
    } else {
      be_.linear_backward_input_recompute(w.gFC, A.fc1_pre, d_fc2, compute_weight(local, Fp8State::fc2, P.fc2_w), act,
                                          A.fc1_pre);
    }
    d_fc1 = w.gFC;
    linear_bwd_weight(local, Fp8State::fc2, A, G.fc2_w, fc2_db, d_fc2, A.fc1_pre);
  }
  if (!d_fc1_quantized) linear_quantize_dy(local, Fp8State::fc1, d_fc1, G.fc1_b);
  if (d_.sequence_parallel) {
    column_parallel_backward_sp(local, Fp8State::fc1, A, A.ln2_out, A.ln2_mean, A.ln2_rstd, A.h1, P.ln2_w, P.ln2_b,
                                G.ln2_w, G.ln2_b, d_fc1, P.fc1_w, G.fc1_w, G.fc1_b, w.gH, dy);
  } else {
    linear_bwd_input(local, Fp8State::fc1, w.gT, d_fc1, P.fc1_w, Activation::none, Tensor());  // (d_fc2 is dead)
    // Column-parallel input gradient: summed over TP.
    if (kept || A.norm_kept)
      be_.norm_backward(w.gH, G.ln2_w, G.ln2_b, reduce_rows(w.gT), A.h1, A.ln2_mean, A.ln2_rstd, P.ln2_w, dy,
                        proj_db_from_norm ? G.proj_b : Tensor(), norm_, dy_amax_slot(s, local, Fp8State::proj));
    else
      be_.norm_backward_recompute(local_rows(A.ln2_out), w.gH, G.ln2_w, G.ln2_b, reduce_rows(w.gT), A.h1, A.ln2_mean,
                                  A.ln2_rstd, P.ln2_w, P.ln2_b, dy, proj_db_from_norm ? G.proj_b : Tensor(), norm_);
    linear_bwd_weight(local, Fp8State::fc1, A, G.fc1_w, G.fc1_b, d_fc1, A.ln2_out);
  }

  // Attention block. gH is the gradient of h1 = x + dropout(proj + b).
  const Tensor proj_dy_amax = dy_amax_from_dropout(local, Fp8State::proj);
  const Tensor d_proj = expand_grad(w.gH, hp, hidden_key(s, layer, 1), proj_dy_amax);
  linear_quantize_dy(local, Fp8State::proj, d_proj, G.proj_b,
                     dy_amax_from_norm(s, local, Fp8State::proj) || !proj_dy_amax.empty());
  linear_bwd_weight(local, Fp8State::proj, A, G.proj_w, proj_db, d_proj, A.attn_out);
  linear_bwd_input(local, Fp8State::proj, w.gATT, d_proj, P.proj_w, Activation::none, Tensor());
  be_.attention_backward(w.gQKV, w.gATT, A.attn_out, A.lse, A.qkv, attention_shape(&s, layer));
  RopeShape rs{d_.heads_local(), d_.groups_local(), d_.head_dim, d_.rot_dim, d_.rope_interleaved};
  if (d_.position == PositionEmbedding::rope) be_.rope_backward(w.gQKV, s.positions, rope_table_, rs);
  if (d_.qk_norm)
    be_.qk_norm_backward(w.gQKV, G.q_ln_w, G.q_ln_b, G.k_ln_w, G.k_ln_b, w.gQKV, A.qkv_raw, A.qk_mean, A.qk_rstd,
                         P.q_ln_w, P.k_ln_w, rs, qk_norm_params());
  linear_quantize_dy(local, Fp8State::qkv, w.gQKV, G.qkv_b);
  // dx is the previous layer's output gradient: its fc2 bias gradient is dx's column sums.
  const Tensor prev_fc2_db = local > 0 && fc2_bias_grad_from_norm(local - 1) ? layer_grads_[local - 1].fc2_b : Tensor();
  if (d_.sequence_parallel) {
    column_parallel_backward_sp(local, Fp8State::qkv, A, A.ln1_out, A.ln1_mean, A.ln1_rstd, x, P.ln1_w, P.ln1_b, G.ln1_w,
                                G.ln1_b, w.gQKV, P.qkv_w, G.qkv_w, G.qkv_b, dx, w.gH);
  } else {
    linear_bwd_input(local, Fp8State::qkv, w.gT, w.gQKV, P.qkv_w, Activation::none, Tensor());
    if (kept || A.norm_kept)
      be_.norm_backward(dx, G.ln1_w, G.ln1_b, reduce_rows(w.gT), x, A.ln1_mean, A.ln1_rstd, P.ln1_w, w.gH, prev_fc2_db,
                        norm_, dy_amax_slot(s, local - 1, Fp8State::fc2));
    else
      be_.norm_backward_recompute(local_rows(A.ln1_out), dx, G.ln1_w, G.ln1_b, reduce_rows(w.gT), x, A.ln1_mean,
                                  A.ln1_rstd, P.ln1_w, P.ln1_b, w.gH, prev_fc2_db, norm_);
    linear_bwd_weight(local, Fp8State::qkv, A, G.qkv_w, G.qkv_b, w.gQKV, A.ln1_out);
  }
}

// Norm -> column-parallel linear under sequence parallelism, backward from the linear's output
// gradient d_out (all rows) to dx (this rank's rows), in Megatron's overlapped order: the norm
// output is recomputed for this rank's rows (norm_forward from the norm's input: the same bits, the
// statistics rewritten with the values they hold) and all-gathered on the TP stream while the
// input-gradient GEMM runs; that gradient is reduce-scattered on the TP stream while the
// weight-gradient GEMM runs; then the norm's backward. (gT holds the input gradient, all rows.)
// FP8 layers with kept inputs skip the recompute and the all-gather: the weight-gradient GEMM
// takes the forward's FP8 copy of the gathered norm output (A.fp8_xq_t), and the norm's backward
// needs only its input and statistics.
void GptModel::column_parallel_backward_sp(int local, Fp8State::Gemm fp8_slot, const LayerActs& A, Tensor norm_out,
                                           Tensor norm_mean, Tensor norm_rstd, Tensor norm_in, Tensor norm_w,
                                           Tensor norm_b, Tensor norm_dw, Tensor norm_db, Tensor d_out, Tensor weight,
                                           Tensor dweight, Tensor dbias, Tensor dx, Tensor dresidual) {
  const Workspace& w = *ws_;
  const bool gather = !fp8_kept_inputs(local);
  if (gather) {
    be_.norm_forward(local_rows(norm_out), norm_mean, norm_rstd, norm_in, norm_w, norm_b, norm_);
    be_.tp_comm_wait_for_compute();
    tp_overlap_->all_gather(norm_out, local_rows(norm_out));
  }
  // (On the copy engines the all-gather needs SMs only for its few synchronizing steps; leaving the
  // GEMM fewer SMs for them measured no gain: bench_tp_overlap, bench/RESULTS.md.)
  linear_bwd_input(local, fp8_slot, w.gT, d_out, weight, Activation::none, Tensor());
  if (gather) be_.compute_wait_for_tp_comm();  // the norm output, all rows
  be_.tp_comm_wait_for_compute();  // the input gradient
  tp_overlap_->reduce_scatter(local_rows(w.gT), w.gT);
  linear_bwd_weight(local, fp8_slot, A, dweight, dbias, d_out, norm_out);
  be_.compute_wait_for_tp_comm();
  be_.norm_backward(dx, norm_dw, norm_db, local_rows(w.gT), norm_in, norm_mean, norm_rstd, norm_w, dresidual, Tensor(),
                    norm_);
}

void GptModel::embedding_backward(Slot& s, Tensor grad) {
  const Globals& G = *globals_;
  if (s.training && d_.hidden_dropout > 0) be_.dropout_backward(grad, grad, d_.hidden_dropout, hidden_key(s, -1, 3));
  if (d_.sequence_parallel) {  // the embeddings need the gradient of every row
    ps_.tp->all_gather(ws_->gT, grad);
    grad = ws_->gT;
  }
  const bool positions = d_.position == PositionEmbedding::learned_absolute;
  zero_grad_if_unwritten(G.dwte);  // the scatter adds (the tied output layer's GEMM may have written first)
  be_.embedding_backward(G.dwte, positions ? G.dwpe : Tensor(), grad, s.tokens, s.positions, d_.vocab_start());
}

void GptModel::backward(int slot, bool grad_sync) {
  Slot& s = slots_.at(static_cast<size_t>(slot));
  MT_CHECK(s.staged && s.training, "backward of slot {} without a training forward", slot);
  const Workspace& w = *ws_;
  const RecomputePlan& rp = opt_.recompute;
  // After each layer of a grad-sync backward its gradients are final: TP-partial ones are summed
  // now, and the hook may start the data-parallel reduction of the buckets they complete.
  auto layer_done = [&](int local) {
    if (!grad_sync) return;
    reduce_tp_partial(d_.layer_begin + local);
    grads_final(layer_first_param_[static_cast<size_t>(local)]);
  };
  if (grad_sync && d_.last_stage) {  // the head's backward ran in the last forward
    reduce_tp_partial(-1);
    grads_final(head_first_param_);
  }
  Tensor cur = s.d_output;
  auto next_buffer = [&](Tensor c) { return c.data == w.gA.data ? w.gB : w.gA; };
  int l = d_.stage_layers() - 1;
  while (l >= 0) {
    const int g = rp.group_of[l];
    if (g >= 0) {
      // Full recompute: rerun the group's forward from its kept input, then its backward.
      const auto [begin, end] = rp.groups[g];
      MT_CHECK(end - 1 == l, "recompute group [{}, {}) entered at layer {}", begin, end, l);
      for (int k = begin; k < end; ++k) layer_forward(k, s, acts(s, k), layer_input(s, k));
      for (int k = end - 1; k >= begin; --k) {
        Tensor nxt = next_buffer(cur);
        layer_backward(k, s, acts(s, k), layer_input(s, k), cur, nxt);
        cur = nxt;
        layer_done(k);
      }
      l = begin - 1;
    } else {
      Tensor nxt = next_buffer(cur);
      layer_backward(l, s, acts(s, l), layer_input(s, l), cur, nxt);
      cur = nxt;
      layer_done(l);
      --l;
    }
  }
  if (d_.first_stage) embedding_backward(s, cur);
  last_input_grad_ = cur;
  if (grad_sync) grads_final(0);
}

}  // namespace mt

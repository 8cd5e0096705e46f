#include "engine/gpt_model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>

#include "core/error.h"
#include "core/master_remainder.h"
#include "core/philox.h"
#include "engine/blocks/attention_core.h"
#include "engine/gpt_model_parts.h"
#include "engine/muon.h"
#include "parallel/parallel_state.h"
#include "parallel/parallel_state_builder.h"

namespace mt {

namespace {

// The dense FP8 GEMM (Fp8State::Gemm) whose weight params()[i] is, or -1.
int dense_gemm_of(const ParamDesc& p) {
  static const char* const kGemmWeights[Fp8State::kGemms] = {".self_attention.linear_qkv.weight",
                                                             ".self_attention.linear_proj.weight",
                                                             ".mlp.linear_fc1.weight", ".mlp.linear_fc2.weight"};
  for (int g = 0; g < Fp8State::kGemms; ++g)
    if (p.name.ends_with(kGemmWeights[g])) return g;
  return -1;
}

}  // namespace

// ---- pieces ------------------------------------------------------------------------------

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
  // (The mtp layers run their forward and backward at once, in the head: never recomputed.)
  o.recompute = RecomputePlan::from_config(cfg.train, d.decoder_layers());
  o.recompute.group_of.resize(static_cast<size_t>(d.stage_layers()), -1);
  const std::vector<std::string>& modules = cfg.train.recompute_modules;
  o.keep_norm_outputs = !(cfg.train.recompute_granularity == RecomputeGranularity::selective &&
                          std::find(modules.begin(), modules.end(), "layernorm") != modules.end());
  o.mla_recompute_up = d.mla && cfg.train.recompute_granularity == RecomputeGranularity::selective &&
                       std::find(modules.begin(), modules.end(), "mla_up_proj") != modules.end();
  const auto selective = [&](const char* m) {
    return cfg.train.recompute_granularity == RecomputeGranularity::selective &&
           std::find(modules.begin(), modules.end(), m) != modules.end();
  };
  o.moe_recompute_fc1 = d.any_moe() && selective("moe");
  o.moe_recompute_shared = d.any_moe() && d.shared_ffn > 0 && (selective("moe") || selective("shared_experts"));
  o.offload = OffloadOptions::from_config(cfg.train, d.pp_rank);
  o.optimizer = cfg.train.optimizer;
  o.sgd_momentum = cfg.train.sgd_momentum != 0.0;
  o.muon = cfg.train.muon;
  o.rope.base = cfg.model.rotary_base;
  o.rope.llama3_scaling = cfg.model.use_rope_scaling;
  o.rope.scaling_factor = cfg.model.rope_scaling_factor;
  o.rope.seq_len_interpolation_factor = cfg.model.rotary_seq_len_interpolation_factor;
  const ModelConfig& m = cfg.model;
  if (m.multi_latent_attention) {
    // MLA's own RoPE (MultiLatentAttention): plain, or YaRN with MLATransformerConfig's fixed
    // original context and betas (Megatron's --yarn-* flags do not reach it).
    o.rope.llama3_scaling = false;
    o.rope.seq_len_interpolation_factor.reset();
    if (mla_rope_is_yarn(m)) o.rope.yarn = YarnParams{m.rotary_scaling_factor, 4096, 32, 1, m.mscale, m.mscale_all_dim, true};
  } else if (m.position_embedding_type == PositionEmbedding::yarn) {
    o.rope.yarn = YarnParams{m.rotary_scaling_factor,
                             m.yarn_original_max_position_embeddings.value_or(4096),
                             m.yarn_beta_fast.value_or(32.0),
                             m.yarn_beta_slow.value_or(1.0),
                             m.mscale,
                             m.mscale_all_dim,
                             m.yarn_correction_range_round_to_int.value_or(true)};
  }
  // Megatron's unfused attention computes the same function as megatrain's flash kernels (which
  // never store the scores); --attention-backend unfused runs those, deterministic like it.
  o.attention_backend = cfg.model.attention_backend == AttentionBackend::unfused ? AttentionBackend::flash
                                                                                : cfg.model.attention_backend;
  o.deterministic = cfg.train.deterministic_mode;
  o.documents = cfg.data.documents();
  o.fp8 = Fp8Options::from_config(cfg);
  // --exp-avg-dtype / --exp-avg-sq-dtype bf16 (precision-aware optimizer; the others are refused).
  o.bf16_exp_avg = cfg.train.exp_avg_dtype == StateDtype::bf16;
  o.bf16_exp_avg_sq = cfg.train.exp_avg_sq_dtype == StateDtype::bf16;
  // Knowledge distillation: this model is the student (the teacher: engine/model_chunks.h).
  const DistillConfig& kd = cfg.train.distill;
  if (kd.enabled()) {
    o.distill.enabled = true;
    o.distill.inv_temperature = static_cast<float>(1.0 / kd.logit_kl_temperature);
    // (ModelOpt keys its losses by the pair: a pair given twice takes its last loss function.)
    for (const DistillConfig::Pair& p : kd.intermediate_layer_pairs) {
      const ModelOptions::Distill::Pair q{DistillConfig::hidden_state_layer(p.student), DistillConfig::hidden_state_layer(p.teacher),
                                          p.mse ? Backend::HiddenLoss::mse : Backend::HiddenLoss::cosine};
      auto same = std::find_if(o.distill.pairs.begin(), o.distill.pairs.end(),
                               [&](const auto& x) { return x.student == q.student && x.teacher == q.teacher; });
      if (same != o.distill.pairs.end()) same->loss = q.loss;
      else o.distill.pairs.push_back(q);
    }
  }
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

// Fully sharded units (ModelOptions::shard_grads / shard_params): slots the size of the largest
// layer's buckets (under expert parallelism a layer has two: its routed experts' and the rest; with
// FP8 parameters their FP8 bucket too), and per bucket its storage: a layer's a view of its slot
// (local layer l in l % slots.size()), one bucket after the other, the others' whole. Only the buckets `take`
// accepts (the others get an empty tensor: FP8 parameters' buckets have slots of their own dtype).
std::vector<Tensor> layout_unit_buffers(Arena& a, MemoryCategory c, DType t, const GradLayout& L, int layer_begin,
                                        std::span<Tensor> slots, const std::function<bool(int)>& take = nullptr) {
  const int n_slots = static_cast<int>(slots.size());
  const auto taken = [&](int b) { return !take || take(b); };
  std::map<int, int64_t> unit_numel;  // per unit: its buckets' elements so far
  std::vector<int64_t> at(static_cast<size_t>(L.num_buckets()), 0);  // a unit bucket's place in its slot
  for (int b = 0; b < L.num_buckets(); ++b)
    if (const int unit = L.bucket_unit[static_cast<size_t>(b)]; unit >= 0 && taken(b)) {
      at[static_cast<size_t>(b)] = unit_numel[unit];
      unit_numel[unit] += L.plan.buckets[static_cast<size_t>(b)].numel;
    }
  int64_t largest_unit = 0;
  for (const auto& [unit, n] : unit_numel) largest_unit = std::max(largest_unit, n);
  for (Tensor& slot : slots)
    if (largest_unit > 0) slot = a.take(c, t, {largest_unit});
  std::vector<Tensor> storage;
  for (int b = 0; b < L.num_buckets(); ++b) {
    const int64_t n = L.plan.buckets[static_cast<size_t>(b)].numel;
    const int unit = L.bucket_unit[static_cast<size_t>(b)];
    storage.push_back(!taken(b)   ? Tensor()
                      : unit >= 0 ? slots[static_cast<size_t>((unit - layer_begin) % n_slots)].flat_slice(
                                            at[static_cast<size_t>(b)], n)
                                  : a.take(c, t, {n}));
  }
  return storage;
}

// The bucket holding [offset, offset + numel) of the flat layout (it must lie inside one).
int bucket_of_range(const GradLayout& L, int64_t offset, int64_t numel) {
  for (int b = 0; b < L.num_buckets(); ++b) {
    const GradBucket& k = L.plan.buckets[static_cast<size_t>(b)];
    if (offset >= k.offset && offset + numel <= k.offset + k.numel) return b;
  }
  fail("range [{}, {}) of the flat buffers is not inside one bucket", offset, offset + numel);
}

}  // namespace

GptModel::GptModel(const ModelDims& dims, const ModelOptions& options, ParallelState& ps, Backend& backend)
    : d_(dims), opt_(options), ps_(ps), be_(backend) {
  MT_CHECK(opt_.num_slots >= 1, "num_slots {}", opt_.num_slots);
  MT_CHECK(opt_.accum == DType::f32 || opt_.accum == DType::f64, "accum dtype");
  MT_CHECK(opt_.grad == opt_.accum || opt_.grad == DType::bf16, "main gradients in {} with accum {}",
           dtype_name(opt_.grad), dtype_name(opt_.accum));
  MT_CHECK(!opt_.master_remainders || (opt_.compute == DType::bf16 && opt_.accum == DType::f32 &&
                                       (opt_.shard_optimizer_state || opt_.grad == opt_.accum) &&
                                       !opt_.fp8.param_gather),
           "master-weight remainders need bf16 parameters, float32 master weights, the distributed optimizer or "
           "float32 main gradients, and no FP8 parameters");
  MT_CHECK(!opt_.master_tie_bits || opt_.master_remainders, "master tie bits without master-weight remainders");
  MT_CHECK(!opt_.shard_grads || opt_.shard_optimizer_state, "sharded gradients need the distributed optimizer");
  MT_CHECK(!opt_.shard_params || (opt_.shard_grads && !opt_.master_remainders),
           "sharded parameters need sharded gradients and no master-weight remainders");
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
  if (offload_.ring > 0) be_.reserve_offload_marks(offload_mark(opt_.num_slots, 0, 0));
  bind_params();
  plan_grad_zeroing();
  for (Fp8State* st : fp8_states()) st->initialize(be_);
  if (fp8_.any()) be_.prepare_fp8_gemms();
  if (d_.any_moe()) be_.prepare_grouped_gemms(d_.experts_local());
  attention_core_ = make_local_attention(be_);  // the FP8 GEMMs' workspace now, not in the first step
  if (d_.cp_size > 1) {  // one context-parallel core per comm type the stage's layers use
    MT_CHECK(ps_.cp && ps_.cp_size == d_.cp_size, "context parallelism {} without its group", d_.cp_size);
    cp_cores_.resize(4);
    for (int layer = d_.layer_begin; layer < d_.layer_end; ++layer) {
      auto& core = cp_cores_.at(static_cast<size_t>(d_.cp_comm.at(static_cast<size_t>(layer))));
      if (!core)
        core = make_context_parallel_attention(be_, *ps_.cp, d_.cp_rank, d_.cp_comm[static_cast<size_t>(layer)],
                                               d_.cp_a2a_size, ws_->cp);
    }
  }
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
  std::vector<std::pair<AttentionCore*, int>> reserved;  // (core, window)
  for (int layer = d_.layer_begin; layer < d_.layer_end; ++layer) {
    const AttentionShape shape = attention_shape(nullptr, layer);
    const std::pair<AttentionCore*, int> key{&attention_core(layer), shape.window_left};
    if (std::find(reserved.begin(), reserved.end(), key) != reserved.end()) continue;
    reserved.push_back(key);
    key.first->reserve(shape, opt_.attention_backend, opt_.compute);
  }
  if (d_.qk_l2) be_.fill(qk_l2_ones_, 1.0);
  if (d_.position == PositionEmbedding::rope || d_.mla) {
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
  MT_CHECK(opt_.shard_size >= 1 && opt_.shard_rank >= 0 && opt_.shard_rank < opt_.shard_size,
           "optimizer shard rank {} of {}", opt_.shard_rank, opt_.shard_size);
  descs_ = build_param_descs(d_, &total_elements_);
  // --fp8-param-gather: the linear weights of FP8 layers are stored as FP8 only.
  plan_fp8_states();
  fp8_param_slot_.assign(descs_.size(), {});
  if (opt_.fp8.param_gather) {
    MT_CHECK(opt_.shard_optimizer_state, "FP8 parameters (--fp8-param-gather) need the distributed optimizer");
    for (size_t i = 0; i < descs_.size(); ++i) {
      fp8_param_slot_[i] = fp8_param_slot(descs_[i]);
      descs_[i].fp8_storage = fp8_param_slot_[i].state != nullptr;
    }
  }
  MT_CHECK((opt_.expert_shard_size > 0) == d_.experts_own_grid(), "expert-DP size {} with EP {} and expert TP {}",
           opt_.expert_shard_size, d_.ep_size, d_.etp_size);
  grad_layout_ = layout_grad_buffer(descs_, opt_.shard_size, opt_.shard_rank, opt_.bucket_size, opt_.shard_optimizer_state,
                                    d_.pipeline && (d_.tied_embeddings || d_.mtp > 0), &total_elements_,
                                    ExpertDpGroup{opt_.expert_shard_size, opt_.expert_shard_rank},
                                    opt_.shard_grads ? std::optional<int>(d_.num_layers) : std::nullopt);
  unit_buckets_.assign(static_cast<size_t>(d_.stage_layers()), {});
  for (int b = 0; b < static_cast<int>(grad_layout_.bucket_unit.size()); ++b)
    if (const int u = grad_layout_.bucket_unit[static_cast<size_t>(b)]; u >= 0)
      unit_buckets_[static_cast<size_t>(u - d_.layer_begin)].push_back(b);
  param_bucket_.assign(descs_.size(), 0);
  for (size_t k = 0; k < grad_layout_.plan_param.size(); ++k)
    param_bucket_[static_cast<size_t>(grad_layout_.plan_param[k])] = grad_layout_.plan.params[k].bucket;
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
  fp8_fresh_.assign(static_cast<size_t>(d_.stage_layers()), 0);
  fp8_weight_amax_taken_.assign(static_cast<size_t>(d_.stage_layers()), 0);
  fp8_weight_gemm_.assign(descs_.size(), {-1, -1});
  for (size_t i = 0; i < descs_.size(); ++i)
    if (opt_.fp8.global_layer_fp8(descs_[i].layer) && dense_gemm_of(descs_[i]) >= 0)
      fp8_weight_gemm_[i] = {descs_[i].layer - d_.layer_begin, dense_gemm_of(descs_[i])};
}

// The three FP8 scaling states: the dense layers' four GEMMs, the routed experts' (MoE layers) and
// the extra ones (multi-latent attention's, the MTP projection's, the shared experts').
void GptModel::plan_fp8_states() {
  fp8_.plan(opt_.fp8, d_.layer_begin, d_.layer_end);
  const size_t L = static_cast<size_t>(std::max(d_.layer_end, 0));
  std::vector<char> moe(L, 0), extra(L, 0);
  for (int l = d_.layer_begin; l < d_.layer_end; ++l) {
    moe[static_cast<size_t>(l)] = d_.is_moe(l) ? 1 : 0;
    extra[static_cast<size_t>(l)] = d_.mla || d_.is_mtp(l) || (d_.is_moe(l) && d_.shared_ffn > 0) ? 1 : 0;
  }
  fp8_ex_.plan_subset(opt_.fp8, d_.layer_begin, d_.layer_end, moe, 2 * std::max(d_.experts_local(), 1), true);
  fp8_extra_.plan_subset(opt_.fp8, d_.layer_begin, d_.layer_end, extra, extra_gemms(), false);
}

// Which state's weight operand casts parameter p where it is an FP8 parameter (the weight of a GEMM
// that runs in FP8), by the name Megatron gives it.
GptModel::Fp8ParamSlot GptModel::fp8_param_slot(const ParamDesc& p) const {
  const int local = p.layer - d_.layer_begin;
  if (p.layer < 0 || local >= d_.stage_layers()) return {};
  const std::string_view n = p.name;
  if (fp8_ex_.layer_fp8(local)) {
    for (int which = 0; which < 2; ++which)
      if (n.ends_with(which == 0 ? ".mlp.experts.linear_fc1.weight" : ".mlp.experts.linear_fc2.weight"))
        return {&fp8_ex_, local, which, 2, p.numel() / d_.experts_local()};
  }
  if (fp8_extra_.layer_fp8(local)) {
    struct Named {
      const char* suffix;
      int gemm;
    };
    const Named extra[] = {{".self_attention.linear_q_down_proj.weight", kMlaQDown},
                           {".self_attention.linear_q_up_proj.weight", kMlaQ},
                           {".self_attention.linear_q_proj.weight", kMlaQ},
                           {".self_attention.linear_kv_down_proj.weight", kMlaKvDown},
                           {".self_attention.linear_kv_up_proj.weight", kMlaKvUp},
                           {".self_attention.linear_proj.weight", kMlaProj},
                           {".eh_proj.weight", extra_eh_gemm()},
                           {".mlp.shared_experts.linear_fc1.weight", extra_shared_gemm(0)},
                           {".mlp.shared_experts.linear_fc2.weight", extra_shared_gemm(1)}};
    for (const Named& e : extra) {
      // (The attention entries are multi-latent attention's: another layer's linear_proj is fp8_'s.)
      if (std::string_view(e.suffix).starts_with(".self_attention.") && !d_.mla) continue;
      if (n.ends_with(e.suffix)) return {&fp8_extra_, local, e.gemm, 1, p.numel()};
    }
  }
  const int g = dense_gemm_of(p);
  if (g >= 0 && fp8_.layer_fp8(local) && !(d_.mla && g < Fp8State::fc1) && !(d_.is_moe(p.layer) && g >= Fp8State::fc1))
    return {&fp8_, local, g, 1, p.numel()};
  return {};
}

MemoryPlan GptModel::plan_memory(const ModelDims& dims, const ModelOptions& options) {
  std::unique_ptr<Backend> host = make_reference_backend(1);  // measuring touches no memory
  ParallelState ps = make_single_process_state();
  GptModel m(dims, options, ps, *host, MeasureOnly{});
  return m.memory_plan();
}

GptModel::~GptModel() {
  if (offload_host_) be_.deallocate_host(offload_host_);
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

// Local layer `local`'s blocks: its MLP (dense or MoE) and its attention (softmax or Gated DeltaNet).
GptModel::LayerKinds GptModel::layer_kinds(int local) const {
  const int layer = d_.layer_begin + local;
  const bool moe = d_.is_moe(layer), gdn = d_.is_gdn(layer);
  return {!moe, moe, !gdn, gdn};
}

// What a layer keeps from forward for backward, declared block by block in this order (the
// arena's offsets follow it): the attention block's (or Gated DeltaNet's), the MLP block's, then
// the FP8 copies of the four linear inputs (blocks/attention.cpp, blocks/gdn.cpp, blocks/mlp.cpp,
// blocks/linear.cpp).
GptModel::LayerActs GptModel::layout_layer_acts(Arena& a, MemoryCategory c, bool keep_out, bool fp8_inputs,
                                                bool keep_act, LayerKinds kinds) {
  LayerActs A;
  A.norm_kept = keeps_norm_outputs(fp8_inputs);
  layout_attention_acts(a, c, A, kinds.softmax, kinds.gdn);
  layout_mlp_acts(a, c, A, keep_act, keep_out, kinds.dense, kinds.moe);
  if (fp8_inputs) layout_fp8_inputs(a, c, A, kinds.dense, !d_.mla);
  return A;
}

void GptModel::layout(Arena& a) {
  using C = MemoryCategory;
  const DType T = opt_.compute, S = opt_.accum;
  const int64_t N = d_.tokens(), Nl = d_.tokens_local(), h = d_.hidden, total = total_elements_;
  const int64_t state = grad_layout_.state_numel;  // == total unless sharded
  const int64_t fp8_begin = grad_layout_.fp8_begin;  // == total without FP8 parameters
  params_ = param_shards_ = fp8_param_shards_ = Tensor();
  for (int k = 0; k < kMaxUnitSlots; ++k) param_slots_[k] = fp8_param_slots_[k] = Tensor();
  const auto unit_slots = [&](Tensor(&slots)[kMaxUnitSlots]) {
    return std::span<Tensor>(slots, static_cast<size_t>(opt_.unit_slots));
  };
  param_bucket_storage_.clear();
  param_shard_storage_.clear();
  fp8_params_ = Tensor();
  if (opt_.shard_params) {
    // The layers' slots and this rank's shards of every bucket (only the layers' are used); the
    // other buckets whole. FP8 parameters' buckets in slots and shards of their own, as FP8 bytes.
    const GradLayout& L = grad_layout_;
    const DType e4 = fp8_.dtype(Fp8State::w);
    param_bucket_storage_ = layout_unit_buffers(a, C::parameters, T, L, d_.layer_begin, unit_slots(param_slots_),
                                                [&](int b) { return !L.fp8_bucket(b); });
    if (fp8_params()) {
      const std::vector<Tensor> fp8 = layout_unit_buffers(a, C::parameters, e4, L, d_.layer_begin,
                                                          unit_slots(fp8_param_slots_),
                                                          [&](int b) { return L.fp8_bucket(b); });
      for (int b = 0; b < L.num_buckets(); ++b)
        if (L.fp8_bucket(b)) param_bucket_storage_[static_cast<size_t>(b)] = fp8[static_cast<size_t>(b)];
    }
    int64_t numel[2] = {0, 0};  // shards: compute dtype, FP8
    for (int b = 0; b < L.num_buckets(); ++b) numel[L.fp8_bucket(b) ? 1 : 0] += L.shard_numel(b);
    param_shards_ = a.take(C::parameters, T, {numel[0]});
    if (numel[1] > 0) fp8_param_shards_ = a.take(C::parameters, e4, {numel[1]});
    int64_t next[2] = {0, 0};
    for (int b = 0; b < L.num_buckets(); ++b) {
      const int k = L.fp8_bucket(b) ? 1 : 0;
      param_shard_storage_.push_back((k ? fp8_param_shards_ : param_shards_).flat_slice(next[k], L.shard_numel(b)));
      next[k] += L.shard_numel(b);
    }
  } else {
    params_ = a.take(C::parameters, T, {fp8_begin});
    if (fp8_params()) fp8_params_ = a.take(C::parameters, fp8_.dtype(Fp8State::w), {total - fp8_begin});
  }
  grad_bucket_storage_.clear();
  grads_ = grad_shards_ = Tensor();
  for (Tensor& t : grad_slots_) t = Tensor();
  if (opt_.shard_grads) {
    // Staging: the units' slots, the other buckets whole; then the main gradients' shards.
    grad_bucket_storage_ =
        layout_unit_buffers(a, C::gradients, opt_.grad, grad_layout_, d_.layer_begin, unit_slots(grad_slots_));
    grad_shards_ = a.take(C::gradients, opt_.grad, {state});
  } else if (!opt_.frozen) {
    grads_ = a.take(C::gradients, opt_.grad, {total});
  }
  master_ = has_master_copy() ? a.take(C::master_weights, opt_.master_remainders ? DType::i16 : S, {state}) : params_;
  ties_ = has_master_copy() && opt_.master_tie_bits ? a.take(C::master_weights, DType::i32, {(state + 31) / 32}) : Tensor();
  state1_ = state2_ = Tensor();
  if (opt_.frozen) {  // (a teacher: no optimizer)
  } else if (opt_.optimizer != OptimizerKind::sgd) {  // (Muon: its momentum in state1, AdamW's for the rest)
    state1_ = a.take(C::optimizer_states, opt_.bf16_exp_avg ? DType::bf16 : S, {state});
    state2_ = a.take(C::optimizer_states, opt_.bf16_exp_avg_sq ? DType::bf16 : S, {state});
  } else if (opt_.sgd_momentum) {
    state1_ = a.take(C::optimizer_states, S, {state});
  }
  muon_workspace_ = Tensor();
  if (opt_.optimizer == OptimizerKind::muon && !opt_.frozen) {
    const int64_t n = muon_workspace_elements(muon_matrices(descs_, d_, opt_.muon), opt_.muon);
    if (n > 0) muon_workspace_ = a.take(C::optimizer_states, S, {n});
  }
  scalars_ = a.take(C::workspace, S, {kScalarCount});
  expert_sumsq_ = opt_.expert_grad_sumsq && d_.any_moe() && !opt_.frozen ? a.take(C::workspace, S, {1}) : Tensor();
  train_loss_ = a.take(C::workspace, S, {2});
  eval_loss_ = a.take(C::workspace, S, {2});
  moe_loss_ = moe_layer_loss_ = Tensor();
  // (kMoeTerms pairs summed over the MoE layers.)
  if (d_.any_moe()) moe_loss_ = a.take(C::workspace, S, {2 * kMoeTerms});
  // With per-layer logging the pairs per global layer, on every chunk (the step's reduction over
  // DP and PP takes one such buffer from every rank, MoE layers or not).
  if (d_.moe_per_layer_logging)
    moe_layer_loss_ = a.take(C::workspace, S, {2 * kMoeTerms * int64_t{d_.num_layers + d_.mtp}});
  moe_global_sum_ = Tensor();
  moe_global_steps_.assign(d_.moe_global_coeff != 0 ? static_cast<size_t>(moe_layers()) : 0, 0);
  if (d_.any_moe() && d_.moe_global_coeff != 0)
    moe_global_sum_ = a.take(C::workspace, S, {int64_t{moe_layers()} * d_.experts});
  moe_host_offsets_.clear();
  moe_exchanges_.clear();
  moe_bias_ = moe_counts_dev_ = Tensor();
  if (has_expert_bias()) {
    const int64_t n = int64_t{moe_layers()} * d_.experts;
    moe_bias_ = a.take(C::workspace, DType::f32, {n});
    moe_counts_dev_ = a.take(C::workspace, DType::f64, {n});
    moe_bias_host_.assign(static_cast<size_t>(n), 0.0f);
    moe_counts_.assign(static_cast<size_t>(n), 0.0);
  }
  if (d_.position == PositionEmbedding::rope || d_.mla)
    rope_table_ = a.take(C::workspace, DType::f32, {d_.max_positions, d_.rot_dim});
  qk_l2_ones_ = d_.qk_l2 ? a.take(C::workspace, T, {d_.head_dim}) : Tensor();
  layout_cp_buffers(a);

  // FP8: scaling state, weight cache of the FP8 layers, quantization workspaces.
  fp8_.layout(a);
  fp8_w_.assign(static_cast<size_t>(d_.stage_layers()), Fp8Weights{});
  fp8_xq_ = fp8_xq_t_ = fp8_dyq_ = fp8_dyq_t_ = fp8_w_compute_ = Tensor();
  if (fp8_.any()) {
    const int64_t qkv = d_.qkv_proj_width_local(), att = d_.attn_width_local(), fc1 = d_.fc1_width_local(),
                  f = d_.ffn_local();
    const int64_t nk[Fp8State::kGemms][2] = {{qkv, h}, {h, att}, {fc1, h}, {h, f}};  // weight [N, K] per GEMM
    const DType e4 = fp8_.dtype(Fp8State::w);
    // Sharded FP8 parameters (ZeRO-3): a decoder layer's transposed copies live in the slot of the
    // same number as its gathered parameters', made once its gather has landed (gather_unit).
    const bool slotted = opt_.shard_params && fp8_params();
    const auto cached = [&](int l, int g) {
      if (g >= Fp8State::fc1 && d_.is_moe(d_.layer_begin + l)) return false;  // (its experts: fp8_ex_)
      if (g < Fp8State::fc1 && d_.mla) return false;                           // (MLA's: fp8_extra_)
      return fp8_.layer_fp8(l);
    };
    int64_t slot_numel = 0;  // the most any decoder layer's transposed copies take
    for (int l = 0; slotted && l < d_.decoder_layers(); ++l) {
      int64_t n = 0;
      for (int g = 0; g < Fp8State::kGemms; ++g) n += cached(l, g) ? nk[g][0] * nk[g][1] : 0;
      slot_numel = std::max(slot_numel, n);
    }
    Tensor wt_slots[kMaxUnitSlots];
    for (int k = 0; k < opt_.unit_slots; ++k)
      if (slot_numel > 0) wt_slots[k] = a.take(C::parameters, e4, {slot_numel});
    for (int l = 0; l < d_.stage_layers(); ++l) {
      const bool in_slot = slotted && l < d_.decoder_layers();
      int64_t at = 0;  // (in its slot)
      for (int g = 0; g < Fp8State::kGemms; ++g) {
        if (!cached(l, g)) continue;
        // An FP8 parameter is its own row-major copy (bind_params points the cache at it).
        if (!opt_.fp8.param_gather) fp8_w_[l].q[g] = a.take(C::parameters, e4, {nk[g][0], nk[g][1]});
        fp8_w_[l].q_t[g] =
            in_slot ? wt_slots[l % opt_.unit_slots].flat_slice(at, nk[g][0] * nk[g][1]).view({nk[g][1], nk[g][0]})
                    : a.take(C::parameters, e4, {nk[g][1], nk[g][0]});
        if (in_slot) at += nk[g][0] * nk[g][1];
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
    const int64_t qkvg_n = d_.output_gate ? N * d_.qkv_proj_width_local() : 0;
    const int64_t att_offset = (qkv_n + 127) / 128 * 128;  // keeps gATT 256-byte aligned
    const Tensor block = a.take(C::workspace, T, {std::max({N * f, att_offset + att_n, att_offset + qkvg_n, qkvg_n})});
    w.act = block.flat_slice(0, N * f).view({N, f});
    if (!d_.swiglu) w.gFC = w.act;
    w.gQKV = block.flat_slice(0, qkv_n).view({N, d_.qkv_width_local()});
    w.gATT = block.flat_slice(att_offset, att_n).view({N, d_.attn_width_local()});
    if (d_.output_gate) {
      w.qkvg = block.flat_slice(0, qkvg_n).view({N, d_.qkv_proj_width_local()});
      w.gated = w.gATT;
      w.gQKVG = block.flat_slice(att_offset, qkvg_n).view({N, d_.qkv_proj_width_local()});
    }
  }

  layout_moe_workspace(a);
  layout_fp8_gemm_workspace(a);
  layout_mla_workspace(a);
  layout_gdn_workspace(a);
  layout_mtp(a);

  // Activation offloading: the measuring pass lays the layers out once to see what they keep, and
  // plans where the offloaded tensors go (in the entries every slot shares, laid out here).
  if (a.measuring()) {
    offload_ = OffloadPlan();
    if (opt_.offload.enabled && !opt_.frozen) {
      const size_t exchanges = moe_exchanges_.size(), host_offsets = moe_host_offsets_.size();
      std::vector<OffloadCandidate> found;
      Arena probe(be_);
      offload_probe_ = &found;
      for (int l = 0; l < d_.decoder_layers(); ++l) {
        if (rp.group_of[static_cast<size_t>(l)] >= 0) continue;
        layout_layer_ = l;
        (void)layout_layer_acts(probe, C::activations, true, fp8_keeps_inputs() && fp8_.layer_fp8(l),
                                keeps_gelu_activation(fp8_.layer_fp8(l)), layer_kinds(l));
      }
      layout_layer_ = -1;
      offload_probe_ = nullptr;
      moe_exchanges_.resize(exchanges);  // (the probe's own)
      moe_host_offsets_.resize(host_offsets);
      plan_offload(found);
      a.count_host(offload_.host_bytes_per_slot * static_cast<size_t>(opt_.num_slots));
    }
  } else if (offload_.ring > 0 && !offload_host_) {
    offload_host_ = be_.allocate_host(offload_.host_bytes_per_slot * static_cast<size_t>(opt_.num_slots));
  }
  offload_ring_.clear();
  for (int e = 0; e < offload_.ring; ++e)
    offload_ring_.push_back(a.take(C::activations, DType::u8, {static_cast<int64_t>(offload_.entry_bytes)}));
  offload_writer_.assign(static_cast<size_t>(offload_.ring), {-1, -1});

  // Per-slot activations.
  slots_.resize(static_cast<size_t>(opt_.num_slots));
  for (Slot& s : slots_) {
    const size_t part_i32 = (static_cast<size_t>(N) * 4 + Arena::kAlignment - 1) / Arena::kAlignment * Arena::kAlignment;
    const size_t part_s =
        (static_cast<size_t>(N) * dtype_size(S) + Arena::kAlignment - 1) / Arena::kAlignment * Arena::kAlignment;
    // (Multi-token prediction: per depth its tokens, labels, mask, log weights and loss gradient after those.)
    const int D = d_.last_stage ? d_.mtp : 0;
    // Packed documents: the document starts of the whole sequence (with CP, its global positions:
    // the attention blocks' masks compare those).
    const size_t doc_bytes =
        opt_.documents ? (static_cast<size_t>(N) * d_.cp_size * 4 + Arena::kAlignment - 1) / Arena::kAlignment * Arena::kAlignment
                       : 0;
    s.io = a.take(C::activations, DType::u8,
                  {static_cast<int64_t>(3 * part_i32 + 2 * part_s + D * (2 * part_i32 + 3 * part_s) + doc_bytes)});
    s.off_doc_start = 3 * part_i32 + 2 * part_s + static_cast<size_t>(D) * (2 * part_i32 + 3 * part_s);
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
    s.doc_start = opt_.documents ? Tensor(static_cast<char*>(s.io.data) + s.off_doc_start, DType::i32, s.io.device,
                                          {N * d_.cp_size})
                                 : Tensor();
    s.mtp.assign(static_cast<size_t>(D), Slot::MtpRows{});
    for (int j = 0; j < D; ++j) {
      Slot::MtpRows& r = s.mtp[static_cast<size_t>(j)];
      const size_t off = 3 * part_i32 + 2 * part_s + static_cast<size_t>(j) * (2 * part_i32 + 3 * part_s);
      r.tokens = part(off, DType::i32);
      r.labels = part(off + part_i32, DType::i32);
      r.mask = part(off + 2 * part_i32, S);
      r.log_weight = part(off + 2 * part_i32 + part_s, S);
      r.dloss = part(off + 2 * part_i32 + 2 * part_s, S);
    }
    if (!a.measuring()) s.host_io.assign(static_cast<size_t>(s.io.numel()), 0);
    s.input = a.take(C::activations, T, {Nl, h});
    s.offload_out.assign(static_cast<size_t>(L), 0);
    s.offload_back.assign(static_cast<size_t>(L), 0);
    s.offload_stayed.assign(static_cast<size_t>(L), 0);
    offload_entries_ = offload_.ring > 0 ? &offload_ring_ : nullptr;
    s.layers.assign(static_cast<size_t>(L), LayerActs{});
    if (a.measuring()) act_bytes_.assign(static_cast<size_t>(L), 0);
    for (int l = 0; l < L; ++l) {
      // (ModelOptions::acts_over_grads: the measuring pass measures each layer's bytes; the
      // allocating pass lays those plan_acts_over_grads placed inside the gradient buffer.)
      // (An mtp layer's never: its backward runs in the forward.)
      const int64_t in_grads =
          a.measuring() || static_cast<size_t>(l) >= act_in_grads_.size() ? -1 : act_in_grads_[static_cast<size_t>(l)];
      if (in_grads >= 0) a.begin_overlay(C::activations, static_cast<char*>(grads_.data) + in_grads);
      const size_t before = a.used(C::activations);
      const int g = rp.group_of[l];
      if (g < 0) {
        layout_layer_ = l;
        s.layers[l] = layout_layer_acts(a, C::activations, true, fp8_keeps_inputs() && fp8_.layer_fp8(l),
                                        keeps_gelu_activation(fp8_.layer_fp8(l)), layer_kinds(l));
        layout_layer_ = -1;
      } else if (l == rp.groups[g].second - 1 || l == L - 1) {
        // Recomputed layers keep only what the next group (or the head) needs: their output.
        s.layers[l].out = a.take(C::activations, T, {Nl, h});
      }
      // (global_aux_loss: the counts a recomputation does not make again.)
      if (g >= 0 && layer_kinds(l).moe && d_.moe_global_coeff != 0)
        s.layers[l].moe.global = a.take(C::activations, S, {2 * int64_t{d_.experts} + 1});
      if (in_grads >= 0) {
        const size_t took = a.end_overlay();
        MT_CHECK(took == act_bytes_[static_cast<size_t>(l)], "layer {}'s activations: {} bytes, measured {}", l, took,
                 act_bytes_[static_cast<size_t>(l)]);
      } else if (a.measuring()) {
        act_bytes_[static_cast<size_t>(l)] = a.used(C::activations) - before;
      }
    }
    offload_entries_ = nullptr;
    s.d_output = a.take(C::activations, T, {Nl, h});
  }
  if (a.measuring()) plan_acts_over_grads(a);
  // Recompute scratch: the internals of one group, shared by all slots (one backward at a time).
  // Entry j serves layer j of every group: FP8 inputs kept where one of them is an FP8 layer.
  scratch_.clear();
  for (int j = 0; j < rp.max_group_size; ++j) {
    bool fp8_inputs = false;
    LayerKinds kinds{false, false, false, false};
    for (const auto& [begin, end] : rp.groups) {
      if (begin + j >= end) continue;
      fp8_inputs |= fp8_.layer_fp8(begin + j);
      const LayerKinds k = layer_kinds(begin + j);
      kinds.dense |= k.dense;
      kinds.moe |= k.moe;
      kinds.softmax |= k.softmax;
      kinds.gdn |= k.gdn;
    }
    scratch_.push_back(layout_layer_acts(a, C::activations, true, fp8_keeps_inputs() && fp8_inputs,
                                         keeps_gelu_activation(fp8_inputs), kinds));
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
    w.kd_logits = w.kd_lse_s = w.kd_lse_t = w.kd_kl = w.kd_hidden = w.kd_sums = Tensor();
    kd_train_loss_ = kd_eval_loss_ = Tensor();
    if (opt_.distill.enabled) {
      w.kd_logits = a.take(C::workspace, T, {logits_rows_, d_.vocab_local()});
      for (Tensor* t : {&w.kd_lse_s, &w.kd_lse_t, &w.kd_kl, &w.kd_hidden}) *t = a.take(C::workspace, S, {N});
      w.kd_sums = a.take(C::workspace, S, {2 + 2 * static_cast<int64_t>(opt_.distill.pairs.size())});
      kd_host_.assign(static_cast<size_t>(w.kd_sums.numel()), 0.0);
      kd_host_f32_.assign(kd_host_.size(), 0.0f);
      kd_train_loss_ = a.take(C::workspace, S, {3});
      kd_eval_loss_ = a.take(C::workspace, S, {3});
    }
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
  if (opt_.shard_params) {
    const int b = bucket_of_range(grad_layout_, offset, numel);
    return param_bucket_storage_[static_cast<size_t>(b)].flat_slice(offset - grad_layout_.plan.buckets[static_cast<size_t>(b)].offset, numel);
  }
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
Tensor GptModel::grad(int i) const {
  const ParamDesc& p = descs_.at(i);
  if (!opt_.shard_grads) return shaped(grads_, p);
  const int b = param_bucket_.at(static_cast<size_t>(i));
  const Tensor t = grad_bucket(b).flat_slice(p.offset - grad_layout_.plan.buckets[static_cast<size_t>(b)].offset, p.numel());
  return p.is_1d() ? t : t.view({p.local_rows(), p.local_cols()});
}

Tensor GptModel::grad_bucket(int b) const {
  if (opt_.shard_grads) return grad_bucket_storage_.at(static_cast<size_t>(b));
  const GradBucket& k = grad_layout_.plan.buckets.at(static_cast<size_t>(b));
  return grads_.flat_slice(k.offset, k.numel);
}

Tensor GptModel::grad_range(int64_t offset, int64_t count) const {
  if (!opt_.shard_grads) return grads_.flat_slice(offset, count);
  const int b = bucket_of_range(grad_layout_, offset, count);
  return grad_bucket(b).flat_slice(offset - grad_layout_.plan.buckets[static_cast<size_t>(b)].offset, count);
}

// Sharded parameters: layer `local`'s whole parameters, all-gathered from the shards into its slot
// (over the optimizer's data-parallel ranks; the routed experts' bucket over the expert-data-
// parallel ones), unless the slot holds them already. FP8 parameters travel as FP8 bytes; their
// transposed copies are then made in the slot's (fp8_refresh_weights). With prefetch_units layer
// `prefetch`'s gather is then issued: on the communication stream where the backend has one
// (UnitGather), after everything enqueued so far on the compute stream (the slot's previous
// layer is done with), and waited for by its own gather_unit. The callers prefetch a layer whose
// slot holds none of the layers the work enqueued until then reads.
void GptModel::gather_unit(int local, int prefetch) {
  if (!opt_.shard_params) return;
  issue_unit_gather(local);
  wait_unit_gather(local);
  // (Never into layer local's own slot: the work that reads it is enqueued after this.)
  if (opt_.prefetch_units && prefetch % opt_.unit_slots != local % opt_.unit_slots) issue_unit_gather(prefetch);
}

void GptModel::issue_unit_gather(int local) {
  if (local < 0 || local >= d_.decoder_layers()) return;
  const int slot = local % opt_.unit_slots;
  int& holder = param_slot_unit_[slot];
  if (holder == local) return;
  const bool on_comm = unit_gather_.dense != nullptr;
  if (on_comm) be_.comm_wait_for_compute();
  for (const int b : unit_buckets_.at(static_cast<size_t>(local))) {
    const Tensor shard = param_shard(b);
    const bool expert = grad_layout_.is_expert_bucket(b);
    Communicator* group = on_comm ? (expert ? unit_gather_.expert : unit_gather_.dense) : nullptr;
    if (!group) group = expert ? &ps_.expert_dist_opt_group() : &ps_.dist_opt_group();
    if (group->size() > 1) group->all_gather(param_bucket_storage_[static_cast<size_t>(b)], shard);
    else be_.copy(param_bucket_storage_[static_cast<size_t>(b)], shard);
  }
  holder = local;
  if (on_comm) {
    be_.record_comm_mark(unit_gather_.first_mark + slot);
    gather_pending_[slot] = true;
  }
  refresh_pending_[slot] = fp8_params() && fp8_layer(local);
}

void GptModel::wait_unit_gather(int local) {
  if (local < 0 || local >= d_.decoder_layers()) return;
  const int slot = local % opt_.unit_slots;
  MT_CHECK(param_slot_unit_[slot] == local, "parameter slot {} holds layer {}, not layer {}", slot,
           param_slot_unit_[slot], local);
  if (gather_pending_[slot]) {
    be_.compute_wait_for_mark(unit_gather_.first_mark + slot);
    gather_pending_[slot] = false;
  }
  if (refresh_pending_[slot]) {
    refresh_pending_[slot] = false;
    fp8_fresh_[static_cast<size_t>(local)] = 0;
    fp8_refresh_weights(local);
  }
}

// After the optimizer step (or anything else that changed the shards) the gathered layers are
// stale. A gather still in flight (none in a step's usual course) is waited for first: it reads
// the shards the next update writes.
void GptModel::param_shards_updated() {
  for (int k = 0; k < kMaxUnitSlots; ++k) {
    if (gather_pending_[k]) be_.compute_wait_for_mark(unit_gather_.first_mark + k);
    gather_pending_[k] = refresh_pending_[k] = false;
    param_slot_unit_[k] = -1;
  }
}

// Sharded gradients: local layer `local`'s slot is zeroed before the micro-batch's first write to
// its gradients (the layer's backward, the backward of the norm after it, or the head's). The
// slot's previous holder, two layers later, was reduce-scattered when its backward ended.
void GptModel::prepare_grad_unit(int local) {
  if (!opt_.shard_grads || local < 0 || local >= d_.decoder_layers()) return;
  const int slot = grad_unit_slot(local);
  int& holder = slot_unit_[slot];
  if (holder == local) return;
  MT_CHECK(holder < 0 || holder >= local + 2, "gradient slot of layer {} still holds layer {}", local, holder);
  if (on_grad_slot_reuse) on_grad_slot_reuse(slot);
  be_.fill(grad_slots_[slot], 0.0);
  holder = local;
}
Tensor GptModel::master(int i) const {
  MT_CHECK(!(grad_layout_.sharded && has_master_copy()) && !opt_.master_remainders,
           "master({}) of a sharded master copy or one kept as remainders", i);
  return shaped(master_, descs_.at(i));
}

void GptModel::bind_params() {
  layer_params_.assign(static_cast<size_t>(d_.stage_layers()), LayerParams{});
  layer_grads_.assign(static_cast<size_t>(d_.stage_layers()), LayerParams{});
  auto find = [&](const std::string& name, Tensor& p, Tensor& g) {
    const int i = find_param(descs_, name);
    if (i < 0) return;
    p = param(i);
    g = opt_.frozen ? Tensor() : grad(i);
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
  mtp_params_.assign(static_cast<size_t>(d_.stage_mtp_layers()), MtpParams{});
  mtp_grads_.assign(static_cast<size_t>(d_.stage_mtp_layers()), MtpParams{});
  for (int l = 0; l < d_.stage_layers(); ++l) {
    const int layer = d_.layer_begin + l;
    const std::string mtp = "mtp.layers." + std::to_string(layer - d_.num_layers) + ".";
    const std::string p = d_.is_mtp(layer) ? mtp + "transformer_layer." : "decoder.layers." + std::to_string(layer) + ".";
    if (d_.is_mtp(layer)) {
      MtpParams &M = mtp_params_[static_cast<size_t>(layer - d_.num_layers)],
                &Mg = mtp_grads_[static_cast<size_t>(layer - d_.num_layers)];
      find(mtp + "enorm.weight", M.enorm_w, Mg.enorm_w);
      find(mtp + "enorm.bias", M.enorm_b, Mg.enorm_b);
      find(mtp + "hnorm.weight", M.hnorm_w, Mg.hnorm_w);
      find(mtp + "hnorm.bias", M.hnorm_b, Mg.hnorm_b);
      find(mtp + "eh_proj.weight", M.eh_w, Mg.eh_w);
      find(mtp + "final_layernorm.weight", M.fnorm_w, Mg.fnorm_w);
      find(mtp + "final_layernorm.bias", M.fnorm_b, Mg.fnorm_b);
    }
    LayerParams &P = layer_params_[l], &Gr = layer_grads_[l];
    find(p + "self_attention.linear_qkv.layer_norm_weight", P.ln1_w, Gr.ln1_w);
    find(p + "self_attention.linear_qkv.layer_norm_bias", P.ln1_b, Gr.ln1_b);
    find(p + "self_attention.linear_qkv.weight", P.qkv_w, Gr.qkv_w);
    find(p + "self_attention.linear_qkv.bias", P.qkv_b, Gr.qkv_b);
    find(p + "self_attention.q_layernorm.weight", P.q_ln_w, Gr.q_ln_w);
    find(p + "self_attention.q_layernorm.bias", P.q_ln_b, Gr.q_ln_b);
    find(p + "self_attention.k_layernorm.weight", P.k_ln_w, Gr.k_ln_w);
    find(p + "self_attention.k_layernorm.bias", P.k_ln_b, Gr.k_ln_b);
    find(p + "self_attention.core_attention.softmax_offset", P.sink, Gr.sink);
    if (d_.qk_l2) P.q_ln_w = P.k_ln_w = qk_l2_ones_;  // weightless: unit weights, no gradients
    find(p + "input_layernorm.weight", P.ln1_w, Gr.ln1_w);  // (MLA layers)
    find(p + "input_layernorm.bias", P.ln1_b, Gr.ln1_b);
    find(p + "self_attention.linear_q_down_proj.weight", P.q_down_w, Gr.q_down_w);
    find(p + "self_attention.linear_q_up_proj.layer_norm_weight", P.q_lat_ln_w, Gr.q_lat_ln_w);
    find(p + "self_attention.linear_q_up_proj.layer_norm_bias", P.q_lat_ln_b, Gr.q_lat_ln_b);
    find(p + "self_attention.linear_q_up_proj.weight", P.q_w, Gr.q_w);
    find(p + "self_attention.linear_q_proj.layer_norm_weight", P.q_lat_ln_w, Gr.q_lat_ln_w);
    find(p + "self_attention.linear_q_proj.layer_norm_bias", P.q_lat_ln_b, Gr.q_lat_ln_b);
    find(p + "self_attention.linear_q_proj.weight", P.q_w, Gr.q_w);
    find(p + "self_attention.linear_kv_down_proj.weight", P.kv_down_w, Gr.kv_down_w);
    find(p + "self_attention.linear_kv_up_proj.layer_norm_weight", P.kv_lat_ln_w, Gr.kv_lat_ln_w);
    find(p + "self_attention.linear_kv_up_proj.layer_norm_bias", P.kv_lat_ln_b, Gr.kv_lat_ln_b);
    find(p + "self_attention.linear_kv_up_proj.weight", P.kv_up_w, Gr.kv_up_w);
    find(p + "self_attention.linear_proj.weight", P.proj_w, Gr.proj_w);
    find(p + "self_attention.in_proj.layer_norm_weight", P.ln1_w, Gr.ln1_w);
    find(p + "self_attention.in_proj.layer_norm_bias", P.ln1_b, Gr.ln1_b);
    find(p + "self_attention.in_proj.weight", P.gdn_in_w, Gr.gdn_in_w);
    find(p + "self_attention.conv1d.weight", P.gdn_conv_w, Gr.gdn_conv_w);
    find(p + "self_attention.dt_bias", P.gdn_dt_bias, Gr.gdn_dt_bias);
    find(p + "self_attention.A_log", P.gdn_a_log, Gr.gdn_a_log);
    find(p + "self_attention.out_norm.weight", P.gdn_norm_w, Gr.gdn_norm_w);
    find(p + "self_attention.out_norm.bias", P.gdn_norm_b, Gr.gdn_norm_b);
    find(p + "self_attention.out_proj.weight", P.proj_w, Gr.proj_w);
    find(p + "self_attention.linear_proj.bias", P.proj_b, Gr.proj_b);
    find(p + "mlp.linear_fc1.layer_norm_weight", P.ln2_w, Gr.ln2_w);
    find(p + "mlp.linear_fc1.layer_norm_bias", P.ln2_b, Gr.ln2_b);
    find(p + "mlp.linear_fc1.weight", P.fc1_w, Gr.fc1_w);
    find(p + "mlp.linear_fc1.bias", P.fc1_b, Gr.fc1_b);
    find(p + "mlp.linear_fc2.weight", P.fc2_w, Gr.fc2_w);
    find(p + "mlp.linear_fc2.bias", P.fc2_b, Gr.fc2_b);
    find(p + "pre_mlp_layernorm.weight", P.ln2_w, Gr.ln2_w);
    find(p + "pre_mlp_layernorm.bias", P.ln2_b, Gr.ln2_b);
    find(p + "mlp.router.weight", P.router_w, Gr.router_w);
    find(p + "mlp.router.bias", P.router_b, Gr.router_b);
    find(p + "mlp.experts.linear_fc1.bias", P.ex_fc1_b, Gr.ex_fc1_b);
    find(p + "mlp.experts.linear_fc2.bias", P.ex_fc2_b, Gr.ex_fc2_b);
    find(p + "mlp.experts.linear_fc1.weight", P.ex_fc1_w, Gr.ex_fc1_w);
    find(p + "mlp.experts.linear_fc2.weight", P.ex_fc2_w, Gr.ex_fc2_w);
    find(p + "mlp.shared_experts.linear_fc1.weight", P.sh_fc1_w, Gr.sh_fc1_w);
    find(p + "mlp.shared_experts.linear_fc2.weight", P.sh_fc2_w, Gr.sh_fc2_w);
    find(p + "mlp.shared_experts.gate_weight", P.sh_gate_w, Gr.sh_gate_w);
    if (!fp8_.layer_fp8(l) || !opt_.fp8.param_gather) continue;
    const Tensor w[Fp8State::kGemms] = {P.qkv_w, P.proj_w, P.fc1_w, P.fc2_w};
    for (int g = 0; g < Fp8State::kGemms; ++g) fp8_w_[static_cast<size_t>(l)].q[g] = w[g];
  }
}

void GptModel::init_parameters(bool random) {
  fp8_begin_step();  // the FP8 weight cache is stale
  if (has_expert_bias()) {  // (Megatron's expert_bias buffer starts at zero)
    std::fill(moe_bias_host_.begin(), moe_bias_host_.end(), 0.0f);
    be_.fill(moe_counts_dev_, 0.0);
    expert_bias_loaded();
  }
  auto draw = [this, random](const ParamDesc& p, Tensor w) { init_param(be_, p, w, d_.seed, random); };
  // The full-precision values are drawn into a full-size buffer: the master copy, or with a
  // sharded master copy or one kept as remainders the (still unused) gradient buffer, from which
  // each rank keeps its shards (or splits). bf16 main grads cannot hold them: then one parameter
  // at a time.
  const bool staged = has_master_copy() && (grad_layout_.sharded || opt_.master_remainders);
  if (!ties_.empty()) be_.fill(ties_, 0.0);
  if (staged && stages_per_param()) {
    stage_full_params([&](int i, Tensor w) { draw(descs_[static_cast<size_t>(i)], w); }, master_, true);
  } else {
    const Tensor full = staged ? grads_ : master_;
    if (staged) be_.fill(grads_, 0.0);  // (the padding too: it is split into the master copy)
    for (const ParamDesc& p : descs_) draw(p, shaped(full, p));
    if (!has_master_copy()) return;
    params_from_full_master(full);
    if (staged) be_.fill(grads_, 0.0);
  }
  fp8_params_from_master(true);
}

void GptModel::round_params(Tensor params, Tensor values) {
  if (opt_.master_remainders && !opt_.master_tie_bits) be_.split_master(params, Tensor(), values);
  else be_.cast(params, values);
}

void GptModel::params_from_full_master(Tensor full) {
  MT_CHECK(has_master_copy() && full.dtype == opt_.accum && full.numel() >= params_.numel(),
           "params_from_full_master: a full-size {} buffer", dtype_name(opt_.accum));
  MT_CHECK(full.data != master_.data || (!grad_layout_.sharded && !opt_.master_remainders),
           "params_from_full_master: the master copy cannot hold the full values");
  const Tensor values = full.flat_slice(0, params_.numel());
  // (the FP8 parameters: fp8_params_from_master)
  round_params(params_, values);
  if (!grad_layout_.sharded) {  // (without remainders `full` is the master copy)
    if (opt_.master_remainders) be_.split_master(params_, master_, values, master_ties(0));
    return;
  }
  for (int b = 0; b < grad_layout_.num_buckets(); ++b) {
    const int64_t n = grad_layout_.shard_numel(b), at = grad_layout_.shard_offset(b);
    const int64_t state = grad_layout_.state_offset[static_cast<size_t>(b)];
    const Tensor shard = master_.flat_slice(state, n);
    if (opt_.master_remainders)
      be_.split_master(params_.flat_slice(at, n), shard, full.flat_slice(at, n), master_ties(state));
    else be_.cast(shard, full.flat_slice(at, n));  // (a copy: the same dtype)
  }
}

void GptModel::master_to_host(float* out, const void* params_host, const void* master_host,
                              const void* ties_host) const {
  MT_CHECK(opt_.master_remainders, "master_to_host: the master weights are not kept as remainders");
  MT_CHECK(!opt_.master_tie_bits || ties_host, "master_to_host: the tie bits");
  const auto* w = static_cast<const uint16_t*>(params_host);
  const auto* r = static_cast<const int16_t*>(master_host);
  const auto* t = static_cast<const uint32_t*>(ties_host);
  const auto join = [&](int64_t state, int64_t at, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
      out[state + i] = opt_.master_tie_bits ? join_master_even(w[at + i], r[state + i], tie_bit(t, state + i))
                                            : join_master_bits(w[at + i], r[state + i]);
  };
  if (!grad_layout_.sharded) return join(0, 0, master_.numel());
  for (int b = 0; b < grad_layout_.num_buckets(); ++b)
    join(grad_layout_.state_offset[static_cast<size_t>(b)], grad_layout_.shard_offset(b), grad_layout_.shard_numel(b));
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
  if (remainders && !ties_.empty()) be_.fill(ties_, 0.0);
  for (size_t i = 0; i < descs_.size(); ++i) {
    const ParamDesc& p = descs_[i];
    ParamDesc at_start = p;
    at_start.offset = 0;
    fill(static_cast<int>(i), shaped(scratch, at_start));
    // (Sharded parameters: a layer's go to this rank's shards, below.)
    const bool sharded_param = opt_.shard_params && param_shard_bucket(param_bucket_[i]);
    if (to_params && !p.fp8_storage && !sharded_param) round_params(param(static_cast<int>(i)), shaped(scratch, at_start));
    for (const auto& [b, s] : pieces[i]) {
      const int64_t at = grad_layout_.state_offset[static_cast<size_t>(b)] + s.shard_offset;
      const Tensor dst = sharded.flat_slice(at, s.numel);
      const Tensor src = scratch.flat_slice(s.param_offset, s.numel);
      if (remainders) be_.split_master(param_storage(p.offset + s.param_offset, s.numel), dst, src, master_ties(at));
      else be_.cast(dst, src);  // (a cast: bf16 moments take their rounding)
      if (to_params && sharded_param && !p.fp8_storage)  // (FP8 ones: fp8_params_from_master)
        be_.cast(param_shard(b).flat_slice(s.shard_offset, s.numel), src);
    }
  }
  be_.synchronize();  // the scratch is freed below
  be_.deallocate(mem);
  param_shards_updated();
}

bool GptModel::sumsq_fused(const ParamDesc& p) const {
  return !expert_sumsq_.empty() && p.expert &&
         (p.name.ends_with(".mlp.experts.linear_fc1.weight") || p.name.ends_with(".mlp.experts.linear_fc2.weight"));
}

void GptModel::zero_grads() {
  if (!expert_sumsq_.empty()) be_.fill(expert_sumsq_, 0.0);
  if (opt_.shard_grads) {
    for (int b = 0; b < grad_layout_.num_buckets(); ++b)
      if (grad_layout_.bucket_unit[static_cast<size_t>(b)] < 0) be_.fill(grad_bucket(b), 0.0);
    for (int k = 0; k < opt_.unit_slots; ++k) {
      if (on_grad_slot_reuse) on_grad_slot_reuse(k);
      slot_unit_[k] = -1;
    }
    be_.fill(grad_shards_, 0.0);
    return;
  }
  for (FirstWriteGrad& f : first_write_grads_) f.written = false;
  if (update_in_flight_) grad_zeroing_deferred_ = true;
  else zero_grad_buffer();
}

void GptModel::zero_grad_buffer() {
  if (any_act_in_grads_) be_.fill_ranges(grads_, step_zeroed_ranges_, 0.0);
  else if (first_write_grads_.empty()) be_.fill(grads_, 0.0);
  else be_.fill_ranges(grads_, zeroed_grad_ranges_, 0.0);
}

void GptModel::zero_layer_grads(int owner) {
  if (!any_act_in_grads_) return;
  const size_t k = owner == kAfterLayers ? static_cast<size_t>(d_.decoder_layers()) : static_cast<size_t>(owner);
  if (!backward_zeroed_ranges_[k].empty()) be_.fill_ranges(grads_, backward_zeroed_ranges_[k], 0.0);
}

std::vector<GptModel::GradOwnerSegment> GptModel::grad_owner_segments() const {
  const int L = d_.decoder_layers();
  // The embeddings' gradients are written only by their backward, after every layer's: not with
  // tied embeddings (the output layer's GEMM writes them in the forward) nor with MTP (its
  // backward, run in the forward, adds to them).
  const bool embeddings_last = d_.first_stage && !d_.tied_embeddings && d_.mtp == 0;
  std::vector<GradOwnerSegment> segs;
  std::vector<int> order(descs_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::sort(order.begin(), order.end(), [&](int x, int y) { return descs_[x].offset < descs_[y].offset; });
  for (int i : order) {
    const ParamDesc& p = descs_[static_cast<size_t>(i)];
    if (p.numel() == 0) continue;
    const int local = p.layer - d_.layer_begin;
    int owner = kNoOwner;
    if (p.layer >= 0 && local >= 0 && local < L) owner = local;
    else if (p.layer < 0 && embeddings_last && p.name.starts_with("embedding.")) owner = kAfterLayers;
    if (segs.empty() && p.offset > 0) segs.push_back({0, p.offset, kNoOwner});
    if (!segs.empty()) segs.back().end = p.offset;  // (the padding goes with the parameter before it)
    segs.push_back({p.offset, p.offset + p.numel(), owner});
  }
  if (!segs.empty()) segs.back().end = std::max(segs.back().end, grads_.numel());
  return segs;
}

void GptModel::plan_acts_over_grads(Arena& a) {
  const int L = d_.decoder_layers();
  act_in_grads_.assign(static_cast<size_t>(std::max(L, 0)), -1);
  if (!opt_.acts_over_grads || grads_.empty() || L < 1) return;
  MT_CHECK(opt_.num_slots == 1 && !opt_.shard_grads && !opt_.frozen,
           "activations over gradients with {} slots, sharded gradients or a frozen model", opt_.num_slots);
  const int64_t esz = static_cast<int64_t>(dtype_size(opt_.grad));
  const std::vector<GradOwnerSegment> segs = grad_owner_segments();
  std::vector<std::pair<int64_t, int64_t>> taken;  // [begin, end) bytes of the layers placed so far
  size_t moved = 0;
  for (int i = L - 1; i >= 0; --i) {
    const int64_t bytes = static_cast<int64_t>(act_bytes_[static_cast<size_t>(i)]);
    if (bytes == 0) continue;
    // Where layer i's activations cannot lie: elements of other owners, and the layers placed.
    std::vector<std::pair<int64_t, int64_t>> blocked = taken;
    for (const GradOwnerSegment& g : segs)
      if (!(g.owner == kAfterLayers || (g.owner >= 0 && g.owner <= i - 2)))
        blocked.push_back({g.begin * esz, g.end * esz});
    std::sort(blocked.begin(), blocked.end());
    const int64_t limit = grads_.numel() * esz;
    int64_t from = 0;  // the first byte not blocked so far
    for (size_t k = 0; k <= blocked.size(); ++k) {
      const int64_t to = k < blocked.size() ? blocked[k].first : limit;
      const int64_t at = (from + Arena::kAlignment - 1) / Arena::kAlignment * Arena::kAlignment;
      if (to - at >= bytes) {
        act_in_grads_[static_cast<size_t>(i)] = at;
        taken.push_back({at, at + bytes});
        moved += static_cast<size_t>(bytes);
        break;
      }
      if (k < blocked.size()) from = std::max(from, blocked[k].second);
    }
  }
  if (moved > 0) a.move_into_grads(MemoryCategory::activations, moved);
}

void GptModel::update_in_flight() {
  MT_CHECK(!opt_.shard_grads && !opt_.frozen, "an update beside the forward with sharded gradients or a frozen model");
  update_in_flight_ = true;
}

void GptModel::update_joined() {
  update_in_flight_ = false;
  if (grad_zeroing_deferred_) zero_grad_buffer();
  grad_zeroing_deferred_ = false;
}

std::vector<int> GptModel::forward_param_boundaries() const {
  const int n = static_cast<int>(descs_.size());
  std::vector<int> b{0};
  for (int l = 0; l < d_.decoder_layers(); ++l) b.push_back(layer_first_param_[static_cast<size_t>(l)]);
  b.push_back(head_first_param_);
  std::vector<int> out;
  for (int x : b) {
    if (x >= n) continue;
    MT_CHECK(out.empty() || x >= out.back(), "the forward's parameters out of order at parameter {}", x);
    if (out.empty() || x > out.back()) out.push_back(x);
  }
  return out;
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
  if (opt_.shard_grads || opt_.frozen) return;  // every staging buffer is zeroed before use: every GEMM adds
  auto ends_with = [](const std::string& s, const char* suffix) {
    const size_t n = std::strlen(suffix);
    return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
  };
  std::vector<int> written;
  for (size_t i = 0; i < descs_.size(); ++i) {
    const std::string& n = descs_[i].name;
    if (n == "output_layer.weight" || n == "embedding.word_embeddings.weight" ||
        ends_with(n, ".linear_qkv.weight") || ends_with(n, ".linear_proj.weight") ||
        ends_with(n, ".linear_fc1.weight") || ends_with(n, ".linear_fc2.weight") ||
        ends_with(n, ".in_proj.weight") || ends_with(n, ".out_proj.weight"))
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
  // Activations over gradients: the zeroed ranges of the layers and embeddings are zeroed by the
  // backward, just before the first op that writes them (zero_layer_grads).
  step_zeroed_ranges_.clear();
  backward_zeroed_ranges_.clear();
  any_act_in_grads_ = std::any_of(act_in_grads_.begin(), act_in_grads_.end(), [](int64_t at) { return at >= 0; });
  if (!any_act_in_grads_) return;
  const int L = d_.decoder_layers();
  backward_zeroed_ranges_.assign(static_cast<size_t>(L) + 1, {});
  const std::vector<GradOwnerSegment> segs = grad_owner_segments();
  for (const FlatRange& r : zeroed_grad_ranges_) {
    for (int64_t at = r.offset, end = r.offset + r.count; at < end;) {
      // The segment holding `at` (segments tile [0, grads_.numel())).
      const auto it = std::upper_bound(segs.begin(), segs.end(), at,
                                       [](int64_t x, const GradOwnerSegment& g) { return x < g.end; });
      MT_CHECK(it != segs.end() && it->begin <= at, "gradient element {} outside the owner segments", at);
      const int64_t stop = std::min(end, it->end);
      const FlatRange piece{at, stop - at};
      if (it->owner == kAfterLayers) backward_zeroed_ranges_[static_cast<size_t>(L)].push_back(piece);
      else if (it->owner >= 0 && it->owner < L - 1) backward_zeroed_ranges_[static_cast<size_t>(it->owner)].push_back(piece);
      else step_zeroed_ranges_.push_back(piece);
      at = stop;
    }
  }
}

void GptModel::stage_micro_batch(int slot, const MicroBatch& mb, double loss_grad_scale, bool per_token_loss,
                                 uint64_t serial, bool training) {
  Slot& s = slots_.at(static_cast<size_t>(slot));
  // With context parallelism the micro-batch holds whole sequences; this rank stages its positions
  // of each (ModelDims::global_position).
  const int b = d_.micro_batch, sq = d_.seq;
  const int64_t whole = d_.seq_total();
  if (mb.batch != b || mb.seq != whole)
    fail("a micro-batch of {} x {} tokens does not match --micro-batch-size {} x --seq-length {}", mb.batch,
         mb.seq, b, whole);
  const size_t N = static_cast<size_t>(b) * static_cast<size_t>(whole);
  if (mb.tokens.size() != N || mb.labels.size() != N || mb.loss_mask.size() != N ||
      (!mb.positions.empty() && mb.positions.size() != N))
    fail("a micro-batch's arrays do not hold {} x {} entries", b, whole);
  unsigned char* h = s.host_io.data();
  auto* tokens = reinterpret_cast<int32_t*>(h + s.off_tokens);
  auto* labels = reinterpret_cast<int32_t*>(h + s.off_labels);
  auto* positions = reinterpret_cast<int32_t*>(h + s.off_positions);
  // The loss gradient is divided by this rank's tokens (with CP, as Megatron: each CP rank's local mean).
  double mb_tokens = 0;
  for (int i = 0; i < b; ++i)
    for (int t = 0; t < sq; ++t) mb_tokens += mb.loss_mask[static_cast<size_t>(i * whole + d_.global_position(t))];
  const double per_row = per_token_loss ? loss_grad_scale : loss_grad_scale / std::max(1.0, mb_tokens);
  s.moe_aux_seed = loss_grad_scale * d_.cp_size;  // (Megatron's aux seed carries x CP)
  const bool f64 = opt_.accum == DType::f64;
  for (int i = 0; i < b; ++i)
    for (int t = 0; t < sq; ++t) {
      const int64_t tg = d_.global_position(t);
      const size_t src = static_cast<size_t>(i * whole + tg), dst = static_cast<size_t>(t) * b + i;  // sequence-major
      tokens[dst] = mb.tokens[src];
      labels[dst] = mb.labels[src];
      positions[dst] = mb.positions.empty() ? static_cast<int32_t>(tg) : mb.positions[src];
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
  // Packed documents: each position's document start, sample-major, from the segments (a new
  // document starts where the segment number changes: after each EOD token). The whole sequence's,
  // with CP too.
  if (opt_.documents) {
    if (mb.segments.size() != N) fail("a micro-batch without segments for --reset-attention-mask");
    auto* doc = reinterpret_cast<int32_t*>(h + s.off_doc_start);
    for (int i = 0; i < b; ++i)
      for (int64_t t = 0; t < whole; ++t) {
        const size_t at = static_cast<size_t>(i * whole + t);
        doc[at] = (t == 0 || mb.segments[at] != mb.segments[at - 1]) ? static_cast<int32_t>(t) : doc[at - 1];
      }
  }
  // Multi-token prediction: depth j's rows rolled j + 1 positions left within each sequence, zeros
  // past its end (the micro-batch holds whole sequences: with CP each rank takes its positions of
  // the rolled ones, Megatron's roll across the CP ranks); its loss gradient is (scale / D) times
  // the main loss's seed over this rank's tokens of it (Megatron's MTPLossAutoScaler: the local
  // count), times the unrolled count n0 with per-token loss.
  const auto io_offset = [&](const Tensor& t) {  // (views into the slot's io block)
    return static_cast<size_t>(static_cast<const char*>(t.data) - static_cast<const char*>(s.io.data));
  };
  for (size_t j = 0; j < s.mtp.size(); ++j) {
    const Slot::MtpRows& r = s.mtp[j];
    const int64_t roll = static_cast<int64_t>(j) + 1;
    auto* tok = reinterpret_cast<int32_t*>(h + io_offset(r.tokens));
    auto* lab = reinterpret_cast<int32_t*>(h + io_offset(r.labels));
    double n = 0;
    for (int i = 0; i < b; ++i)
      for (int t = 0; t < sq; ++t) {
        const int64_t tg = d_.global_position(t);
        if (tg + roll < whole) n += mb.loss_mask[static_cast<size_t>(i * whole + tg + roll)];
      }
    const double coef = d_.mtp_scale * (per_token_loss ? loss_grad_scale * mb_tokens / std::max(1.0, n)
                                                       : loss_grad_scale / std::max(1.0, n));
    const size_t offs[3] = {io_offset(r.mask), io_offset(r.log_weight), io_offset(r.dloss)};
    for (int i = 0; i < b; ++i)
      for (int t = 0; t < sq; ++t) {
        const int64_t tg = d_.global_position(t);
        const size_t dst = static_cast<size_t>(t) * b + i;
        const bool in = tg + roll < whole;
        const size_t src = in ? static_cast<size_t>(i * whole + tg + roll) : 0;
        tok[dst] = in ? mb.tokens[src] : 0;
        lab[dst] = in ? mb.labels[src] : 0;
        const double m = in ? mb.loss_mask[src] : 0.0;
        const double vals[3] = {m, m / std::max(1.0, n), m * coef};
        for (int k = 0; k < 3; ++k) {
          if (f64) reinterpret_cast<double*>(h + offs[k])[dst] = vals[k];
          else reinterpret_cast<float*>(h + offs[k])[dst] = static_cast<float>(vals[k]);
        }
      }
  }
  // One copy. (From pageable memory the copy has consumed the host buffer when it returns, so
  // the next micro-batch may overwrite it.)
  be_.copy_from_host(s.io, h);
  set_slot_key(s, serial, training);
  // Distillation: the teacher reads the same tokens, in evaluation mode.
  if (teacher_) teacher_->stage_micro_batch(0, mb, loss_grad_scale, per_token_loss, serial, false);
}

void GptModel::stage_without_data(int slot, uint64_t serial, bool training, double loss_grad_scale) {
  Slot& s = slots_.at(static_cast<size_t>(slot));
  MT_CHECK(!opt_.documents, "--reset-attention-mask: a stage without data has no document boundaries");
  s.moe_aux_seed = loss_grad_scale * d_.cp_size;  // (Megatron's aux seed carries x CP)
  const int b = d_.micro_batch, sq = d_.seq;
  auto* positions = reinterpret_cast<int32_t*>(s.host_io.data() + s.off_positions);
  for (int t = 0; t < sq; ++t)
    for (int i = 0; i < b; ++i) positions[static_cast<size_t>(t) * b + i] = static_cast<int32_t>(d_.global_position(t));
  be_.copy_from_host(s.positions, positions);
  set_slot_key(s, serial, training);
}

void GptModel::set_slot_key(Slot& s, uint64_t serial, bool training) {
  s.key = mix_key(mix_key(d_.seed, 0x64726f706f7574ULL /* "dropout" */), mix_key(serial, ps_.dp_rank));
  s.serial = serial;
  s.training = training;
  s.staged = true;
}

Tensor GptModel::stage_input(int slot) const { return slots_.at(static_cast<size_t>(slot)).input; }
Tensor GptModel::stage_output(int slot) const {
  const Slot& s = slots_.at(static_cast<size_t>(slot));
  return d_.decoder_layers() ? s.layers[static_cast<size_t>(d_.decoder_layers() - 1)].out : s.input;
}
Tensor GptModel::output_grad(int slot) const { return slots_.at(static_cast<size_t>(slot)).d_output; }
Tensor GptModel::input_grad() const { return last_input_grad_; }

// Dropout sites: 0 attention probabilities, 1 after the attention projection, 2 after the MLP,
// 3 the embeddings (layer -1).
uint64_t GptModel::site_key(const Slot& s, int layer, int site) const {
  return mix_key(s.key, static_cast<uint64_t>(layer + 1) * 8 + static_cast<uint64_t>(site));
}

AttentionSinks GptModel::attention_sinks(int local) const {
  AttentionSinks k;
  k.enabled = d_.sinks();
  if (d_.softmax == SoftmaxType::learnable) {
    k.logits = layer_params_.at(static_cast<size_t>(local)).sink;
    k.grad = layer_grads_.at(static_cast<size_t>(local)).sink;
  }
  return k;
}

AttentionCore& GptModel::attention_core(int layer) const {
  if (d_.cp_size == 1) return *attention_core_;
  return *cp_cores_.at(static_cast<size_t>(d_.cp_comm.at(static_cast<size_t>(layer))));
}

// Context parallelism's buffers (attention_core.h): the ring's two key/value blocks and their
// gradients, the all-gather's whole sequence of them, one block's output and lse.
void GptModel::layout_cp_buffers(Arena& a) {
  CpBuffers& b = ws_->cp;
  b = CpBuffers{};
  if (d_.cp_size == 1 || d_.stage_layers() == 0) return;
  using C = MemoryCategory;
  const DType T = opt_.compute, S = opt_.accum;
  const int64_t R = d_.tokens(), kv = 2 * int64_t{d_.groups_local()} * d_.head_dim;
  bool ring = false, gather = false, a2a = false;
  for (int layer = d_.layer_begin; layer < d_.layer_end; ++layer) {
    const CpCommType t = d_.cp_comm.at(static_cast<size_t>(layer));
    gather |= t == CpCommType::allgather;
    ring |= t == CpCommType::p2p || (t == CpCommType::a2a_p2p && d_.cp_a2a_size < d_.cp_size);
    a2a |= t == CpCommType::a2a || t == CpCommType::a2a_p2p;
  }
  for (int i = 0; i < 2; ++i) {
    if (i == 0 || ring) b.kv[i] = a.take(C::workspace, T, {R, kv});
    if (i == 0 || ring) b.dkv[i] = a.take(C::workspace, T, {R, kv});
  }
  if (gather) {
    b.kv_all = a.take(C::workspace, T, {d_.cp_size * R, kv});
    b.dkv_all = a.take(C::workspace, T, {d_.cp_size * R, kv});
  }
  if (a2a) {
    const int64_t qkv = d_.qkv_width_local(), att = d_.attn_width_local();
    b.x = a.take(C::workspace, T, {R * qkv});
    b.x_dqkv = a.take(C::workspace, T, {R * qkv});
    b.x_out = a.take(C::workspace, T, {R * att});
    b.x_dout = a.take(C::workspace, T, {R * att});
    b.stage = a.take(C::workspace, T, {R * std::max(qkv, att)});
  }
  b.out_blk = a.take(C::workspace, T, {R / 2, d_.attn_width_local()});
  b.lse_blk = a.take(C::workspace, S, {d_.micro_batch, d_.heads_local(), d_.seq / 2});
}

// The attention of one layer for one slot (s == nullptr: the shape alone, for set-up).
AttentionShape GptModel::attention_shape(const Slot* s, int layer) const {
  AttentionShape as = AttentionShape::make(d_.micro_batch, d_.seq, d_.heads_local(), d_.groups_local(), d_.head_dim,
                                          /*causal=*/true, (s == nullptr || s->training) ? d_.attention_dropout : 0.0f);
  as.deterministic = opt_.deterministic;
  if (d_.softmax_scale > 0) as.softmax_scale = d_.softmax_scale;  // (MLA)
  as.window_left = d_.window_left.at(static_cast<size_t>(layer));
  as.documents = opt_.documents;
  if (s && opt_.documents) as.doc_start = s->doc_start;
  // The heads differ per TP rank, so their masks come from different streams.
  if (s) as.dropout_key = mix_key(site_key(*s, layer, 0), static_cast<uint64_t>(d_.tp_rank));
  return as;
}

// Dropout in the sequence-parallel regions: each TP rank drops its own rows, so its masks come
// from its own stream (Megatron forks the RNG there too). Without SP all TP ranks draw alike.
uint64_t GptModel::hidden_key(const Slot& s, int layer, int site) const {
  uint64_t k = site_key(s, layer, site);
  // Context-parallel ranks hold other positions of the same samples: masks of their own. (Attention
  // dropout draws by global positions instead: each probability is one rank's, as without CP.)
  if (d_.cp_size > 1) k = mix_key(k, 0x6370ULL + static_cast<uint64_t>(d_.cp_rank));
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
    if (l == layer) ps_.tp->all_reduce(grad_range(r.offset, r.count));
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
  a.moe.global = s.layers[local].moe.global;
  return a;
}

// ---- forward -----------------------------------------------------------------------------

// A layer's output is read first by the norm after it. Where that layer and the next (or the
// head) run their forward only once (no full-recompute group: a group's rerun in backward must not
// write a neighbour's norm, whose statistics may share the group's scratch), the norm is written
// by the layer's closing bias + dropout + residual: one pass over the rows instead of two.
bool GptModel::norm_from_previous(int local) const {
  const auto& g = opt_.recompute.group_of;
  // (An mtp layer's input is its depth's projection, not the layer before's output.)
  return opt_.seams.fuse_next_norm && local > 0 && !mtp_layer(local) && g[static_cast<size_t>(local - 1)] < 0 &&
         g[static_cast<size_t>(local)] < 0;
}

GptModel::NextNorm GptModel::next_norm(const Slot& s, int local) const {
  const auto& g = opt_.recompute.group_of;
  if (!opt_.seams.fuse_next_norm || g[static_cast<size_t>(local)] >= 0) return {};
  if (local + 1 < d_.decoder_layers()) {
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

// One decoder layer: the attention block, then the MLP block. Each block ends with its bias +
// dropout + residual, which also writes the norm that reads its output (the MLP's ln2; the next
// layer's ln1 or the final norm: next), so a layer makes two passes over its residual rows.
void GptModel::layer_forward(int local, Slot& s, const LayerActs& A, Tensor x, const NextNorm& next) {
  fp8_training_ = s.training;
  attention_forward(local, s, A, x);  // x -> h1, ln2(h1)
  if (d_.is_moe(d_.layer_begin + local)) moe_forward(local, s, A, next);  // h1 -> out, next(out)
  else mlp_forward(local, s, A, next);
}

void GptModel::forward(int slot) {
  Slot& s = slots_.at(static_cast<size_t>(slot));
  MT_CHECK(s.staged, "forward of slot {} before stage_micro_batch", slot);
  if (teacher_) teacher_->forward(0);  // (distillation: the teacher's features of the same tokens first)
  const int L = d_.decoder_layers();  // (the mtp layers run in the head)
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
    // (With prefetch: the next layer's gather runs beside this one, into the slot of the layer before.)
    gather_unit(l, next.fused ? -1 : l + 1);
    if (next.fused) gather_unit(l + 1, l + 2);  // (its input norm)
    fp8_keep_inputs_now_ = opt_.recompute.group_of[static_cast<size_t>(l)] < 0;
    offload_before_forward(slot, l);
    layer_forward(l, s, acts(s, l), layer_input(s, l), next);
    offload_after_forward(s, slot, l);
    head_norm_done = l == L - 1 && next.fused;
  }
  fp8_keep_inputs_now_ = true;
  offload_stay_ = -1;
  if (d_.last_stage) {
    params_needed(static_cast<int>(descs_.size()));
    if (s.training) prepare_grad_unit(L - 1);  // (the final norm's backward takes its fc2 bias gradient)
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
  // (An mtp layer's output goes through its own final norm, whose backward takes no bias gradient.
  // A distillation pair's layer output: its gradient gains the pair's after that norm's backward.)
  const auto paired = [&] {
    for (const ModelOptions::Distill::Pair& p : opt_.distill.pairs)
      if (p.student == d_.layer_begin + local) return true;
    return false;
  };
  return proj_bias_grad_from_norm(local) && (local + 1 < d_.decoder_layers() || (d_.last_stage && !mtp_layer(local))) &&
         !paired();
}

Tensor GptModel::prev_fc2_bias_grad(int local) const {
  return local > 0 && !mtp_layer(local) && fc2_bias_grad_from_norm(local - 1) ? layer_grads_[local - 1].fc2_b : Tensor();
}

// One decoder layer's backward: the MLP block's, then the attention block's.
void GptModel::layer_backward(int local, Slot& s, const LayerActs& A, Tensor x, Tensor dy, Tensor dx) {
  if (d_.is_moe(d_.layer_begin + local)) moe_backward(local, s, A, dy);  // d out -> d h1 (gH)
  else mlp_backward(local, s, A, dy);
  attention_backward(local, s, A, x, dx);  // d h1 -> d x
}

void GptModel::backward(int slot, bool grad_sync) {
  Slot& s = slots_.at(static_cast<size_t>(slot));
  MT_CHECK(s.staged && s.training, "backward of slot {} without a training forward", slot);
  params_needed(static_cast<int>(descs_.size()));  // (an update beside the forward is joined: gradients follow)
  const Workspace& w = *ws_;
  const RecomputePlan& rp = opt_.recompute;
  // After each layer of a grad-sync backward its gradients are final: TP-partial ones are summed
  // now, and the hook may start the data-parallel reduction of the buckets they complete.
  // Sharded gradients: every micro-batch's backward reduces its gradients as they become final.
  const bool reduce_now = grad_sync || opt_.shard_grads;
  if (opt_.shard_grads) grads_final(kBackwardBegins);
  auto layer_done = [&](int local) {
    if (!reduce_now) return;
    reduce_tp_partial(d_.layer_begin + local);
    grads_final(layer_first_param_[static_cast<size_t>(local)]);
  };
  // (A layer's backward also writes the layer before's fc2 bias gradient: fc2_bias_grad_from_norm.)
  // The layer whose parameters the backward needs after layer k's: k - 1's, or where k - 1 ends a
  // recompute group, the group's first (its forward runs first).
  auto needed_after = [&](int k) {
    if (k <= 0) return -1;
    const int g = rp.group_of[static_cast<size_t>(k - 1)];
    return g >= 0 ? rp.groups[static_cast<size_t>(g)].first : k - 1;
  };
  auto layer_backward_at = [&](int k, Tensor dy, Tensor dx) {
    if (opt_.distill.enabled) distill_intermediate_backward(s, k, dy);  // (pairs of layer k's output)
    gather_unit(k, needed_after(k));
    prepare_grad_unit(k);
    prepare_grad_unit(k - 1);
    if (k > 0) zero_layer_grads(k - 1);  // (activations over gradients: layer k - 1's, whose fc2 bias k writes)
    offload_before_backward(s, slot, k);
    layer_backward(k, s, acts(s, k), layer_input(s, k), dy, dx);
  };
  if (reduce_now && d_.last_stage) {  // the head's backward (and the mtp layers') ran in the last forward
    reduce_tp_partial(-1);
    for (int l = d_.decoder_end(); l < d_.layer_end; ++l) reduce_tp_partial(l);
    grads_final(d_.stage_mtp_layers() > 0 ? layer_first_param_[static_cast<size_t>(d_.decoder_layers())]
                                          : head_first_param_);
  }
  Tensor cur = s.d_output;
  auto next_buffer = [&](Tensor c) { return c.data == w.gA.data ? w.gB : w.gA; };
  int l = d_.decoder_layers() - 1;
  while (l >= 0) {
    const int g = rp.group_of[l];
    if (g >= 0) {
      // Full recompute: rerun the group's forward from its kept input, then its backward.
      const auto [begin, end] = rp.groups[g];
      MT_CHECK(end - 1 == l, "recompute group [{}, {}) entered at layer {}", begin, end, l);
      recomputing_ = true;
      for (int k = begin; k < end; ++k) {
        gather_unit(k, k + 1 < end ? k + 1 : -1);
        layer_forward(k, s, acts(s, k), layer_input(s, k));
      }
      recomputing_ = false;
      for (int k = end - 1; k >= begin; --k) {
        Tensor nxt = next_buffer(cur);
        layer_backward_at(k, cur, nxt);
        cur = nxt;
        layer_done(k);
      }
      l = begin - 1;
    } else {
      Tensor nxt = next_buffer(cur);
      layer_backward_at(l, cur, nxt);
      cur = nxt;
      layer_done(l);
      --l;
    }
  }
  if (d_.first_stage) {
    zero_layer_grads(kAfterLayers);
    embedding_backward(s, cur);
  }
  last_input_grad_ = cur;
  if (reduce_now) grads_final(0);
  for (int& u : slot_unit_) u = -1;  // (sharded gradients: every slot's reduce-scatter was issued)
}

}  // namespace mt

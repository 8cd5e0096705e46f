// The MoE block of a decoder layer (Megatron-Core's MoELayer with its TopKRouter, dropless, on one
// expert-parallel rank), forward and backward: ln2 (the pre-MLP norm, written by the attention
// block's closing op) -> router -> top-k routing -> permute (tokens grouped by expert) -> the
// experts' fc1 (grouped GEMM) -> activation -> times the routing weight -> fc2 (grouped GEMM) ->
// un-permute (sum of each token's k expert outputs) [+ the shared expert, optionally gated] ->
// dropout + residual, whose pass also writes the norm that follows. Load-balancing (aux) and
// z-losses add their gradients to the router's logits; they are logged, never added to the loss.
//
// Expert parallelism (EP > 1), Megatron's all-gather token dispatcher over the EP group: each rank
// routes its own tokens, then the group's tokens, routing weights and choices are all-gathered
// (Ng = N x EP rows); each rank permutes only the pairs routed to its experts, runs them, and the
// un-permuted partial outputs [Ng, h] are reduce-scattered back to their ranks (the sum over the
// experts). Backward mirrors it: the output gradient all-gathered, the input gradient and the
// routing weights' gradient reduce-scattered.
// With the all-to-all dispatcher (alltoall, flex) each rank sorts its own (token, slot) pairs by
// expert, sends each expert's chunk of rows and routing weights to the expert's rank (the chunk
// sizes all-gathered first, then taken on the host), and receives the outputs of its pairs back,
// which it sums per token as one rank does: a pair's row crosses the network once each way
// rather than every token reaching every rank. Backward: the output gradients out, the input
// gradients and the weights' gradients back.
//
// The rows a rank dispatches: all N rows of the micro-batch when the experts split over TP as the
// dense MLP does (their outputs then partial over TP, summed with the shared expert's by the TP
// reduction), or with an expert TP size of 1 under TP > 1 its own sequence-parallel rows (whole
// experts: the routed output of those rows is complete and joins the shared expert's after the TP
// reduction; the EP group then spans TP ranks).
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/philox.h"
#include "engine/gpt_model.h"
#include "engine/gpt_model_parts.h"
#include "engine/moe_routing.h"
#include "parallel/parallel_state.h"

namespace mt {

MoeRouting GptModel::moe_routing() const {
  return MoeRouting::make(d_.experts, d_.topk, d_.moe_score, d_.moe_pre_softmax, d_.moe_scaling, d_.moe_groups,
                          d_.moe_group_topk);
}

// The expert bias of local layer `local` on the device (empty without expert bias).
Tensor GptModel::layer_expert_bias(int local) const {
  if (!has_expert_bias()) return Tensor();
  return moe_bias_.flat_slice(static_cast<int64_t>(moe_index(local)) * d_.experts, d_.experts);
}

// The shared expert's gate as a routing of one expert, top-1, sigmoid scoring: its weight is
// sigmoid(logit) rounded to the logit's dtype (Megatron's F.sigmoid in that dtype), and the routing
// backward gives d logit = d g * g (1 - g).
MoeRouting GptModel::gate_routing() const { return MoeRouting::make(1, 1, MoeScoreFunction::sigmoid); }

// g = sigmoid(the kept gate logit) float32 [N, 1], in the workspace.
Tensor GptModel::shared_gate_forward(const LayerParams& P, const LayerActs& A) {
  (void)P;
  be_.moe_route(ws_->moe_gate_p, ws_->moe_gate_idx, A.moe.sh_gate, Tensor(), gate_routing());
  return ws_->moe_gate_p;
}

// The router's dtype: the compute dtype, or float32 with --moe-router-dtype fp32 where the compute
// dtype is narrower (bf16, fp16).
DType GptModel::router_dtype() const {
  const DType T = opt_.compute;
  return d_.moe_router_fp32 && (T == DType::bf16 || T == DType::f16) ? DType::f32 : T;
}

int GptModel::moe_index(int local) const {
  int n = 0;
  for (int l = d_.layer_begin; l < d_.layer_begin + local; ++l) n += d_.is_moe(l) ? 1 : 0;
  return n;
}

std::span<float> GptModel::expert_bias(int layer) {
  MT_CHECK(has_expert_bias() && d_.is_moe(layer) && layer >= d_.layer_begin && layer < d_.layer_end,
           "no expert bias of layer {} in this chunk", layer);
  return std::span<float>(moe_bias_host_).subspan(static_cast<size_t>(moe_index(layer - d_.layer_begin)) * d_.experts,
                                                  static_cast<size_t>(d_.experts));
}

void GptModel::expert_bias_loaded() { be_.copy_from_host(moe_bias_, moe_bias_host_.data()); }

const std::vector<double>& GptModel::expert_token_counts() {
  if (has_expert_bias()) be_.copy_to_host(moe_counts_.data(), moe_counts_dev_);
  return moe_counts_;
}

void GptModel::update_expert_bias() {
  if (!has_expert_bias()) return;
  ps_.replicas().all_reduce(moe_counts_dev_);  // (over DP x CP)
  // (Only the experts' TP rank 0 counted; with experts split over fewer ranks than TP, the TP
  // ranks counted other rows.)
  if (d_.tp_size > 1) ps_.tp->all_reduce(moe_counts_dev_);
  be_.copy_to_host(moe_counts_.data(), moe_counts_dev_);
  const size_t E = static_cast<size_t>(d_.experts);
  for (size_t m = 0; m < moe_bias_host_.size() / E; ++m)
    moe_expert_bias_update(moe_bias_host_.data() + m * E, moe_counts_.data() + m * E, d_.experts, d_.moe_bias_rate);
  be_.fill(moe_counts_dev_, 0.0);
  expert_bias_loaded();
}

// Rows are sequence-major (row s * B + b); sequence b's rows in order are rows b * S .. of the copy.
Tensor GptModel::moe_sequence_logits(const Tensor& logits) {
  const Workspace& w = *ws_;
  const int64_t B = d_.micro_batch, S = d_.seq;
  if (!moe_seq_index_ready_) {
    std::vector<int32_t> index(static_cast<size_t>(B * S)), inverse(index.size());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s) {
        index[static_cast<size_t>(b * S + s)] = static_cast<int32_t>(s * B + b);
        inverse[static_cast<size_t>(s * B + b)] = static_cast<int32_t>(b * S + s);
      }
    be_.copy_from_host(w.moe_seq_index, index.data());
    be_.copy_from_host(w.moe_seq_inverse, inverse.data());
    be_.synchronize();  // (the host arrays go out of scope)
    moe_seq_index_ready_ = true;
  }
  be_.moe_gather_rows(w.moe_seq_logits, logits, w.moe_seq_index, 1);
  return w.moe_seq_logits;
}

int GptModel::moe_layers() const {
  int n = 0;
  for (int l = d_.layer_begin; l < d_.layer_end; ++l) n += d_.is_moe(l) ? 1 : 0;
  return n;
}

// The group the dispatched rows are gathered over (null: this rank's alone): the EP group, or
// with experts split over fewer ranks than TP the experts' tp x ep group (each member's own rows).
Communicator* GptModel::moe_dispatch_group() const {
  Communicator* g = d_.experts_local_rows() ? ps_.expert_tp_ep.get() : ps_.ep.get();
  return g && g->size() > 1 ? g : nullptr;
}

// The dispatch group's rows of a micro-batch (N without EP) and the most (row, slot) pairs this
// rank's experts can receive (dropless, k distinct experts per row: at most min(k, El) of each).
int64_t GptModel::moe_group_tokens() const {
  return d_.experts_local_rows() ? d_.tokens_local() * d_.etp_size * d_.ep_size : d_.tokens() * d_.ep_size;
}
int64_t GptModel::moe_dispatch_rows() const { return d_.experts_local_rows() ? d_.tokens_local() : d_.tokens(); }
int64_t GptModel::moe_max_rows() const {
  // (FP8 experts: each expert's rows padded to a multiple of moe_row_align(), at most align - 1 more each.)
  return moe_group_tokens() * std::min<int64_t>(d_.topk, d_.experts_local()) +
         (moe_row_align() - 1) * d_.experts_local();
}

// Without expert parallelism the ops past the offsets run on all moe_max_rows() rows: with token
// dropping the rows past the kept pairs' (order's entries past offsets[E] are stale) are gathered
// and computed but never read, as every reader of the permuted rows goes through slot_of, and the
// grouped GEMMs stop at offsets[E]. Under expert parallelism a rank's pairs are a fraction of that
// bound, so the host takes the offsets there.
bool GptModel::moe_offsets_on_device() const { return moe_dispatch_group() == nullptr && !fp8_ex_.any(); }

ExpertOffsets GptModel::moe_offsets(const MoeActs& M, int64_t& rows) const {
  if (moe_offsets_on_device()) {
    rows = moe_max_rows();
    return ExpertOffsets::on_device(M.offsets);
  }
  rows = M.host_offsets->back();
  return ExpertOffsets(*M.host_offsets);
}

bool GptModel::moe_alltoall() const {
  // (Experts split over TP ranks inside a dispatch group that spans TP, ETP > 1 below TP, would
  // need each pair sent to every ETP rank of its expert: those take the all-gather.)
  return d_.moe_alltoall && moe_dispatch_group() != nullptr && ModelDims::moe_alltoall_applies(d_.tp_size, d_.etp_size);
}

// The plan of a layer's all-to-all: this rank's pairs `idx` [n, k] sorted by expert (all E), the
// group's offsets all-gathered and taken on the host, the chunk sizes (MoeExchange) and this rank's
// expert offsets (host and device, expert-major over the source ranks). Returns R, the pairs this
// rank's experts receive.
int64_t GptModel::moe_exchange_plan(const MoeActs& M, Tensor idx, Communicator& g) {
  const int E = d_.experts, El = d_.experts_local(), G = g.size(), me = g.rank();
  MT_CHECK(G == d_.ep_size && me == d_.ep_rank, "all-to-all dispatch over a group of {} (rank {}) under EP {} (rank {})",
           G, me, d_.ep_size, d_.ep_rank);
  be_.moe_permute_plan(M.s_order, M.s_slot_of, M.s_offsets, idx, 0, E);
  g.all_gather(ws_->moe_offs_g, M.s_offsets);
  const size_t W = static_cast<size_t>(E) + 1;
  moe_offs_g_.resize(W * static_cast<size_t>(G));
  moe_off32_[0] = 0;
  be_.copy_to_host(moe_offs_g_.data(), ws_->moe_offs_g);
  MoeExchange& x = *M.exchange;
  x.send.assign(moe_offs_g_.begin() + static_cast<std::ptrdiff_t>(W * me),
                moe_offs_g_.begin() + static_cast<std::ptrdiff_t>(W * (me + 1)));
  x.recv.assign(static_cast<size_t>(El) * G, 0);
  std::vector<int64_t>& off = *M.host_offsets;
  off[0] = 0;
  for (int e = 0; e < El; ++e) {
    const size_t ge = static_cast<size_t>(d_.expert_begin() + e);
    int64_t sum = 0;
    for (int src = 0; src < G; ++src) {
      const int32_t* o = moe_offs_g_.data() + W * static_cast<size_t>(src);
      sum += x.recv[static_cast<size_t>(e) * G + src] = o[ge + 1] - o[ge];
    }
    off[static_cast<size_t>(e) + 1] = off[static_cast<size_t>(e)] + sum;
    moe_off32_[static_cast<size_t>(e) + 1] = moe_off32_[static_cast<size_t>(e)] + static_cast<int32_t>(sum);
  }
  // FP8 experts: each expert's rows from a multiple of moe_row_align() (moe_zero_padding zeroes the
  // rows between). The device offsets stay the received rows' own.
  const int64_t align = moe_row_align();
  for (int e = 0; e < El && align > 1; ++e) {
    const int64_t n = moe_off32_[static_cast<size_t>(e) + 1] - moe_off32_[static_cast<size_t>(e)];
    off[static_cast<size_t>(e) + 1] = off[static_cast<size_t>(e)] + (n + align - 1) / align * align;
  }
  // (The device offsets: the aux-loss-free balancing's counts read them. A pageable host source is
  // staged before the copy returns.)
  be_.copy_from_host(M.offsets, moe_off32_.data());
  return off.back();
}

// One all-to-all of rows between this rank's expert-sorted pairs `sorted` [P, c] (P = send[E]; expert
// e's chunk to or from group rank e / El) and its experts' rows `perm` [R, c] (expert-major, source
// rank minor). Each pair of ranks posts its chunks in expert order, so they match in order; a rank's
// chunks to itself are copied.
void GptModel::moe_exchange(Communicator& g, const MoeActs& M, Tensor sorted, Tensor perm, bool to_experts) {
  const MoeExchange& x = *M.exchange;
  const int El = d_.experts_local(), G = g.size(), me = g.rank();
  const std::vector<int64_t>& off = *M.host_offsets;
  g.group_start();
  for (int dst = 0; dst < G; ++dst)
    for (int e = dst * El; e < (dst + 1) * El && dst != me; ++e) {
      const int64_t a = x.send[static_cast<size_t>(e)], c = x.send[static_cast<size_t>(e) + 1] - a;
      if (c == 0) continue;
      if (to_experts) g.send(sorted.row_slice(a, c), dst);
      else g.recv(sorted.row_slice(a, c), dst);
    }
  for (int e = 0; e < El; ++e) {
    int64_t pos = off[static_cast<size_t>(e)];
    for (int src = 0; src < G; ++src) {
      const int64_t c = x.recv[static_cast<size_t>(e) * G + src];
      const Tensor theirs = perm.row_slice(pos, c);
      pos += c;
      if (c == 0) continue;
      if (src == me) {  // (a copy: the grouped point-to-point only batches the communicator's own calls)
        const Tensor mine = sorted.row_slice(x.send[static_cast<size_t>(d_.expert_begin() + e)], c);
        if (to_experts) be_.copy(theirs, mine);
        else be_.copy(mine, theirs);
      } else if (to_experts) {
        g.recv(theirs, src);
      } else {
        g.send(theirs, src);
      }
    }
  }
  g.group_end();
}

Tensor GptModel::router_input(Tensor x, Tensor buffer, uint64_t jitter_key, int64_t index0) {
  const float jitter = d_.moe_jitter_eps;
  if (buffer.empty()) return x;
  if (buffer.dtype == x.dtype) {
    be_.moe_jitter(buffer, x, jitter, jitter_key, index0);  // (the buffer exists for the jitter)
    return buffer;
  }
  be_.cast(buffer, x);
  if (jitter > 0) be_.moe_jitter(buffer, buffer, jitter, jitter_key, index0);
  return buffer;
}

Tensor GptModel::router_weight(const LayerParams& P) {
  if (ws_->moe_w32.empty()) return P.router_w;
  be_.cast(ws_->moe_w32, P.router_w);
  return ws_->moe_w32;
}

Tensor GptModel::router_bias(const LayerParams& P) {
  if (ws_->moe_b32.empty()) return P.router_b;
  be_.cast(ws_->moe_b32, P.router_b);
  return ws_->moe_b32;
}

// Megatron's load-balancing loss factors, coefficients removed: a term is factor * sum_e P_e c_e
// (P_e the scores' sums over this rank's rows, c_e the counts), with E / (k T^2) for T tokens:
// aux_loss over the micro-batch's T = N x CP tokens (the counts summed over CP); seq_aux_loss
// per sequence over its S x CP rows, divided by the B sequences; global_aux_loss over the DP x CP
// ranks' T = N x CP x DP tokens (the counts over DP too, averaged over the step's micro-batches).
// The z-loss is z * sum lse^2 with 1 / (N x CP). The ranks' values add up to Megatron's losses.
// (The backward multiplies in the coefficients before dividing, as it always has.)
GptModel::MoeLossFactors GptModel::moe_loss_factors() const {
  MoeLossFactors f;
  f.sequences = d_.micro_batch;
  f.rows = d_.tokens() / f.sequences;
  const double E = d_.experts, k = d_.topk;
  const double seq_rows = static_cast<double>(f.rows) * d_.cp_size, tokens = static_cast<double>(d_.tokens()) * d_.cp_size;
  const double global = tokens * ps_.dp_size;
  f.aux = E / (k * tokens * tokens);
  f.seq = E / (k * seq_rows * seq_rows * static_cast<double>(f.sequences));
  f.global = E / (k * global * global);
  f.z = 1.0 / tokens;
  return f;
}

// The statistics' layout (MoeActs::stats): the micro-batch's, then with seq_aux_loss each
// sequence's, [2E + 1] each.
int64_t GptModel::moe_stats_blocks() const { return 1 + (d_.moe_seq_coeff != 0 ? d_.micro_batch : 0); }

// The router's load-balancing statistics of a micro-batch (MoeActs::stats; each sequence's counts
// over all its positions: summed over CP) and in a training forward, not a recomputation's, the
// logged values of the terms computed (a term at coefficient 0 logs 0, as Megatron records none).
// global_aux_loss: the micro-batch's counts summed over DP and added to the layer's running sum,
// whose mean over the step's micro-batches so far the backward takes (MoeActs::global).
void GptModel::moe_balance_forward(int local, const Slot& s, const MoeActs& M) {
  const MoeLossFactors f = moe_loss_factors();
  const int64_t E = d_.experts, width = 2 * E + 1;
  const int layer = d_.layer_begin + local;
  const MoeRouting r = moe_routing();
  const bool first = s.training && !recomputing_;
  const auto stats_of = [&](const Tensor& stats, const Tensor& logits) {
    be_.moe_aux_stats(stats, logits, r);
    if (d_.cp_size > 1) ps_.cp->all_reduce(stats.flat_slice(E, E));
  };
  const auto record = [&](int term, const Tensor& stats, double factor, double z) {
    const float a = static_cast<float>(factor), zf = static_cast<float>(z);
    be_.moe_aux_log(moe_loss_.flat_slice(2 * term, 2), stats, a, zf);
    if (!moe_layer_loss_.empty())
      be_.moe_aux_log(moe_layer_loss_.flat_slice(2 * (int64_t{kMoeTerms} * layer + term), 2), stats, a, zf);
  };
  const Tensor whole = M.stats.flat_slice(0, width);
  stats_of(whole, M.logits);
  if (first) record(kMoeAuxTerm, whole, d_.moe_aux_coeff != 0 ? f.aux : 0.0, f.z);
  if (d_.moe_seq_coeff != 0) {
    const Tensor ordered = moe_sequence_logits(M.logits);
    for (int64_t b = 0; b < f.sequences; ++b) {
      const Tensor stats = M.stats.flat_slice((1 + b) * width, width);
      stats_of(stats, ordered.row_slice(b * f.rows, f.rows));
      if (first) record(kMoeSeqTerm, stats, f.seq, 0.0);
    }
  }
  if (d_.moe_global_coeff != 0 && first) {
    const size_t m = static_cast<size_t>(moe_index(local));
    const Tensor counts = M.global.flat_slice(E, E), sum = moe_global_sum_.flat_slice(static_cast<int64_t>(m) * E, E);
    be_.copy(counts, whole.flat_slice(E, E));
    if (ps_.dp_size > 1) ps_.dp->all_reduce(counts);
    be_.axpby(sum, 1.0f, sum, 1.0f, counts);
    const int n = ++moe_global_steps_[m];
    be_.axpby(counts, 1.0f / static_cast<float>(n), sum, 0.0f, sum);
    be_.copy(M.global.flat_slice(0, E), whole.flat_slice(0, E));
    be_.fill(M.global.flat_slice(2 * E, 1), 0.0);
    record(kMoeGlobalTerm, M.global, f.global, 0.0);
  }
}

void GptModel::moe_begin_step() {
  if (moe_global_sum_.empty()) return;
  be_.fill(moe_global_sum_, 0.0);
  std::fill(moe_global_steps_.begin(), moe_global_steps_.end(), 0);
}

// What an MoE layer keeps for backward (after ln2's output and statistics, laid out by
// layout_mlp_acts).
void GptModel::layout_moe_acts(Arena& a, MemoryCategory c, LayerActs& A) {
  const int64_t N = d_.tokens(), h = d_.hidden, E = d_.experts, El = d_.experts_local();
  const int64_t Ngk = moe_group_tokens() * d_.topk, R = moe_max_rows();
  const DType T = opt_.compute, S = opt_.accum;
  MoeActs& M = A.moe;
  M.logits = a.take(c, router_dtype(), {N, E});
  M.probs = a.take(c, S, {N, d_.topk});
  M.idx = a.take(c, DType::i32, {N, d_.topk});
  M.kept = d_.moe_drops() ? a.take(c, DType::i32, {N, d_.topk}) : Tensor();
  if (d_.moe_aux_terms()) M.stats = a.take(c, S, {moe_stats_blocks() * (2 * E + 1)});
  // global_aux_loss: kept by every MoE layer, also a recomputed one (GptModel::layout), as the
  // forward made it (a recomputation does not count again).
  M.global = d_.moe_global_coeff != 0 ? a.take(c, S, {2 * E + 1}) : Tensor();
  M.order = M.slot_of = M.s_order = M.s_slot_of = M.s_offsets = Tensor();
  M.exchange = nullptr;
  if (moe_alltoall()) {
    const int64_t nk = moe_dispatch_rows() * d_.topk;
    M.s_order = a.take(c, DType::i32, {nk});
    M.s_slot_of = a.take(c, DType::i32, {nk});
    M.s_offsets = a.take(c, DType::i32, {E + 1});
    moe_exchanges_.push_back(std::make_unique<MoeExchange>());
    M.exchange = moe_exchanges_.back().get();
  } else {
    M.order = a.take(c, DType::i32, {std::max(Ngk, R)});  // (R: padded for FP8 experts)
    M.slot_of = a.take(c, DType::i32, {Ngk});
  }
  M.offsets = a.take(c, DType::i32, {El + 1});
  moe_host_offsets_.push_back(std::make_unique<std::vector<int64_t>>(static_cast<size_t>(El + 1), 0));
  M.host_offsets = moe_host_offsets_.back().get();
  M.p_perm = a.take(c, S, {R});
  M.fc1_pre = opt_.moe_recompute_fc1 ? ws_->moe_fc1 : take_act(a, c, OffloadField::moe_fc1_pre, T, {R, d_.expert_fc1_width_local()});
  if (d_.shared_ffn > 0) {
    M.sh_fc1_pre = opt_.moe_recompute_shared ? ws_->moe_sh_fc1 : a.take(c, T, {N, d_.shared_fc1_width_local()});
    if (d_.shared_gate) {
      M.sh_out = a.take(c, T, {N, h});
      M.sh_gate = a.take(c, T, {N, 1});
    }
  }
}

// The MoE layers' shared workspace (none without MoE layers on this stage).
void GptModel::layout_moe_workspace(Arena& a) {
  Workspace& w = *ws_;
  w.moe_rows = w.moe_act = w.moe_dact = w.moe_sh_act = w.moe_dlogits = w.moe_aux_grad = w.moe_dprobs =
      w.moe_dp_perm = w.moe_xg = w.moe_yg = w.moe_pg = w.moe_ig = w.moe_dxl = Tensor();
  if (!d_.any_moe()) return;
  moe_off32_.assign(static_cast<size_t>(d_.experts_local() + 1), 0);
  moe_order_host_.clear();
  moe_slot_host_.clear();
  if (fp8_ex_.any() && !moe_alltoall()) {  // (moe_pad_permutation's host copies)
    moe_order_host_.assign(static_cast<size_t>(2 * moe_max_rows()), 0);
    moe_slot_host_.assign(static_cast<size_t>(moe_group_tokens() * d_.topk), 0);
  }
  using C = MemoryCategory;
  const DType T = opt_.compute, S = opt_.accum;
  const int64_t N = d_.tokens(), h = d_.hidden, E = d_.experts, fe = d_.expert_ffn_local();
  const int64_t R = moe_max_rows(), Ng = moe_group_tokens();
  w.moe_rows = a.take(C::workspace, T, {std::max(R, N), h});  // (N: the shared expert's rows use it too)
  w.moe_act = a.take(C::workspace, T, {R, fe});
  // --moe-apply-probs-on-input: the permuted inputs unscaled, for the routing weights' gradient.
  w.moe_xin = d_.moe_probs_on_input ? a.take(C::workspace, T, {R, h}) : Tensor();
  w.moe_dact = a.take(C::workspace, T, {R, fe});
  w.moe_xs = w.moe_ps = w.moe_offs_g = Tensor();
  if (moe_alltoall()) {
    const int64_t nk = moe_dispatch_rows() * d_.topk;
    w.moe_xs = a.take(C::workspace, T, {nk, h});
    w.moe_ps = a.take(C::workspace, S, {nk});
    w.moe_offs_g = a.take(C::workspace, DType::i32, {int64_t{moe_dispatch_group()->size()} * (E + 1)});
  } else if (Ng > moe_dispatch_rows()) {  // (gathered over a dispatch group)
    w.moe_xg = a.take(C::workspace, T, {Ng, h});
    w.moe_yg = a.take(C::workspace, T, {Ng, h});
    w.moe_pg = a.take(C::workspace, S, {Ng, d_.topk});
    w.moe_ig = a.take(C::workspace, DType::i32, {Ng, d_.topk});
  }
  w.moe_seq_logits = w.moe_seq_grad = w.moe_seq_index = w.moe_seq_inverse = Tensor();
  if (d_.moe_seq_coeff != 0) {
    w.moe_seq_logits = a.take(C::workspace, router_dtype(), {N, E});
    w.moe_seq_grad = a.take(C::workspace, S, {N, E});
    w.moe_seq_index = a.take(C::workspace, DType::i32, {N});
    w.moe_seq_inverse = a.take(C::workspace, DType::i32, {N});
    moe_seq_index_ready_ = false;
  }
  if (moe_alltoall()) {
    if (d_.experts_local_rows()) w.moe_dxl = a.take(C::workspace, T, {moe_dispatch_rows(), h});
  } else if (Ng > N || d_.experts_local_rows()) {
    w.moe_dxl = a.take(C::workspace, T, {std::max(N, Ng), h});
  }
  if (d_.shared_ffn > 0) w.moe_sh_act = a.take(C::workspace, T, {N, d_.shared_ffn_local()});
  const DType RT = router_dtype();
  w.moe_dlogits = a.take(C::workspace, RT, {N, E});
  w.moe_force_bias = d_.moe_force_bias ? a.take(C::workspace, RT, {1, E}) : Tensor();
  w.moe_fc1 = opt_.moe_recompute_fc1 ? a.take(C::workspace, T, {R, d_.expert_fc1_width_local()}) : Tensor();
  w.moe_sh_fc1 = opt_.moe_recompute_shared ? a.take(C::workspace, T, {N, d_.shared_fc1_width_local()}) : Tensor();
  w.moe_x32 = w.moe_w32 = w.moe_b32 = w.moe_xj = Tensor();
  if (RT != T) {
    w.moe_x32 = a.take(C::workspace, RT, {N, h});
    w.moe_w32 = a.take(C::workspace, RT, {E, h});
    if (d_.linear_bias) w.moe_b32 = a.take(C::workspace, RT, {E});
  } else if (d_.moe_jitter_eps > 0) {
    w.moe_xj = a.take(C::workspace, T, {N, h});
  }
  w.moe_aux_counts = Tensor();
  if (d_.moe_aux_terms()) {
    w.moe_aux_grad = a.take(C::workspace, S, {N, E});
    w.moe_aux_counts = a.take(C::workspace, S, {2 * (2 * E + 1)});
  }
  w.moe_dprobs = a.take(C::workspace, S, {N, d_.topk});
  w.moe_dp_perm = a.take(C::workspace, S, {R});
  w.moe_gate_p = w.moe_gate_idx = w.moe_dgate = w.moe_dsh = Tensor();
  if (d_.shared_gate) {
    w.moe_gate_p = a.take(C::workspace, S, {N, 1});
    w.moe_gate_idx = a.take(C::workspace, DType::i32, {N, 1});
    w.moe_dgate = a.take(C::workspace, T, {N, 1});
    w.moe_dsh = a.take(C::workspace, T, {N, h});
  }
}

// The MoE block of layer `local`: h1 (normed into ln2_out by the attention block's closing op)
// -> out = h1 + dropout(routed experts + shared expert), and the norm that reads out (next).
void GptModel::moe_forward(int local, Slot& s, const LayerActs& A, const NextNorm& next) {
  const LayerParams& P = layer_params_[static_cast<size_t>(local)];
  const Workspace& w = *ws_;
  const MoeActs& M = A.moe;
  const int layer = d_.layer_begin + local;
  const int k = d_.topk;
  const int64_t N = d_.tokens();
  const float hp = s.training ? d_.hidden_dropout : 0.0f;
  const MoeRouting r = moe_routing();
  gather_rows(A.ln2_out);

  // Router: logits, top-k routing weights and experts; the load-balancing statistics. With input
  // jitter the router reads its own copy of the input, scaled elementwise by factors drawn from
  // site 4 of the layer's keys (every TP rank draws the same: they route the same rows).
  const Tensor router_buffer = w.moe_x32.empty() ? w.moe_xj : w.moe_x32;
  be_.linear_forward(M.logits, router_input(A.ln2_out, router_buffer, site_key(s, layer, 4), 0), router_weight(P),
                     router_bias(P), Activation::none, Tensor());
  // Forced balance (benchmarks): random logits, the same on every TP rank of the micro-batch
  // (site 3 of the layer's keys); the backward treats them as the gating GEMM's output.
  if (d_.moe_force_balance || d_.moe_force_bias)
    be_.init_normal(M.logits, site_key(s, layer, 3), 1.0f, ShardIndex::whole(N, d_.experts));
  // Forced bias (benchmarks): a per-expert bias added to those random logits, the same on every
  // rank (keyed by the seed, the layer and, for a positive std, the micro-batch's serial).
  if (d_.moe_force_bias) {
    const float std = *d_.moe_force_bias;
    const uint64_t base = mix_key(mix_key(d_.seed, 0x626961736564ULL /* "biased" */), static_cast<uint64_t>(layer));
    be_.init_normal(w.moe_force_bias, std < 0 ? base : mix_key(base, s.serial), std::fabs(std),
                    ShardIndex::whole(1, d_.experts));
    const int64_t all_rows[2] = {0, N};  // (one group: every row)
    be_.grouped_bias_forward(M.logits, w.moe_force_bias, Tensor(), ExpertOffsets(std::span<const int64_t>(all_rows)));
  }
  if (d_.moe_sinkhorn)  // (each TP rank routes its own rows under SP, as Megatron's router does)
    be_.moe_sinkhorn_route(M.probs, M.idx, M.logits, k, d_.tokens_local(), s.training);
  else
    be_.moe_route(M.probs, M.idx, M.logits, layer_expert_bias(local), r);
  // Token dropping: the pairs over an expert's capacity among this rank's rows leave the dispatch
  // (M.kept); the routing itself (M.idx: the weights' backward) is unchanged.
  if (d_.moe_drops())
    be_.moe_capacity_drop(M.kept, M.idx, M.probs, d_.experts, d_.moe_capacity(), d_.tokens_local(),
                          d_.moe_drop_by_position);
  const Tensor dispatched = d_.moe_drops() ? M.kept : M.idx;
  if (!M.stats.empty()) moe_balance_forward(local, s, M);

  // Dispatch: the rows this rank dispatches (all, or its own under whole experts), under expert
  // parallelism with the EP group's, all-gathered, or this rank's pairs sent to their experts.
  const bool own_rows = d_.experts_local_rows();
  Communicator* const disp = moe_dispatch_group();
  const bool a2a = moe_alltoall(), ag = disp != nullptr && !a2a;
  const int64_t n_disp = moe_dispatch_rows(), r0 = own_rows ? d_.local_row_begin() : 0;
  const Tensor x_in = A.ln2_out.row_slice(r0, n_disp);
  const Tensor xg = ag ? w.moe_xg : x_in;
  const Tensor pg = ag ? w.moe_pg : M.probs.row_slice(r0, n_disp), ig = ag ? w.moe_ig : dispatched.row_slice(r0, n_disp);
  if (ag) {
    disp->all_gather(xg, x_in);
    disp->all_gather(pg, M.probs.row_slice(r0, n_disp));
    disp->all_gather(ig, dispatched.row_slice(r0, n_disp));
  }
  const int64_t Ng = xg.rows();

  // Permute: the (token, slot) pairs routed to this rank's experts, grouped by expert; the grouped
  // GEMMs read the split sizes on the device, or (moe_offsets) take them on the host (one copy per
  // layer). The permuted expert inputs [R, h] are in the workspace (gathered again for the
  // backward's weight gradient rather than kept: R * h per MoE layer). All-to-all: this rank's
  // pairs sorted by expert, their rows and weights sent to the experts' ranks.
  int64_t R = 0, pairs = 0;
  if (a2a) {
    R = moe_exchange_plan(M, ig, *disp);
    pairs = M.exchange->send.back();
  } else {
    be_.moe_permute_plan(M.order.flat_slice(0, M.slot_of.numel()), M.slot_of, M.offsets, ig, d_.expert_begin(),
                         d_.experts_local());
    if (!moe_offsets_on_device()) {
      be_.copy_to_host(moe_off32_.data(), M.offsets);
      std::copy(moe_off32_.begin(), moe_off32_.end(), M.host_offsets->begin());
      if (moe_row_align() > 1) moe_pad_permutation(M);
    }
  }
  const ExpertOffsets offsets = moe_offsets(M, R);
  const Tensor x_perm = w.moe_rows.row_slice(0, R), p_perm = M.p_perm.flat_slice(0, R);
  if (a2a) {
    const Tensor s_order = M.s_order.flat_slice(0, pairs), ps = w.moe_ps.flat_slice(0, pairs);
    be_.moe_gather_rows(w.moe_xs.row_slice(0, pairs), x_in, s_order, k);
    be_.moe_gather_rows(ps.view({pairs, 1}), pg.view({n_disp * k, 1}), s_order, 1);
    moe_exchange(*disp, M, w.moe_xs.row_slice(0, pairs), x_perm, true);
    moe_exchange(*disp, M, ps.view({pairs, 1}), p_perm.view({R, 1}), true);
    moe_zero_padding(M, x_perm);
    moe_zero_padding(M, p_perm.view({R, 1}));
  } else {
    const Tensor order = M.order.flat_slice(0, R);
    be_.moe_gather_rows(x_perm, xg, order, k);
    be_.moe_gather_rows(p_perm.view({R, 1}), pg.view({Ng * k, 1}), order, 1);
  }

  // Shared expert's fc1 and activation (the last reader of ln2's output, which may share the
  // memory of tmp_h: ModelOptions::keep_norm_outputs).
  if (d_.shared_ffn > 0) {
    extra_linear_fwd(local, extra_shared_gemm(0), M.sh_fc1_pre, A.ln2_out, P.sh_fc1_w);
    if (d_.swiglu) be_.swiglu_forward(w.moe_sh_act, M.sh_fc1_pre, d_.glu);
    else be_.activation_forward(w.moe_sh_act, M.sh_fc1_pre, d_.ungated_mlp_activation());
    if (d_.shared_gate) be_.linear_forward(M.sh_gate, A.ln2_out, P.sh_gate_w, Tensor(), Activation::none, Tensor());
  }

  // Experts: fc1 -> activation -> times the routing weight -> fc2; then each token's k outputs
  // summed (all-gather EP: this rank's experts' share of every group token, reduce-scattered to its
  // rank; all-to-all: the outputs of this rank's pairs received first).
  const Tensor fc1_pre = M.fc1_pre.row_slice(0, R), act = w.moe_act.row_slice(0, R);
  // (--moe-apply-probs-on-input: the routing weight scales the expert's input instead, top-1.)
  if (d_.moe_probs_on_input) be_.moe_scale_rows(x_perm, x_perm, p_perm);
  expert_linear_fwd(local, 0, fc1_pre, x_perm, P.ex_fc1_w, offsets);
  expert_bias_fwd(P, 0, fc1_pre, p_perm, offsets);
  if (d_.moe_probs_on_input) {
    if (d_.swiglu) be_.swiglu_forward(act, fc1_pre, d_.glu);
    else be_.activation_forward(act, fc1_pre, d_.ungated_mlp_activation());
  } else if (d_.swiglu) {
    be_.moe_swiglu_forward(act, fc1_pre, p_perm, d_.glu);
  } else {
    be_.activation_forward(act, fc1_pre, d_.ungated_mlp_activation());
    be_.moe_scale_rows(act, act, p_perm);
  }
  expert_linear_fwd(local, 1, x_perm, act, P.ex_fc2_w, offsets);
  expert_bias_fwd(P, 1, x_perm, p_perm, offsets);
  // The routed output: into tmp_h [N, h] (partial over TP), or with whole experts this rank's rows
  // [Nl, h], complete.
  const Tensor routed = own_rows ? w.moe_dxl.row_slice(0, n_disp) : w.tmp_h;
  if (a2a) {
    moe_exchange(*disp, M, w.moe_xs.row_slice(0, pairs), x_perm, false);
    be_.moe_combine(routed, w.moe_xs.row_slice(0, pairs), M.s_slot_of, k, false);
  } else {
    be_.moe_combine(ag ? w.moe_yg : routed, x_perm, M.slot_of, k, false);
    if (ag) disp->reduce_scatter(routed, w.moe_yg);
  }

  // The shared expert's output added (Megatron: routed + shared), gated: times sigmoid(x . w_g)
  // (with whole experts tmp_h holds the shared expert's output alone).
  const bool shared = d_.shared_ffn > 0;
  if (shared) {
    const Tensor rows = w.moe_rows.flat_slice(0, N * d_.hidden).view({N, d_.hidden});
    const Tensor sh_out = d_.shared_gate ? M.sh_out : rows;
    extra_linear_fwd(local, extra_shared_gemm(1), sh_out, w.moe_sh_act, P.sh_fc2_w);
    if (d_.shared_gate) be_.moe_scale_rows(rows, sh_out, shared_gate_forward(P, A).view({N}));
    const Tensor sh = d_.shared_gate ? rows : sh_out;
    if (own_rows) be_.copy(w.tmp_h, sh);
    else be_.axpby(w.tmp_h, 1.0f, w.tmp_h, 1.0f, sh);
  }
  Tensor y = routed;
  if (!own_rows || shared) {
    y = reduce_rows(w.tmp_h);
    if (own_rows) be_.axpby(y, 1.0f, y, 1.0f, routed);
  }

  if (!next.fused)
    be_.bias_dropout_add(A.out, y, Tensor(), A.h1, hp, hidden_key(s, layer, 2));
  else
    be_.bias_dropout_add_norm(A.out, next.out, next.mean, next.rstd, A.h1, y, Tensor(), hp, hidden_key(s, layer, 2),
                              next.weight, next.bias, norm_, next.amax);
}

// The MoE block's backward: dy (the gradient of out) -> the gradient of h1 in the workspace's gH,
// with the router's, the experts', the shared expert's and ln2's parameter gradients.
void GptModel::moe_backward(int local, Slot& s, const LayerActs& A, Tensor dy) {
  const LayerParams &P = layer_params_[static_cast<size_t>(local)], &G = layer_grads_[static_cast<size_t>(local)];
  const Workspace& w = *ws_;
  const MoeActs& M = A.moe;
  const int layer = d_.layer_begin + local;
  const int k = d_.topk;
  const int64_t N = d_.tokens();
  const float hp = s.training ? d_.hidden_dropout : 0.0f;
  const MoeRouting r = moe_routing();
  int64_t R = 0;
  const ExpertOffsets offsets = moe_offsets(M, R);
  const bool own_rows = d_.experts_local_rows();
  Communicator* const disp = moe_dispatch_group();
  const bool a2a = moe_alltoall(), ag = disp != nullptr && !a2a;
  const int64_t n_disp = moe_dispatch_rows(), r0 = own_rows ? d_.local_row_begin() : 0;
  const Tensor rows = w.moe_rows.row_slice(0, R);
  // All-to-all: this rank's pairs sorted by expert; `to_experts` sends rows of this rank's
  // dispatched rows (one per pair) into `rows`.
  const int64_t pairs = a2a ? M.exchange->send.back() : 0;
  const Tensor sorted = a2a ? w.moe_xs.row_slice(0, pairs) : Tensor();
  const auto to_experts = [&](const Tensor& x) {
    be_.moe_gather_rows(sorted, x, M.s_order.flat_slice(0, pairs), k);
    moe_exchange(*disp, M, sorted, rows, true);
    moe_zero_padding(M, rows);
  };
  // The dispatched rows' permuted rows (under all-gather EP from the group's rows, gathered first).
  const auto permute = [&](const Tensor& x, const Tensor& group) {
    if (a2a) return to_experts(x);
    if (ag) disp->all_gather(group, x);
    be_.moe_gather_rows(rows, ag ? group : x, M.order.flat_slice(0, R), k);
  };
  // Aux-loss-free balancing: this micro-batch's tokens per expert (after dropping; this rank's
  // experts over the EP group's tokens), counted once per training micro-batch (here, not in a
  // forward that recomputation may repeat). Padded to the capacity, every expert counts the same
  // (Megatron's count of the padded map): none here, the same update (none).
  if (has_expert_bias() && d_.etp_rank == 0 && !d_.moe_pad_to_capacity)  // (one count per pair: the experts' TP rank 0)
    be_.moe_count_rows(moe_counts_dev_.flat_slice(int64_t{moe_index(local)} * d_.experts + d_.expert_begin(),
                                                  d_.experts_local()),
                       M.offsets);

  // The norm output, where not kept, is rewritten (the same bits) for the weight gradients below.
  if (!A.norm_kept) {
    be_.norm_forward(local_rows(A.ln2_out), A.ln2_mean, A.ln2_rstd, A.h1, P.ln2_w, P.ln2_b, norm_);
    gather_rows(A.ln2_out);
  }
  // This rank's dispatched rows of ln2's output, permuted into `rows` (under all-gather EP the
  // group's, gathered once per backward: nothing else writes moe_xg).
  const Tensor x_disp = A.ln2_out.row_slice(r0, n_disp);
  bool group_gathered = false;
  const auto gather_inputs = [&] {
    if (ag && group_gathered) be_.moe_gather_rows(rows, w.moe_xg, M.order.flat_slice(0, R), k);
    else permute(x_disp, w.moe_xg);
    group_gathered = true;
  };
  // Recomputation (ModelOptions::moe_recompute_*): the fc1 outputs not kept, as the forward made them.
  if (opt_.moe_recompute_fc1) {
    gather_inputs();
    if (d_.moe_probs_on_input) be_.moe_scale_rows(rows, rows, M.p_perm.flat_slice(0, R));
    expert_linear_fwd(local, 0, M.fc1_pre.row_slice(0, R), rows, P.ex_fc1_w, offsets);
    expert_bias_fwd(P, 0, M.fc1_pre.row_slice(0, R), M.p_perm.flat_slice(0, R), offsets);
  }
  if (opt_.moe_recompute_shared) extra_linear_fwd(local, extra_shared_gemm(0), M.sh_fc1_pre, A.ln2_out, P.sh_fc1_w);
  // The MoE output's gradient [N, h] (gT itself with dropout or SP: read before gT is written).
  const Tensor d_out = expand_grad(dy, hp, hidden_key(s, layer, 2));
  // Its permuted rows d y_perm [R, h] (of the dispatched rows; under EP from the group's, gathered,
  // or sent to the experts).
  permute(d_out.row_slice(r0, n_disp), w.moe_yg);
  bool dx_started = false;  // whether gT (the gradient of ln2's output) holds a first term

  // Shared expert (gT = its input gradient).
  if (d_.shared_ffn > 0) {
    Tensor d_sh = d_out;  // the gradient of the shared expert's output
    if (d_.shared_gate) {
      // out += sh_out * g, g = sigmoid(logit): d sh_out = d_out * g, d g = sum_c d_out * sh_out,
      // d logit = d g * g (1 - g).
      // (With TP, sh_out is this rank's partial sum: so is d g, summed over TP. The gate's input
      // gradient is added to ln2's on this rank's rows after the reduction, below.)
      const Tensor g = shared_gate_forward(P, A);
      const Tensor dg = w.moe_dprobs.flat_slice(0, N);
      be_.moe_scale_rows_backward(w.moe_dsh, dg, d_out, M.sh_out, g.view({N}));
      if (d_.tp_size > 1) ps_.tp->all_reduce(dg);
      be_.moe_route_backward(w.moe_dgate, dg.view({N, 1}), M.sh_gate, w.moe_gate_idx, Tensor(), gate_routing());
      be_.linear_backward_weight(G.sh_gate_w, Tensor(), local_rows(w.moe_dgate), local_rows(A.ln2_out), true);
      d_sh = w.moe_dsh;
    }
    const int sh1 = extra_shared_gemm(0), sh2 = extra_shared_gemm(1);
    if (d_.swiglu) {
      extra_linear_bwd_input(local, sh2, w.moe_sh_act, d_sh, P.sh_fc2_w, false);
      // In place: sh_fc1_pre becomes its gradient and the activation gradient the activation.
      be_.swiglu_backward_recompute(M.sh_fc1_pre, w.moe_sh_act, w.moe_sh_act, M.sh_fc1_pre, d_.glu);
      extra_linear_bwd_weight(local, sh2, G.sh_fc2_w, d_sh, w.moe_sh_act);
      extra_linear_bwd(local, sh1, G.sh_fc1_w, Tensor(), w.gT, M.sh_fc1_pre, A.ln2_out, P.sh_fc1_w, dx_started);
    } else if (fp8_extra_layer(local)) {
      // FP8: fc2's input gradient plain, then the activation's backward (sh_fc1_pre becomes the
      // activation for fc2's weight gradient), as the fused recompute below does in one op.
      const Activation act = d_.ungated_mlp_activation();
      extra_linear_bwd_input(local, sh2, w.moe_sh_act, d_sh, P.sh_fc2_w, false);
      be_.activation_backward(w.moe_sh_act, w.moe_sh_act, M.sh_fc1_pre, act);
      be_.activation_forward(M.sh_fc1_pre, M.sh_fc1_pre, act);
      extra_linear_bwd_weight(local, sh2, G.sh_fc2_w, d_sh, M.sh_fc1_pre);
      extra_linear_bwd(local, sh1, G.sh_fc1_w, Tensor(), w.gT, w.moe_sh_act, A.ln2_out, P.sh_fc1_w, dx_started);
    } else {
      // fc1's output gradient into the activation buffer, sh_fc1_pre becomes the activation.
      be_.linear_backward_input_recompute(w.moe_sh_act, M.sh_fc1_pre, d_sh, P.sh_fc2_w, d_.ungated_mlp_activation(),
                                          M.sh_fc1_pre);
      be_.linear_backward_weight(G.sh_fc2_w, Tensor(), d_sh, M.sh_fc1_pre, accumulate_weight_grad(G.sh_fc2_w));
      be_.linear_backward_weight(G.sh_fc1_w, Tensor(), w.moe_sh_act, A.ln2_out, accumulate_weight_grad(G.sh_fc1_w));
      be_.linear_backward_input(w.gT, w.moe_sh_act, P.sh_fc1_w, dx_started, Activation::none, Tensor());
    }
    dx_started = true;
  }

  // Routed experts, last GEMM first.
  const Tensor fc1_pre = M.fc1_pre.row_slice(0, R), act = w.moe_act.row_slice(0, R), dact = w.moe_dact.row_slice(0, R);
  const Tensor p_perm = M.p_perm.flat_slice(0, R), dp_perm = w.moe_dp_perm.flat_slice(0, R);
  expert_quantize_dy(local, 1, rows, offsets);
  expert_linear_bwd_input(local, 1, dact, rows, P.ex_fc2_w, offsets);  // d (act * p)
  // fc1's output gradient: SwiGLU's in place of fc1_pre [R, 2f] (with fc2's input act * p again and
  // d p, one pass), GeLU's in place of d act.
  const Tensor d_fc1 = d_.swiglu ? fc1_pre : dact;
  if (d_.moe_probs_on_input) {
    // (The routing weight scaled the input: fc2's input is the activation itself, and d p comes
    // from the input's gradient below.)
    if (d_.swiglu) be_.swiglu_backward_recompute(d_fc1, act, dact, fc1_pre, d_.glu);
    else be_.activation_forward(act, fc1_pre, d_.ungated_mlp_activation());
  } else if (d_.swiglu) {
    be_.moe_swiglu_backward(d_fc1, act, dp_perm, dact, fc1_pre, p_perm, d_.glu);
  } else {
    be_.activation_forward(act, fc1_pre, d_.ungated_mlp_activation());
    be_.moe_scale_rows_backward(dact, dp_perm, dact, act, p_perm);  // d act, d p
    be_.moe_scale_rows(act, act, p_perm);                           // fc2's input again
  }
  // Each rank's experts hold 1/ETP of f: the weights' gradient is partial over the experts' TP ranks.
  // Summed over TP here when the experts split over TP; otherwise the reduce-scatter over the
  // dispatch group below (which holds the experts' TP ranks) sums it.
  if (d_.etp_size > 1 && !own_rows && !d_.moe_probs_on_input) ps_.tp->all_reduce(dp_perm);
  expert_linear_bwd_weight(local, 1, G.ex_fc2_w, rows, act, offsets);
  // fc2's bias: its gradient (times the routing weights) and, where the weights scale it, their
  // gradient's share (rows still holds d y_perm).
  expert_bias_bwd(P, G, 1, d_.moe_probs_on_input ? Tensor() : dp_perm, rows, p_perm, offsets);
  if (!d_.swiglu) be_.activation_backward(d_fc1, dact, fc1_pre, d_.ungated_mlp_activation());
  expert_bias_bwd(P, G, 0, Tensor(), d_fc1, p_perm, offsets);
  expert_quantize_dy(local, 0, d_fc1, offsets);
  // The permuted inputs again (x_perm; under EP from the group's inputs, gathered again), scaled
  // by the routing weights with --moe-apply-probs-on-input (kept unscaled for d p).
  gather_inputs();
  const Tensor x_unscaled = d_.moe_probs_on_input ? w.moe_xin.row_slice(0, R) : Tensor();
  if (d_.moe_probs_on_input) {
    be_.copy(x_unscaled, rows);
    be_.moe_scale_rows(rows, rows, p_perm);
  }
  expert_linear_bwd_weight(local, 0, G.ex_fc1_w, d_fc1, rows, offsets);
  expert_linear_bwd_input(local, 0, rows, d_fc1, P.ex_fc1_w, offsets);  // d x_perm [R, h]
  if (d_.moe_probs_on_input) {
    be_.moe_scale_rows_backward(rows, dp_perm, rows, x_unscaled, p_perm);  // d x, d p
    if (d_.etp_size > 1 && !own_rows) ps_.tp->all_reduce(dp_perm);         // (partial over the experts' TP)
  }
  // The dispatched rows' input gradient: into gT [N, h] (partial over TP, after the shared
  // expert's), or with whole experts this rank's rows [Nl, h], complete (added after the TP
  // reduction below); under EP this rank's experts' share of every group row, reduce-scattered.
  // (All-to-all: the input gradients of this rank's pairs received first, then summed per token.)
  const Tensor routed_dx = w.moe_dxl.empty() ? Tensor() : w.moe_dxl.row_slice(0, n_disp);
  if (a2a) moe_exchange(*disp, M, sorted, rows, false);
  const Tensor dx_rows = a2a ? sorted : rows, dx_slot_of = a2a ? M.s_slot_of : M.slot_of;
  if (!ag && !own_rows) {
    be_.moe_combine(w.gT, dx_rows, dx_slot_of, k, dx_started);
  } else if (!ag) {
    be_.moe_combine(routed_dx, dx_rows, dx_slot_of, k, false);
  } else {
    be_.moe_combine(w.moe_yg, rows, M.slot_of, k, false);
    const bool into_gT = !own_rows && !dx_started;
    disp->reduce_scatter(into_gT ? w.gT : routed_dx, w.moe_yg);
    if (!own_rows && dx_started) be_.axpby(w.gT, 1.0f, w.gT, 1.0f, routed_dx);
  }
  const bool gT_written = dx_started || !own_rows;

  // Router: the routing weights' gradient back in token order (of the dispatched rows; under
  // all-gather EP the group's, zero where another rank's expert took the pair, reduce-scattered;
  // all-to-all: this rank's pairs' received first), the aux and
  // z-losses' gradients (seeded as the loss is: loss scale / micro-batches), then the gating
  // GEMM's backward, all on this rank's rows (all rows without sequence parallelism).
  const int64_t Ng = moe_group_tokens();
  const Tensor dprobs_disp = w.moe_dprobs.row_slice(r0, n_disp);
  if (a2a) {
    const Tensor ps = w.moe_ps.flat_slice(0, pairs).view({pairs, 1});
    moe_exchange(*disp, M, ps, dp_perm.view({R, 1}), false);
    be_.moe_gather_rows(dprobs_disp.view({n_disp * k, 1}), ps, M.s_slot_of, 1);
  } else {
    const Tensor dprobs_g = ag ? w.moe_pg : dprobs_disp;
    be_.moe_gather_rows(dprobs_g.view({Ng * k, 1}), dp_perm.view({R, 1}), M.slot_of, 1);
    if (ag) disp->reduce_scatter(dprobs_disp, dprobs_g);
  }
  Tensor aux_grad;
  if (!M.stats.empty()) {
    // The load-balancing terms' gradients at once: moe_aux_grad is linear in the counts, so every
    // row takes aux_loss's and global_aux_loss's counts times their factors and coefficients, seeded
    // as the loss is (with seq_aux_loss its own sequence's added), and the z-loss's.
    const MoeLossFactors f = moe_loss_factors();
    const double seed = s.moe_aux_seed;
    const int64_t E = d_.experts, width = 2 * E + 1;
    const Tensor base = w.moe_aux_counts.flat_slice(0, width), counts = base.flat_slice(E, E);
    const Tensor whole = M.stats.flat_slice(E, E);
    be_.axpby(counts, static_cast<float>(d_.moe_aux_coeff * f.aux * seed), whole, 0.0f, whole);
    if (d_.moe_global_coeff != 0)
      be_.axpby(counts, 1.0f, counts, static_cast<float>(d_.moe_global_coeff * f.global * seed),
                M.global.flat_slice(E, E));
    const float z_scale = static_cast<float>(d_.moe_z_coeff * f.z * seed);
    aux_grad = local_rows(w.moe_aux_grad);
    if (d_.moe_seq_coeff == 0) {
      be_.moe_aux_grad(aux_grad, local_rows(M.logits), base, 1.0f, z_scale, r);
    } else {
      // In sequence order, each sequence's rows with its own counts, then back to the rows' order.
      const Tensor ordered = moe_sequence_logits(M.logits), own = w.moe_aux_counts.flat_slice(width, width);
      const float seq_scale = static_cast<float>(d_.moe_seq_coeff * f.seq * seed);
      for (int64_t b = 0; b < f.sequences; ++b) {
        be_.axpby(own.flat_slice(E, E), 1.0f, counts, seq_scale, M.stats.flat_slice((1 + b) * width + E, E));
        be_.moe_aux_grad(w.moe_seq_grad.row_slice(b * f.rows, f.rows), ordered.row_slice(b * f.rows, f.rows), own,
                         1.0f, z_scale, r);
      }
      be_.moe_gather_rows(w.moe_aux_grad, w.moe_seq_grad, w.moe_seq_inverse, 1);
    }
  }
  // (Sinkhorn's weights are the pre-softmax rule's, or the sigmoid rule's with top-1, at its choice.)
  const MoeRouting weights_rule =
      !d_.moe_sinkhorn ? r
      : k == 1         ? MoeRouting::make(d_.experts, 1, MoeScoreFunction::sigmoid)
                       : MoeRouting::make(d_.experts, k, MoeScoreFunction::softmax, /*pre_softmax=*/true);
  be_.moe_route_backward(local_rows(w.moe_dlogits), local_rows(w.moe_dprobs), local_rows(M.logits),
                         local_rows(M.idx), aux_grad, weights_rule);

  // The gating GEMMs' backward on this rank's rows: their weight gradients (partial over TP with
  // SP, summed by the grad-sync backward), and their input gradients added to ln2's gradient after
  // its reduction over TP (with whole experts, to the routed rows' own gradient); then ln2's
  // backward, plus the residual's gradient.
  Tensor d_ln2 = routed_dx;  // [Nl, h]
  if (gT_written) {
    d_ln2 = reduce_rows(w.gT);
    if (own_rows) be_.axpby(d_ln2, 1.0f, d_ln2, 1.0f, routed_dx);
  }
  const Tensor dlogits = local_rows(w.moe_dlogits), x = local_rows(A.ln2_out);
  // Input jitter: this rank's rows of the jittered input again (the same factors: their flat
  // indices in the full [N, h] input), and the input gradient scaled by them.
  const Tensor router_buffer = w.moe_x32.empty() ? w.moe_xj : w.moe_x32;
  if (router_buffer.empty()) {
    be_.linear_backward_weight(G.router_w, G.router_b, dlogits, x, true);
    be_.linear_backward_input(d_ln2, dlogits, P.router_w, true, Activation::none, Tensor());
  } else {  // a float32 router, or jitter: the input gradient in the router's buffer, then added
    const float jitter = d_.moe_jitter_eps;
    const uint64_t jitter_key = site_key(s, layer, 4);
    const int64_t jitter_from = d_.sequence_parallel ? d_.local_row_begin() * d_.hidden : 0;
    const Tensor xr = router_input(x, local_rows(router_buffer), jitter_key, jitter_from);
    be_.linear_backward_weight(G.router_w, G.router_b, dlogits, xr, true);
    be_.linear_backward_input(xr, dlogits, router_weight(P), false, Activation::none, Tensor());
    if (jitter > 0) be_.moe_jitter(xr, xr, jitter, jitter_key, jitter_from);
    be_.axpby(d_ln2, 1.0f, d_ln2, 1.0f, xr);
  }
  if (d_.shared_gate)
    be_.linear_backward_input(d_ln2, local_rows(w.moe_dgate), P.sh_gate_w, true, Activation::none, Tensor());
  // (With linear biases the attention's proj bias gradient is the column sums of dy: ln2's backward
  // adds them up where it may, GptModel::proj_bias_grad_from_norm; else the attention block does.)
  be_.norm_backward(w.gH, G.ln2_w, G.ln2_b, d_ln2, A.h1, A.ln2_mean, A.ln2_rstd, P.ln2_w, dy,
                    proj_bias_grad_from_norm(local) ? G.proj_b : Tensor(), norm_);
}

// The experts' linear biases (with linear biases): fc1's (which = 0) added to its output, fc2's (1)
// times each row's routing weight (Megatron's expert MLP: output + output_bias * per_token_scale;
// with --moe-apply-probs-on-input the weights scaled the input, and fc2's bias is added as is).
void GptModel::expert_bias_fwd(const LayerParams& P, int which, Tensor y, Tensor p_perm, const ExpertOffsets& offsets) {
  const Tensor b = which == 0 ? P.ex_fc1_b : P.ex_fc2_b;
  if (b.empty()) return;
  const Tensor p = which == 1 && !d_.moe_probs_on_input ? p_perm : Tensor();
  be_.grouped_bias_forward(y, b.view({d_.experts_local(), y.cols()}), p, offsets);
}

// Its backward from the output gradient dy: the bias gradient, and with dp (fc2's) d p += dy . b.
void GptModel::expert_bias_bwd(const LayerParams& P, const LayerParams& G, int which, Tensor dp, Tensor dy,
                               Tensor p_perm, const ExpertOffsets& offsets) {
  const Tensor b = which == 0 ? P.ex_fc1_b : P.ex_fc2_b, db = which == 0 ? G.ex_fc1_b : G.ex_fc2_b;
  if (b.empty()) return;
  const Tensor p = which == 1 && !d_.moe_probs_on_input ? p_perm : Tensor();
  const int64_t El = d_.experts_local();
  be_.grouped_bias_backward(db.view({El, dy.cols()}), dp, dy, b.view({El, dy.cols()}), p, offsets,
                            accumulate_weight_grad(db));
}

// ---- FP8 experts (their GEMMs: engine/blocks/fp8_gemms.cpp) ---------------------------------

void GptModel::moe_pad_permutation(const MoeActs& M) {
  const int El = d_.experts_local();
  const int64_t align = moe_row_align(), Rmax = moe_max_rows();
  // The permutation's own offsets are moe_off32_ (the forward's host copy); the padded ones go to
  // M.host_offsets.
  const std::vector<int32_t>& own = moe_off32_;
  std::vector<int64_t>& off = *M.host_offsets;
  const int64_t R = own[static_cast<size_t>(El)];
  int32_t* order = moe_order_host_.data();       // [0, R): the permutation's order
  int32_t* padded = order + Rmax;                // [0, Rp): the padded order
  if (R > 0) be_.copy_to_host(order, M.order.flat_slice(0, R));
  be_.copy_to_host(moe_slot_host_.data(), M.slot_of);
  int64_t at = 0;
  for (int e = 0; e < El; ++e) {
    const int64_t b = own[static_cast<size_t>(e)], n = own[static_cast<size_t>(e) + 1] - b;
    std::copy(order + b, order + b + n, padded + at);
    const int64_t end = at + (n + align - 1) / align * align;
    std::fill(padded + at + n, padded + end, -1);  // (moe_gather_rows: zero rows)
    off[static_cast<size_t>(e)] = at;
    at = end;
  }
  // slot_of: each placed pair's row r of expert e moves by (its padded start - its own start).
  for (int32_t& r : moe_slot_host_) {
    if (r < 0 || r >= R) continue;
    const int e = static_cast<int>(std::upper_bound(own.begin(), own.end(), r) - own.begin()) - 1;
    r = static_cast<int32_t>(r - own[static_cast<size_t>(e)] + off[static_cast<size_t>(e)]);
  }
  off[static_cast<size_t>(El)] = at;
  MT_CHECK(at <= Rmax, "padded expert rows {} past the bound {}", at, Rmax);
  if (at > 0) be_.copy_from_host(M.order.flat_slice(0, at), padded);
  be_.copy_from_host(M.slot_of, moe_slot_host_.data());
}

void GptModel::moe_zero_padding(const MoeActs& M, Tensor perm) {
  if (moe_row_align() == 1) return;
  const std::vector<int64_t>& off = *M.host_offsets;
  const MoeExchange& x = *M.exchange;
  const int El = d_.experts_local(), G = static_cast<int>(x.recv.size()) / std::max(El, 1);
  for (int e = 0; e < El; ++e) {
    int64_t n = 0;
    for (int src = 0; src < G; ++src) n += x.recv[static_cast<size_t>(e) * G + src];
    const int64_t from = off[static_cast<size_t>(e)] + n, to = off[static_cast<size_t>(e) + 1];
    if (to > from) be_.fill(perm.row_slice(from, to - from), 0.0);
  }
}

}  // namespace mt

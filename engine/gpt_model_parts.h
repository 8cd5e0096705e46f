// The pieces of a GptModel stage that its blocks share (engine/blocks/): a layer's parameters, what
// it keeps from forward for backward, a micro-batch slot, the stage's global parameters and the
// workspace every layer reuses. Internal to the engine: include only from GptModel's own files.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/blocks/attention_core.h"
#include "engine/gpt_model.h"

namespace mt {

// A [rows, cols] block at element `at` of a flat workspace (the FP8 casts' workspaces).
inline Tensor flat_block(Tensor flat, int64_t at, int64_t rows, int64_t cols) {
  return flat.flat_slice(at, rows * cols).view({rows, cols});
}

struct GptModel::LayerParams {
  Tensor ln1_w, ln1_b, qkv_w, qkv_b, q_ln_w, q_ln_b, k_ln_w, k_ln_b, sink, proj_w, proj_b, ln2_w, ln2_b, fc1_w, fc1_b,
      fc2_w, fc2_b;
  // MoE layers (ln2: the pre-MLP norm): router [E, h], experts' fc1 [E * fc1, h] and fc2 [E * h, f]
  // (expert e's rows stacked), the shared expert's fc1, fc2 and gate [1, h].
  Tensor router_w, ex_fc1_w, ex_fc2_w, sh_fc1_w, sh_fc2_w, sh_gate_w;
  // With linear biases: the router's [E] and the experts' fc1 [E * fc1] and fc2 [E * h] (expert e's
  // bias its e-th block; this rank's experts under EP).
  Tensor router_b, ex_fc1_b, ex_fc2_b;
  // Multi-latent attention (in place of qkv and the q/k norms; ln1: its input_layernorm): the query
  // down projection [q_lora, h] (with q_lora), the norm of its output (without q_lora: --qk-
  // layernorm's second norm of the input), the query up (or direct) projection, the key/value down
  // projection [kv_lora + d_rope, h], the norm of c_kv, the key/value up projection.
  Tensor q_down_w, q_lat_ln_w, q_lat_ln_b, q_w, kv_down_w, kv_lat_ln_w, kv_lat_ln_b, kv_up_w;
  // Gated DeltaNet layers (in place of qkv; ln1: the input projection's fused norm, proj: the
  // output projection): the input projection [proj_width, h], the convolution's taps [conv_width,
  // K], dt_bias and A_log [value heads], the output norm over one value head.
  Tensor gdn_in_w, gdn_conv_w, gdn_dt_bias, gdn_a_log, gdn_norm_w, gdn_norm_b;
};

// A multi-token-prediction depth's own parameters (engine/blocks/mtp.cpp; its decoder layer's are a
// LayerParams): the norms of the embedding and of the hidden state, their projection [h / TP rows,
// 2h], and the final norm.
struct GptModel::MtpParams {
  Tensor enorm_w, enorm_b, hnorm_w, hnorm_b, eh_w, fnorm_w, fnorm_b;
};

// What a depth keeps from its forward to its backward (both within one head_forward), this rank's
// rows [Nl, .] unless marked: the embedding of the rolled tokens e, its norm en and the hidden
// state's hn with their statistics, their concatenation [en | hn] (all N rows), the projection's
// output u (the layer's input), the depth's output h (its final norm) with statistics.
struct GptModel::MtpActs {
  Tensor e, en, en_mean, en_rstd, hn, hn_mean, hn_rstd, cat, u, h, f_mean, f_rstd;
};

// What an MoE layer keeps for backward (engine/blocks/moe.cpp). Ng = N x EP: the tokens of the
// expert-parallel group (N without EP); El = E / EP this rank's experts; R <= Rmax = Ng x min(k,
// El) the (token, slot) pairs routed to them (Ng x k without EP).
// All-to-all dispatch: the rows each (expert, rank) chunk moves, on the host. send [E + 1]: the first
// of this rank's expert-sorted pairs routed to each expert (the chunk for expert e goes to group
// rank e / El); recv [El x G]: the pairs this rank's expert e receives from group rank g, placed
// expert-major, rank-minor (from MoeActs::host_offsets[e]).
struct GptModel::MoeExchange {
  std::vector<int64_t> send, recv;
};

struct GptModel::MoeActs {
  Tensor logits;                 // router output [N, E] (compute dtype, or float32: moe_router_fp32)
  Tensor probs, idx;             // routing weights float32 [N, k], experts int32 [N, k]
  Tensor kept;                   // token dropping: idx with the dropped pairs' experts -1 [N, k]
  Tensor stats;                  // load-balancing statistics float32 [2E + 1] (any aux or z-loss)
                                 // of the micro-batch, then with seq_aux_loss of each sequence
  Tensor global;                 // global_aux_loss: {this rank's scores' sums, the counts over DP
                                 // averaged over the step's micro-batches so far, 0} [2E + 1]
  Tensor order, slot_of, offsets;  // the permutation of the group's pairs int32 [Ng k], [Ng k], [El + 1]
  std::vector<int64_t>* host_offsets = nullptr;  // offsets on the host (the grouped GEMMs' splits)
  // All-to-all dispatch (GptModel::moe_alltoall; order and slot_of then unused): this rank's own
  // dispatched pairs sorted by expert, all E of them, int32 [n k], [n k], [E + 1] (n the rows it
  // dispatches), and the sizes of the chunks exchanged (host).
  Tensor s_order, s_slot_of, s_offsets;
  MoeExchange* exchange = nullptr;
  Tensor p_perm;                 // routing weights in permuted order float32 [Rmax]
  Tensor fc1_pre;                // experts' fc1 output [Rmax, fc1] (backward: its gradient)
  Tensor sh_fc1_pre;             // shared expert's fc1 output [N, fc1_sh] (backward: its gradient,
                                 // or with GeLU its activation)
  Tensor sh_out, sh_gate;        // gated shared expert: its output before the gate [N, h], gate logit [N, 1]
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
  // Multi-latent attention (engine/blocks/mla.cpp), all N rows: the query latent before and after
  // its norm [N, q_lora] (without q_lora, with --qk-layernorm: the normed input [N, h] as cq), the
  // down projection's output [c_kv | k_rope], c_kv before and after its norm [N, kv_lora], and the
  // norms' statistics.
  Tensor mla_cq_raw, mla_cq, mla_cq_mean, mla_cq_rstd, mla_ckv, mla_ckv_raw, mla_ckv_n, mla_ckv_mean, mla_ckv_rstd;
  // Gated DeltaNet layers (engine/blocks/gdn.cpp; GdnShape's layouts), all N rows: the input
  // projection's output, the convolution's output (after SiLU), the recurrence's output, its
  // states at chunk starts (accum dtype) and the output norm's statistics [N x value heads].
  Tensor gdn_proj, gdn_xc, gdn_o, gdn_states, gdn_nmean, gdn_nrstd;
  Tensor attn_out, lse;                // attention output [N, heads*d] and its log-sum-exp
  Tensor gate;                         // --attention-output-gate: the gate [N, heads*d] before its
                                       // sigmoid (backward overwrites it with its gradient)
  Tensor h1;                           // residual after attention
  Tensor ln2_out, ln2_mean, ln2_rstd;  // pre-MLP norm (ln2_out shared unless norm_kept)
  bool norm_kept = false;              // ln1_out and ln2_out are this layer's own
  Tensor fc1_pre, fc1_act;             // fc1 output before / after the activation (fc1_act shared
                                       // unless act_kept); backward overwrites fc1_pre (SwiGLU: with
                                       // its gradient; GeLU: with the activation, unless fp8_xq_t
                                       // or fc1_act is kept)
  bool act_kept = false;               // fc1_act is this layer's own (keeps_gelu_activation)
  Tensor out;                          // layer output (the next layer's input)
  MoeActs moe;                         // MoE layers only
  // FP8 layers with FP8 weight gradients (GptModel::fp8_kept_inputs): the four linear inputs
  // (ln1_out, attn_out, ln2_out, fc1_act; all N rows) as the forward's cast quantized them,
  // transposed [K, N] for the weight-gradient GEMMs, per Fp8State::Gemm. Tensorwise scaling also
  // keeps those casts' scale_inv [4]: a later micro-batch's forward rewrites the state's.
  Tensor fp8_xq_t[Fp8State::kGemms];
  Tensor fp8_x_scale_inv;
};

struct GptModel::Slot {
  Tensor tokens, labels, positions, mask, dloss;  // [N] (int32 / accum)
  Tensor doc_start;  // packed documents (ModelOptions::documents): int32 [b * s * CP] (the whole sequence), sample-major; else empty
  Tensor input;                                   // stage input [N, h]
  std::vector<LayerActs> layers;                  // per local layer
  Tensor d_output;                                // grad of the stage output [N, h]
  // The five inputs live in one device block (`io`) mirrored by one host buffer, so that staging
  // a micro-batch is a single host->device copy. Byte offsets of each part in both:
  Tensor io;
  std::vector<unsigned char> host_io;
  size_t off_tokens = 0, off_labels = 0, off_positions = 0, off_mask = 0, off_dloss = 0, off_doc_start = 0;
  // Multi-token prediction, per depth j (in io too): the tokens, labels and loss mask rolled j + 1
  // positions left within each sequence (zeros past its end), the mask divided by its count (the
  // logged mean's weights) and the loss gradient per row.
  struct MtpRows {
    Tensor tokens, labels, mask, log_weight, dloss;
  };
  std::vector<MtpRows> mtp;
  // Activation offloading (GptModel::offload_): per local layer which modules' copies to host are
  // not yet waited for (a bit per OffloadModule), whether its copy back was issued in this
  // backward, and whether its tensors stayed in their entry (GptModel::backward_follows).
  std::vector<uint32_t> offload_out;
  std::vector<uint8_t> offload_back, offload_stayed;
  uint64_t key = 0;
  uint64_t serial = 0;  // the micro-batch's place in the run (the same on every data-parallel rank)
  double moe_aux_seed = 1.0;  // the aux losses' gradient seed: the loss gradient's scale (loss scale / M)
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
  // --attention-output-gate, in the same block: the QKV projection's output [N, qkv + gate] in
  // forward (split at once), the gated attention output (gATT's memory: the projection's input,
  // recomputed in backward) and the merged projection gradient gQKVG (after gATT is consumed).
  Tensor qkvg, gated, gQKVG;
  // Multi-latent attention (engine/blocks/mla.cpp): the queries [N, heads x d_qk] and keys/values
  // [N, heads x (d_nope + d_v)] of the up projections (backward: their gradients), the attention
  // output without its padding [N, heads x d_v] (backward: its gradient), the gradient of the
  // down projection's output [N, kv_lora + d_rope] and of a latent [N, max(q_lora or h, kv_lora)].
  Tensor mla_q, mla_kv, mla_out, mla_dckv, mla_dlat;
  Tensor mla_qkv;  // --recompute-modules mla_up_proj: every layer's attention input [N, qkv]
  // Gated DeltaNet (engine/blocks/gdn.cpp): the output norm's output and the gated product [N,
  // value width] (backward: the gradients of the product, then in place of the norm's output), the
  // recurrence output's gradient, the convolution output's [N, conv width] and the projection
  // output's [N, proj width].
  Tensor gdn_n, gdn_y, gdn_do, gdn_dxc, gdn_dproj;
  CpBuffers cp;  // context parallelism (attention_core.h)
  // MoE layers: permuted rows [Nk, h] (the permuted expert inputs, then fc2's output; backward: the
  // gradient of fc2's output, the permuted inputs gathered again, the gradient of the inputs), the experts' activation and its gradient [Nk, f_e], the shared
  // expert's activation [N, f_sh], router gradients (logits' dtype [N, E]; float32 aux gradient
  // [N, E]; routing weights' gradient float32 [N, k], [Nk]).
  Tensor moe_rows, moe_act, moe_dact, moe_sh_act, moe_dlogits, moe_aux_grad, moe_dprobs, moe_dp_perm;
  Tensor moe_force_bias;  // --moe-router-force-biased: [1, E] in the router's dtype
  // Expert parallelism (engine/blocks/moe.cpp): the EP group's tokens [Ng, h] (the MoE input, then
  // the output gradient), their experts' outputs before the reduce-scatter [Ng, h] (backward: the
  // input gradient), routing weights float32 [Ng, k] and experts int32 [Ng, k] (backward: the
  // weights' gradient), and this rank's tokens' input gradient [N, h] after the reduce-scatter.
  Tensor moe_xg, moe_yg, moe_pg, moe_ig, moe_dxl;
  // All-to-all dispatch: this rank's pairs' rows sorted by expert [n k, h] (the inputs sent, the
  // outputs received; backward: the output gradients sent, the input gradients received), their
  // routing weights float32 [n k] (backward: the weights' gradient), and the group's pair offsets
  // int32 [G x (E + 1)] (all-gathered: the chunk sizes).
  Tensor moe_xs, moe_ps, moe_offs_g;
  Tensor moe_xin;  // --moe-apply-probs-on-input: the permuted inputs [Rmax, h], unscaled (backward)
  // seq_aux_loss: the router logits in sequence order [N, E] (each sequence's rows contiguous), the
  // aux gradient in that order float32 [N, E], and the row permutations int32 [N] to it and back.
  Tensor moe_seq_logits, moe_seq_grad, moe_seq_index, moe_seq_inverse;
  // The load-balancing terms' counts weighted by their gradient scales and summed, float32
  // [2 x (2E + 1)] in moe_aux_grad's stats layout (the counts in [E, 2E)): those of every row, then
  // with seq_aux_loss of the sequence at hand.
  Tensor moe_aux_counts;
  // A float32 router (ModelDims::moe_router_fp32) under a narrower compute dtype: its input [N, h]
  // (in backward also its input gradient) and weight [E, h] cast to float32 (with linear biases
  // its bias [E] too).
  Tensor moe_x32, moe_w32, moe_b32;
  // --moe-input-jitter-eps under a router in the compute dtype: the router's jittered input [N, h]
  // (in backward also its input gradient). (A float32 router jitters moe_x32.)
  Tensor moe_xj;
  // Recomputed MoE fc1 outputs (ModelOptions::moe_recompute_fc1 / moe_recompute_shared): the
  // experts' [Rmax, fc1] and the shared expert's [N, fc1_sh], every MoE layer's.
  Tensor moe_fc1, moe_sh_fc1;
  // The shared expert's gate: sigmoid(logit) float32 [N, 1] (and the routing op's index [N, 1]),
  // the logit's gradient [N, 1], the gradient of the shared expert's output before the gate [N, h].
  Tensor moe_gate_p, moe_gate_idx, moe_dgate, moe_dsh;
  // Multi-token prediction (engine/blocks/mtp.cpp): per depth what it keeps; the gradient of the
  // decoder's output after the final norm [Nl, h], the gradient carried to the previous depth's
  // output, the final norm's, the layer's input's, the embedding's and the hidden state's [Nl, h]
  // each; the projection's TP part of the output (and its gradient) [N, h / TP], the gathered parts
  // and the whole output [N, h], the concatenation's gradient [N, 2h], a depth's output on all rows.
  std::vector<MtpActs> mtp;
  Tensor mtp_dy0, mtp_carry, mtp_dv, mtp_du, mtp_de, mtp_dhn, mtp_part, mtp_parts, mtp_full, mtp_dcat, mtp_yall;
  // Each row's largest logit (float32) and its vocabulary id (int32) [N], and with TP every
  // shard's [tp, N] (the acceptance counts).
  Tensor mtp_max, mtp_argmax, mtp_max_parts, mtp_argmax_parts;
  Tensor logits;                      // [logits_rows, V/tp] one chunk of rows (dlogits in place)
  Tensor y, fmean, frstd;             // final norm output and statistics
  Tensor lse_part, lse_parts, lse, target, loss;  // [N] / [tp, N] accum
  // Knowledge distillation (a student's head): the teacher's logits of one chunk of rows [logits_rows,
  // V/tp]; the rows' log-sum-exps of the student's and the teacher's logits over the temperature
  // [N] (their shards' gathered through lse_parts); each row's KL divergence (this shard's part,
  // then summed) and intermediate loss [N]; the micro-batch's masked sums {logits, tokens} and per intermediate pair
  // {its loss, tokens}.
  Tensor kd_logits, kd_lse_s, kd_lse_t, kd_kl, kd_hidden, kd_sums;
};

}  // namespace mt

// Backend: the ops interface the model is written against. Two implementations: the CUDA backend
// (cuda/, fast: bf16/fp16/fp32) and the reference backend (engine/reference/, plain C++, float32
// and float64, the oracle for every kernel test and the CPU path used in CI).
//
// Conventions shared by every op:
// - Tensors are views of memory the backend allocated (device memory for CUDA, host for reference).
//   Ops never allocate; they are ordered on the backend's stream and may return before finishing.
// - Token rows are sequence-major, as in Megatron: row r = t * b + i for position t of sample i
//   (so a sequence-parallel shard is a contiguous block of rows).
// - "accumulate" outputs are float32 (or float64 in gradient checks) and are added to (+=);
//   parameter gradients always accumulate, as Megatron's main_grad does across micro-batches.
//   Parameter gradients may also be bf16 (--grad-reduce-in-bf16): an op sums its contribution in
//   float32 (reference: double) and stores bf16(old + contribution), one rounding; the optimizer
//   ops and the gradient reductions read bf16 gradients as float.
// - Empty tensors (data == nullptr) mean "absent" (no bias, no positions, ...).
// - The packed QKV activation has, per token row, for each of the `groups` KV groups:
//   [q: heads/groups * d][k: d][v: d]  (Megatron's grouped layout; TP shards whole groups).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/shard.h"
#include "core/tensor.h"
#include "engine/activation.h"

namespace mt {

struct NormParams {
  Normalization kind = Normalization::layernorm;
  float eps = 1e-5f;
  bool one_p = false;  // --apply-layernorm-1p: weight stored as (gamma - 1)
};

struct AttentionShape {
  int batch = 0;     // b (micro-batch size)
  int seq = 0;       // s
  int heads = 0;     // query heads on this rank
  int groups = 0;    // KV groups on this rank (heads % groups == 0)
  int head_dim = 0;  // d
  float softmax_scale = 0;  // 1/sqrt(d) unless configured otherwise
  bool causal = true;
  // Sliding window (--window-size LEFT,RIGHT; causal only): query q sees keys q - window_left
  // ... q, i.e. window_left + 1 keys (Transformer Engine's (left, 0); Hugging Face's sliding_window
  // is window_left + 1). -1: no window, every earlier key.
  int window_left = -1;
  float dropout_p = 0;      // attention dropout on the probabilities
  uint64_t dropout_key = 0; // Philox key; element (i, h, q, k) uses index ((i*heads + h)*seq + q)*seq + k
  bool deterministic = false;  // --deterministic-mode: only implementations whose backward repeats bit for bit
  // Packed documents (--reset-attention-mask): a query sees only the keys of its own document.
  // doc_start (int32 [batch * seq], sample-major: entry i * seq + t, in the backend's memory) is the
  // first position of position t's document, so that the causal query t sees keys doc_start .. t;
  // along a sample it either stays or jumps to t (a new document starts at t). `documents` is set
  // for set-up shapes too (which have no tensor); the ops need the tensor. The attention_block_*
  // ops (context parallelism) take the WHOLE sequence's starts, [batch * blk.seq_total] by global
  // position, since a block's mask compares global positions.
  bool documents = false;
  Tensor doc_start;
  int64_t qkv_row_stride() const { return static_cast<int64_t>(groups) * (heads / groups + 2) * head_dim; }
  bool windowed() const { return window_left >= 0; }
  // The keys query q sees: [first_key(q), last_key(q)].
  int64_t first_key(int64_t q) const { return windowed() && q > window_left ? q - window_left : 0; }
  int64_t last_key(int64_t q) const { return causal ? q : seq - 1; }
  // The queries that see key k: [first_query(k), last_query(k)].
  int64_t first_query(int64_t k) const { return causal ? k : 0; }
  int64_t last_query(int64_t k) const { return windowed() ? std::min<int64_t>(seq - 1, k + window_left) : seq - 1; }
  // The usual shape: softmax scale 1/sqrt(head_dim).
  static AttentionShape make(int batch, int seq, int heads, int groups, int head_dim, bool causal = true,
                             float dropout_p = 0, uint64_t dropout_key = 0) {
    AttentionShape a;
    a.batch = batch;
    a.seq = seq;
    a.heads = heads;
    a.groups = groups;
    a.head_dim = head_dim;
    a.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
    a.causal = causal;
    a.dropout_p = dropout_p;
    a.dropout_key = dropout_key;
    return a;
  }
};

// A block of attention_block_forward (context parallelism): global positions of its first query
// and first key, its number of keys, and the whole sequence's length (dropout's index).
struct AttentionBlock {
  int64_t q_begin = 0, k_begin = 0;
  int kv_len = 0;
  int64_t seq_total = 0;
};

// ---- FP8 (--fp8-format; see the FP8 section of Backend below) ----------------------------
// Fp8Recipe and Fp8AmaxAlgo are in core/config.h; the ops take delayed and tensorwise only.

// The scaling state of ONE FP8 operand (one of the three tensors of one FP8 GEMM: input x,
// weight w, output gradient dy). Views of single float32 elements of the model's flat FP8 state
// (engine/fp8_state.h), in backend memory; ops read and write them on the stream, never on the host.
struct Fp8TensorMeta {
  Tensor scale;      // float32 [1]: q = fp8(x * scale)
  Tensor scale_inv;  // float32 [1]: 1 / scale, what the GEMM multiplies by to dequantize
  Tensor amax;       // float32 [1]: this step's running max |x| (row 0 of the amax history);
                     // empty: record nothing (evaluation forwards)
  Fp8Recipe recipe = Fp8Recipe::delayed;
  int margin = 0;    // --fp8-margin (tensorwise: applied when the op computes the scale)
  // Tensorwise scaling: the operand's slot for the max |x| of the cast in progress (float32 [1],
  // zero between casts: the cast zeroes it once read). The cast's amax pass maxes into it, unless
  // fresh_taken: then the op that wrote x's source already did (norm_forward's out_amax for the
  // norm output fp8_quantize_norm casts, norm_backward's dx_amax for a layer's output gradient),
  // and the cast skips that pass. Empty: the cast takes the amax in scratch.
  Tensor fresh;
  bool fresh_taken = false;
  // Tensorwise only, optional float32 [1]: also receives this cast's scale_inv (a layer's kept
  // copy for its weight-gradient GEMM), written by the cast instead of a separate copy.
  Tensor scale_inv_copy;
};

// The per-step scale update of delayed scaling (Transformer Engine's DelayedScaling).
struct Fp8ScaleUpdate {
  Fp8AmaxAlgo algo = Fp8AmaxAlgo::most_recent;
  int margin = 0;
};

struct RopeShape {
  int heads = 0, groups = 0, head_dim = 0;
  int rot_dim = 0;          // rotated dims per head (head_dim * rotary_percent), even
  bool interleaved = false; // RoFormer pairs (2i, 2i+1) instead of Llama's halves (i, i + rot_dim/2)
};

// Multi-latent attention's attention input (Backend::mla_qkv_forward): heads on this rank, the
// query/key dims without and with RoPE, how many of the latter turn (rot_dim <= rope_dim: MLA's
// --rotary-percent with --rope-type rope), the value dim, and where the shared key's RoPE part
// starts in the key/value down projection's output.
struct MlaShape {
  int heads = 0, nope_dim = 0, rope_dim = 0, rot_dim = 0, v_dim = 0;
  int64_t kr_col = 0;
  int qk_dim() const { return nope_dim + rope_dim; }
  int64_t qkv_width() const { return int64_t{heads} * 3 * qk_dim(); }
  int64_t q_width() const { return int64_t{heads} * qk_dim(); }
  int64_t kv_width() const { return int64_t{heads} * (nope_dim + v_dim); }
};

// Backend::mla_qkv_forward's and _backward's argument checks (both backends): qkv is the packed
// input (or its gradient), q, kv and down its sources (or their gradients).
void check_mla_qkv_args(const char* what, const Tensor& qkv, const Tensor& q, const Tensor& kv, const Tensor& down,
                        const Tensor& positions, const Tensor& cos_sin, const MlaShape& m);

// The gated QKV projection's layout (Backend::attention_gate_split): query groups on this rank,
// query heads per group, head dimension.
struct GateShape {
  int groups = 0, q_per_group = 0, head_dim = 0;
  int64_t qkv_width() const { return static_cast<int64_t>(groups) * (q_per_group + 2) * head_dim; }
  int64_t gate_width() const { return static_cast<int64_t>(groups) * q_per_group * head_dim; }
  int64_t qkvg_width() const { return qkv_width() + gate_width(); }
};

// Gated DeltaNet's layout (--experimental-attention-variant gated_delta_net; engine/blocks/gdn.cpp)
// on one TP rank. Token rows are sequence-major (row t * batch + i). The input projection's row
// holds, per key head g (key_heads on this rank, each serving rep = value_heads / key_heads value
// heads): [q (dk) | k (dk) | v (rep x dv) | z (rep x dv) | beta (rep) | alpha (rep)]: group_width()
// values. The convolution's channels (and its output's row) are each group's [q | k | v]:
// conv_group_width() values. Value head v (of this rank) belongs to group v / rep.
struct GdnShape {
  int batch = 0, seq = 0;
  int key_heads = 0, value_heads = 0;  // on this rank
  int dk = 0, dv = 0;                  // key (and query) head dimension, value head dimension
  int conv_k = 4;                      // causal convolution width
  float scale = 0;                     // the queries' scale: 1 / sqrt(dk)
  float l2_eps = 1e-6f;                // q and k: x / sqrt(sum x^2 + eps)
  int rep() const { return value_heads / key_heads; }
  int64_t group_width() const { return 2 * int64_t{dk} + 2 * int64_t{rep()} * dv + 2 * int64_t{rep()}; }
  int64_t proj_width() const { return key_heads * group_width(); }
  int64_t conv_group_width() const { return 2 * int64_t{dk} + int64_t{rep()} * dv; }
  int64_t conv_width() const { return key_heads * conv_group_width(); }
  int64_t value_width() const { return int64_t{value_heads} * dv; }
  int64_t tokens() const { return int64_t{batch} * seq; }
  // Column of conv channel c in the projection's row.
  int64_t proj_col_of_conv(int64_t c) const { return c / conv_group_width() * group_width() + c % conv_group_width(); }
  // Columns of value head v's output gate (its first value), beta and alpha in the projection's row.
  int64_t z_col(int v) const { return int64_t{v / rep()} * group_width() + conv_group_width() + int64_t{v % rep()} * dv; }
  int64_t beta_col(int v) const { return int64_t{v / rep()} * group_width() + conv_group_width() + int64_t{rep()} * dv + v % rep(); }
  int64_t alpha_col(int v) const { return beta_col(v) + rep(); }
  // Columns of group g's q and k, and of value head v's values, in the convolution's output row.
  int64_t q_col(int g) const { return int64_t{g} * conv_group_width(); }
  int64_t k_col(int g) const { return q_col(g) + dk; }
  int64_t v_col(int v) const { return int64_t{v / rep()} * conv_group_width() + 2 * int64_t{dk} + int64_t{v % rep()} * dv; }
  // The recurrence keeps its state at the start of every chunk of kChunk positions.
  static constexpr int kChunk = 64;
  int64_t chunks() const { return (seq + kChunk - 1) / kChunk; }
  int64_t states_numel() const { return int64_t{batch} * value_heads * chunks() * dk * dv; }
};

// A mixture-of-experts router's routing rule (Backend::moe_route; Megatron's TopKRouter).
struct MoeRouting {
  int experts = 0, topk = 0;
  MoeScoreFunction score = MoeScoreFunction::softmax;
  bool pre_softmax = false;
  float scaling = 0;              // --moe-router-topk-scaling-factor (0: none)
  int num_groups = 0, group_topk = 0;  // group-limited routing (0: off)
  static MoeRouting make(int experts, int topk, MoeScoreFunction score = MoeScoreFunction::softmax,
                         bool pre_softmax = false, float scaling = 0, int num_groups = 0, int group_topk = 0) {
    return MoeRouting{experts, topk, score, pre_softmax, scaling, num_groups, group_topk};
  }
};

// The experts' row offsets of a grouped linear op (Backend::grouped_linear_*): E + 1 values, rows
// [offsets[e], offsets[e+1]) of the row-major operands belong to expert e. Given on the host (a
// span), or as an int32 tensor [E + 1] on the backend's device (on_device: the MoE block's offsets
// as the permutation wrote them, read by the CUDA backend's grouped kernel without the host
// waiting for them); then the operands' rows bound offsets[E] (rows beyond it are left alone).
struct ExpertOffsets {
  std::span<const int64_t> host;
  Tensor device;
  ExpertOffsets(std::span<const int64_t> h) : host(h) {}  // NOLINT: implicit, the common form
  ExpertOffsets(const std::vector<int64_t>& h) : host(h) {}  // NOLINT
  static ExpertOffsets on_device(Tensor offsets) {
    ExpertOffsets o{std::span<const int64_t>()};
    o.device = offsets;
    return o;
  }
  bool on_host() const { return !host.empty(); }
  int64_t experts() const { return (on_host() ? static_cast<int64_t>(host.size()) : device.numel()) - 1; }
};

class Backend;
// The offsets on the host: as given, or the device's copied into `storage` (the stream waits);
// checked against the operands' rows (exactly with host offsets, as a bound with the device's).
std::span<const int64_t> expert_offsets_on_host(Backend& be, const ExpertOffsets& o, int64_t rows,
                                                std::vector<int64_t>& storage);

// One contiguous run of the flat parameter buffer with its optimizer group.
struct OptimSegment {
  int64_t offset = 0;
  int64_t count = 0;
  int group = 0;  // index into the per-group lr / weight decay of AdamParams (at most 4 groups)
  // FP8 model copy (--fp8-param-gather: one FP8 weight's piece): the update writes
  // e4m3(float(new master) * *fp8_scale) (float32 product, round to nearest even, saturating).
  // Single float32 values in backend memory; fp8_scale is null for a compute-dtype model copy.
  // fp8_amax (required with fp8_scale, optional otherwise): the update also maxes |new weight| as
  // the weight's next FP8 cast reads it into *fp8_amax: |new master| for an FP8 copy (cast from the
  // master weights) or without a copy, |value stored| for a compute-dtype copy (tensorwise
  // scaling's weight casts take that amax: Fp8TensorMeta::fresh). Bit-exact max |x| of that cast.
  const float* fp8_scale = nullptr;
  float* fp8_amax = nullptr;
  bool operator==(const OptimSegment&) const = default;
};

// Master weights kept as int16 remainders rounded to nearest even (core/master_remainder.h,
// ModelOptions::master_tie_bits): element i's extra bit is bit (first + i) of `words` (int32 words
// read as uint32, in backend memory). Empty: remainders rounded ties away (Transformer Engine's).
struct TieBits {
  Tensor words;
  int64_t first = 0;
  bool empty() const { return words.empty(); }
};

struct OptimStepParams {
  static constexpr int kMaxGroups = 5;
  float lr[kMaxGroups] = {};
  float weight_decay[kMaxGroups] = {};
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  // A group's own Adam eps where > 0 (--use-mup's hidden matrices: eps / width), else eps.
  float group_eps[kMaxGroups] = {};
  float eps_of(int group) const { return group_eps[group] > 0 ? group_eps[group] : eps; }
  int64_t step = 1;         // 1-based Adam step for bias correction
  float grad_scale = 1.0f;  // multiplies gradients first (1/loss_scale * clip coefficient)
  float sgd_momentum = 0.9f;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual Device device() const = 0;

  // ---- memory (set-up time only) and transfers ------------------------------------------
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* p) = 0;
  virtual void copy_from_host(Tensor dst, const void* host_src) = 0;  // async w.r.t. the host
  virtual void copy_to_host(void* host_dst, Tensor src) = 0;          // waits for completion
  virtual void copy(Tensor dst, Tensor src) = 0;                      // same dtype and numel
  // dst[:, dst_col + j] = src[:, src_col + j] for j < cols: 2-D tensors of the same rows and dtype
  // (the default copies row by row; the CUDA backend in one strided copy).
  virtual void copy_columns(Tensor dst, int64_t dst_col, Tensor src, int64_t src_col, int64_t cols);
  virtual void synchronize() = 0;
  virtual void* stream() { return nullptr; }  // cudaStream_t for communicators; null on CPU
  // Memory this backend holds now, in bytes: for CUDA the device memory in use by this process
  // beyond its context (our buffers plus the libraries' workspaces), the figure to compare with
  // PyTorch's max_memory_allocated; nothing is allocated inside the step, so it is also the peak.
  // 0 where unknown.
  virtual size_t memory_in_use() const { return 0; }
  // Device bytes this backend has allocated and not freed: buffers it handed out (allocate: the
  // models' arenas) and its own workspaces (GEMMs, attention, scratch). Nothing is allocated inside
  // a training step: the trainer checks that a step leaves this unchanged. 0 on the reference
  // backend, whose buffers are host memory.
  virtual size_t bytes_allocated() const { return 0; }
  // Sets up what FP8 GEMMs use (the CUDA backend: cuBLASLt's FP8 workspace and scale slots) at
  // set-up time, so that no training step allocates; GptModel's constructor calls it for models
  // with FP8 layers. No-op on the reference backend.
  virtual void prepare_fp8_gemms() {}

  // ---- elementwise -----------------------------------------------------------------------
  virtual void fill(Tensor t, double value) = 0;
  // fill(flat.flat_slice(r.offset, r.numel), value) for every range (the CUDA backend zeroes many
  // small ranges in one launch: the gradient buffer between the weights that need no zeroing).
  virtual void fill_ranges(Tensor flat, const std::vector<FlatRange>& ranges, double value);
  virtual void cast(Tensor dst, Tensor src) = 0;  // any float dtype to any float dtype
  // out = alpha * a + beta * b (b may be empty: out = alpha * a). out may alias a or b.
  virtual void axpby(Tensor out, float alpha, Tensor a, float beta, Tensor b) = 0;
  // x *= 1 / max(sqrt(sumsq), eps) (float32 or float64 x; sumsq: a float [1] in backend memory,
  // read on the stream: no host wait). The factor in float32, one rounding per element.
  virtual void scale_by_rnorm(Tensor x, Tensor sumsq, float eps) = 0;
  // Layout-independent normal init: element i of t gets std * normal_at(key, global index of i)
  // (the product taken in float32, then converted to t's dtype).
  virtual void init_normal(Tensor t, uint64_t key, float std, const ShardIndex& index) = 0;
  // The same with lo + (hi - lo) * uniform_at(key, global index) (float32), or with log_of its log:
  // the uniform draws of PyTorch's default Conv1d init and of Gated DeltaNet's A_log.
  virtual void init_uniform(Tensor t, uint64_t key, float lo, float hi, bool log_of, const ShardIndex& index) = 0;

  // ---- embedding -------------------------------------------------------------------------
  // out[N, h] = wte[tokens - vocab_start] (zero if the token is outside this vocab shard)
  //           + wpe[positions] (if wpe is given; the model passes it only on the shard with
  //             vocab_start == 0, so that the TP all-reduce adds it once).
  virtual void embedding_forward(Tensor out, Tensor tokens, Tensor positions, Tensor wte, Tensor wpe,
                                 int64_t vocab_start) = 0;
  // dwte += scatter of dout by token (deterministic: fixed summation order), dwpe likewise
  // (every TP rank passes dwpe: the position table is duplicated and its grads must agree).
  virtual void embedding_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens, Tensor positions,
                                  int64_t vocab_start) = 0;

  // ---- normalization (rows of x) ---------------------------------------------------------
  // out = norm(x) * w (+ b). mean/rstd are float32 [rows] saved for backward (mean unused by RMSNorm).
  // out may be empty: the statistics only (fp8_quantize_norm casts the output from them; so may
  // bias_dropout_add_norm's out). out_amax (optional float32 [1]) = max(out_amax, max |out|) over
  // the output as it is (or would be) stored, rounded to x's dtype; NaN is not a maximum. (The
  // tensorwise FP8 cast of a norm output takes its amax from here: Fp8TensorMeta::fresh.)
  virtual void norm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor x, Tensor weight, Tensor bias,
                            const NormParams& p, Tensor out_amax = Tensor()) = 0;
  // Fused residual: sum = a + dropout_p(b) (dropout_p == 0: plain add); out = norm(sum).
  virtual void add_norm_forward(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor a, Tensor b,
                                float dropout_p, uint64_t dropout_key, Tensor weight, Tensor bias,
                                const NormParams& p) = 0;
  // sum = residual + dropout_p(x + x_bias) (bias_dropout_add), then out = norm(sum): the block
  // boundary of a pre-norm layer in one pass. x_bias may be empty; sum may alias residual. The
  // default runs bias_dropout_add, then norm_forward; a fused implementation must give the same
  // sum bits and normalize the stored (rounded) sum.
  // out_amax as in norm_forward.
  virtual void bias_dropout_add_norm(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor residual, Tensor x,
                                     Tensor x_bias, float dropout_p, uint64_t dropout_key, Tensor weight, Tensor bias,
                                     const NormParams& p, Tensor out_amax = Tensor());
  // dx = norm_backward(dout) (+ dresidual if given); dweight, dbias accumulate (parameter gradients: float32 or bf16).
  // dx_colsum (float32 [h], optional) += the column sums of dx as stored (rounded to its dtype): the
  // bias gradient of the linear layer whose output gradient dx is, taken while dx is at hand.
  // dx_amax (optional float32 [1]) = max(dx_amax, max |dx| as stored); NaN is not a maximum (the
  // tensorwise FP8 cast of that linear layer's output gradient takes its amax from here).
  // dx may alias dout or dresidual.
  virtual void norm_backward(Tensor dx, Tensor dweight, Tensor dbias, Tensor dout, Tensor x, Tensor mean,
                             Tensor rstd, Tensor weight, Tensor dresidual, Tensor dx_colsum, const NormParams& p,
                             Tensor dx_amax = Tensor()) = 0;
  // norm_backward, and also out = norm(x) * w (+ b) recomputed from x and the saved statistics:
  // the same bits norm_forward wrote, so that the model need not keep norm outputs for the weight
  // gradients of the GEMMs that read them. out must not alias any input or dx. The default runs
  // norm_backward, then norm_forward (which rewrites mean/rstd with the values they hold).
  virtual void norm_backward_recompute(Tensor out, Tensor dx, Tensor dweight, Tensor dbias, Tensor dout, Tensor x,
                                       Tensor mean, Tensor rstd, Tensor weight, Tensor bias, Tensor dresidual,
                                       Tensor dx_colsum, const NormParams& p);

  // --qk-layernorm: out = qkv with every q head and every k head normalized over its head_dim
  // values (q heads share q_weight/q_bias [d], k heads k_weight/k_bias [d]); v is copied through.
  // mean/rstd: float32 [N, groups * (heads/groups + 1)], per row the heads in packed order (q heads
  // then k of group 0, then group 1, ...). out must not alias qkv (backward needs the input).
  // Backends without it raise Unsupported (the default).
  virtual void qk_norm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor qkv, Tensor q_weight, Tensor q_bias,
                               Tensor k_weight, Tensor k_bias, const RopeShape& r, const NormParams& p);
  // dqkv = gradient w.r.t. the un-normalized qkv (v part: dout's v part); weight/bias grads accumulate.
  // dqkv may alias dout.
  virtual void qk_norm_backward(Tensor dqkv, Tensor dq_weight, Tensor dq_bias, Tensor dk_weight, Tensor dk_bias,
                                Tensor dout, Tensor qkv, Tensor mean, Tensor rstd, Tensor q_weight,
                                Tensor k_weight, const RopeShape& r, const NormParams& p);

  // ---- linear layers (GEMMs) -------------------------------------------------------------
  // y[M, N] = act(x[M, K] . w[N, K]^T + bias[N]); with act != none, pre_act[M, N] receives the
  // value before the activation (for the backward pass).
  virtual void linear_forward(Tensor y, Tensor x, Tensor w, Tensor bias, Activation act, Tensor pre_act) = 0;
  // dx[M, K] = dy[M, N] . w[N, K], or dx += ... with accumulate. With act != none, the result is
  // multiplied by act'(pre_act) (pre_act has dx's shape): the gradient through a preceding activation.
  virtual void linear_backward_input(Tensor dx, Tensor dy, Tensor w, bool accumulate, Activation act,
                                     Tensor pre_act) = 0;
  // dw[N, K] += dy[M, N]^T . x[M, K], or dw = ... without accumulate (dw's old contents are not
  // read, NaN included: the first write of a step's gradient needs no zeroed buffer);
  // dbias[N] += column sums of dy (if dbias is given; bias gradients always accumulate).
  virtual void linear_backward_weight(Tensor dw, Tensor dbias, Tensor dy, Tensor x, bool accumulate) = 0;
  // linear_backward_input(dx, dy, w, false, act, pre_act) (act: a GeLU), and also
  // act_out = act(pre_act): the activation linear_forward produced, recomputed so that the model
  // need not keep it (bit for bit, except where a backend's forward took the activation from the
  // unrounded GEMM result: CUDA's fused tanh-GeLU epilogue). act_out may alias pre_act (the
  // pre-activation is dead after this).
  virtual void linear_backward_input_recompute(Tensor dx, Tensor act_out, Tensor dy, Tensor w, Activation act,
                                               Tensor pre_act);

  // ---- FP8 linear layers (--fp8-format) --------------------------------------------------
  // Hopper's FP8 GEMMs (cuBLASLt) take both operands K-major ("TN"): every FP8 matrix below is
  // row-major with the GEMM's reduction dimension contiguous. Per linear layer y = x . w^T:
  //   forward         y[M,N]  = x[M,K]    . w[N,K]^T     xq [M,K] (e4m3), wq [N,K] (e4m3)
  //   backward input  dx[M,K] = dy[M,N]   . w_t[K,N]^T   dyq [M,N], wq_t [K,N]   (w transposed)
  //   backward weight dw[N,K] = dy_t[N,M] . x_t[K,M]^T   dyq_t [N,M], xq_t [K,M] (both transposed)
  // so fp8_quantize writes a row-major copy and/or a transposed copy in one pass. dy is e5m2 with
  // --fp8-format hybrid, e4m3 with --fp8-format e4m3; x and w are always e4m3.
  // Who produces what (engine/gpt_model.cpp):
  //   - weights: fp8_quantize(wq, wq_t, w) once per step per FP8 weight (the FP8 weight cache,
  //     refreshed at the first use after the optimizer step), not per micro-batch; FP8 parameters
  //     (--fp8-param-gather) are written by the optimizer update instead, and only transposed here;
  //   - inputs: forward fp8_quantize(xq, xq_t, x), once: xq for the forward GEMM, xq_t kept with
  //     the layer's activations for the weight-gradient GEMM (ModelOptions::TestSeams::fp8_keep_inputs =
  //     false, tests only: forward fp8_quantize(xq, {}, x), backward
  //     fp8_quantize({}, xq_t, x) from x recomputed or kept in the compute dtype, with the same
  //     meta: the same scale, the same bits); fc2's input by fp8_quantize_activation from fc1's
  //     output (the activation itself is not written);
  //   - output gradients: fp8_quantize(dyq, dyq_t, dy) before the two backward GEMMs.
  // All FP8 GEMMs accumulate in float32; outputs are in the compute dtype (dw: the main grad, float32 or bf16).
  // Scaling (e = the dtype of q / q_t, fp8_max(e) = 448 or 57344, core/dtype.h):
  //   delayed:    uses meta.scale as it is (computed by fp8_update_scales from earlier steps);
  //               meta.amax = max(meta.amax, max|x|); scale_inv is not written.
  //   tensorwise: first a = max|x| (this call's tensor only); if a > 0 and finite,
  //               meta.scale = (fp8_max(e) / a) / 2^margin (float32 math, IEEE division; an
  //               infinite result, from a tiny a, becomes FLT_MAX as in Transformer Engine),
  //               meta.scale_inv = 1 / meta.scale (otherwise both keep their values);
  //               meta.amax = max(meta.amax, a); then the cast with the new scale.
  // The cast: q = e(float(x) * scale) (product in float32), round to nearest even, saturating to
  // +-fp8_max (infinities too), NaN stays NaN: exactly core/dtype.h's float_to_fp8_bits.
  // q and q_t have the same FP8 dtype; either may be empty (not written), not both. x is 2-D [R, C]:
  // q is [R, C], q_t is [C, R].
  virtual void fp8_quantize(Tensor q, Tensor q_t, Tensor x, const Fp8TensorMeta& meta);
  // fp8_quantize of groups of rows, each with its own scaling state (the routed experts' rows, one
  // group per expert): group g is rows [off[g], off[g + 1]) of x [R, C], cast with metas[g] into the
  // same rows of q [R, C] and into the [C, M_g] block at element off[g] * C of q_t (a buffer of at
  // least off.back() * C elements); either may be empty, not both; empty groups are skipped. The
  // same bytes, amaxes and scales as fp8_quantize per group, which this default calls; the CUDA
  // backend casts every group in one launch where it can (delayed scaling).
  virtual void fp8_quantize_groups(Tensor q, Tensor q_t, Tensor x, std::span<const int64_t> off,
                                   std::span<const Fp8TensorMeta> metas);
  // fp8_quantize of x = act(pre) without writing x: bit for bit activation_forward(x, pre) /
  // swiglu_forward(x, pre) in pre's dtype, then fp8_quantize(q, q_t, x, meta) (amax and scales of x
  // too). pre is [R, C] for GeLU and squared ReLU, [R, 2C] for SwiGLU; q is [R, C], q_t [C, R]. FP8 layers cast
  // fc2's input this way straight from fc1's output (the GEMM then writes only fc1's output, no
  // GeLU epilogue), saving the activation's write and read in the compute dtype.
  // (SwiGLU: the gated unit glu, engine/activation.h, as swiglu_forward / swiglu_backward take it.)
  virtual void fp8_quantize_activation(Tensor q, Tensor q_t, Tensor pre, MlpActivation act,
                                       const Fp8TensorMeta& meta, const Glu& glu = {});
  // fp8_quantize of y = norm(x) without writing y: bit for bit the y that norm_forward(y, mean,
  // rstd, x, weight, bias, p) writes (x's dtype), given the mean and rstd that call wrote (a
  // norm_forward or bias_dropout_add_norm with an empty out: statistics only), then
  // fp8_quantize(q, q_t, y, meta). x [R, C]; q [R, C], q_t [C, R]. FP8 layers cast the QKV and fc1
  // inputs this way (ModelOptions::TestSeams::fp8_norm_cast), saving the norm output's write and read in the
  // compute dtype.
  virtual void fp8_quantize_norm(Tensor q, Tensor q_t, Tensor x, Tensor mean, Tensor rstd, Tensor weight, Tensor bias,
                                 const NormParams& p, const Fp8TensorMeta& meta);
  // fp8_quantize(q, q_t, dy, meta), and dbias[C] (a parameter gradient) += the column sums of dy (the unquantized
  // values, as fp8_linear_backward_weight sums them), read in the same pass: the bias gradient of
  // an FP8 layer with FP8 weight gradients (fp8_linear_backward_weight then gets no dbias).
  virtual void fp8_quantize_with_dbias(Tensor q, Tensor q_t, Tensor dy, const Fp8TensorMeta& meta, Tensor dbias);
  // fp8_quantize_with_dbias of d, the gradient of the activation's input, without writing d: bit
  // for bit activation_backward(d, dout, pre) / swiglu_backward(d, dout, pre) in pre's dtype, then
  // fp8_quantize_with_dbias(q, q_t, d, meta, dbias) (dbias may be empty). GeLU and squared ReLU:
  // dout and pre [R, C];
  // SwiGLU: dout [R, F], pre and d [R, 2F]. FP8 layers take fc1's output gradient this way from
  // fc2's plain input gradient (no DGELU epilogue, no compute-dtype copy of the gradient).
  virtual void fp8_quantize_activation_backward(Tensor q, Tensor q_t, Tensor dout, Tensor pre, MlpActivation act,
                                          const Fp8TensorMeta& meta, Tensor dbias, const Glu& glu = {});
  // y[M,N] = act(xq[M,K] . wq[N,K]^T * x_scale_inv * w_scale_inv + bias[N]) (fp32 accumulation,
  // bias and activation in float32, y and pre_act in the compute dtype). pre_act as in linear_forward.
  virtual void fp8_linear_forward(Tensor y, Tensor xq, Tensor x_scale_inv, Tensor wq, Tensor w_scale_inv,
                                  Tensor bias, Activation act, Tensor pre_act);
  // dx[M,K] (+)= dyq[M,N] . wq_t[K,N]^T * dy_scale_inv * w_scale_inv; with act != none multiplied
  // by act'(pre_act) as in linear_backward_input.
  virtual void fp8_linear_backward_input(Tensor dx, Tensor dyq, Tensor dy_scale_inv, Tensor wq_t,
                                         Tensor w_scale_inv, bool accumulate, Activation act, Tensor pre_act);
  // dw[N,K] += dyq_t[N,M] . xq_t[K,M]^T * dy_scale_inv * x_scale_inv (dw: the main grad, float32 or bf16).
  // dbias[N] += column sums of dy, the UNQUANTIZED output gradient [M,N] in the compute dtype (as
  // Transformer Engine takes dbias from the high-precision gradient); dy is only read for dbias
  // and may be empty when dbias is. (--no-fp8-wgrad: the model calls linear_backward_weight instead.)
  virtual void fp8_linear_backward_weight(Tensor dw, Tensor dbias, Tensor dy, Tensor dyq_t, Tensor dy_scale_inv,
                                          Tensor xq_t, Tensor x_scale_inv, bool accumulate);
  // Delayed scaling, once per optimizer step, after the amax all-reduce (max) over the amax
  // group. For n operands: history float32 [H, n] (row 0: the step just finished), scale,
  // scale_inv and fp8_max float32 [n]. For every operand i:
  //   a = (algo == max) ? max_j history[j, i] : history[0, i];
  //   if a > 0 and a is finite: scale[i] = (fp8_max[i] / a) / 2^margin (FLT_MAX if that is
  //   infinite), scale_inv[i] = 1 / scale[i] (float32, IEEE division); otherwise both keep their values;
  //   then the history rolls: row j <- row j+1 (j < H-1), row H-1 <- old row 0, and row 0 <- 0.
  virtual void fp8_update_scales(Tensor history, Tensor scale, Tensor scale_inv, Tensor fp8_max,
                                 const Fp8ScaleUpdate& p);

  // ---- FP8 parameters (--fp8-param-gather) --------------------------------------------------
  // FP8 layers' weights then live only as FP8 (the optimizer casts its float32 master weights into
  // them with fp8_quantize); these two ops serve the weight's other uses.
  // q_t[C, R] = q[R, C] transposed: the FP8 bytes as they are (q and q_t one FP8 dtype). The
  // weight cache's transposed copy, for the input-gradient GEMM (and nothing else moves).
  virtual void fp8_transpose(Tensor q_t, Tensor q);
  // out[i] = float(q[i]) * scale_inv (float32 product), rounded once to out's dtype (the compute
  // dtype or float32); out and q the same shape. The weight in the compute dtype where a layer's
  // GEMMs do not run in FP8 (delayed scaling's calibrating first step).
  virtual void fp8_dequantize(Tensor out, Tensor q, Tensor scale_inv);

  // ---- activations -----------------------------------------------------------------------
  // out = act(in), din = dout * act'(in), elementwise (act != none); din may alias dout.
  virtual void activation_forward(Tensor out, Tensor in, Activation act) = 0;
  virtual void activation_backward(Tensor din, Tensor dout, Tensor in, Activation act) = 0;
  // in[M, 2f] = [gate | up] per row; out[M, f] = silu(gate) * up, or the gated unit `g`
  // (engine/activation.h: quick-GeLU, the linear offset, the clamp) where it is not plain SwiGLU.
  virtual void swiglu_forward(Tensor out, Tensor in, const Glu& g = {}) = 0;
  // din may alias in (elementwise, each element read before written).
  virtual void swiglu_backward(Tensor din, Tensor dout, Tensor in, const Glu& g = {}) = 0;
  // swiglu_backward, and also act_out[M, f] = swiglu(in), bit for bit what swiglu_forward wrote.
  // din may alias in and act_out may alias dout (elementwise, each element read before written).
  // The default handles only the non-aliased case.
  virtual void swiglu_backward_recompute(Tensor din, Tensor act_out, Tensor dout, Tensor in, const Glu& g = {});

  // ---- mixture of experts (engine/blocks/moe.cpp) -----------------------------------------
  // N token rows, E experts, k = r.topk slots per token. idx/order/slot_of/offsets are int32.
  // Routing of each row z = logits[t] (E values, read as float):
  //   softmax, post (default): idx = topk(z); p = softmax over the k selected z (float).
  //   softmax, pre (r.pre_softmax): s = softmax(z) over all E; idx = topk(s); p = s[idx] (not renormalized).
  //   sigmoid: s = sigmoid(z); idx = topk(s + expert_bias) (bias: float32 [E] or empty);
  //            p = s[idx], divided by (sum of the k values + 1e-20) when k > 1.
  //   Group-limited (r.num_groups > 0): the E experts are r.num_groups contiguous groups; a group's
  //   score is the sum of the top floor(k / r.group_topk) values in it of the tensor being top-k'd
  //   (z for post-softmax, s for pre-softmax, s + bias for sigmoid); only the r.group_topk best
  //   groups' experts take part in the top-k.
  //   Then p *= r.scaling (when r.scaling != 0), and p is rounded to the logits' dtype (Megatron
  //   casts the routing weights to it) but stored in probs' dtype (float32).
  //   top-k: descending value; ties go to the lower expert index (slot j = 0 is the largest).
  // probs float32 [N, k], idx int32 [N, k].
  virtual void moe_route(Tensor probs, Tensor idx, Tensor logits, Tensor expert_bias, const MoeRouting& r) = 0;
  // Sinkhorn load balancing (--moe-router-load-balancing-type sinkhorn, Megatron's
  // sinkhorn_load_balancing): the weights are sigmoid(z) (k = 1) or softmax(z) over all E (k > 1) at
  // the chosen experts, not renormalized, rounded to the logits' dtype (stored float32); the choice
  // is, in training, the top-k of sinkhorn(z) computed over each block of block_rows rows (the rows
  // one rank routes: engine/moe_routing.h has the iteration), in evaluation the top-k of the
  // weights. Their backward is moe_route_backward's with a pre-softmax rule (k > 1) or a sigmoid
  // rule (k = 1). probs float32 [N, k], idx int32 [N, k].
  virtual void moe_sinkhorn_route(Tensor probs, Tensor idx, Tensor logits, int topk, int64_t block_rows,
                                  bool training) = 0;
  // dlogits [N, E] (logits' dtype) = the gradient of the routing weights' function above w.r.t. the
  // logits, given dprobs float32 [N, k] (the selection is constant; values recomputed from logits),
  // plus aux_grad [N, E] (float32, optional: added before the single rounding to dlogits' dtype).
  virtual void moe_route_backward(Tensor dlogits, Tensor dprobs, Tensor logits, Tensor idx, Tensor aux_grad,
                                  const MoeRouting& r) = 0;
  // Load-balancing statistics of one micro-batch (Megatron's aux and z losses), float32
  // stats [2E + 1]: stats[e] = sum over rows of the aux score s~[t, e], stats[E + e] = the number of
  // rows whose top-k of s~ (plain top-k: no bias, no groups) holds e, stats[2E] = sum over rows of
  // logsumexp(z)^2. s~ = softmax(z) (softmax scoring) or s / sum_e s with s = sigmoid(z).
  virtual void moe_aux_stats(Tensor stats, Tensor logits, const MoeRouting& r) = 0;
  // aux_grad float32 [N, E] = aux_scale * d/dz (sum_e stats[E + e] * sum_t s~[t, e]) (the counts are
  // constants) + z_scale * d/dz (sum_t logsumexp(z_t)^2), per row from logits; either scale may be 0.
  virtual void moe_aux_grad(Tensor aux_grad, Tensor logits, Tensor stats, float aux_scale, float z_scale,
                            const MoeRouting& r) = 0;
  // sums float32 [2] += {aux_scale * sum_e stats[e] * stats[E + e], z_scale * stats[2E]}: the
  // logged losses, accumulated on the device (no host sync).
  virtual void moe_aux_log(Tensor sums, Tensor stats, float aux_scale, float z_scale) = 0;
  // Token dropping (--moe-expert-capacity-factor; Megatron's apply_router_token_dropping without
  // padding): within each block of block_rows rows (the rows one rank routes), each expert keeps at
  // most `capacity` of the (row, slot) pairs routed to it: those with the largest routing weight
  // (by_position false; equal weights: the lower row first) or those of the first rows (true).
  // kept = idx with every dropped pair's expert -1 (moe_permute_plan then does not place it: its
  // output and its weight's gradient are zero). kept, idx int32 [N, k]; probs [N, k] (float32, or
  // float64 on the reference backend). The default runs engine/moe_routing.h's rule on host copies
  // (one device-to-host copy of idx and probs per call).
  virtual void moe_capacity_drop(Tensor kept, Tensor idx, Tensor probs, int num_experts, int64_t capacity,
                                 int64_t block_rows, bool by_position);
  // The permutation of the N * k (row, slot) pairs routed to experts [first_expert, first_expert +
  // E) (all experts, or this rank's under expert parallelism), expert-major, row ascending within an
  // expert (Megatron's order): order[r] = t * k + j of the r-th permuted row, slot_of[t * k + j] = r
  // (its inverse), offsets [E + 1]: the first permuted row of each expert (offsets[E]: the pairs
  // placed, N * k when every pair is routed inside the range). A pair routed outside the range is
  // not placed: slot_of = -1; order past offsets[E] is left as it was.
  virtual void moe_permute_plan(Tensor order, Tensor slot_of, Tensor offsets, Tensor idx, int first_expert,
                                int num_experts) = 0;
  // counts[e] += offsets[e + 1] - offsets[e] for the E experts of a permutation's offsets (int32
  // [E + 1]); counts float64 [E]: the pairs each expert received, counted on the device
  // (aux-loss-free balancing's token counts, with no host wait).
  virtual void moe_count_rows(Tensor counts, Tensor offsets) = 0;
  // The router's input jitter (--moe-input-jitter-eps): out[i] = in[i] * (1 - eps + 2 eps u) with
  // u = uniform_at(key, index0 + i) (core/philox.h), the factor in float32, the product rounded
  // once to out's dtype (in's; a float32 product first for 16-bit types on the GPU). out may alias
  // in. The backward redraws the same factors.
  virtual void moe_jitter(Tensor out, Tensor in, float eps, uint64_t key, int64_t index0) = 0;
  // out[r, :] = x[index[r] / k, :] for every row r of out (any dtype; out and x the same dtype and
  // columns); an index < 0 or past x's rows (a pair not placed) gives a zero row. Gathers the
  // permuted tokens (index = order, k = topk), and with k = 1 any row gather (the routing weights in
  // permuted order: index = order on probs viewed [N * k, 1]).
  virtual void moe_gather_rows(Tensor out, Tensor x, Tensor index, int k) = 0;
  // out[t, :] (+)= sum_{j < k} y[slot_of[t * k + j], :], summed in float (j ascending), rounded
  // once to out's dtype (with accumulate: added to out's value before that rounding); a slot < 0 or
  // past y's rows (a pair not placed, routed to another rank's expert) adds nothing. The
  // un-permutation (combine) and the backward of moe_gather_rows.
  virtual void moe_combine(Tensor out, Tensor y, Tensor slot_of, int k, bool accumulate) = 0;
  // out[r, :] = x[r, :] * p[r] (float product, rounded once to out's dtype); p float32 [R]. out may
  // alias x. The routing weight applied inside the expert, between its activation and fc2.
  virtual void moe_scale_rows(Tensor out, Tensor x, Tensor p) = 0;
  // dx[r, :] = dout[r, :] * p[r] (rounded once), dp[r] = sum_c dout[r, c] * x[r, c] (float32, summed
  // in double on the reference backend). dx may alias dout.
  virtual void moe_scale_rows_backward(Tensor dx, Tensor dp, Tensor dout, Tensor x, Tensor p) = 0;
  // The SwiGLU experts' activation and routing weight in one pass (the defaults run the ops named,
  // in order; the CUDA backend fuses them, with the same bits). in [R, 2f] = fc1's output, p float32 [R].
  //   forward:  out [R, f] = swiglu(in) * p: swiglu_forward, then moe_scale_rows in place.
  //   backward: from dout = d(swiglu(in) * p) [R, f] (its contents are clobbered): act [R, f] =
  //     swiglu(in) * p again (fc2's input, for its weight gradient); dp = sum_c dout * swiglu(in);
  //     din [R, 2f] = the gradient of in (din may alias in): swiglu_forward(act), then
  //     moe_scale_rows_backward(dout, dp, dout, act, p), moe_scale_rows(act, act, p),
  //     swiglu_backward(din, dout, in).
  virtual void moe_swiglu_forward(Tensor out, Tensor in, Tensor p, const Glu& g = {});
  virtual void moe_swiglu_backward(Tensor din, Tensor act, Tensor dp, Tensor dout, Tensor in, Tensor p,
                                   const Glu& g = {});
  // Grouped linear layers (the experts): rows [offsets[e], offsets[e+1]) of x belong to expert e,
  // whose weight is rows [e * Nw, (e+1) * Nw) of w [E * Nw, K] (Nw = w.rows() / E). offsets: E + 1
  // values, on the host or on the device (ExpertOffsets). y[r] = x[r] . w_e^T; dx[r] = dy[r] . w_e;
  // dw_e (+)= dy_e^T . x_e (an expert without rows: dw_e unchanged with accumulate, else zeroed).
  // The defaults run one linear_* per expert on row slices (device offsets copied to the host).
  // prepare_grouped_gemms (set-up time; the CUDA backend: a grouped GEMM of up to max_groups
  // experts per call, its workspace allocated here) makes them one call each; without it they run
  // the defaults.
  virtual void prepare_grouped_gemms(int max_groups) { (void)max_groups; }
  virtual void grouped_linear_forward(Tensor y, Tensor x, Tensor w, const ExpertOffsets& offsets);
  virtual void grouped_linear_backward_input(Tensor dx, Tensor dy, Tensor w, const ExpertOffsets& offsets);
  // sumsq (optional, float32 [1] or the accumulation dtype's): += the sum of squares of dw as
  // stored (every expert's; without accumulate only), for the gradient norm (ModelOptions::
  // expert_grad_sumsq). The default adds sum_squares(dw) after the op; the CUDA backend's grouped
  // GEMM sums the squares in its epilogue instead (float sums per thread, added in double in a
  // fixed order: the same result run to run, not sum_squares' bits).
  virtual void grouped_linear_backward_weight(Tensor dw, Tensor dy, Tensor x, const ExpertOffsets& offsets,
                                              bool accumulate, Tensor sumsq = Tensor());

  // The experts' linear biases (MoE layers with linear biases), rows as the grouped linear ops': y
  // [R, n], bias [E, n] (expert e's bias its row e, y's dtype), p float32 [R] or empty (s_r = p[r],
  // or 1 without p). forward: y[r, :] = y[r, :] + s_r * bias[e(r), :] (float math, rounded once):
  // fc1's bias, and fc2's times the routing weight (Megatron's expert MLP adds output_bias *
  // per_token_scale). backward: dbias [E, n] (+)= for each expert the sum over its rows of s_r *
  // dy[r, :] (float sums, rows ascending; the reference: double), an expert without rows giving
  // zero (accumulate: unchanged); with dp (float32 [R]): dp[r] += sum_c dy[r, c] * bias[e(r), c].
  // With device offsets, rows past offsets[E] are left alone.
  virtual void grouped_bias_forward(Tensor y, Tensor bias, Tensor p, const ExpertOffsets& offsets) = 0;
  virtual void grouped_bias_backward(Tensor dbias, Tensor dp, Tensor dy, Tensor bias, Tensor p,
                                     const ExpertOffsets& offsets, bool accumulate) = 0;

  // ---- attention output gate (--attention-output-gate) ---------------------------------------
  // The QKV projection's output with the gate, per row and per query group g of s.groups:
  // [q (qpg heads) | gate (qpg heads) | k | v], heads of s.head_dim, qpg = s.q_per_group (Megatron's
  // layout). split: qkv[M, groups*(qpg+2)*d] = the [q | k | v] parts, gate[M, groups*qpg*d] the gate
  // heads; merge: the reverse (qkvg from qkv and gate, e.g. their gradients).
  virtual void attention_gate_split(Tensor qkv, Tensor gate, Tensor qkvg, const GateShape& s) = 0;
  virtual void attention_gate_merge(Tensor qkvg, Tensor qkv, Tensor gate, const GateShape& s) = 0;
  // out = x * sigmoid(gate) (float math, rounded once). Backward: dx = dout * sigmoid(gate),
  // dgate = dout * x * sigmoid(gate) * (1 - sigmoid(gate)); dx may alias dout and dgate may alias
  // gate (elementwise, each element read before written).
  virtual void output_gate_forward(Tensor out, Tensor x, Tensor gate) = 0;
  virtual void output_gate_backward(Tensor dx, Tensor dgate, Tensor dout, Tensor x, Tensor gate) = 0;

  // ---- Gated DeltaNet (engine/blocks/gdn.cpp; GdnShape gives the layouts) ---------------------
  // Causal depthwise convolution of the projection's q, k, v channels, then SiLU:
  //   xc[t, c] = silu(sum_j w[c, j] * x[t - (K - 1) + j, c]), x[t', c] = proj[t', proj_col_of_conv(c)]
  // (zero before position 0 of each sample), w [conv_width, K]; sums in float32 (the reference:
  // float64), xc rounded once. Backward (the pre-activation recomputed from proj and w): dproj's q,
  // k, v columns = the input gradient (its other columns untouched); dw (+)= the weight gradient.
  virtual void gdn_conv_forward(Tensor xc, Tensor proj, Tensor w, const GdnShape& s) = 0;
  virtual void gdn_conv_backward(Tensor dproj, Tensor dw, Tensor dxc, Tensor proj, Tensor w, const GdnShape& s,
                                 bool accumulate) = 0;
  // The gated delta rule, per sample and value head v (group g = v / rep), position by position:
  //   q = scale * l2(xc q_g), k = l2(xc k_g), u = xc v_v (l2(x) = x / sqrt(|x|^2 + l2_eps)),
  //   beta = sigmoid(proj[beta_col(v)]), decay a = exp(-exp(a_log[v]) * softplus(proj[alpha_col(v)] + dt_bias[v])),
  //   S = a S + k (beta (u - a S^T k))^T  (S [dk, dv], zero at position 0),  out[t, v] = S^T q.
  // out [N, value_width]; states (float32, the reference: its accumulation dtype) [batch,
  // value_heads, chunks, dk, dv]: S before each chunk's first position, for the backward, which
  // recomputes the states inside a chunk from it. Backward: dxc (all of it: q, k, v columns),
  // dproj's beta and alpha columns, and d a_log, d dt_bias [value_heads] (+)= theirs (the CUDA
  // backend sums those from dproj's alpha column as stored, so with 16-bit data from its rounded
  // values, as autograd would).
  virtual void gdn_forward(Tensor out, Tensor states, Tensor xc, Tensor proj, Tensor a_log, Tensor dt_bias,
                           const GdnShape& s) = 0;
  virtual void gdn_backward(Tensor dxc, Tensor dproj, Tensor da_log, Tensor ddt_bias, Tensor dout, Tensor xc,
                            Tensor proj, Tensor a_log, Tensor dt_bias, Tensor states, const GdnShape& s,
                            bool accumulate) = 0;
  // The output gate: y[t, v*dv + e] = n[t, v*dv + e] * silu(proj[t, z_col(v) + e]) (float math,
  // rounded once). Backward: dn = dy * silu(z) (dn may alias dy), dproj's z columns = dy * n * silu'(z).
  virtual void gdn_gate_forward(Tensor y, Tensor n, Tensor proj, const GdnShape& s) = 0;
  virtual void gdn_gate_backward(Tensor dn, Tensor dproj, Tensor dy, Tensor n, Tensor proj, const GdnShape& s) = 0;
  // out = residual + dropout_p(x + bias) (bias may be empty). out may alias residual.
  // Dropout (here and in add_norm_forward, dropout_backward): element with flat index i of the
  // dropped tensor is kept iff dropout_keep(key, i, p) (engine/dropout_mask.h) and then scaled by
  // 1/(1-p); p == 0 draws nothing.
  virtual void bias_dropout_add(Tensor out, Tensor x, Tensor bias, Tensor residual, float dropout_p,
                                uint64_t dropout_key) = 0;
  // dx = dout * mask / (1 - p), the mask redrawn from the same key (nothing is stored). dx may alias
  // dout; the model also uses it as the forward of a plain dropout (embedding dropout).
  // dx_amax (optional float32 [1]) = max(dx_amax, max |dx| as stored), as norm_backward's.
  virtual void dropout_backward(Tensor dx, Tensor dout, float dropout_p, uint64_t dropout_key,
                                Tensor dx_amax = Tensor()) = 0;

  // ---- rotary embeddings (in place on the q and k parts of packed QKV) -------------------
  // cos_sin: float32 [max_positions, rot_dim]: cos of the rot_dim/2 frequencies, then their sin.
  virtual void rope_forward(Tensor qkv, Tensor positions, Tensor cos_sin, const RopeShape& r) = 0;
  virtual void rope_backward(Tensor dqkv, Tensor positions, Tensor cos_sin, const RopeShape& r) = 0;

  // ---- multi-latent attention's attention input -----------------------------------------
  // qkv [N, heads * 3 * qk_dim] (the attention ops' packed layout with groups = heads: per head
  // [Q | K | V padded with zeros to qk_dim]) from q [N, heads * qk_dim] (per head [q_nope |
  // q_rope]), kv [N, heads * (nope_dim + v_dim)] (per head [k_nope | v]) and k_rope, columns
  // [kr_col, kr_col + rope_dim) of down [N, *], shared by the heads: Q = [q_nope | R(q_rope)],
  // K = [k_nope | R(k_rope)]. R is Megatron's MLA RoPE: the first rot_dim values are interleaved
  // pairs (2i, 2i + 1), each turned by the angle of pair i (cos_sin and positions as
  // rope_forward's) and written de-interleaved (the pairs' first elements, then their second
  // ones); values past rot_dim pass through.
  virtual void mla_qkv_forward(Tensor qkv, Tensor q, Tensor kv, Tensor down, Tensor positions, Tensor cos_sin,
                               const MlaShape& m) = 0;
  // Its backward: dq and dkv (overwritten) and the k_rope columns of ddown (overwritten: the sum
  // over the heads; its other columns untouched) from dqkv (the V padding's gradient dropped).
  virtual void mla_qkv_backward(Tensor dq, Tensor dkv, Tensor ddown, Tensor dqkv, Tensor positions, Tensor cos_sin,
                                const MlaShape& m) = 0;

  // ---- attention (causal, GQA, flash-style: the s x s scores never go to memory) ----------
  // out[N, heads*d]; lse float32 [b, heads, s] (log-sum-exp of each score row, for backward).
  virtual void attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a) = 0;
  virtual void attention_backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv,
                                  const AttentionShape& a) = 0;

  // ---- attention sinks (--softmax-type off-by-one / learnable) ------------------------------
  // Query head h's sink logit s_h joins every one of its rows' softmax and carries no value
  // (Megatron-Core's SoftmaxOne: softmax over [scores, s_h], the sink's column dropped). From
  // attention_forward's out [s * b, heads * d] and lse [b, heads, s] (the shape is read from lse):
  //   lse' = log(exp(lse) + exp(s_h)),  out *= exp(lse - lse'),  lse = lse'  (in place).
  // attention_backward given these out and lse (and the same dout) then computes the gradients of
  // attention with sinks exactly: it rebuilds the probabilities from lse and rowsum(dout * out).
  // sink: [heads] (float32 or the compute dtype); an empty tensor: s_h = 0 (off-by-one).
  virtual void attention_sink_forward(Tensor out, Tensor lse, Tensor sink) = 0;
  // dsink[h] += -sum over h's rows of exp(s_h - lse) * rowsum(dout * out), with the out and lse
  // attention_sink_forward left (a parameter gradient: float32, or the compute dtype).
  virtual void attention_sink_backward(Tensor dsink, Tensor dout, Tensor out, Tensor lse, Tensor sink) = 0;

  // ---- attention blocks (context parallelism: a sequence split over ranks) ----------------
  // One block of a sequence's attention: the queries at global positions [blk.q_begin,
  // blk.q_begin + a.seq) against the keys and values at [blk.k_begin, blk.k_begin + blk.kv_len).
  // AttentionShape's mask applies to the global positions (causal: key <= query; a window: key >=
  // query - window_left; documents: key >= the query's document start, a.doc_start holding the
  // whole sequence's) and dropout draws by global positions in a sequence of blk.seq_total
  // (engine/attention_dropout.h with seq = seq_total), so that the blocks of a split sequence
  // together compute exactly what attention_forward computes on the whole.
  //   q:   [b * a.seq, a.qkv_row_stride()] packed QKV rows (sequence-major, row t * b + i); only
  //        the query parts are read.
  //   kv:  [b * blk.kv_len, groups * 2 * d] sequence-major; per row and group its key, then its value.
  //   out: [b * a.seq, heads * d]; lse (float32 or float64): [b, heads, a.seq].
  // Forward writes this block's normalized output and log-sum-exp (a row that sees no key of the
  // block: lse = -inf, out = 0); attention_merge combines blocks.
  virtual void attention_block_forward(Tensor out, Tensor lse, Tensor q, Tensor kv, const AttentionShape& a,
                                       const AttentionBlock& blk);
  // Backward of one block given the MERGED out and lse of these queries (over all their blocks):
  // dq (packed QKV layout as q; only its query parts are touched) += this block's dQ, dkv (kv's
  // layout) += its dK, dV. dout: [b * a.seq, heads * d].
  virtual void attention_block_backward(Tensor dq, Tensor dkv, Tensor dout, Tensor out, Tensor lse, Tensor q,
                                        Tensor kv, const AttentionShape& a, const AttentionBlock& blk);
  // out, lse (running) merged with a block's out_blk, lse_blk of the same queries:
  //   lse' = log(exp(lse) + exp(lse_blk)), out' = out exp(lse - lse') + out_blk exp(lse_blk - lse')
  // (-inf on both sides: out' = 0, lse' = -inf).
  virtual void attention_merge(Tensor out, Tensor lse, Tensor out_blk, Tensor lse_blk);
  // kv [b * a.seq, groups * 2 * d] = the key and value parts of packed QKV rows.
  virtual void attention_kv_pack(Tensor kv, Tensor qkv, const AttentionShape& a);
  // The key and value parts of dqkv (packed QKV rows) += dkv (attention_kv_pack's layout).
  virtual void attention_kv_unpack_add(Tensor dqkv, Tensor dkv, const AttentionShape& a);

  // ---- cross-entropy over a (possibly vocab-parallel) logits shard ------------------------
  // Per row: lse = log(sum(exp(logits))) over this shard's columns; target = logit of the label
  // if it falls in [vocab_start, vocab_start + cols), else 0. Both float32 [N].
  virtual void cross_entropy_forward(Tensor lse, Tensor target, Tensor logits, Tensor labels,
                                     int64_t vocab_start) = 0;
  // dlogits = (softmax(logits) - onehot(label)) * dloss[row], softmax from the global lse.
  // dlogits may alias logits (done in place to save memory).
  virtual void cross_entropy_backward(Tensor dlogits, Tensor logits, Tensor labels, Tensor lse, Tensor dloss,
                                      int64_t vocab_start) = 0;
  // Both of the above for a whole (not vocab-parallel) vocabulary, the gradient written over the
  // logits: lse and target as cross_entropy_forward, then dlogits as cross_entropy_backward with
  // that lse (the same values). A backend may do both in one pass over the logits.
  virtual void cross_entropy_forward_backward(Tensor lse, Tensor target, Tensor logits, Tensor labels, Tensor dloss);
  // lse_out[N] = log(sum_r exp(lse_parts[r, N])): combines per-shard lse after an all-gather.
  virtual void logsumexp_combine(Tensor lse_out, Tensor lse_parts) = 0;
  // ---- knowledge distillation (ModelOpt's losses, megatron/post_training) -------------------
  // Per row of a (possibly vocab-parallel) logits shard [N, cols]: lse float32 [N] = log(sum(exp(
  // logits * scale))) over this shard's columns (scale: 1 / the KL temperature; -inf for a row of
  // -inf). t and s, a and b (and da) below have one dtype.
  virtual void logsumexp_rows(Tensor lse, Tensor logits, float scale) = 0;
  // LogitsKLLoss: the student's logits s and the teacher's t [N, cols] (one shard, the same
  // columns), each times scale (1 / temperature); lse_s, lse_t float32 [N] their rows' global log-
  // sum-exp of that (logsumexp_rows, combined over the shards). With p = exp(x * scale - lse):
  // kl float32 [N] = sum over this shard's columns with p_t > 0 of p_t * (log p_t - log p_s) (the row's KL(t || s)
  // where the shard is the whole vocabulary; shards' values add up to it); where dloss (float32
  // [N]) is not empty, ds [N, cols] (may alias s) = (p_s - p_t) * scale * dloss[row].
  virtual void kd_logits_kl(Tensor kl, Tensor ds, Tensor s, Tensor t, Tensor lse_s, Tensor lse_t, float scale,
                            Tensor dloss) = 0;
  // Intermediate losses between hidden states a (student) and b (teacher) [N, h], per row (float32
  // loss [N]): cosine: 1 - a.b / sqrt((|a|^2 + 1e-12) (|b|^2 + 1e-12)) (torch's
  // cosine_embedding_loss with target 1); mse: mean over h of (a - b)^2.
  enum class HiddenLoss { cosine, mse };
  virtual void hidden_loss_forward(Tensor loss, Tensor a, Tensor b, HiddenLoss kind) = 0;
  // da (+)= d loss[row] / d a * dloss[row] * scale (da [N, h] like a; accumulate: added to it).
  virtual void hidden_loss_backward(Tensor da, Tensor a, Tensor b, Tensor dloss, float scale, HiddenLoss kind,
                                    bool accumulate) = 0;
  // out[0] (+)= sum(loss * mask), out[1] (+)= sum(mask); out float32 [2].
  virtual void masked_loss_sum(Tensor out, Tensor loss, Tensor mask, bool accumulate) = 0;
  // Per row of a (possibly vocab-parallel) logits shard [N, cols], as torch.max(dim=-1) gives them:
  // max float32 [N] = the row's largest logit, index int32 [N] = vocab_start + the column of its
  // first occurrence.
  virtual void logits_argmax(Tensor max, Tensor index, Tensor logits, int64_t vocab_start) = 0;
  // Multi-token prediction's acceptance counts (Megatron-LM's argmax == label): a row's prediction
  // is index_parts[r, row] of the first shard r with the largest max_parts[r, row] (torch.argmax
  // over the gathered shards; one shard without TP). out[0] (+)= the rows with mask != 0 whose
  // prediction is their label, out[1] (+)= the rows with mask != 0; out as masked_loss_sum's.
  // max_parts float32 [R, N], index_parts and labels int32.
  virtual void argmax_match_count(Tensor out, Tensor max_parts, Tensor index_parts, Tensor labels, Tensor mask,
                                  bool accumulate) = 0;

  // ---- optimizer -------------------------------------------------------------------------
  // AdamW (decoupled weight decay) on flat float32 buffers, over the given segments. The new
  // master weights are also written to model_param (the bf16/fp16 copy; may be empty; FP8 (e4m3)
  // when every segment carries its fp8_scale and fp8_amax).
  // exp_avg / exp_avg_sq: float32, or bf16 each (read as float32, stored rounded to nearest even).
  // master may instead be int16 remainders beside a bf16 model_param (core/master_remainder.h):
  // the float32 master weight is joined from the two, updated, and split back into both, rounded
  // ties away (the precision-aware optimizer's) or, with `ties` (its bits of these elements read
  // and written), to nearest even.
  virtual void adamw_step(Tensor master, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, Tensor model_param,
                          std::span<const OptimSegment> segments, const OptimStepParams& p, TieBits ties = {}) = 0;
  // Float32 master weights into bf16 weights `model` and int16 `remainder` (core/master_remainder.h;
  // set-up and checkpoint loads), with `ties`: rounded to nearest even, their bits written. remainder
  // may be empty: the weights alone, rounded the same way (ties then empty too).
  virtual void split_master(Tensor model, Tensor remainder, Tensor master, TieBits ties = {}) = 0;
  // out float32 [1] (+)= sum of squares of the float32 master weights joined from the bf16 `model`,
  // the int16 `remainder` and `ties` (not empty) over the segments: sum_squares' bits over those
  // master weights as a float32 buffer.
  virtual void master_sum_squares(Tensor out, Tensor model, Tensor remainder, TieBits ties,
                                  std::span<const OptimSegment> segments, bool accumulate) = 0;
  // float32 `master` = the master weights joined from the bf16 `model` and int16 `remainder`
  // (split_master's inverse: ties away with `ties` empty, else to nearest even with its bits).
  virtual void join_master(Tensor master, Tensor model, Tensor remainder, TieBits ties) = 0;
  virtual void sgd_step(Tensor master, Tensor grad, Tensor momentum, Tensor model_param,
                        std::span<const OptimSegment> segments, const OptimStepParams& p) = 0;
  // out float32 [1] (+)= sum of squares of x over the segments (all of x when segments is empty).
  virtual void sum_squares(Tensor out, Tensor x, std::span<const OptimSegment> segments, bool accumulate) = 0;
  // out float32 [1] (+)= number of exact zeros in x over the segments.
  virtual void count_zeros(Tensor out, Tensor x, std::span<const OptimSegment> segments, bool accumulate) = 0;

  // ---- integrity -------------------------------------------------------------------------
  // out int64 [1] = the 64-bit hash of x's bytes (any dtype) of core/byte_hash.h, bit-identical
  // on every backend (the weight hash check of --check-weight-hash-across-dp-replicas-interval
  // compares them across ranks). Reads device memory where x lives; x may be empty (numel 0).
  virtual void hash_bytes(Tensor out, Tensor x) = 0;

  // ---- set-up planning (call before the first step; the reference backend needs none) -----
  // Sizes the attention workspace for the largest shape of the run (training and, without
  // dropout, evaluation) in the activation dtype, and picks the attention implementation (CUDA:
  // allocated here, so attention calls allocate nothing). Throws Unsupported, naming the flag, for
  // an attention this backend cannot run: at set-up, not in the first step.
  virtual void reserve_attention(const AttentionShape& a, AttentionBackend backend, DType dtype) {
    (void)a, (void)backend, (void)dtype;
  }
  // The same for attention_block_* ops of blocks of up to a.seq queries against up to
  // max_kv_len keys (context parallelism). Throws Unsupported where the backend has none.
  virtual void reserve_attention_blocks(const AttentionShape& a, int max_kv_len, DType dtype);
  // Uploads an optimizer segment list once (CUDA: a device table), so that the optimizer calls
  // above with an equal list upload nothing per step. Short lists (<= 24 segments) also work
  // unregistered; longer ones must be registered on the CUDA backend.
  virtual void register_optim_segments(std::span<const OptimSegment> segments) { (void)segments; }

  // ---- communication overlap ------------------------------------------------------------
  // CUDA: a second stream on which the data-parallel communicators run, so that gradient
  // reductions overlap the backward pass and parameter all-gathers the next forward pass. The
  // reference backend has none (null): its communication is synchronous and the calls below do
  // nothing, so the same code runs on both.
  virtual void* comm_stream() { return nullptr; }
  // The communication stream waits for everything enqueued on the compute stream so far.
  virtual void comm_wait_for_compute() {}
  // The compute stream waits for everything enqueued on the communication stream so far.
  virtual void compute_wait_for_comm() {}
  // Numbered positions on the communication stream, allocated at set-up (reserve_comm_marks):
  // record_comm_mark(i) marks the position now, compute_wait_for_mark(i) makes the compute
  // stream wait until the communication stream has passed it.
  // A second communication stream for tensor-parallel collectives that overlap the backward's
  // GEMMs (sequence parallelism: the norm output's all-gather beside the input-gradient GEMM, the
  // input gradient's reduce-scatter beside the weight-gradient GEMM), apart from the data-parallel
  // stream so that TP transfers never queue behind gradient buckets. Null / no-ops on the reference
  // backend.
  virtual void* tp_comm_stream() { return nullptr; }
  virtual void tp_comm_wait_for_compute() {}
  virtual void compute_wait_for_tp_comm() {}
  virtual void reserve_comm_marks(int n) { (void)n; }
  // n marks of their own for a user (numbers [first, first + n)), reserved: returns first.
  int allocate_comm_marks(int n) {
    const int first = comm_marks_allocated_;
    comm_marks_allocated_ += n;
    reserve_comm_marks(comm_marks_allocated_);
    return first;
  }
  virtual void record_comm_mark(int i) { (void)i; }
  virtual void compute_wait_for_mark(int i) { (void)i; }

  // ---- the optimizer's update beside the next forward ----------------------------------------
  // CUDA: begin_side_ops() sends the ops that follow, until end_side_ops(), to a side stream, after
  // everything enqueued on the compute stream so far. Ops there take no scratch (the optimizer's
  // updates). record_side_mark(i) marks the side stream's position now (marks reserved at set-up:
  // reserve_side_marks); compute_wait_for_side_mark(i) makes the compute stream wait until the side
  // stream has passed mark i, compute_wait_for_side() until it has done everything enqueued so far;
  // synchronize() waits for both streams. The reference backend runs each op when it is called:
  // these do nothing, so the same code runs on both.
  virtual void reserve_side_marks(int n) { (void)n; }
  virtual void begin_side_ops() {}
  virtual void end_side_ops() {}
  virtual void record_side_mark(int i) { (void)i; }
  virtual void compute_wait_for_side_mark(int i) { (void)i; }
  virtual void compute_wait_for_side() {}

  // ---- activation offloading (engine/activation_offload.h) ------------------------------------
  // Host memory for offloaded activations (CUDA: pinned, so that its copies run beside compute).
  virtual void* allocate_host(size_t bytes) { return allocate(bytes); }
  virtual void deallocate_host(void* p) { deallocate(p); }
  // offload_copy copies `bytes` from src to dst (one of them allocate_host memory, the other this
  // backend's) on an offload stream, after everything enqueued on the compute stream so far, and
  // marks its end as mark i (marks reserved at set-up: reserve_offload_marks);
  // compute_wait_for_offload_mark(i) makes the compute stream wait for it. One offload stream: its
  // copies run in the order issued. The reference backend copies at once; its waits do nothing.
  virtual void reserve_offload_marks(int n) { (void)n; }
  virtual void offload_copy(void* dst, const void* src, size_t bytes, int mark) {
    (void)mark;
    const int64_t n = static_cast<int64_t>(bytes);
    copy(Tensor(dst, DType::u8, device(), {n}), Tensor(const_cast<void*>(src), DType::u8, device(), {n}));
  }
  virtual void compute_wait_for_offload_mark(int mark) { (void)mark; }

  // ---- timing spans (--log-straggler) ---------------------------------------------------------
  // Numbered timestamps on the compute stream, allocated at set-up (reserve_time_marks):
  // record_time_mark(i) marks the position now; time_between_marks_ms(a, b) is the device time
  // from mark a to mark b once both have completed (after a synchronize or a read back). Here: the
  // host clock, exact for a synchronous backend (the reference one); CUDA: events.
  virtual void reserve_time_marks(int n) {
    if (static_cast<int>(time_marks_.size()) < n) time_marks_.resize(static_cast<size_t>(n));
  }
  virtual void record_time_mark(int i) { time_marks_.at(static_cast<size_t>(i)) = std::chrono::steady_clock::now(); }
  virtual double time_between_marks_ms(int a, int b) {
    return std::chrono::duration<double, std::milli>(time_marks_.at(static_cast<size_t>(b)) -
                                                     time_marks_.at(static_cast<size_t>(a)))
        .count();
  }

 private:
  std::vector<std::chrono::steady_clock::time_point> time_marks_;
  int comm_marks_allocated_ = 0;
};

std::unique_ptr<Backend> make_reference_backend(int num_threads = 0);
#if MEGATRAIN_WITH_CUDA
// gemm_autotune: time cuBLASLt's candidates on each GEMM shape's first call (cuda/gemm_cublaslt.h).
std::unique_ptr<Backend> make_cuda_backend(int device_ordinal, bool gemm_autotune = false);
#endif

}  // namespace mt

// Host launchers of the CUDA backend's kernels, one section per op family (one .cu file each;
// the GEMMs are in gemm_cublaslt.h).
// CudaBackend (cuda_backend.cu) checks shapes and calls these; they pick the kernel instance for
// the dtypes and alignment, launch it on ctx.stream and check the launch. None of them allocates:
// temporary buffers come from ctx.scratch, a region the backend allocated at construction.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/shard.h"
#include "core/tensor.h"
#include "engine/backend.h"

namespace mt::cuda {

// A bump allocator over one device buffer allocated up front. Every op starts from the beginning
// (reset) and takes what it needs; ops are ordered on one stream, so their uses never overlap.
class Scratch {
 public:
  Scratch() = default;
  Scratch(void* base, size_t bytes) : base_(static_cast<char*>(base)), bytes_(bytes) {}
  void reset() { used_ = 0; }
  size_t remaining() const { return bytes_ - used_; }
  size_t capacity() const { return bytes_; }
  // 256-byte aligned; fails with a message naming the op if the scratch is too small.
  void* take(size_t bytes, const char* what);
  template <typename T>
  T* take_array(size_t count, const char* what) { return static_cast<T*>(take(count * sizeof(T), what)); }

 private:
  char* base_ = nullptr;
  size_t bytes_ = 0;
  size_t used_ = 0;
};

// Where an op adds (or writes) a parameter gradient: float32, or bfloat16 under
// --grad-reduce-in-bf16 (engine/backend.h; each element the float32 sum of its old value and the
// op's float32 contribution, rounded once). A float* converts (float32).
struct GradOut {
  void* data = nullptr;
  DType dtype = DType::f32;
  GradOut() = default;
  GradOut(float* p) : data(p) {}  // implicit: the float32 call sites
  explicit GradOut(const Tensor& t) : data(t.data), dtype(t.dtype) {}
  explicit operator bool() const { return data != nullptr; }
  bool is_bf16() const { return dtype == DType::bf16; }
};

// Checks a parameter-gradient tensor (empty: absent, accepted): float32 or bfloat16, numel elements.
inline void check_grad(const Tensor& g, int64_t numel, const char* op, const char* name) {
  if (g.empty()) return;
  if (g.dtype != DType::f32 && g.dtype != DType::bf16)
    fail("{}: gradient {} is {}; the CUDA backend takes parameter gradients in float32 or bfloat16 "
         "(--grad-reduce-in-bf16)", op, name, dtype_name(g.dtype));
  if (g.numel() != numel) fail("{}: gradient {} is {}, expected {} elements", op, name, g.shape_string(), numel);
}

struct KernelContext {
  cudaStream_t stream = nullptr;
  int num_sms = 1;
  Scratch* scratch = nullptr;
  // The backend's side stream (Backend::begin_side_ops), of the lowest priority: the optimizer
  // kernels launch a block per chunk instead of a grid that loops, so that each block is short
  // and the compute stream's blocks take the SMs first whenever they wait.
  bool short_blocks = false;
};

// ---- elementwise_kernels.cu -------------------------------------------------------------------
void fill(const KernelContext& ctx, Tensor t, double value);
// Zeroes the element ranges of flat (value +0 in every dtype): ranges of 1 MiB or more by the
// driver's memset, the small ones together in one launch per kZeroRangesPerLaunch of them.
void zero_ranges(const KernelContext& ctx, Tensor flat, const std::vector<FlatRange>& ranges);
void cast(const KernelContext& ctx, Tensor dst, Tensor src);
void axpby(const KernelContext& ctx, Tensor out, float alpha, Tensor a, float beta, Tensor b);
void scale_by_rnorm(const KernelContext& ctx, Tensor x, Tensor sumsq, float eps);
// The ungated activations (GeLU erf / tanh, squared ReLU; act != none).
void activation_forward(const KernelContext& ctx, Tensor out, Tensor in, Activation act);
void activation_backward(const KernelContext& ctx, Tensor din, Tensor dout, Tensor in, Activation act);
// out = g * act'(pre) (accumulate: out += ...). out may alias g. Used after a plain GEMM.
void activation_grad_multiply(const KernelContext& ctx, Tensor out, Tensor g, Tensor pre, Activation act,
                              bool accumulate);
void swiglu_forward(const KernelContext& ctx, Tensor out, Tensor in, const Glu& q = {});
void swiglu_backward(const KernelContext& ctx, Tensor din, Tensor dout, Tensor in, const Glu& q = {});
// swiglu_backward plus act_out = swiglu(in) (as swiglu_forward computes it); din may alias in,
// act_out may alias dout.
void swiglu_backward_recompute(const KernelContext& ctx, Tensor din, Tensor act_out, Tensor dout, Tensor in,
                               const Glu& q = {});
// The attention output gate (Backend::attention_gate_split and the three after it).
void attention_gate_split(const KernelContext& ctx, Tensor qkv, Tensor gate, Tensor qkvg, const GateShape& s);
void attention_gate_merge(const KernelContext& ctx, Tensor qkvg, Tensor qkv, Tensor gate, const GateShape& s);
void output_gate_forward(const KernelContext& ctx, Tensor out, Tensor x, Tensor gate);
void output_gate_backward(const KernelContext& ctx, Tensor dx, Tensor dgate, Tensor dout, Tensor x, Tensor gate);
// g = g * act'(pre) in place and act_out = act(pre) (act_out may alias pre): the activation's
// backward after a plain GEMM, recomputing the activation on the way.
void activation_grad_recompute(const KernelContext& ctx, Tensor g, Tensor act_out, Tensor pre, Activation act);
void bias_dropout_add(const KernelContext& ctx, Tensor out, Tensor x, Tensor bias, Tensor residual, float p,
                      uint64_t key);
void dropout_backward(const KernelContext& ctx, Tensor dx, Tensor dout, float p, uint64_t key,
                      float* dx_amax = nullptr);
// An optional amax slot of a tensorwise FP8 cast's producer (Fp8TensorMeta::fresh): empty, or
// float32 [1] (else a clear error naming op and what); amax_slot_ptr gives its pointer (or null).
void check_amax_slot(const Tensor& amax, const char* op, const char* what);
float* amax_slot_ptr(const Tensor& amax, const char* op, const char* what);
// dst[i] += src[i] (float32, n elements).
void add_f32(const KernelContext& ctx, float* dst, const float* src, int64_t n);
// dst[i] += src[i] for a parameter gradient dst (n elements): float32 as add_f32; bfloat16 the float32
// sum of the stored value and src[i], rounded once (a weight gradient's float32 GEMM result added to
// a bf16 main grad).
void add_to_grad(const KernelContext& ctx, GradOut dst, const float* src, int64_t n);

// ---- init_kernels.cu ---------------------------------------------------------------------------
void init_normal(const KernelContext& ctx, Tensor t, uint64_t key, float std, const ShardIndex& index);
// lo + (hi - lo) * uniform_at(key, global index) in float32 (its log with log_of), as the host computes it.
void init_uniform(const KernelContext& ctx, Tensor t, uint64_t key, float lo, float hi, bool log_of,
                  const ShardIndex& index);

// ---- norm_kernels.cu ---------------------------------------------------------------------------
// b empty: out = norm(a) (sum unused). b given: sum = a + dropout(b), out = norm(sum).
// b_bias (optional, with b): sum = a + dropout(b + b_bias), the bias_dropout_add order of operations.
// out_amax (optional float32 [1], plain rows): max |out| as stored (written or not), maxed into it.
void norm_forward(const KernelContext& ctx, Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor a, Tensor b,
                  float dropout_p, uint64_t dropout_key, Tensor weight, Tensor bias, const NormParams& p,
                  Tensor b_bias = Tensor(), Tensor out_amax = Tensor());
// out (optional): also writes the forward's output, recomputed from x and the saved statistics with
// the forward's rounding (bit-identical); bias is its bias. dx_colsum (optional, engine/backend.h):
// += the column sums of dx as stored. dx_amax (optional float32 [1]): max |dx| as stored, maxed into it.
void norm_backward(const KernelContext& ctx, Tensor dx, Tensor dweight, Tensor dbias, Tensor dout, Tensor x,
                   Tensor mean, Tensor rstd, Tensor weight, Tensor dresidual, const NormParams& p,
                   Tensor out = Tensor(), Tensor bias = Tensor(), Tensor dx_colsum = Tensor(),
                   Tensor dx_amax = Tensor());
// --qk-layernorm: every q and k head of packed QKV normalized over head_dim (engine/backend.h).
void qk_norm_forward(const KernelContext& ctx, Tensor out, Tensor mean, Tensor rstd, Tensor qkv, Tensor q_weight,
                     Tensor q_bias, Tensor k_weight, Tensor k_bias, const RopeShape& r, const NormParams& p);
void qk_norm_backward(const KernelContext& ctx, Tensor dqkv, Tensor dq_weight, Tensor dq_bias, Tensor dk_weight,
                      Tensor dk_bias, Tensor dout, Tensor qkv, Tensor mean, Tensor rstd, Tensor q_weight,
                      Tensor k_weight, const RopeShape& r, const NormParams& p);

// ---- embedding_kernels.cu ----------------------------------------------------------------------
void embedding_forward(const KernelContext& ctx, Tensor out, Tensor tokens, Tensor positions, Tensor wte,
                       Tensor wpe, int64_t vocab_start);
void embedding_backward(const KernelContext& ctx, Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens,
                        Tensor positions, int64_t vocab_start);

// ---- rope_kernels.cu ---------------------------------------------------------------------------
// backward = rotate by -angle (the transpose of the forward rotation).
void rope(const KernelContext& ctx, Tensor qkv, Tensor positions, Tensor cos_sin, const RopeShape& r, bool backward);
// Backend::mla_qkv_forward (backward = false: qkv from q, kv, down) and mla_qkv_backward (backward =
// true: qkv is dqkv, and q, kv, down receive the gradients).
void mla_qkv(const KernelContext& ctx, Tensor qkv, Tensor q, Tensor kv, Tensor down, Tensor positions, Tensor cos_sin,
             const MlaShape& m, bool backward);

// ---- cross_entropy_kernels.cu ------------------------------------------------------------------
void cross_entropy_forward(const KernelContext& ctx, Tensor lse, Tensor target, Tensor logits, Tensor labels,
                           int64_t vocab_start);
void cross_entropy_backward(const KernelContext& ctx, Tensor dlogits, Tensor logits, Tensor labels, Tensor lse,
                            Tensor dloss, int64_t vocab_start);
// Forward then backward per row in one kernel (whole vocabulary; dlogits over the logits): the
// same lse, target and dlogits as the two kernels, the row re-read from L2 instead of DRAM.
void cross_entropy_forward_backward(const KernelContext& ctx, Tensor lse, Tensor target, Tensor logits, Tensor labels,
                                    Tensor dloss);
void logsumexp_combine(const KernelContext& ctx, Tensor lse_out, Tensor lse_parts);
void masked_loss_sum(const KernelContext& ctx, Tensor out, Tensor loss, Tensor mask, bool accumulate);
void logits_argmax(const KernelContext& ctx, Tensor max, Tensor index, Tensor logits, int64_t vocab_start);
void argmax_match_count(const KernelContext& ctx, Tensor out, Tensor max_parts, Tensor index_parts, Tensor labels,
                        Tensor mask, bool accumulate);

// ---- optimizer_kernels.cu ----------------------------------------------------------------------
// The optimizer kernels walk a segment table in chunks of kOptimChunk elements.
constexpr int64_t kOptimChunk = 8192;
struct DeviceSegment {
  int64_t offset = 0;
  int64_t count = 0;
  int64_t first_chunk = 0;  // chunks of the segments before this one
  int32_t group = 0;
  int32_t pad = 0;
  const float* fp8_scale = nullptr;  // an FP8 model copy's scale and amax (OptimSegment), or null
  float* fp8_amax = nullptr;
};
// A segment list as the kernels see it: a table uploaded at set-up (register_optim_segments), or,
// for short unregistered lists, the segments themselves passed by value with the launch.
constexpr int kInlineSegments = 24;
struct SegmentArg {
  const DeviceSegment* table = nullptr;  // device memory, or null: use inline_segments
  int count = 0;
  int64_t total_chunks = 0;
  DeviceSegment inline_segments[kInlineSegments];
};
// Host-side: the table for `segments` (prefix chunk counts), as stored by the registry.
void build_segment_table(std::span<const OptimSegment> segments, DeviceSegment* out, int64_t* total_chunks);

// Float32 master weights into bf16 weights and int16 remainders (core/master_remainder.h; remainder
// may be empty), rounded to nearest even with tie bits where `ties` is not empty.
void split_master(const KernelContext& ctx, Tensor model, Tensor remainder, Tensor master, TieBits ties);
void master_sum_squares(const KernelContext& ctx, Tensor out, Tensor model, Tensor remainder, TieBits ties,
                        const SegmentArg& segs, bool accumulate);
// split_master's inverse: float32 master weights from bf16 weights, int16 remainders and tie bits.
void join_master(const KernelContext& ctx, Tensor master, Tensor model, Tensor remainder, TieBits ties);
void adamw_step(const KernelContext& ctx, Tensor master, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq,
                Tensor model_param, const SegmentArg& segs, const OptimStepParams& p, TieBits ties = {});
void sgd_step(const KernelContext& ctx, Tensor master, Tensor grad, Tensor momentum, Tensor model_param,
              const SegmentArg& segs, const OptimStepParams& p);
void sum_squares(const KernelContext& ctx, Tensor out, Tensor x, const SegmentArg& segs, bool accumulate);
void count_zeros(const KernelContext& ctx, Tensor out, Tensor x, const SegmentArg& segs, bool accumulate);
// out int64 [1] = byte_hash(x) (core/byte_hash.h): one launch; the blocks' sums are added with
// 64-bit atomics, exact modulo 2^64 and so the same bits in any order.
void hash_bytes(const KernelContext& ctx, Tensor out, Tensor x);

// ---- moe_kernels.cu ----------------------------------------------------------------------------
// Mixture of experts (Backend::moe_route and the ops after it; engine/backend.h has the math).
// Routing, its backward and the statistics: logits float32, bfloat16 or float16, E <= 512
// experts, top-k <= 16; probs, dprobs, aux_grad, stats and sums float32; indices int32.
void moe_route(const KernelContext& ctx, Tensor probs, Tensor idx, Tensor logits, Tensor expert_bias,
               const MoeRouting& r);
void moe_route_backward(const KernelContext& ctx, Tensor dlogits, Tensor dprobs, Tensor logits, Tensor idx,
                        Tensor aux_grad, const MoeRouting& r);
// Deterministic: block partials in scratch, added in block order.
void moe_aux_stats(const KernelContext& ctx, Tensor stats, Tensor logits, const MoeRouting& r);
void moe_aux_grad(const KernelContext& ctx, Tensor aux_grad, Tensor logits, Tensor stats, float aux_scale,
                  float z_scale, const MoeRouting& r);
void moe_aux_log(const KernelContext& ctx, Tensor sums, Tensor stats, float aux_scale, float z_scale);
// A stable counting sort of the pairs by expert (per-chunk counts in scratch, no atomics). An
// expert index outside [0, E) is left out: its slot_of is -1 and offsets[E] counts only the rest.
void moe_permute_plan(const KernelContext& ctx, Tensor order, Tensor slot_of, Tensor offsets, Tensor idx,
                      int first_expert, int num_experts);
// counts (float64 [E]) += the experts' rows from offsets (int32 [E + 1]).
void moe_count_rows(const KernelContext& ctx, Tensor counts, Tensor offsets);
// out = in * (1 - eps + 2 eps uniform_at(key, index0 + i)) (Backend::moe_jitter).
void moe_jitter(const KernelContext& ctx, Tensor out, Tensor in, float eps, uint64_t key, int64_t index0);
// Any dtype (rows move as bytes); an index outside x's rows zeroes its output row.
void moe_gather_rows(const KernelContext& ctx, Tensor out, Tensor x, Tensor index, int k);
// float32, bfloat16, float16 rows; a slot outside y's rows adds nothing.
void moe_combine(const KernelContext& ctx, Tensor out, Tensor y, Tensor slot_of, int k, bool accumulate);
void moe_scale_rows(const KernelContext& ctx, Tensor out, Tensor x, Tensor p);
void moe_scale_rows_backward(const KernelContext& ctx, Tensor dx, Tensor dp, Tensor dout, Tensor x, Tensor p);
// Backend::grouped_bias_forward / _backward: with the offsets on the device one launch, on the host
// one launch per expert.
void grouped_bias_forward(const KernelContext& ctx, Tensor y, Tensor bias, Tensor p, const ExpertOffsets& offsets);
void grouped_bias_backward(const KernelContext& ctx, Tensor dbias, Tensor dp, Tensor dy, Tensor bias, Tensor p,
                           const ExpertOffsets& offsets, bool accumulate);
// Backend::moe_swiglu_forward / _backward fused (the composed ops' bits; dout is only read).
void moe_swiglu_forward(const KernelContext& ctx, Tensor out, Tensor in, Tensor p, const Glu& q = {});
void moe_swiglu_backward(const KernelContext& ctx, Tensor din, Tensor act, Tensor dp, Tensor dout, Tensor in, Tensor p,
                         const Glu& q = {});

}  // namespace mt::cuda

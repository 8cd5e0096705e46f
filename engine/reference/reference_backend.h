// ReferenceBackend: engine/backend.h in plain C++ on host memory. Data tensors are float32 or
// float64 (one type per op: the type of its main input); the "float32" statistics, accumulators and
// losses may be float32 or float64 independently (float64 throughout in gradient checks).
// Sums run in double. This is the oracle the CUDA kernels are tested against, so it favours
// obviously-correct loops over speed; rows are spread over a small thread pool.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/reference/thread_pool.h"

namespace mt::reference {

class ReferenceBackend final : public Backend {
 public:
  explicit ReferenceBackend(int num_threads);

  std::string name() const override { return "reference"; }
  Device device() const override { return Device::cpu; }

  void* allocate(size_t bytes) override;
  void deallocate(void* p) override;
  void copy_from_host(Tensor dst, const void* host_src) override;
  void copy_to_host(void* host_dst, Tensor src) override;
  void copy(Tensor dst, Tensor src) override;
  void synchronize() override {}

  void fill(Tensor t, double value) override;
  void cast(Tensor dst, Tensor src) override;
  void axpby(Tensor out, float alpha, Tensor a, float beta, Tensor b) override;
  void scale_by_rnorm(Tensor x, Tensor sumsq, float eps) override;
  void init_normal(Tensor t, uint64_t key, float std, const ShardIndex& index) override;
  void init_uniform(Tensor t, uint64_t key, float lo, float hi, bool log_of, const ShardIndex& index) override;

  void embedding_forward(Tensor out, Tensor tokens, Tensor positions, Tensor wte, Tensor wpe,
                         int64_t vocab_start) override;
  void embedding_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens, Tensor positions,
                          int64_t vocab_start) override;

  void norm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor x, Tensor weight, Tensor bias,
                    const NormParams& p, Tensor out_amax = Tensor()) override;
  void add_norm_forward(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor a, Tensor b, float dropout_p,
                        uint64_t dropout_key, Tensor weight, Tensor bias, const NormParams& p) override;
  void norm_backward(Tensor dx, Tensor dweight, Tensor dbias, Tensor dout, Tensor x, Tensor mean, Tensor rstd,
                     Tensor weight, Tensor dresidual, Tensor dx_colsum, const NormParams& p,
                     Tensor dx_amax = Tensor()) override;
  void qk_norm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor qkv, Tensor q_weight, Tensor q_bias,
                       Tensor k_weight, Tensor k_bias, const RopeShape& r, const NormParams& p) override;
  void qk_norm_backward(Tensor dqkv, Tensor dq_weight, Tensor dq_bias, Tensor dk_weight, Tensor dk_bias,
                        Tensor dout, Tensor qkv, Tensor mean, Tensor rstd, Tensor q_weight, Tensor k_weight,
                        const RopeShape& r, const NormParams& p) override;

  void linear_forward(Tensor y, Tensor x, Tensor w, Tensor bias, Activation act, Tensor pre_act) override;
  void linear_backward_input(Tensor dx, Tensor dy, Tensor w, bool accumulate, Activation act,
                             Tensor pre_act) override;
  void linear_backward_weight(Tensor dw, Tensor dbias, Tensor dy, Tensor x, bool accumulate) override;

  void fp8_quantize(Tensor q, Tensor q_t, Tensor x, const Fp8TensorMeta& meta) override;
  void fp8_quantize_activation_backward(Tensor q, Tensor q_t, Tensor dout, Tensor pre, MlpActivation act,
                                  const Fp8TensorMeta& meta, Tensor dbias, const Glu& glu = {}) override;
  void fp8_quantize_with_dbias(Tensor q, Tensor q_t, Tensor dy, const Fp8TensorMeta& meta, Tensor dbias) override;
  void fp8_quantize_activation(Tensor q, Tensor q_t, Tensor pre, MlpActivation act,
                               const Fp8TensorMeta& meta, const Glu& glu = {}) override;
  void fp8_quantize_norm(Tensor q, Tensor q_t, Tensor x, Tensor mean, Tensor rstd, Tensor weight, Tensor bias,
                         const NormParams& p, const Fp8TensorMeta& meta) override;
  void fp8_linear_forward(Tensor y, Tensor xq, Tensor x_scale_inv, Tensor wq, Tensor w_scale_inv, Tensor bias,
                          Activation act, Tensor pre_act) override;
  void fp8_linear_backward_input(Tensor dx, Tensor dyq, Tensor dy_scale_inv, Tensor wq_t, Tensor w_scale_inv,
                                 bool accumulate, Activation act, Tensor pre_act) override;
  void fp8_linear_backward_weight(Tensor dw, Tensor dbias, Tensor dy, Tensor dyq_t, Tensor dy_scale_inv, Tensor xq_t,
                                  Tensor x_scale_inv, bool accumulate) override;
  void fp8_update_scales(Tensor history, Tensor scale, Tensor scale_inv, Tensor fp8_max,
                         const Fp8ScaleUpdate& p) override;
  void fp8_transpose(Tensor q_t, Tensor q) override;
  void fp8_dequantize(Tensor out, Tensor q, Tensor scale_inv) override;
  void activation_forward(Tensor out, Tensor in, Activation act) override;
  void activation_backward(Tensor din, Tensor dout, Tensor in, Activation act) override;
  void swiglu_forward(Tensor out, Tensor in, const Glu& g = {}) override;
  void swiglu_backward(Tensor din, Tensor dout, Tensor in, const Glu& g = {}) override;
  void swiglu_backward_recompute(Tensor din, Tensor act_out, Tensor dout, Tensor in, const Glu& g = {}) override;
  void moe_route(Tensor probs, Tensor idx, Tensor logits, Tensor expert_bias, const MoeRouting& r) override;
  void moe_sinkhorn_route(Tensor probs, Tensor idx, Tensor logits, int topk, int64_t block_rows,
                          bool training) override;
  void moe_route_backward(Tensor dlogits, Tensor dprobs, Tensor logits, Tensor idx, Tensor aux_grad,
                          const MoeRouting& r) override;
  void moe_aux_stats(Tensor stats, Tensor logits, const MoeRouting& r) override;
  void moe_aux_grad(Tensor aux_grad, Tensor logits, Tensor stats, float aux_scale, float z_scale,
                    const MoeRouting& r) override;
  void moe_aux_log(Tensor sums, Tensor stats, float aux_scale, float z_scale) override;
  void moe_permute_plan(Tensor order, Tensor slot_of, Tensor offsets, Tensor idx, int first_expert,
                        int num_experts) override;
  void moe_count_rows(Tensor counts, Tensor offsets) override;
  void moe_jitter(Tensor out, Tensor in, float eps, uint64_t key, int64_t index0) override;
  void moe_gather_rows(Tensor out, Tensor x, Tensor index, int k) override;
  void moe_combine(Tensor out, Tensor y, Tensor slot_of, int k, bool accumulate) override;
  void moe_scale_rows(Tensor out, Tensor x, Tensor p) override;
  void moe_scale_rows_backward(Tensor dx, Tensor dp, Tensor dout, Tensor x, Tensor p) override;
  void grouped_bias_forward(Tensor y, Tensor bias, Tensor p, const ExpertOffsets& offsets) override;
  void grouped_bias_backward(Tensor dbias, Tensor dp, Tensor dy, Tensor bias, Tensor p, const ExpertOffsets& offsets,
                             bool accumulate) override;
  void attention_gate_split(Tensor qkv, Tensor gate, Tensor qkvg, const GateShape& s) override;
  void attention_gate_merge(Tensor qkvg, Tensor qkv, Tensor gate, const GateShape& s) override;
  void output_gate_forward(Tensor out, Tensor x, Tensor gate) override;
  void output_gate_backward(Tensor dx, Tensor dgate, Tensor dout, Tensor x, Tensor gate) override;
  void gdn_conv_forward(Tensor xc, Tensor proj, Tensor w, const GdnShape& s) override;
  void gdn_conv_backward(Tensor dproj, Tensor dw, Tensor dxc, Tensor proj, Tensor w, const GdnShape& s,
                         bool accumulate) override;
  void gdn_forward(Tensor out, Tensor states, Tensor xc, Tensor proj, Tensor a_log, Tensor dt_bias,
                   const GdnShape& s) override;
  void gdn_backward(Tensor dxc, Tensor dproj, Tensor da_log, Tensor ddt_bias, Tensor dout, Tensor xc, Tensor proj,
                    Tensor a_log, Tensor dt_bias, Tensor states, const GdnShape& s, bool accumulate) override;
  void gdn_gate_forward(Tensor y, Tensor n, Tensor proj, const GdnShape& s) override;
  void gdn_gate_backward(Tensor dn, Tensor dproj, Tensor dy, Tensor n, Tensor proj, const GdnShape& s) override;
  void bias_dropout_add(Tensor out, Tensor x, Tensor bias, Tensor residual, float dropout_p,
                        uint64_t dropout_key) override;
  void dropout_backward(Tensor dx, Tensor dout, float dropout_p, uint64_t dropout_key,
                        Tensor dx_amax = Tensor()) override;

  void rope_forward(Tensor qkv, Tensor positions, Tensor cos_sin, const RopeShape& r) override;
  void rope_backward(Tensor dqkv, Tensor positions, Tensor cos_sin, const RopeShape& r) override;
  void mla_qkv_forward(Tensor qkv, Tensor q, Tensor kv, Tensor down, Tensor positions, Tensor cos_sin,
                       const MlaShape& m) override;
  void mla_qkv_backward(Tensor dq, Tensor dkv, Tensor ddown, Tensor dqkv, Tensor positions, Tensor cos_sin,
                        const MlaShape& m) override;

  void attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a) override;
  void attention_backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv,
                          const AttentionShape& a) override;
  void attention_block_forward(Tensor out, Tensor lse, Tensor q, Tensor kv, const AttentionShape& a,
                               const AttentionBlock& blk) override;
  void attention_block_backward(Tensor dq, Tensor dkv, Tensor dout, Tensor out, Tensor lse, Tensor q, Tensor kv,
                                const AttentionShape& a, const AttentionBlock& blk) override;
  void attention_merge(Tensor out, Tensor lse, Tensor out_blk, Tensor lse_blk) override;
  void attention_sink_forward(Tensor out, Tensor lse, Tensor sink) override;
  void attention_sink_backward(Tensor dsink, Tensor dout, Tensor out, Tensor lse, Tensor sink) override;
  void attention_kv_pack(Tensor kv, Tensor qkv, const AttentionShape& a) override;
  void attention_kv_unpack_add(Tensor dqkv, Tensor dkv, const AttentionShape& a) override;
  void reserve_attention_blocks(const AttentionShape& a, int max_kv_len, DType dtype) override;

  void cross_entropy_forward(Tensor lse, Tensor target, Tensor logits, Tensor labels, int64_t vocab_start) override;
  void cross_entropy_backward(Tensor dlogits, Tensor logits, Tensor labels, Tensor lse, Tensor dloss,
                              int64_t vocab_start) override;
  void logsumexp_combine(Tensor lse_out, Tensor lse_parts) override;
  void masked_loss_sum(Tensor out, Tensor loss, Tensor mask, bool accumulate) override;
  void logsumexp_rows(Tensor lse, Tensor logits, float scale) override;
  void kd_logits_kl(Tensor kl, Tensor ds, Tensor s, Tensor t, Tensor lse_s, Tensor lse_t, float scale,
                    Tensor dloss) override;
  void hidden_loss_forward(Tensor loss, Tensor a, Tensor b, HiddenLoss kind) override;
  void hidden_loss_backward(Tensor da, Tensor a, Tensor b, Tensor dloss, float scale, HiddenLoss kind,
                            bool accumulate) override;
  void logits_argmax(Tensor max, Tensor index, Tensor logits, int64_t vocab_start) override;
  void argmax_match_count(Tensor out, Tensor max_parts, Tensor index_parts, Tensor labels, Tensor mask,
                          bool accumulate) override;

  void adamw_step(Tensor master, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, Tensor model_param,
                  std::span<const OptimSegment> segments, const OptimStepParams& p, TieBits ties = {}) override;
  void split_master(Tensor model, Tensor remainder, Tensor master, TieBits ties = {}) override;
  void master_sum_squares(Tensor out, Tensor model, Tensor remainder, TieBits ties,
                          std::span<const OptimSegment> segments, bool accumulate) override;
  void join_master(Tensor master, Tensor model, Tensor remainder, TieBits ties) override;
  void sgd_step(Tensor master, Tensor grad, Tensor momentum, Tensor model_param,
                std::span<const OptimSegment> segments, const OptimStepParams& p) override;
  void sum_squares(Tensor out, Tensor x, std::span<const OptimSegment> segments, bool accumulate) override;
  void count_zeros(Tensor out, Tensor x, std::span<const OptimSegment> segments, bool accumulate) override;
  void hash_bytes(Tensor out, Tensor x) override;

  ThreadPool& pool() { return pool_; }
  // Tensorwise FP8 casts so far that used the amax their source's producer took
  // (Fp8TensorMeta::fresh_taken; each checked against the cast's own max |x|). For tests.
  int64_t fp8_amaxes_taken() const { return fp8_amaxes_taken_; }
  // Per-thread double scratch of at least n elements (grown on first use, then reused).
  double* scratch(int thread, size_t n);

 private:
  void swiglu_backward_rows(Tensor din, Tensor act_out, Tensor dout, Tensor in, const Glu& g, const char* op);

  ThreadPool pool_;
  std::vector<std::vector<double>> scratch_;
  int64_t fp8_amaxes_taken_ = 0;
};

}  // namespace mt::reference

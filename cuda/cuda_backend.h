// CudaBackend: engine/backend.h on one GPU. Owns one compute stream, a cuBLASLt handle with its
// 32 MiB workspace, a scratch region for the ops' temporaries (per-block partial sums, sort
// buffers), the attention workspace and the uploaded optimizer segment tables, all allocated at
// set-up: the ops themselves never allocate. Kernels live in one file per op family (kernels.h,
// gemm_cublaslt.h); this class checks devices and dispatches.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <unordered_map>
#include <vector>

#include "cuda/fp8_gemm_cublaslt.h"
#include "cuda/fp8_kernels.h"  // CastSource
#include "cuda/gemm_cublaslt.h"
#include "cuda/grouped_gemm.h"
#include "cuda/kernels.h"
#include "cuda/op_profiler.h"
#include "engine/backend.h"

namespace mt {

class CudaBackend final : public Backend {
 public:
  static constexpr size_t kGemmWorkspaceBytes = size_t{32} << 20;
  static constexpr size_t kDefaultScratchBytes = size_t{64} << 20;

  explicit CudaBackend(int device_ordinal, size_t scratch_bytes = kDefaultScratchBytes);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string name() const override { return "cuda"; }
  Device device() const override { return Device::cuda; }

  size_t memory_in_use() const override;
  size_t bytes_allocated() const override { return bytes_allocated_; }
  void prepare_fp8_gemms() override { fp8_gemm(); }
  void prepare_grouped_gemms(int max_groups) override;
  void grouped_linear_forward(Tensor y, Tensor x, Tensor w, const ExpertOffsets& offsets) override;
  void grouped_linear_backward_input(Tensor dx, Tensor dy, Tensor w, const ExpertOffsets& offsets) override;
  void grouped_linear_backward_weight(Tensor dw, Tensor dy, Tensor x, const ExpertOffsets& offsets,
                                      bool accumulate, Tensor sumsq = Tensor()) override;
  void* allocate(size_t bytes) override;
  void deallocate(void* p) override;
  void copy_from_host(Tensor dst, const void* host_src) override;
  void copy_to_host(void* host_dst, Tensor src) override;
  void copy(Tensor dst, Tensor src) override;
  void copy_columns(Tensor dst, int64_t dst_col, Tensor src, int64_t src_col, int64_t cols) override;
  void synchronize() override;
  void* stream() override { return stream_; }

  void fill(Tensor t, double value) override;
  void fill_ranges(Tensor flat, const std::vector<FlatRange>& ranges, double value) override;
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
  void bias_dropout_add_norm(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor residual, Tensor x,
                             Tensor x_bias, float dropout_p, uint64_t dropout_key, Tensor weight, Tensor bias,
                             const NormParams& p, Tensor out_amax = Tensor()) override;
  void add_norm_forward(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor a, Tensor b, float dropout_p,
                        uint64_t dropout_key, Tensor weight, Tensor bias, const NormParams& p) override;
  void norm_backward(Tensor dx, Tensor dweight, Tensor dbias, Tensor dout, Tensor x, Tensor mean, Tensor rstd,
                     Tensor weight, Tensor dresidual, Tensor dx_colsum, const NormParams& p,
                     Tensor dx_amax = Tensor()) override;
  void norm_backward_recompute(Tensor out, Tensor dx, Tensor dweight, Tensor dbias, Tensor dout, Tensor x, Tensor mean,
                               Tensor rstd, Tensor weight, Tensor bias, Tensor dresidual, Tensor dx_colsum, const NormParams& p) override;
  void qk_norm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor qkv, Tensor q_weight, Tensor q_bias,
                       Tensor k_weight, Tensor k_bias, const RopeShape& r, const NormParams& p) override;
  void qk_norm_backward(Tensor dqkv, Tensor dq_weight, Tensor dq_bias, Tensor dk_weight, Tensor dk_bias, Tensor dout,
                        Tensor qkv, Tensor mean, Tensor rstd, Tensor q_weight, Tensor k_weight, const RopeShape& r,
                        const NormParams& p) override;

  void linear_forward(Tensor y, Tensor x, Tensor w, Tensor bias, Activation act, Tensor pre_act) override;
  void linear_backward_input(Tensor dx, Tensor dy, Tensor w, bool accumulate, Activation act, Tensor pre_act) override;
  void linear_backward_weight(Tensor dw, Tensor dbias, Tensor dy, Tensor x, bool accumulate) override;
  void linear_backward_input_recompute(Tensor dx, Tensor act_out, Tensor dy, Tensor w, Activation act,
                                       Tensor pre_act) override;

  // FP8 linear layers (cuda/cuda_backend_fp8.cu; bf16 compute dtype).
  void fp8_quantize(Tensor q, Tensor q_t, Tensor x, const Fp8TensorMeta& meta) override;
  void fp8_quantize_groups(Tensor q, Tensor q_t, Tensor x, std::span<const int64_t> off,
                           std::span<const Fp8TensorMeta> metas) override;
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
  void moe_swiglu_forward(Tensor out, Tensor in, Tensor p, const Glu& g = {}) override;
  void moe_swiglu_backward(Tensor din, Tensor act, Tensor dp, Tensor dout, Tensor in, Tensor p,
                           const Glu& g = {}) override;
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

  // Attention blocks of context parallelism (cuda/attention_blocks.cu): a block's queries and
  // keys/values assembled into packed QKV rows and run by attention_forward / attention_backward.
  void attention_block_forward(Tensor out, Tensor lse, Tensor q, Tensor kv, const AttentionShape& a,
                               const AttentionBlock& blk) override;
  void attention_block_backward(Tensor dq, Tensor dkv, Tensor dout, Tensor out, Tensor lse, Tensor q, Tensor kv,
                                const AttentionShape& a, const AttentionBlock& blk) override;
  void attention_merge(Tensor out, Tensor lse, Tensor out_blk, Tensor lse_blk) override;
  void attention_sink_forward(Tensor out, Tensor lse, Tensor sink) override;
  void attention_sink_backward(Tensor dsink, Tensor dout, Tensor out, Tensor lse, Tensor sink) override;
  void attention_kv_pack(Tensor kv, Tensor qkv, const AttentionShape& a) override;
  void attention_kv_unpack_add(Tensor dqkv, Tensor dkv, const AttentionShape& a) override;

  void cross_entropy_forward(Tensor lse, Tensor target, Tensor logits, Tensor labels, int64_t vocab_start) override;
  void cross_entropy_forward_backward(Tensor lse, Tensor target, Tensor logits, Tensor labels, Tensor dloss) override;
  void cross_entropy_backward(Tensor dlogits, Tensor logits, Tensor labels, Tensor lse, Tensor dloss,
                              int64_t vocab_start) override;
  void logsumexp_combine(Tensor lse_out, Tensor lse_parts) override;
  // Knowledge distillation's losses (cuda/kd_kernels.cu: the kernels and these members).
  void logsumexp_rows(Tensor lse, Tensor logits, float scale) override;
  void kd_logits_kl(Tensor kl, Tensor ds, Tensor s, Tensor t, Tensor lse_s, Tensor lse_t, float scale,
                    Tensor dloss) override;
  void hidden_loss_forward(Tensor loss, Tensor a, Tensor b, HiddenLoss kind) override;
  void hidden_loss_backward(Tensor da, Tensor a, Tensor b, Tensor dloss, float scale, HiddenLoss kind,
                            bool accumulate) override;
  void masked_loss_sum(Tensor out, Tensor loss, Tensor mask, bool accumulate) override;
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

  void reserve_attention(const AttentionShape& a, AttentionBackend backend, DType dtype) override;
  void reserve_attention_blocks(const AttentionShape& a, int max_kv_len, DType dtype) override;
  void register_optim_segments(std::span<const OptimSegment> segments) override;

  void* comm_stream() override { return comm_stream_; }
  void* tp_comm_stream() override { return tp_comm_stream_; }
  void tp_comm_wait_for_compute() override;
  void compute_wait_for_tp_comm() override;
  void comm_wait_for_compute() override;
  void compute_wait_for_comm() override;
  void reserve_comm_marks(int n) override;
  void reserve_time_marks(int n) override;
  void record_time_mark(int i) override;
  double time_between_marks_ms(int a, int b) override;
  void record_comm_mark(int i) override;
  void compute_wait_for_mark(int i) override;
  void reserve_side_marks(int n) override;
  void begin_side_ops() override;
  void end_side_ops() override;
  void record_side_mark(int i) override;
  void compute_wait_for_side_mark(int i) override;
  void compute_wait_for_side() override;
  void* allocate_host(size_t bytes) override;
  void deallocate_host(void* p) override;
  void reserve_offload_marks(int n) override;
  void offload_copy(void* dst, const void* src, size_t bytes, int mark) override;
  void compute_wait_for_offload_mark(int mark) override;

  // CUDA-specific access (benchmarks, tests, communicators).
  cudaStream_t cuda_stream() const { return stream_; }
  int device_ordinal() const { return device_; }
  int num_sms() const { return num_sms_; }
  cuda::GemmRunner& gemm() { return *gemm_; }

 private:
  cuda::KernelContext context();  // resets the scratch for the next op
  // The FP8 GEMM runner (own cuBLASLt handle and workspace) and the two 16-byte aligned scale
  // slots, made by prepare_fp8_gemms (or the first FP8 op of a test); fp8_stage_scales copies an
  // op's two scale_inv values there.
  cuda::Fp8GemmRunner& fp8_gemm();
  void fp8_quantize_impl(const char* op, Tensor q, Tensor q_t, const cuda::CastSource& src, const Fp8TensorMeta& meta,
                         Tensor dbias);
  void fp8_stage_scales(const cuda::KernelContext& ctx, const Tensor& a_scale_inv, const Tensor& b_scale_inv,
                        const char* op);
  cuda::SegmentArg segment_arg(std::span<const OptimSegment> segments, int64_t numel, const char* what);

  struct RegisteredSegments {
    std::vector<OptimSegment> host;
    cuda::DeviceSegment* device = nullptr;
    int64_t total_chunks = 0;
    int64_t max_end = 0;
  };

  int device_ = 0;
  int num_sms_ = 1;
  size_t baseline_in_use_ = 0;  // device memory in use after context creation (other processes included)
  // What this backend allocated and has not freed (bytes_allocated), and the size of each block
  // allocate() handed out.
  size_t bytes_allocated_ = 0;
  std::unordered_map<void*, size_t> block_bytes_;
  // cudaMalloc through the count (the backend's own buffers, freed only with the backend).
  void* device_alloc(size_t bytes);
  cudaStream_t stream_ = nullptr;
  // Data-parallel communication (engine/dp_grad_sync.h): its own stream, the two events that
  // hand work between the streams, and the numbered marks of the parameter all-gathers.
  cudaStream_t comm_stream_ = nullptr, tp_comm_stream_ = nullptr;
  cudaEvent_t tp_compute_done_ = nullptr, tp_comm_done_ = nullptr;
  cudaEvent_t compute_done_ = nullptr, comm_done_ = nullptr;
  std::vector<cudaEvent_t> comm_marks_;
  // The side stream (begin_side_ops): made by reserve_side_marks (none with the op profiler on);
  // side_ops_ while ops go to it.
  cudaStream_t side_stream_ = nullptr;
  cudaEvent_t side_start_ = nullptr, side_done_ = nullptr;
  std::vector<cudaEvent_t> side_marks_;
  bool side_ops_ = false;
  // Activation offloading's copies (offload_copy): made by reserve_offload_marks.
  cudaStream_t offload_stream_ = nullptr;
  cudaEvent_t offload_start_ = nullptr;
  std::vector<cudaEvent_t> offload_marks_;
  int lowest_priority_ = 0, highest_priority_ = 0;  // (cudaDeviceGetStreamPriorityRange)
  std::vector<cudaEvent_t> time_marks_;
  void* scratch_memory_ = nullptr;
  cuda::Scratch scratch_;
  std::unique_ptr<cuda::GemmRunner> gemm_;
  std::unique_ptr<cuda::Fp8GemmRunner> fp8_gemm_;
  std::unique_ptr<cuda::GroupedGemm> grouped_;  // prepare_grouped_gemms
  bool grouped_takes(const ExpertOffsets& offsets) const;
  // moe_sinkhorn_route's host staging (sized at its first call).
  std::vector<uint8_t> sinkhorn_raw_;
  std::vector<double> sinkhorn_z_, sinkhorn_p_;
  std::vector<float> sinkhorn_p32_;
  std::vector<int32_t> sinkhorn_idx_;
  float* fp8_scale_slots_ = nullptr;  // [8]: slot 0 at [0], slot 1 at [4]
  void* attention_workspace_ = nullptr;
  size_t attention_workspace_bytes_ = 0;
  AttentionBackend attention_backend_ = AttentionBackend::auto_;
  // attention_block_*: one block's packed QKV rows [b * seq, qkv_row_stride] and their gradient
  // (reserve_attention_blocks: block_qkv_bytes_ each, the largest reservation's).
  void* block_qkv_ = nullptr;
  void* block_dqkv_ = nullptr;
  size_t block_qkv_bytes_ = 0;
  // Packed documents: a block's document starts in its own coordinates (int32 [b * seq]).
  void* block_doc_ = nullptr;
  size_t block_doc_bytes_ = 0;
  // A set-up buffer of at least `need` bytes: reallocated, once the stream has drained, when smaller.
  void reserve_buffer(void*& buffer, size_t& bytes, size_t need);
  // The packed QKV rows of a block (attention_block_*): checks the block, assembles block_qkv_
  // from q's query parts and kv, and returns the shape to run attention_forward/backward with.
  AttentionShape assemble_attention_block(const char* op, Tensor q, Tensor kv, const AttentionShape& a,
                                          const AttentionBlock& blk);
  std::vector<RegisteredSegments> registered_segments_;
  std::unique_ptr<cuda::OpProfiler> profiler_;
};

}  // namespace mt

// GEMMs on cuBLASLt: the three linear-layer ops of engine/backend.h and the plan cache behind them.
//
// Row-major y[M, N] = x[M, K] . w[N, K]^T is, read column-major, y^T[N, M] = w^T . x^T: so each op
// is one column-major cuBLASLt GEMM with the operands swapped (see gemm_cublaslt.cu for the three
// mappings). Inputs bf16/fp16 (or fp32), fp32 compute; weight gradients accumulate (beta = 1)
// into fp32 main grads, or bf16 ones (--grad-reduce-in-bf16: the float32 product added and rounded
// once; see linear_backward_weight in gemm_cublaslt.cu).
//
// Plans (descriptors, layouts and the heuristic's algorithm) are cached per (shape, dtypes,
// epilogue, alignment) in a map filled at first use. cublasLtMatmulAlgoGetHeuristic costs tens of
// microseconds, so every shape must be used once before the timed steps (the engine's warm-up or
// plan step does this); afterwards a call is a map look-up, two attribute sets and the launch.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "cuda/kernels.h"
#include "engine/backend.h"

#define MT_CUBLAS_CHECK(expr)                                                                            \
  do {                                                                                                   \
    cublasStatus_t mt_status_ = (expr);                                                                  \
    if (mt_status_ != CUBLAS_STATUS_SUCCESS)                                                             \
      ::mt::fail("cuBLASLt error {} ({}) in {} at {}:{}", static_cast<int>(mt_status_),                 \
                 cublasLtGetStatusString(mt_status_), #expr, __FILE__, __LINE__);                        \
  } while (0)

namespace mt::cuda {

enum class GemmEpilogue : uint8_t { none, bias, gelu, gelu_bias, gelu_aux, gelu_aux_bias, dgelu, bgradb };

// Column-major D[m, n] = alpha * op(A) op(B) + beta * D, with op(A) [m, k] and op(B) [k, n].
struct GemmCall {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  DType a_type = DType::bf16;
  int64_t lda = 0;
  const void* b = nullptr;
  DType b_type = DType::bf16;
  int64_t ldb = 0;
  void* d = nullptr;
  DType d_type = DType::bf16;
  int64_t ldd = 0;
  float alpha = 1.0f, beta = 0.0f;
  GemmEpilogue epilogue = GemmEpilogue::none;
  void* bias = nullptr;  // bias input (bias epilogues) or bias-gradient output (bgradb)
  void* aux = nullptr;   // GELU input: written by gelu_aux*, read by dgelu
  int64_t aux_ld = 0;
  // D narrower than float32 must receive the float32 result rounded ONCE (a bf16 weight gradient's
  // first write, beta 0, --grad-reduce-in-bf16): split-K algorithms are kept only where they reduce
  // in the compute type (cuda/gemm_splitk_guard.h), not in D's type. (With beta 1 and a bf16 C,
  // cuBLASLt was seen rounding the product before adding C: linear_backward_weight does not use it.)
  bool round_once = false;
};

class GemmRunner {
 public:
  GemmRunner(cudaStream_t stream, size_t workspace_bytes);
  ~GemmRunner();
  GemmRunner(const GemmRunner&) = delete;
  GemmRunner& operator=(const GemmRunner&) = delete;

  // Runs the GEMM. Returns false without running anything when cuBLASLt offers no algorithm for
  // it; callers use that to fall back from a fused epilogue to separate kernels.
  bool try_run(const GemmCall& call);
  void run(const GemmCall& call, const char* what);
  size_t cached_plans() const { return plans_.size(); }

  // Fused epilogues can be switched (benchmarks compare both ways; bench/RESULTS.md). GELU_AUX and
  // DGELU pay (15-28%); BGRADB measured 2-3% slower than the GEMM plus the column-sum kernel.
  bool use_bias_grad_epilogue = false;
  bool use_gelu_epilogue = true;
  // Autotuning: the first call of each GEMM shape times up to kTuneCandidates of cuBLASLt's
  // heuristic candidates and keeps the fastest (bench_gemm_algo measured the first pick up to 20%
  // slower on some shapes). Only GEMMs that overwrite their output (beta = 0) are tuned, on their
  // own buffers: running one again rewrites the same outputs, and the real call comes last. GEMMs
  // that accumulate (a weight gradient's later micro-batches or chunks) are not timed, since that
  // would add into the gradient (see reuse_tuned_for_accumulate). Off with --deterministic-mode:
  // the pick depends on timings, so two runs could round differently.
  bool autotune = false;
  // With autotune, an accumulating GEMM takes the tuned pick of the same GEMM with beta = 0 where
  // that ran first (the descriptors are the same; only beta differs): the output layer's weight
  // gradient, whose first chunk writes (beta 0) and the others add. false: the heuristic's first
  // pick.
  bool reuse_tuned_for_accumulate = true;
  static constexpr int kTuneCandidates = 8;
  // For a k that is not a multiple of 256, no split-K algorithm sees the tail of k: cuBLASLt's
  // split-K kernels were seen to drop it (cuda/gemm_splitk_guard.h). Float32 outputs without an
  // epilogue (weight gradients) run the tail as a GEMM of its own (try_run); others run without
  // split-K algorithms (make_plan). Off only in the test that shows what cuBLASLt does.
  bool avoid_splitk_with_k_tail = true;
  // SMs the GEMMs may use (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET); 0: all. Set while a collective
  // runs beside them: cuBLASLt's persistent kernels start one block per SM and give each a fixed
  // share of the tiles, so blocks that wait for the SMs a collective holds finish last, and the
  // GEMM ends about when it would have ended after the collective. A GEMM that leaves the
  // collective its SMs runs a little longer but beside it (bench_tp_overlap measures such margins).
  int sm_count_target = 0;
  size_t tuned_plans() const { return tuned_; }

 private:
  struct Key {
    int64_t m, n, k, lda, ldb, ldd, aux_ld;
    uint8_t trans_a, trans_b, a_type, b_type, d_type, epilogue, accumulate, round_once;
    uint16_t align_a, align_b, align_d, align_bias, align_aux, sms;
    bool operator==(const Key& o) const;
  };
  struct KeyHash {
    size_t operator()(const Key& k) const;
  };
  struct Plan {
    bool ok = false;
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    cublasLtMatmulAlgo_t candidates[kTuneCandidates]{};  // still to be timed (autotune)
    int num_candidates = 0;                               // 0 once tuned
    bool tuned = false;                                   // algo is the fastest candidate's
  };
  Plan make_plan(const GemmCall& call, const Key& key);
  bool try_run_one(const GemmCall& call);  // try_run without splitting k
  void tune(const GemmCall& call, Plan& plan);

  cudaStream_t stream_;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::unordered_map<Key, Plan, KeyHash> plans_;
  cudaEvent_t tune_start_ = nullptr, tune_stop_ = nullptr;
  size_t tuned_ = 0;
};

// The linear-layer ops (semantics in engine/backend.h).
void linear_forward(GemmRunner& gemm, const KernelContext& ctx, Tensor y, Tensor x, Tensor w, Tensor bias,
                    Activation act, Tensor pre_act);
void linear_backward_input(GemmRunner& gemm, const KernelContext& ctx, Tensor dx, Tensor dy, Tensor w,
                           bool accumulate, Activation act, Tensor pre_act);
void linear_backward_weight(GemmRunner& gemm, const KernelContext& ctx, Tensor dw, Tensor dbias, Tensor dy, Tensor x,
                            bool accumulate);
// dx = (dy . w) * act'(pre_act) and act_out = act(pre_act) (engine/backend.h); act_out may alias pre_act.
void linear_backward_input_recompute(GemmRunner& gemm, const KernelContext& ctx, Tensor dx, Tensor act_out, Tensor dy,
                                     Tensor w, Activation act, Tensor pre_act);

// dbias[N] += column sums of dy[M, N], deterministic (fixed two-stage order); dbias float32, or
// bfloat16 (the float32 sum added to its old value in float32, rounded once).
void column_sum_accumulate(const KernelContext& ctx, Tensor dbias, Tensor dy);
// dbias[c] += sum over g < chunks of partial[g * cols + c], in g order (float32 sums; dbias [cols] on
// the device, float32 or bfloat16 as above): the last step of column_sum_accumulate and of the FP8
// cast's fused bias gradient.
void column_partials_accumulate(const KernelContext& ctx, GradOut dbias, const float* partial, int64_t chunks,
                                int64_t cols);

}  // namespace mt::cuda

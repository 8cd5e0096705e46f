// FP8 GEMMs on cuBLASLt (Hopper): the linear layers' matmuls with FP8 operands, fp32 accumulation
// and a bf16 or fp32 result.
//
// cuBLASLt runs FP8 only in the "TN" form: both operands stored K-major (the reduction dimension
// contiguous). In row-major terms every FP8 GEMM here is therefore
//     out[M, N] = alpha * (x_scale_inv * x[M, K]) . (w_scale_inv * w[N, K])^T  (+ beta * out) (+ bias[N])
// with x and w both row-major, K contiguous. The three linear-layer products map onto it as
//     forward          y[M, Nout]   = x[M, Kin]    . w[Nout, Kin]^T     x = input,  w = weight
//     backward input   dx[M, Kin]   = dy[M, Nout]  . wT[Kin, Nout]^T    x = dy,     w = weight transposed
//     backward weight  dw[Nout, Kin] += dyT[Nout, M] . xT[Kin, M]^T      x = dy^T,   w = input transposed
// so the caller keeps transposed FP8 copies where a K-major operand is needed (fp8_kernels.h's
// cast_transpose writes both layouts in one pass).
//
// Scaling is per tensor: x_scale_inv and w_scale_inv are DEVICE pointers to one float each (the
// dequantization factors 1/scale; cuBLASLt multiplies them in), read when the GEMM runs, so the
// delayed-scaling update can change them on the GPU without a host round trip.
//
// Requirements (cuBLASLt FP8, checked with a one-line error): M, N, K multiples of 16, operand
// pointers 16-byte aligned, the scale_inv pointers too (measured: cuBLASLt 13.1 declines a scale
// pointer at a 4-byte offset at run time); x/w formats e4m3 x e4m3, e4m3 x e5m2 or e5m2 x e4m3 (no e5m2 x e5m2);
// out bf16 (bias optional, bf16) or fp32 (beta 0 or 1: weight gradients accumulate into fp32
// main grads). fast_accum trades the periodic promotion of partial sums to full fp32 for speed
// (Transformer Engine uses it in the forward GEMMs only, not for gradients).
//
// Plans (descriptor, layouts, the heuristic's algorithm) are cached per (shape, formats, output,
// flags, alignment); make every shape run once before timing (the heuristic costs tens of us). The
// workspace is allocated at construction.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "core/tensor.h"
#include "cuda/kernels.h"  // KernelContext

namespace mt::cuda {

// The two OCP FP8 formats: e4m3 (max 448, for activations and weights) and e5m2 (max 57344, for
// gradients in the "hybrid" recipe).
enum class Fp8Format : uint8_t { e4m3, e5m2 };
const char* fp8_format_name(Fp8Format f);
float fp8_format_max(Fp8Format f);

struct Fp8GemmCall {
  int64_t m = 0, n = 0, k = 0;       // out[m, n] = x[m, k] . w[n, k]^T (row-major)
  const void* x = nullptr;           // fp8 bytes, row-major [m, k]
  Fp8Format x_format = Fp8Format::e4m3;
  const float* x_scale_inv = nullptr;  // device pointer, one float
  const void* w = nullptr;           // fp8 bytes, row-major [n, k]
  Fp8Format w_format = Fp8Format::e4m3;
  const float* w_scale_inv = nullptr;  // device pointer, one float
  void* out = nullptr;               // row-major [m, n]
  DType out_type = DType::bf16;      // bf16 or f32
  float alpha = 1.0f;
  float beta = 0.0f;                 // 0 (overwrite) or 1 (accumulate, fp32 out only)
  const void* bias = nullptr;        // optional bf16 [n] (bf16 out only)
  float* amax_out = nullptr;         // optional device float: max |out| of this GEMM (before rounding)
  bool fast_accum = false;
  // A bf16 out that must be the float32 result rounded once (bf16 weight gradients): no split-K
  // algorithm that combines partial sums in the output type (as GemmCall::round_once).
  bool round_once = false;
};

class Fp8GemmRunner {
 public:
  Fp8GemmRunner(cudaStream_t stream, size_t workspace_bytes);
  ~Fp8GemmRunner();
  Fp8GemmRunner(const Fp8GemmRunner&) = delete;
  Fp8GemmRunner& operator=(const Fp8GemmRunner&) = delete;

  // Fails (mt::Error naming `what` and the shape) when the call breaks a requirement or cuBLASLt
  // has no algorithm for it.
  void run(const Fp8GemmCall& call, const char* what);
  // (When cuBLASLt has no algorithm for all m rows at once, run() splits the rows in two blocks,
  // recursively, and warns once per shape.)
  // Same checks, but returns false instead of failing when cuBLASLt offers no algorithm (callers
  // fall back, e.g. from the bias epilogue or the amax output to separate kernels).
  bool try_run(const Fp8GemmCall& call, const char* what);
  // What the heuristic said for the last call's plan (for diagnostics).
  const std::string& last_diagnosis() const { return last_diagnosis_; }
  size_t cached_plans() const { return plans_.size(); }
  // How many GEMMs run() had to split into row blocks (no algorithm for the whole; see run()).
  int64_t row_splits() const { return row_splits_; }
  cudaStream_t stream() const { return stream_; }
  // SMs the GEMMs may use; 0: all (see GemmRunner::sm_count_target).
  int sm_count_target = 0;

 private:
  struct Key {
    int64_t m, n, k;
    uint8_t x_format, w_format, out_type, accumulate, has_bias, has_amax, fast_accum, round_once;
    uint16_t align_x, align_w, align_out, align_bias, sms;
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
    std::string diagnosis;  // what the heuristic (and a declining cublasLtMatmul) returned
  };
  Plan make_plan(const Fp8GemmCall& call, const Key& key);
  void check(const Fp8GemmCall& call, const char* what) const;

  cudaStream_t stream_;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::unordered_map<Key, Plan, KeyHash> plans_;
  std::string last_diagnosis_;
  std::unordered_set<int64_t> split_warned_;
  int64_t row_splits_ = 0;
};

// The three linear-layer products in FP8 (the mappings in this file's header comment). An operand
// is fp8 bytes, row-major, with its format and dequantization factor (device pointer).
struct Fp8Operand {
  const void* data = nullptr;
  Fp8Format format = Fp8Format::e4m3;
  const float* scale_inv = nullptr;
};
// y[M, N] = x[M, K] . w[N, K]^T (+ bias[N], bf16, with a bf16 y only): bf16 or float32 y, fast
// accumulation (forward only).
void fp8_linear_forward(Fp8GemmRunner& gemm, Tensor y, Fp8Operand x, Fp8Operand w, int64_t k_in, const void* bias);
// dx[M, K] = dy[M, N] . w[N, K], from w_t = w^T [K, N] (the transposed copy); bf16 or fp32 dx,
// accumulate (+=) only into fp32.
void fp8_linear_backward_input(Fp8GemmRunner& gemm, Tensor dx, Fp8Operand dy, Fp8Operand w_t, int64_t n_out,
                               bool accumulate);
// dw[N, K] += dy^T . x (dw = ... without accumulate), from dy_t = dy^T [N, M] and x_t = x^T [K, M]; dw
// float32, or bfloat16 (--grad-reduce-in-bf16: round_bf16(dw + the float32 product), one rounding;
// with accumulate the product goes through float32 scratch, so ctx is required for it).
void fp8_linear_backward_weight(Fp8GemmRunner& gemm, Tensor dw, Fp8Operand dy_t, Fp8Operand x_t, int64_t tokens,
                                bool accumulate, const KernelContext* ctx = nullptr);

}  // namespace mt::cuda

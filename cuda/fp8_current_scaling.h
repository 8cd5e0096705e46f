// EXPERIMENTAL: FP8 linear layers inside the CUDA backend with current (per-call, "tensorwise")
// scaling, switched on by the environment variable MEGATRAIN_EXPERIMENTAL_FP8=e4m3|hybrid.
//
// This exists to measure FP8 end to end (throughput, loss) before the engine's FP8 interface
// (Megatron's --fp8-* flags, delayed scaling with amax history, per-layer state; helper "fp8")
// lands; it needs no engine state. Each linear op quantizes its operands on the spot:
//   forward          amax(x), amax(w) -> scales -> x, w to e4m3 -> FP8 GEMM (fast accumulation)
//   backward input   amax(dy), amax(w) -> dy to e5m2 (hybrid) or e4m3, w^T to e4m3 -> FP8 GEMM
//   backward weight  amax(dy), amax(x) -> dy^T, x^T -> FP8 GEMM accumulating into fp32 dw
// so x and dy are quantized twice per layer and weights once per use (the real path quantizes
// once and keeps the copies). Only bf16 linears whose dimensions are multiples of 16 and below
// 32768 take it (so the vocabulary-sized output layer stays bf16, as in Megatron), without input
// accumulation into dx and with a float32 dw; everything else runs the bf16 path.
// The quantized copies live in buffers grown at first use (the first iteration), not planned
// up front: another reason this is an experiment, not the product.
#pragma once

#include <cuda_runtime.h>

#include <memory>

#include "core/tensor.h"
#include "cuda/fp8_gemm_cublaslt.h"
#include "cuda/kernels.h"
#include "engine/backend.h"

namespace mt::cuda {

class CurrentScalingFp8 {
 public:
  // Null unless MEGATRAIN_EXPERIMENTAL_FP8 is set (fails on a value other than e4m3 / hybrid).
  static std::unique_ptr<CurrentScalingFp8> from_environment(cudaStream_t stream);
  CurrentScalingFp8(cudaStream_t stream, Fp8Format grad_format);
  ~CurrentScalingFp8();
  CurrentScalingFp8(const CurrentScalingFp8&) = delete;
  CurrentScalingFp8& operator=(const CurrentScalingFp8&) = delete;

  // Each returns false (having done nothing) when the call does not qualify; the caller then runs
  // the bf16 op.
  bool linear_forward(const KernelContext& ctx, Tensor y, Tensor x, Tensor w, Tensor bias, Activation act,
                      Tensor pre_act);
  bool linear_backward_input(const KernelContext& ctx, Tensor dx, Tensor dy, Tensor w, bool accumulate, Activation act,
                             Tensor pre_act);
  bool linear_backward_input_recompute(const KernelContext& ctx, Tensor dx, Tensor act_out, Tensor dy, Tensor w,
                                       Activation act, Tensor pre_act);
  bool linear_backward_weight(const KernelContext& ctx, Tensor dw, Tensor dbias, Tensor dy, Tensor x);

  int64_t fp8_calls() const { return fp8_calls_; }
  int64_t bf16_calls() const { return bf16_calls_; }

 private:
  struct Buffer {
    void* p = nullptr;
    size_t bytes = 0;
  };
  // Counts the call as FP8 or bf16; n_out x k_in is the weight, tokens the activation rows.
  bool qualifies(bool dtypes_ok, int64_t n_out, int64_t k_in, int64_t tokens);
  uint8_t* ensure(Buffer& b, size_t bytes);
  // Quantizes `in` with a fresh scale in slot `slot`: amax, scale update, cast (row-major and/or
  // transposed). Returns the operand (row-major data or transposed data, whichever was asked).
  Fp8Operand quantize(const KernelContext& ctx, Tensor in, Fp8Format f, int slot, Buffer* row_major,
                      Buffer* transposed);
  void backward_input_gemm(const KernelContext& ctx, Tensor dx, Tensor dy, Tensor w);

  Fp8GemmRunner gemm_;
  Fp8Format grad_format_;
  // Per slot (one quantized operand of an op): amax, scale, scale_inv, each 16-byte aligned (12
  // floats a slot).
  float* meta_ = nullptr;
  Buffer a_, b_, w_;
  int64_t fp8_calls_ = 0, bf16_calls_ = 0;
};

}  // namespace mt::cuda

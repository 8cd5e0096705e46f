// EXPERIMENTAL: FP8 linear layers inside the CUDA backend, switched on by the environment variable
// MEGATRAIN_EXPERIMENTAL_FP8=e4m3|hybrid (gradients e4m3, or e5m2 in "hybrid").
//
// This exists to measure FP8 end to end (throughput, loss) before the engine's FP8 interface
// (Megatron's --fp8-* flags with per-layer state; helper "fp8") lands, and needs no engine state.
// Every linear op quantizes its operands itself:
//   forward          x, w to e4m3 -> FP8 GEMM (fast accumulation), bias epilogue, GeLU kernel
//   backward input   dy to the gradient format, w^T to e4m3 -> FP8 GEMM
//   backward weight  dy^T, x^T -> FP8 GEMM accumulating into the fp32 main grad
// so x and dy are quantized twice per layer and each weight twice per step (the engine-side path
// would quantize once and keep the copies). Only bf16 linears whose dimensions are multiples of
// 16 and below 32768 take it (the vocabulary-sized output layer stays bf16, as in Megatron),
// without accumulation into dx and with a float32 dw; everything else runs the bf16 path.
//
// Recipes (MEGATRAIN_EXPERIMENTAL_FP8_RECIPE):
//   delayed (default)  Transformer Engine's delayed scaling, amax history
//                      MEGATRAIN_EXPERIMENTAL_FP8_HISTORY long (default 16), algo max, margin 0.
//                      Each quantization in a step gets the next "slot" (its position in the
//                      step's sequence of quantizations: the same operand every step); the cast
//                      records the amax in the slot's history and uses the slot's scale from the
//                      previous steps; the optimizer step (end_step) updates all scales in one
//                      kernel. A slot's first use scales from its current amax.
//   current            per-call amax pass, then the cast (one more read of every operand).
// Slots assume that every step makes the same sequence of linear calls (true for training with
// --eval-iters 0; an evaluation pass between steps would shift them).
// The quantized copies live in buffers grown at first use (the first iteration), not planned up
// front: one more reason this is an experiment, not the product.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "core/tensor.h"
#include "cuda/fp8_gemm_cublaslt.h"
#include "cuda/fp8_kernels.h"
#include "cuda/kernels.h"
#include "engine/backend.h"

namespace mt::cuda {

class ExperimentalFp8 {
 public:
  enum class Recipe { delayed, current };
  static constexpr int kMaxSlots = 4096;  // quantizations per step, per format pool

  // Null unless MEGATRAIN_EXPERIMENTAL_FP8 is set (fails on values it does not know).
  static std::unique_ptr<ExperimentalFp8> from_environment(cudaStream_t stream);
  ExperimentalFp8(cudaStream_t stream, Fp8Format grad_format, Recipe recipe, int history_len);
  ~ExperimentalFp8();
  ExperimentalFp8(const ExperimentalFp8&) = delete;
  ExperimentalFp8& operator=(const ExperimentalFp8&) = delete;

  // Each returns false (having done nothing) when the call does not qualify; the caller then runs
  // the bf16 op.
  bool linear_forward(const KernelContext& ctx, Tensor y, Tensor x, Tensor w, Tensor bias, Activation act,
                      Tensor pre_act);
  bool linear_backward_input(const KernelContext& ctx, Tensor dx, Tensor dy, Tensor w, bool accumulate, Activation act,
                             Tensor pre_act);
  bool linear_backward_input_recompute(const KernelContext& ctx, Tensor dx, Tensor act_out, Tensor dy, Tensor w,
                                       Activation act, Tensor pre_act);
  bool linear_backward_weight(const KernelContext& ctx, Tensor dw, Tensor dbias, Tensor dy, Tensor x);
  // At the optimizer step: the delayed-scaling update of every slot, and the slots start over.
  // Idempotent within a step (the optimizer may call the backend once per parameter range).
  void end_step(const KernelContext& ctx);

  int64_t fp8_calls() const { return fp8_calls_; }
  int64_t bf16_calls() const { return bf16_calls_; }

 private:
  struct Buffer {
    void* p = nullptr;
    size_t bytes = 0;
  };
  // One pool of slots per format (their scales use that format's largest value).
  struct Pool {
    Fp8Format format = Fp8Format::e4m3;
    float* history = nullptr;    // [history_len, kMaxSlots]; row 0 collects this step's amax
    float* scale = nullptr;      // slot s at [4 s] (16-byte aligned entries)
    float* scale_inv = nullptr;  // slot s at [4 s]
    int next = 0;                // next slot this step
    std::vector<bool> seen;      // slot used in an earlier step
  };
  // Counts the call as FP8 or bf16; n_out x k_in is the weight, tokens the activation rows.
  bool qualifies(bool dtypes_ok, int64_t n_out, int64_t k_in, int64_t tokens);
  uint8_t* ensure(Buffer& b, size_t bytes);
  // Quantizes `in` into the next slot of the format's pool (row-major and/or transposed copy).
  // Returns the operand (the row-major copy if asked for, else the transposed one).
  Fp8Operand quantize(const KernelContext& ctx, Tensor in, Fp8Format f, Buffer* row_major, Buffer* transposed);
  void backward_input_gemm(const KernelContext& ctx, Tensor dx, Tensor dy, Tensor w);
  Pool& pool(Fp8Format f) { return f == Fp8Format::e4m3 ? e4m3_ : e5m2_; }

  Fp8GemmRunner gemm_;
  Fp8Format grad_format_;
  Recipe recipe_;
  int history_len_;
  Pool e4m3_, e5m2_;
  Buffer a_, b_, w_;
  int64_t fp8_calls_ = 0, bf16_calls_ = 0;
};

}  // namespace mt::cuda

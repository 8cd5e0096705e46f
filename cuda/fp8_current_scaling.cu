// EXPERIMENTAL current-scaling FP8 linears; see fp8_current_scaling.h.
#include "cuda/fp8_current_scaling.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "core/log.h"
#include "cuda/cuda_check.h"
#include "cuda/fp8_kernels.h"
#include "cuda/gemm_cublaslt.h"  // column_sum_accumulate

namespace mt::cuda {
namespace {
constexpr int kSlots = 4;
constexpr int kSlotFloats = 12;
constexpr int64_t kMaxDim = 32768;  // larger: the vocabulary-sized output layer, kept in bf16
}  // namespace

std::unique_ptr<CurrentScalingFp8> CurrentScalingFp8::from_environment(cudaStream_t stream) {
  const char* v = std::getenv("MEGATRAIN_EXPERIMENTAL_FP8");
  if (!v || !*v) return nullptr;
  const std::string s = v;
  MT_CHECK(s == "e4m3" || s == "hybrid", "MEGATRAIN_EXPERIMENTAL_FP8 must be e4m3 or hybrid, got '{}'", s);
  log::warn0("EXPERIMENTAL: linear layers in FP8 with current scaling ({}; MEGATRAIN_EXPERIMENTAL_FP8), "
             "not Megatron's --fp8-* path", s);
  return std::make_unique<CurrentScalingFp8>(stream, s == "hybrid" ? Fp8Format::e5m2 : Fp8Format::e4m3);
}

CurrentScalingFp8::CurrentScalingFp8(cudaStream_t stream, Fp8Format grad_format)
    : gemm_(stream, size_t{32} << 20), grad_format_(grad_format) {
  MT_CUDA_CHECK(cudaMalloc(&meta_, kSlots * kSlotFloats * sizeof(float)));
  std::vector<float> init(kSlots * kSlotFloats, 0.0f);
  for (int s = 0; s < kSlots; ++s) init[s * kSlotFloats + 4] = init[s * kSlotFloats + 8] = 1.0f;
  MT_CUDA_CHECK(cudaMemcpy(meta_, init.data(), init.size() * sizeof(float), cudaMemcpyHostToDevice));
}

CurrentScalingFp8::~CurrentScalingFp8() {
  for (Buffer* b : {&a_, &b_, &w_})
    if (b->p) cudaFree(b->p);
  if (meta_) cudaFree(meta_);
}

uint8_t* CurrentScalingFp8::ensure(Buffer& b, size_t bytes) {
  if (b.bytes < bytes) {
    if (b.p) MT_CUDA_CHECK(cudaFree(b.p));  // synchronizes: no kernel still reads the old buffer
    MT_CUDA_CHECK(cudaMalloc(&b.p, bytes));
    b.bytes = bytes;
  }
  return static_cast<uint8_t*>(b.p);
}

bool CurrentScalingFp8::qualifies(bool dtypes_ok, int64_t n_out, int64_t k_in, int64_t tokens) {
  const bool ok = dtypes_ok && n_out % 16 == 0 && k_in % 16 == 0 && tokens % 16 == 0 && tokens > 0 &&
                  n_out < kMaxDim && k_in < kMaxDim;
  ++(ok ? fp8_calls_ : bf16_calls_);
  return ok;
}

Fp8Operand CurrentScalingFp8::quantize(const KernelContext& ctx, Tensor in, Fp8Format f, int slot, Buffer* row_major,
                                       Buffer* transposed) {
  float* amax = meta_ + slot * kSlotFloats;
  float* scale = amax + 4;
  float* scale_inv = amax + 8;
  fp8_amax(ctx, amax, in);
  // History length 1: amax -> scale now, and amax zeroed for the next use of the slot.
  fp8_update_scales(ctx, amax, 1, 1, scale, scale_inv, fp8_format_max(f), 0, Fp8AmaxAlgo::most_recent);
  uint8_t* rm = row_major ? ensure(*row_major, in.numel()) : nullptr;
  uint8_t* tr = transposed ? ensure(*transposed, in.numel()) : nullptr;
  if (tr)
    cast_transpose_to_fp8(ctx, rm, tr, f, in, scale, nullptr);
  else
    cast_to_fp8(ctx, rm, f, in, scale, nullptr);
  return Fp8Operand{rm ? rm : tr, f, scale_inv};
}

bool CurrentScalingFp8::linear_forward(const KernelContext& ctx, Tensor y, Tensor x, Tensor w, Tensor bias,
                                       Activation act, Tensor pre_act) {
  const Tensor target = (act != Activation::none && !pre_act.empty()) ? pre_act : y;
  const bool dtypes = x.dtype == DType::bf16 && w.dtype == DType::bf16 && y.dtype == DType::bf16 &&
                      target.dtype == DType::bf16 && (bias.empty() || bias.dtype == DType::bf16);
  if (!qualifies(dtypes, w.rows(), w.cols(), x.rows())) return false;
  const Fp8Operand xq = quantize(ctx, x, Fp8Format::e4m3, 0, &a_, nullptr);
  const Fp8Operand wq = quantize(ctx, w, Fp8Format::e4m3, 1, &w_, nullptr);
  fp8_linear_forward(gemm_, target.view({x.rows(), w.rows()}), xq, wq, w.cols(), bias.data);
  if (act != Activation::none) gelu_forward(ctx, y, target, act == Activation::gelu_tanh);
  return true;
}

void CurrentScalingFp8::backward_input_gemm(const KernelContext& ctx, Tensor dx, Tensor dy, Tensor w) {
  const Fp8Operand dyq = quantize(ctx, dy, grad_format_, 2, &a_, nullptr);
  const Fp8Operand wt = quantize(ctx, w, Fp8Format::e4m3, 1, nullptr, &w_);
  fp8_linear_backward_input(gemm_, dx.view({dy.rows(), w.cols()}), dyq, wt, w.rows(), false);
}

bool CurrentScalingFp8::linear_backward_input(const KernelContext& ctx, Tensor dx, Tensor dy, Tensor w,
                                              bool accumulate, Activation act, Tensor pre_act) {
  const bool dtypes = dy.dtype == DType::bf16 && w.dtype == DType::bf16 && dx.dtype == DType::bf16;
  if (!qualifies(dtypes && !accumulate, w.rows(), w.cols(), dy.rows())) return false;
  backward_input_gemm(ctx, dx, dy, w);
  if (act != Activation::none) gelu_grad_multiply(ctx, dx, dx, pre_act, act == Activation::gelu_tanh, false);
  return true;
}

bool CurrentScalingFp8::linear_backward_input_recompute(const KernelContext& ctx, Tensor dx, Tensor act_out, Tensor dy,
                                                        Tensor w, Activation act, Tensor pre_act) {
  const bool dtypes = dy.dtype == DType::bf16 && w.dtype == DType::bf16 && dx.dtype == DType::bf16;
  if (!qualifies(dtypes, w.rows(), w.cols(), dy.rows())) return false;
  backward_input_gemm(ctx, dx, dy, w);
  gelu_grad_recompute(ctx, dx, act_out, pre_act, act == Activation::gelu_tanh);
  return true;
}

bool CurrentScalingFp8::linear_backward_weight(const KernelContext& ctx, Tensor dw, Tensor dbias, Tensor dy, Tensor x) {
  const bool dtypes = dy.dtype == DType::bf16 && x.dtype == DType::bf16 && dw.dtype == DType::f32;
  if (!qualifies(dtypes, dw.rows(), dw.cols(), dy.rows())) return false;
  const Fp8Operand dyt = quantize(ctx, dy, grad_format_, 2, nullptr, &a_);
  const Fp8Operand xt = quantize(ctx, x, Fp8Format::e4m3, 3, nullptr, &b_);
  fp8_linear_backward_weight(gemm_, dw, dyt, xt, dy.rows());
  if (!dbias.empty()) column_sum_accumulate(ctx, dbias, dy);
  return true;
}

}  // namespace mt::cuda

// EXPERIMENTAL FP8 linears inside the CUDA backend; see fp8_experimental.h.
#include "cuda/fp8_experimental.h"

#include <cstdlib>
#include <string>

#include "core/log.h"
#include "cuda/cuda_check.h"
#include "cuda/gemm_cublaslt.h"  // column_sum_accumulate

namespace mt::cuda {
namespace {
constexpr int64_t kMaxDim = 32768;  // larger: the vocabulary-sized output layer, kept in bf16

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : std::string(fallback);
}
}  // namespace

std::unique_ptr<ExperimentalFp8> ExperimentalFp8::from_environment(cudaStream_t stream) {
  const std::string format = env_or("MEGATRAIN_EXPERIMENTAL_FP8", "");
  if (format.empty()) return nullptr;
  MT_CHECK(format == "e4m3" || format == "hybrid", "MEGATRAIN_EXPERIMENTAL_FP8 must be e4m3 or hybrid, got '{}'",
           format);
  const std::string recipe = env_or("MEGATRAIN_EXPERIMENTAL_FP8_RECIPE", "delayed");
  MT_CHECK(recipe == "delayed" || recipe == "current",
           "MEGATRAIN_EXPERIMENTAL_FP8_RECIPE must be delayed or current, got '{}'", recipe);
  const int history = std::atoi(env_or("MEGATRAIN_EXPERIMENTAL_FP8_HISTORY", "16").c_str());
  MT_CHECK(history >= 1 && history <= 1024, "MEGATRAIN_EXPERIMENTAL_FP8_HISTORY must be 1..1024, got {}", history);
  log::warn0("EXPERIMENTAL: linear layers in FP8 ({}, {} scaling{}), from MEGATRAIN_EXPERIMENTAL_FP8: not "
             "Megatron's --fp8-* path",
             format, recipe, recipe == "delayed" ? fmt::format(", amax history {} max", history) : std::string());
  return std::make_unique<ExperimentalFp8>(stream, format == "hybrid" ? Fp8Format::e5m2 : Fp8Format::e4m3,
                                           recipe == "delayed" ? Recipe::delayed : Recipe::current, history);
}

ExperimentalFp8::ExperimentalFp8(cudaStream_t stream, Fp8Format grad_format, Recipe recipe, int history_len)
    : gemm_(stream, size_t{32} << 20), grad_format_(grad_format), recipe_(recipe), history_len_(history_len) {
  e5m2_.format = Fp8Format::e5m2;
  for (Pool* p : {&e4m3_, &e5m2_}) {
    MT_CUDA_CHECK(cudaMalloc(&p->history, sizeof(float) * history_len_ * kMaxSlots));
    MT_CUDA_CHECK(cudaMalloc(&p->scale, sizeof(float) * 4 * kMaxSlots));
    MT_CUDA_CHECK(cudaMalloc(&p->scale_inv, sizeof(float) * 4 * kMaxSlots));
    MT_CUDA_CHECK(cudaMemset(p->history, 0, sizeof(float) * history_len_ * kMaxSlots));
    const std::vector<float> ones(4 * kMaxSlots, 1.0f);
    MT_CUDA_CHECK(cudaMemcpy(p->scale, ones.data(), sizeof(float) * ones.size(), cudaMemcpyHostToDevice));
    MT_CUDA_CHECK(cudaMemcpy(p->scale_inv, ones.data(), sizeof(float) * ones.size(), cudaMemcpyHostToDevice));
    p->seen.assign(kMaxSlots, false);
  }
}

ExperimentalFp8::~ExperimentalFp8() {
  for (Buffer* b : {&a_, &b_, &w_})
    if (b->p) cudaFree(b->p);
  for (Pool* p : {&e4m3_, &e5m2_})
    for (float* q : {p->history, p->scale, p->scale_inv})
      if (q) cudaFree(q);
}

uint8_t* ExperimentalFp8::ensure(Buffer& b, size_t bytes) {
  if (b.bytes < bytes) {
    if (b.p) MT_CUDA_CHECK(cudaFree(b.p));  // synchronizes: no kernel still reads the old buffer
    MT_CUDA_CHECK(cudaMalloc(&b.p, bytes));
    b.bytes = bytes;
  }
  return static_cast<uint8_t*>(b.p);
}

bool ExperimentalFp8::qualifies(bool dtypes_ok, int64_t n_out, int64_t k_in, int64_t tokens) {
  const bool ok = dtypes_ok && n_out % 16 == 0 && k_in % 16 == 0 && tokens % 16 == 0 && tokens > 0 &&
                  n_out < kMaxDim && k_in < kMaxDim;
  ++(ok ? fp8_calls_ : bf16_calls_);
  return ok;
}

Fp8Operand ExperimentalFp8::quantize(const KernelContext& ctx, Tensor in, Fp8Format f, Buffer* row_major,
                                     Buffer* transposed) {
  Pool& p = pool(f);
  MT_CHECK(p.next < kMaxSlots, "experimental FP8: more than {} quantizations in one step", kMaxSlots);
  const int slot = p.next++;
  float* amax = p.history + slot;  // row 0
  float* scale = p.scale + 4 * slot;
  float* scale_inv = p.scale_inv + 4 * slot;
  const bool fresh = recipe_ == Recipe::current || !p.seen[static_cast<size_t>(slot)];
  if (fresh) {
    // Scale from this operand's amax (history length 1 here: row 0 is zeroed again, so the cast
    // below records the amax afresh for the delayed update).
    fp8_amax(ctx, amax, in);
    fp8_update_scales(ctx, amax, 1, 1, scale, scale_inv, fp8_format_max(f), 0, Fp8AmaxAlgo::most_recent);
  }
  p.seen[static_cast<size_t>(slot)] = true;
  float* record = recipe_ == Recipe::delayed ? amax : nullptr;
  uint8_t* rm = row_major ? ensure(*row_major, in.numel()) : nullptr;
  uint8_t* tr = transposed ? ensure(*transposed, in.numel()) : nullptr;
  if (tr)
    cast_transpose_to_fp8(ctx, rm, tr, f, in, scale, record);
  else
    cast_to_fp8(ctx, rm, f, in, scale, record);
  return Fp8Operand{rm ? rm : tr, f, scale_inv};
}

void ExperimentalFp8::end_step(const KernelContext& ctx) {
  for (Pool* p : {&e4m3_, &e5m2_}) {
    if (p->next == 0) continue;
    if (recipe_ == Recipe::delayed)
      fp8_update_scales(ctx, p->history, history_len_, kMaxSlots, p->scale, p->scale_inv, fp8_format_max(p->format), 0,
                        Fp8AmaxAlgo::max, 4);
    p->next = 0;
  }
}

bool ExperimentalFp8::linear_forward(const KernelContext& ctx, Tensor y, Tensor x, Tensor w, Tensor bias,
                                     Activation act, Tensor pre_act) {
  const Tensor target = (act != Activation::none && !pre_act.empty()) ? pre_act : y;
  const bool dtypes = x.dtype == DType::bf16 && w.dtype == DType::bf16 && y.dtype == DType::bf16 &&
                      target.dtype == DType::bf16 && (bias.empty() || bias.dtype == DType::bf16);
  if (!qualifies(dtypes, w.rows(), w.cols(), x.rows())) return false;
  const Fp8Operand xq = quantize(ctx, x, Fp8Format::e4m3, &a_, nullptr);
  const Fp8Operand wq = quantize(ctx, w, Fp8Format::e4m3, &w_, nullptr);
  fp8_linear_forward(gemm_, target.view({x.rows(), w.rows()}), xq, wq, w.cols(), bias.data);
  if (act != Activation::none) gelu_forward(ctx, y, target, act == Activation::gelu_tanh);
  return true;
}

void ExperimentalFp8::backward_input_gemm(const KernelContext& ctx, Tensor dx, Tensor dy, Tensor w) {
  const Fp8Operand dyq = quantize(ctx, dy, grad_format_, &a_, nullptr);
  const Fp8Operand wt = quantize(ctx, w, Fp8Format::e4m3, nullptr, &w_);
  fp8_linear_backward_input(gemm_, dx.view({dy.rows(), w.cols()}), dyq, wt, w.rows(), false);
}

bool ExperimentalFp8::linear_backward_input(const KernelContext& ctx, Tensor dx, Tensor dy, Tensor w, bool accumulate,
                                            Activation act, Tensor pre_act) {
  const bool dtypes = dy.dtype == DType::bf16 && w.dtype == DType::bf16 && dx.dtype == DType::bf16;
  if (!qualifies(dtypes && !accumulate, w.rows(), w.cols(), dy.rows())) return false;
  backward_input_gemm(ctx, dx, dy, w);
  if (act != Activation::none) gelu_grad_multiply(ctx, dx, dx, pre_act, act == Activation::gelu_tanh, false);
  return true;
}

bool ExperimentalFp8::linear_backward_input_recompute(const KernelContext& ctx, Tensor dx, Tensor act_out, Tensor dy,
                                                      Tensor w, Activation act, Tensor pre_act) {
  const bool dtypes = dy.dtype == DType::bf16 && w.dtype == DType::bf16 && dx.dtype == DType::bf16;
  if (!qualifies(dtypes, w.rows(), w.cols(), dy.rows())) return false;
  backward_input_gemm(ctx, dx, dy, w);
  gelu_grad_recompute(ctx, dx, act_out, pre_act, act == Activation::gelu_tanh);
  return true;
}

bool ExperimentalFp8::linear_backward_weight(const KernelContext& ctx, Tensor dw, Tensor dbias, Tensor dy, Tensor x) {
  const bool dtypes = dy.dtype == DType::bf16 && x.dtype == DType::bf16 && dw.dtype == DType::f32;
  if (!qualifies(dtypes, dw.rows(), dw.cols(), dy.rows())) return false;
  const Fp8Operand dyt = quantize(ctx, dy, grad_format_, nullptr, &a_);
  const Fp8Operand xt = quantize(ctx, x, Fp8Format::e4m3, nullptr, &b_);
  fp8_linear_backward_weight(gemm_, dw, dyt, xt, dy.rows());
  if (!dbias.empty()) column_sum_accumulate(ctx, dbias, dy);
  return true;
}

}  // namespace mt::cuda

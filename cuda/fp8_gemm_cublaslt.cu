// FP8 GEMMs on cuBLASLt; see fp8_gemm_cublaslt.h.
//
// Row-major out[M, N] = x[M, K] . w[N, K]^T read column-major is out^T[N, M] = w^T . x^T: one
// column-major GEMM with m = N, n = M, A = w (stored [K, N] column-major, ld K, op T), B = x
// (stored [K, M], ld K, op N), D = out (ld N). That is exactly cuBLASLt's required FP8 "TN" form.
#include "cuda/fp8_gemm_cublaslt.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"
#include "core/log.h"
#include "cuda/cuda_check.h"
#include "cuda/gemm_cublaslt.h"  // MT_CUBLAS_CHECK
#include "cuda/gemm_splitk_guard.h"

namespace mt::cuda {
namespace {

cudaDataType_t fp8_cuda_type(Fp8Format f) { return f == Fp8Format::e4m3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

uint16_t alignment_of(const void* p) {
  if (!p) return 256;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  return static_cast<uint16_t>(std::min<uintptr_t>(a & (~a + 1), 256));
}

template <typename V>
void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const V& v) {
  MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof(v)));
}

}  // namespace

const char* fp8_format_name(Fp8Format f) { return f == Fp8Format::e4m3 ? "e4m3" : "e5m2"; }
float fp8_format_max(Fp8Format f) { return f == Fp8Format::e4m3 ? 448.0f : 57344.0f; }

bool Fp8GemmRunner::Key::operator==(const Key& o) const {
  return m == o.m && n == o.n && k == o.k && x_format == o.x_format && w_format == o.w_format &&
         out_type == o.out_type && accumulate == o.accumulate && has_bias == o.has_bias && has_amax == o.has_amax &&
         fast_accum == o.fast_accum && round_once == o.round_once && align_x == o.align_x && align_w == o.align_w &&
         align_out == o.align_out && align_bias == o.align_bias && sms == o.sms;
}

size_t Fp8GemmRunner::KeyHash::operator()(const Key& k) const {
  size_t h = 1469598103934665603ULL;
  auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ULL; };
  for (int64_t v : {k.m, k.n, k.k}) mix(static_cast<uint64_t>(v));
  for (unsigned v : {k.x_format, k.w_format, k.out_type, k.accumulate, k.has_bias, k.has_amax, k.fast_accum,
                     k.round_once})
    mix(v);
  for (unsigned v : {k.align_x, k.align_w, k.align_out, k.align_bias, k.sms}) mix(v);
  return h;
}

Fp8GemmRunner::Fp8GemmRunner(cudaStream_t stream, size_t workspace_bytes)
    : stream_(stream), workspace_bytes_(workspace_bytes) {
  MT_CUBLAS_CHECK(cublasLtCreate(&handle_));
  if (workspace_bytes_ > 0) MT_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
}

Fp8GemmRunner::~Fp8GemmRunner() {
  for (auto& [key, p] : plans_) {
    if (p.a) cublasLtMatrixLayoutDestroy(p.a);
    if (p.b) cublasLtMatrixLayoutDestroy(p.b);
    if (p.d) cublasLtMatrixLayoutDestroy(p.d);
    if (p.desc) cublasLtMatmulDescDestroy(p.desc);
  }
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(handle_);
}

void Fp8GemmRunner::check(const Fp8GemmCall& c, const char* what) const {
  MT_CHECK(c.m > 0 && c.n > 0 && c.k > 0, "{}: FP8 GEMM with an empty dimension (m={} n={} k={})", what, c.m, c.n,
           c.k);
  MT_CHECK(c.m % 16 == 0 && c.n % 16 == 0 && c.k % 16 == 0,
           "{}: FP8 GEMMs need every dimension a multiple of 16 (m={} n={} k={}); pad the sizes (e.g. "
           "--make-vocab-size-divisible-by, micro-batch x sequence length) or run without --fp8-format",
           what, c.m, c.n, c.k);
  MT_CHECK(!(c.x_format == Fp8Format::e5m2 && c.w_format == Fp8Format::e5m2),
           "{}: cuBLASLt has no e5m2 x e5m2 FP8 GEMM", what);
  MT_CHECK(c.x && c.w && c.out && c.x_scale_inv && c.w_scale_inv, "{}: FP8 GEMM with a null operand or scale", what);
  MT_CHECK(alignment_of(c.x) >= 16 && alignment_of(c.w) >= 16 && alignment_of(c.out) >= 16,
           "{}: FP8 GEMM operands must be 16-byte aligned", what);
  // Measured on the H200 (cuBLASLt 13.1): the heuristic accepts a scale pointer at a 4-byte
  // offset, then cublasLtMatmul returns NOT_SUPPORTED for it. The plan cache does not key on these
  // pointers, so they are required aligned here, with a clear message.
  MT_CHECK(alignment_of(c.x_scale_inv) >= 16 && alignment_of(c.w_scale_inv) >= 16,
           "{}: FP8 GEMM scale_inv pointers must be 16-byte aligned (space per-tensor scales 4 floats apart)", what);
  MT_CHECK(c.out_type == DType::bf16 || c.out_type == DType::f32, "{}: FP8 GEMM output must be bfloat16 or float32, got {}",
           what, dtype_name(c.out_type));
  MT_CHECK(c.beta == 0.0f || c.out_type == DType::f32, "{}: FP8 GEMM accumulation (beta != 0) needs a float32 output",
           what);
  MT_CHECK(!c.bias || c.out_type == DType::bf16, "{}: FP8 GEMM bias epilogue only with a bfloat16 output", what);
}

Fp8GemmRunner::Plan Fp8GemmRunner::make_plan(const Fp8GemmCall& c, const Key& key) {
  Plan p;
  MT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_desc(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set_desc(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  const int8_t fast = c.fast_accum ? 1 : 0;
  set_desc(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast);
  if (key.sms > 0) set_desc(p.desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, static_cast<int32_t>(key.sms));
  // Scale pointers are part of the descriptor; the heuristic only needs to know they are set.
  set_desc(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(c.w_scale_inv));
  set_desc(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(c.x_scale_inv));
  if (c.bias) {
    set_desc(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    const int32_t bias_type = CUDA_R_16BF;
    set_desc(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bias_type);
    set_desc(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, c.bias);
  }
  if (c.amax_out) set_desc(p.desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, static_cast<void*>(c.amax_out));
  const cudaDataType_t out_type = c.out_type == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F;
  MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, fp8_cuda_type(c.w_format), c.k, c.n, c.k));
  MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, fp8_cuda_type(c.x_format), c.k, c.m, c.k));
  MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, out_type, c.n, c.m, c.n));

  // The heuristic, first with the operands' real alignments and one result; if it offers nothing,
  // again asking for several results without alignment hints (the record says which attempt
  // succeeded and what each returned, for the error message).
  for (int attempt = 0; attempt < 2 && !p.ok; ++attempt) {
    cublasLtMatmulPreference_t pref = nullptr;
    MT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = workspace_bytes_;
    MT_CUBLAS_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    if (attempt == 0) {
      const uint32_t al_a = key.align_w, al_b = key.align_x, al_d = key.align_out;
      MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, 4));
      MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, 4));
      MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, 4));
      MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, 4));
    }
    if (c.round_once) {  // split-K only with float32 partial sums (unsplit algorithms are always allowed)
      const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
      MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes,
                                                           sizeof(schemes)));
    }
    cublasLtMatmulHeuristicResult_t results[kGuardedHeuristicResults]{};
    int found = 0;
    // More results where k has a tail, to pass over split-K ones (cuda/gemm_splitk_guard.h).
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.a, p.b, p.d, p.d, pref,
                                                             k_has_tail(c.k) ? kGuardedHeuristicResults
                                                             : attempt > 0   ? 8
                                                                             : 1,
                                                             results, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    p.diagnosis += fmt::format("{}heuristic attempt {}: {} ({} found)", attempt ? "; " : "", attempt,
                               cublasLtGetStatusString(st), found);
    if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE)
      MT_CUBLAS_CHECK(st);
    p.ok = splitk_safe_algos({handle_, p.desc, p.a, p.b, p.d}, results, found, c.k, true, &p.algo, 1, c.round_once) ==
           1;
    if (!p.ok && found > 0 && k_has_tail(c.k))
      p.diagnosis += fmt::format(" (split-K ones passed over: k {} is not a multiple of {})", c.k, kSplitKSafeMultiple);
  }
  return p;
}

bool Fp8GemmRunner::try_run(const Fp8GemmCall& c, const char* what) {
  check(c, what);
  Key key{c.m, c.n, c.k,
          static_cast<uint8_t>(c.x_format), static_cast<uint8_t>(c.w_format), static_cast<uint8_t>(c.out_type),
          c.beta != 0.0f, c.bias != nullptr, c.amax_out != nullptr, c.fast_accum, c.round_once,
          alignment_of(c.x), alignment_of(c.w), alignment_of(c.out), alignment_of(c.bias),
          static_cast<uint16_t>(sm_count_target)};
  auto it = plans_.find(key);
  if (it == plans_.end()) it = plans_.emplace(key, make_plan(c, key)).first;
  Plan& p = it->second;
  last_diagnosis_ = p.diagnosis;
  if (!p.ok) return false;
  set_desc(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(c.w_scale_inv));
  set_desc(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(c.x_scale_inv));
  if (c.bias) set_desc(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, c.bias);
  if (c.amax_out) set_desc(p.desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, static_cast<void*>(c.amax_out));
  const cublasStatus_t st = cublasLtMatmul(handle_, p.desc, &c.alpha, c.w, p.a, c.x, p.b, &c.beta, c.out, p.d, c.out,
                                           p.d, &p.algo, workspace_, workspace_bytes_, stream_);
  const bool optional_features = c.bias || c.amax_out;
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || (optional_features && st == CUBLAS_STATUS_INVALID_VALUE)) {
    p.ok = false;  // the chosen kernel cannot do the epilogue after all: decline from now on
    p.diagnosis += fmt::format("; cublasLtMatmul: {}", cublasLtGetStatusString(st));
    last_diagnosis_ = p.diagnosis;
    return false;
  }
  MT_CUBLAS_CHECK(st);
  return true;
}

void Fp8GemmRunner::run(const Fp8GemmCall& c, const char* what) {
  if (try_run(c, what)) return;
  // No algorithm for this many rows: the rows of x and out are independent, so run the product
  // in two row blocks (each a multiple of 16). Said once per shape; the bench reports it.
  if (c.m >= 32 && !c.amax_out) {
    const int64_t top = (c.m / 2 + 15) / 16 * 16;
    if (split_warned_.insert(c.m * 1000003 + c.n * 1009 + c.k).second)
      log::warn("{}: cuBLASLt has no FP8 algorithm for m={} n={} k={} ({}); running it as row blocks of {} and {}",
                what, c.m, c.n, c.k, last_diagnosis_, top, c.m - top);
    ++row_splits_;
    Fp8GemmCall a = c, b = c;
    a.m = top;
    b.m = c.m - top;
    b.x = static_cast<const uint8_t*>(c.x) + top * c.k;
    b.out = static_cast<char*>(c.out) + top * c.n * static_cast<int64_t>(dtype_size(c.out_type));
    run(a, what);
    run(b, what);
    return;
  }
  fail("{}: cuBLASLt has no FP8 algorithm for m={} n={} k={} ({} x {} -> {}{}{}{}): {}", what, c.m, c.n, c.k,
       fp8_format_name(c.x_format), fp8_format_name(c.w_format), dtype_name(c.out_type), c.bias ? ", bias" : "",
       c.amax_out ? ", amax" : "", c.fast_accum ? ", fast accumulation" : "", last_diagnosis_);
}

// ---- linear-layer mappings ----------------------------------------------------------------------
void fp8_linear_forward(Fp8GemmRunner& gemm, Tensor y, Fp8Operand x, Fp8Operand w, int64_t k_in, const void* bias) {
  MT_CHECK(y.dtype == DType::bf16 || y.dtype == DType::f32, "fp8_linear_forward: y must be bfloat16 or float32, got {}",
           dtype_name(y.dtype));
  Fp8GemmCall c;
  c.m = y.rows(), c.n = y.cols(), c.k = k_in;
  c.x = x.data, c.x_format = x.format, c.x_scale_inv = x.scale_inv;
  c.w = w.data, c.w_format = w.format, c.w_scale_inv = w.scale_inv;
  c.out = y.data, c.out_type = y.dtype;
  c.bias = bias;
  c.fast_accum = true;  // forward only, as Transformer Engine does
  gemm.run(c, "fp8_linear_forward");
}

void fp8_linear_backward_input(Fp8GemmRunner& gemm, Tensor dx, Fp8Operand dy, Fp8Operand w_t, int64_t n_out,
                               bool accumulate) {
  MT_CHECK(!accumulate || dx.dtype == DType::f32, "fp8_linear_backward_input: accumulation needs a float32 dx");
  Fp8GemmCall c;
  c.m = dx.rows(), c.n = dx.cols(), c.k = n_out;
  c.x = dy.data, c.x_format = dy.format, c.x_scale_inv = dy.scale_inv;
  c.w = w_t.data, c.w_format = w_t.format, c.w_scale_inv = w_t.scale_inv;
  c.out = dx.data, c.out_type = dx.dtype;
  c.beta = accumulate ? 1.0f : 0.0f;
  gemm.run(c, "fp8_linear_backward_input");
}

void fp8_linear_backward_weight(Fp8GemmRunner& gemm, Tensor dw, Fp8Operand dy_t, Fp8Operand x_t, int64_t tokens,
                                bool accumulate, const KernelContext* ctx) {
  const char* what = "fp8_linear_backward_weight";
  check_grad(dw, dw.numel(), what, "dw");
  Fp8GemmCall c;
  c.m = dw.rows(), c.n = dw.cols(), c.k = tokens;
  c.x = dy_t.data, c.x_format = dy_t.format, c.x_scale_inv = dy_t.scale_inv;
  c.w = x_t.data, c.w_format = x_t.format, c.w_scale_inv = x_t.scale_inv;
  c.out = dw.data, c.out_type = dw.dtype;
  c.beta = accumulate ? 1.0f : 0.0f;
  if (dw.dtype == DType::f32) {
    gemm.run(c, what);
    return;
  }
  // bf16 dw: without accumulate the GEMM writes it (beta 0, one rounding of the float32 result). With
  // accumulate the product goes to float32 scratch and is added (one rounding of dw + product): a
  // bf16 C with beta 1 was seen rounding the product before adding C (gemm_cublaslt.cu,
  // linear_backward_weight). Blocks of dw's rows, a multiple of 16 (the FP8 GEMMs' m).
  c.round_once = true;
  if (!accumulate) {
    gemm.run(c, what);
    return;
  }
  MT_CHECK(ctx && ctx->scratch, "{}: accumulating into a bfloat16 dw needs the kernel context (float32 scratch)", what);
  const int64_t rows_total = c.m, cols = c.n;
  const size_t row_bytes = static_cast<size_t>(cols) * sizeof(float);
  int64_t rows = static_cast<int64_t>(ctx->scratch->remaining() / row_bytes);  // as many as the scratch holds,
  rows = std::min(rows >= 128 ? rows / 128 * 128 : rows / 16 * 16, rows_total);  // whole tiles (m: multiples of 16)
  MT_CHECK(rows >= 1, "{}: scratch too small for 16 rows of {} floats", what, cols);
  float* tmp = ctx->scratch->take_array<float>(static_cast<size_t>(rows * cols), "fp8_linear_backward_weight (bf16 dw)");
  for (int64_t r0 = 0; r0 < rows_total; r0 += rows) {
    Fp8GemmCall cc = c;
    cc.m = std::min(rows, rows_total - r0);
    cc.x = static_cast<const uint8_t*>(c.x) + r0 * tokens;  // dy_t's rows r0.. (one byte per element)
    cc.out = tmp, cc.out_type = DType::f32;
    cc.beta = 0.0f;
    cc.round_once = false;
    gemm.run(cc, what);
    add_to_grad(*ctx, GradOut(dw.view({rows_total, cols}).row_slice(r0, cc.m)), tmp, cc.m * cols);
  }
}

}  // namespace mt::cuda

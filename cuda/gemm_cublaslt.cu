// cuBLASLt GEMMs for the linear layers; see gemm_cublaslt.h.
//
// The three mappings from row-major tensors to one column-major GEMM D[m, n] = op(A) op(B):
//   forward         y[M,N]  = x[M,K] w[N,K]^T : m=N n=M k=K, A = w (transposed, ld K), B = x (ld K), D = y (ld N)
//   backward input  dx[M,K] = dy[M,N] w[N,K]  : m=K n=M k=N, A = w (ld K), B = dy (ld N), D = dx (ld K)
//   backward weight dw[N,K] += dy^T x         : m=K n=N k=M, A = x (ld K), B = dy (transposed, ld N), D = dw (ld K)
// Epilogues: BIAS (bias per row of D = per output feature), GELU_AUX(_BIAS) and DGELU for the tanh
// GeLU only (cuBLASLt's GELU is the tanh approximation; the erf GeLU runs as a separate kernel),
// BGRADB for the bias gradient (column sums of dy over the GEMM's k = M), written to scratch and
// then added, since the epilogue overwrites and parameter gradients accumulate.
#include "cuda/gemm_cublaslt.h"

#include <algorithm>
#include <cstring>
#include <functional>

#include "cuda/cuda_check.h"
#include "cuda/device_utils.cuh"
#include "cuda/gemm_splitk_guard.h"

namespace mt::cuda {
namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
    default: fail("GEMM: dtype {} is not supported (float32, bfloat16, float16)", dtype_name(t));
  }
}

cublasLtEpilogue_t lt_epilogue(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::none: return CUBLASLT_EPILOGUE_DEFAULT;
    case GemmEpilogue::bias: return CUBLASLT_EPILOGUE_BIAS;
    case GemmEpilogue::gelu: return CUBLASLT_EPILOGUE_GELU;
    case GemmEpilogue::gelu_bias: return CUBLASLT_EPILOGUE_GELU_BIAS;
    case GemmEpilogue::gelu_aux: return CUBLASLT_EPILOGUE_GELU_AUX;
    case GemmEpilogue::gelu_aux_bias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case GemmEpilogue::dgelu: return CUBLASLT_EPILOGUE_DGELU;
    case GemmEpilogue::bgradb: return CUBLASLT_EPILOGUE_BGRADB;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

// Alignment of a pointer in bytes, capped at 256 (cuBLASLt's default assumption).
uint16_t alignment_of(const void* p) {
  if (!p) return 256;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uintptr_t al = a & (~a + 1);
  return static_cast<uint16_t>(std::min<uintptr_t>(al, 256));
}

template <typename V>
void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const V& v) {
  MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof(v)));
}

}  // namespace

bool GemmRunner::Key::operator==(const Key& o) const {
  return m == o.m && n == o.n && k == o.k && lda == o.lda && ldb == o.ldb && ldd == o.ldd && aux_ld == o.aux_ld &&
         trans_a == o.trans_a && trans_b == o.trans_b && a_type == o.a_type && b_type == o.b_type &&
         d_type == o.d_type && epilogue == o.epilogue && accumulate == o.accumulate && round_once == o.round_once &&
         align_a == o.align_a &&
         align_b == o.align_b && align_d == o.align_d && align_bias == o.align_bias && align_aux == o.align_aux && sms == o.sms;
}

size_t GemmRunner::KeyHash::operator()(const Key& k) const {
  size_t h = 1469598103934665603ULL;
  auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ULL; };
  for (int64_t v : {k.m, k.n, k.k, k.lda, k.ldb, k.ldd, k.aux_ld}) mix(static_cast<uint64_t>(v));
  for (unsigned v : {k.trans_a, k.trans_b, k.a_type, k.b_type, k.d_type, k.epilogue, k.accumulate, k.round_once}) mix(v);
  for (unsigned v : {k.align_a, k.align_b, k.align_d, k.align_bias, k.align_aux, k.sms}) mix(v);
  return h;
}

GemmRunner::GemmRunner(cudaStream_t stream, size_t workspace_bytes)
    : stream_(stream), workspace_bytes_(workspace_bytes) {
  MT_CUBLAS_CHECK(cublasLtCreate(&handle_));
  MT_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
  MT_CUDA_CHECK(cudaEventCreate(&tune_start_));
  MT_CUDA_CHECK(cudaEventCreate(&tune_stop_));
}

GemmRunner::~GemmRunner() {
  for (auto& [key, p] : plans_) {
    if (p.a) cublasLtMatrixLayoutDestroy(p.a);
    if (p.b) cublasLtMatrixLayoutDestroy(p.b);
    if (p.d) cublasLtMatrixLayoutDestroy(p.d);
    if (p.desc) cublasLtMatmulDescDestroy(p.desc);
  }
  if (workspace_) cudaFree(workspace_);
  if (tune_start_) cudaEventDestroy(tune_start_);
  if (tune_stop_) cudaEventDestroy(tune_stop_);
  if (handle_) cublasLtDestroy(handle_);
}

GemmRunner::Plan GemmRunner::make_plan(const GemmCall& c, const Key& key) {
  Plan p;
  MT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = c.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = c.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  set_desc(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, ta);
  set_desc(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, tb);
  set_desc(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, lt_epilogue(c.epilogue));
  if (key.sms > 0) set_desc(p.desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, static_cast<int32_t>(key.sms));
  // The heuristic reads the epilogue pointers' values for their alignment.
  if (c.bias) set_desc(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, c.bias);
  if (c.aux) {
    set_desc(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, c.aux);
    set_desc(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, c.aux_ld);
  }
  MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, cuda_type(c.a_type), c.trans_a ? c.k : c.m, c.trans_a ? c.m : c.k,
                                             c.lda));
  MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, cuda_type(c.b_type), c.trans_b ? c.n : c.k, c.trans_b ? c.k : c.n,
                                             c.ldb));
  MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, cuda_type(c.d_type), c.m, c.n, c.ldd));

  cublasLtMatmulPreference_t pref = nullptr;
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = workspace_bytes_;
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const uint32_t al_a = key.align_a, al_b = key.align_b, al_d = key.align_d;
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, 4));
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, 4));
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, 4));
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, 4));
  if (c.round_once) {  // split-K only with partial sums in float32 (unsplit algorithms are always allowed)
    const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    MT_CUBLAS_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof(schemes)));
  }

  static_assert(kGuardedHeuristicResults >= kTuneCandidates);
  cublasLtMatmulHeuristicResult_t results[kGuardedHeuristicResults]{};
  int found = 0;
  const bool tunable = autotune && c.beta == 0.0f;
  const bool guarded = avoid_splitk_with_k_tail && k_has_tail(c.k);  // more results, to pass over split-K ones
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.a, p.b, p.d, p.d, pref,
                                                           guarded ? kGuardedHeuristicResults
                                                           : tunable ? kTuneCandidates : 1,
                                                           results, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0) {
    cublasLtMatmulAlgo_t usable[kTuneCandidates];
    const int n = splitk_safe_algos({handle_, p.desc, p.a, p.b, p.d}, results, found, c.k, avoid_splitk_with_k_tail,
                                    usable, kTuneCandidates, c.round_once);
    if (n > 0) {
      p.ok = true;
      p.algo = usable[0];
      if (tunable && n > 1)
        for (int i = 0; i < n; ++i) p.candidates[p.num_candidates++] = usable[i];
    }
  } else if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED) {
    MT_CUBLAS_CHECK(st);
  }
  return p;
}

namespace {

// Byte ranges [p, p + bytes) overlap (null pointers never do).
bool overlaps(const void* p, size_t p_bytes, const void* q, size_t q_bytes) {
  if (!p || !q) return false;
  const auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(q);
  return a < b + q_bytes && b < a + p_bytes;
}

}  // namespace

// Times every candidate on the call's own buffers (each run rewrites the same outputs: beta = 0,
// and the output overlaps no input) and keeps the fastest unless it beats the heuristic's first
// pick by less than 1% (timing noise). The host waits for the timings: once per GEMM shape.
void GemmRunner::tune(const GemmCall& c, Plan& p) {
  const int count = p.num_candidates;
  p.num_candidates = 0;
  p.tuned = true;
  ++tuned_;
  const size_t d_bytes = static_cast<size_t>(c.ldd) * static_cast<size_t>(c.n) * dtype_size(c.d_type);
  const size_t a_bytes = static_cast<size_t>(c.lda) * static_cast<size_t>(c.trans_a ? c.m : c.k) * dtype_size(c.a_type);
  const size_t b_bytes = static_cast<size_t>(c.ldb) * static_cast<size_t>(c.trans_b ? c.k : c.n) * dtype_size(c.b_type);
  const size_t aux_bytes = static_cast<size_t>(c.aux_ld) * static_cast<size_t>(c.n) * dtype_size(c.d_type);
  if (overlaps(c.d, d_bytes, c.a, a_bytes) || overlaps(c.d, d_bytes, c.b, b_bytes) ||
      overlaps(c.d, d_bytes, c.aux, aux_bytes) || overlaps(c.aux, aux_bytes, c.a, a_bytes) ||
      overlaps(c.aux, aux_bytes, c.b, b_bytes))
    return;
  constexpr int kReps = 3;
  float best_ms = 0.0f, first_ms = 0.0f;
  int best = 0;
  for (int i = 0; i < count; ++i) {
    const cublasLtMatmulAlgo_t* algo = &p.candidates[i];
    // (warm-up) a candidate that cannot run this call is passed over
    if (cublasLtMatmul(handle_, p.desc, &c.alpha, c.a, p.a, c.b, p.b, &c.beta, c.d, p.d, c.d, p.d, algo, workspace_,
                       workspace_bytes_, stream_) != CUBLAS_STATUS_SUCCESS)
      continue;
    MT_CUDA_CHECK(cudaEventRecord(tune_start_, stream_));
    for (int r = 0; r < kReps; ++r)
      MT_CUBLAS_CHECK(cublasLtMatmul(handle_, p.desc, &c.alpha, c.a, p.a, c.b, p.b, &c.beta, c.d, p.d, c.d, p.d, algo,
                                     workspace_, workspace_bytes_, stream_));
    MT_CUDA_CHECK(cudaEventRecord(tune_stop_, stream_));
    MT_CUDA_CHECK(cudaEventSynchronize(tune_stop_));
    float ms = 0.0f;
    MT_CUDA_CHECK(cudaEventElapsedTime(&ms, tune_start_, tune_stop_));
    if (i == 0) first_ms = ms;
    if (i == 0 || ms < best_ms) {
      best_ms = ms;
      best = i;
    }
  }
  if (best != 0 && first_ms > 0.0f && best_ms < 0.99f * first_ms) p.algo = p.candidates[best];
}

namespace {
const void* advance(const void* p, DType t, int64_t elements) {
  return static_cast<const char*>(p) + elements * static_cast<int64_t>(dtype_size(t));
}
}  // namespace

// A float32 output without an epilogue, and a k with a tail (not a multiple of 256): the whole-256
// part of k as one GEMM, with any algorithm (split-K included: that part has no tail), then the
// tail added by a second GEMM (beta 1). Weight gradients over an odd token count keep the split-K
// kernels the heuristic prefers for a long k, and their shorter float32 accumulation chains (one
// unsplit chain over k = 8193 measured 1.6e-5 relative error, split ones under 1e-5). Other
// outputs would be rounded twice, so they run as one GEMM without split-K algorithms (make_plan).
bool GemmRunner::try_run(const GemmCall& c) {
  const int64_t k_main = c.k / kSplitKSafeMultiple * kSplitKSafeMultiple;
  if (!avoid_splitk_with_k_tail || k_main == 0 || k_main == c.k || c.epilogue != GemmEpilogue::none ||
      c.d_type != DType::f32)
    return try_run_one(c);
  GemmCall main = c, tail = c;
  main.k = k_main;
  tail.k = c.k - k_main;
  tail.beta = 1.0f;
  // op(A) is m x k: stored k x m (k contiguous) when transposed, else m x k (k strided by lda);
  // op(B) is k x n: stored n x k (k strided by ldb) when transposed, else k x n.
  tail.a = advance(c.a, c.a_type, c.trans_a ? k_main : k_main * c.lda);
  tail.b = advance(c.b, c.b_type, c.trans_b ? k_main * c.ldb : k_main);
  if (!try_run_one(main)) return false;
  // D now holds part of the sum, so no false from here (a caller's fallback would add it again).
  if (!try_run_one(tail))
    fail("GEMM m={} n={} k={}: cuBLASLt has no algorithm for the last {} of k that does not split it", c.m, c.n,
         c.k, tail.k);
  return true;
}

bool GemmRunner::try_run_one(const GemmCall& c) {
  Key key{c.m, c.n, c.k, c.lda, c.ldb, c.ldd, c.aux ? c.aux_ld : 0,
          c.trans_a, c.trans_b, static_cast<uint8_t>(c.a_type), static_cast<uint8_t>(c.b_type),
          static_cast<uint8_t>(c.d_type), static_cast<uint8_t>(c.epilogue), c.beta != 0.0f, c.round_once,
          alignment_of(c.a), alignment_of(c.b), alignment_of(c.d), alignment_of(c.bias), alignment_of(c.aux),
          static_cast<uint16_t>(sm_count_target)};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    Plan plan = make_plan(c, key);
    if (plan.ok && key.accumulate && autotune && reuse_tuned_for_accumulate) {
      Key writes = key;
      writes.accumulate = 0;
      const auto twin = plans_.find(writes);
      if (twin != plans_.end() && twin->second.ok && twin->second.tuned) plan.algo = twin->second.algo;
    }
    it = plans_.emplace(key, plan).first;
  }
  Plan& p = it->second;
  if (!p.ok) return false;
  if (c.bias) set_desc(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, c.bias);
  if (c.aux) set_desc(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, c.aux);
  if (p.num_candidates > 0) tune(c, p);
  const cublasStatus_t st = cublasLtMatmul(handle_, p.desc, &c.alpha, c.a, p.a, c.b, p.b, &c.beta, c.d, p.d, c.d,
                                           p.d, &p.algo, workspace_, workspace_bytes_, stream_);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) {  // an epilogue the chosen kernel cannot do after all: decline
    p.ok = false;
    return false;
  }
  MT_CUBLAS_CHECK(st);
  return true;
}

void GemmRunner::run(const GemmCall& c, const char* what) {
  if (!try_run(c))
    fail("{}: cuBLASLt has no algorithm for m={} n={} k={} ({} x {} -> {}){}", what, c.m, c.n, c.k,
         dtype_name(c.a_type), dtype_name(c.b_type), dtype_name(c.d_type),
         avoid_splitk_with_k_tail && k_has_tail(c.k)
             ? fmt::format(" that does not split k (k is not a multiple of {}; see cuda/gemm_splitk_guard.h)",
                           kSplitKSafeMultiple)
             : std::string());
}

// ---- column sums for the bias gradient (when the BGRADB epilogue is off or unavailable) ----------
namespace {

constexpr int kColThreads = 32, kRowThreads = 8;

// Block (32 x 8) sums rows [chunk_begin, chunk_end) of a strip of 32 * VEC columns: thread row ty
// takes every 8th row, then the 8 partial sums are added in ty order.
template <typename T, int VEC>
__global__ void column_partial_kernel(float* partial, const T* dy, int64_t rows, int64_t cols, int64_t rows_per_chunk) {
  __shared__ float acc[kRowThreads][kColThreads * VEC];
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * kColThreads + threadIdx.x) * VEC;
  const int64_t r_begin = blockIdx.y * rows_per_chunk, r_end = std::min(rows, r_begin + rows_per_chunk);
  float s[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) s[j] = 0.0f;
  if (c0 < cols) {
    // Four rows' loads in flight per thread (one at a time left the loop latency-bound, ~2.4 TB/s),
    // added in the same row order as one at a time, so the sums keep their bits.
    int64_t r = r_begin + threadIdx.y;
    for (; r + 3 * kRowThreads < r_end; r += 4 * kRowThreads) {
      Floats<VEC> v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = load_vec<VEC>(dy + (r + u * kRowThreads) * cols + c0);
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int j = 0; j < VEC; ++j) s[j] += v[u].v[j];
    }
    for (; r < r_end; r += kRowThreads) {
      const Floats<VEC> v = load_vec<VEC>(dy + r * cols + c0);
#pragma unroll
      for (int j = 0; j < VEC; ++j) s[j] += v.v[j];
    }
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[threadIdx.y][threadIdx.x * VEC + j] = s[j];
  __syncthreads();
  if (threadIdx.y == 0 && c0 < cols) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      float t = 0.0f;
      for (int y = 0; y < kRowThreads; ++y) t += acc[y][threadIdx.x * VEC + j];
      partial[blockIdx.y * cols + c0 + j] = t;
    }
  }
}

template <typename G>
__global__ void column_finish_kernel(G* dbias, const float* partial, int chunks, int64_t cols) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float s = 0.0f;
  for (int g = 0; g < chunks; ++g) s += partial[g * cols + c];
  grad_add(dbias + c, s);
}

}  // namespace

void column_sum_accumulate(const KernelContext& ctx, Tensor dbias, Tensor dy) {
  const int64_t rows = dy.rows(), cols = dy.cols();
  check_grad(dbias, cols, "bias gradient (column sums)", "dbias");
  MT_CHECK(!dbias.empty(), "bias gradient (column sums): no dbias");
  if (rows == 0 || cols == 0) return;
  MT_DISPATCH_FLOAT(dy.dtype, T, "bias gradient", {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = aligned16(dy.data) && cols % kVec == 0;
    const int per_block_cols = kColThreads * (vec ? kVec : 1);
    const int64_t strips = (cols + per_block_cols - 1) / per_block_cols;
    // Enough row chunks to fill the GPU about four times over; a function of the shape only.
    int64_t chunks = std::max<int64_t>(1, (4LL * ctx.num_sms + strips - 1) / strips);
    chunks = std::min<int64_t>({chunks, 256, (rows + kRowThreads - 1) / kRowThreads});
    const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
    chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
    float* partial = ctx.scratch->take_array<float>(chunks * cols, "bias gradient partial sums");
    const dim3 grid(static_cast<unsigned>(strips), static_cast<unsigned>(chunks)), block(kColThreads, kRowThreads);
    if (vec)
      column_partial_kernel<T, kVec><<<grid, block, 0, ctx.stream>>>(partial, dy.ptr<const T>(), rows, cols, rows_per_chunk);
    else
      column_partial_kernel<T, 1><<<grid, block, 0, ctx.stream>>>(partial, dy.ptr<const T>(), rows, cols, rows_per_chunk);
    MT_CUDA_CHECK_LAUNCH();
    column_partials_accumulate(ctx, GradOut(dbias), partial, chunks, cols);
  });
}

void column_partials_accumulate(const KernelContext& ctx, GradOut dbias, const float* partial, int64_t chunks,
                                int64_t cols) {
  if (cols == 0) return;
  MT_DISPATCH_GRAD(dbias.dtype, G, "bias gradient (column sums)", {
    column_finish_kernel<G><<<static_cast<unsigned>((cols + 255) / 256), 256, 0, ctx.stream>>>(
        static_cast<G*>(dbias.data), partial, static_cast<int>(chunks), cols);
  });
  MT_CUDA_CHECK_LAUNCH();
}

// ---- linear layers ------------------------------------------------------------------------------
void linear_forward(GemmRunner& gemm, const KernelContext& ctx, Tensor y, Tensor x, Tensor w, Tensor bias,
                    Activation act, Tensor pre_act) {
  const int64_t M = x.rows(), K = x.cols(), N = w.rows();
  MT_CHECK(w.cols() == K && y.rows() == M && y.cols() == N, "linear_forward: y {} = x {} . w {}^T", y.shape_string(),
           x.shape_string(), w.shape_string());
  MT_CHECK(x.dtype == w.dtype && y.dtype == x.dtype, "linear_forward: dtypes of y, x, w differ");
  MT_CHECK(bias.empty() || (bias.numel() == N && bias.dtype == x.dtype), "linear_forward: bias {}", bias.shape_string());
  MT_CHECK(pre_act.empty() || (pre_act.numel() == M * N && pre_act.dtype == y.dtype), "linear_forward: pre_act {}",
           pre_act.shape_string());
  MT_CHECK(K > 0, "linear_forward: empty reduction dimension");
  if (M == 0 || N == 0) return;
  GemmCall c;
  c.trans_a = true;
  c.m = N, c.n = M, c.k = K;
  c.a = w.data, c.a_type = w.dtype, c.lda = K;
  c.b = x.data, c.b_type = x.dtype, c.ldb = K;
  c.d_type = y.dtype, c.ldd = N;
  const bool has_bias = !bias.empty();
  if (act == Activation::gelu_tanh && gemm.use_gelu_epilogue) {
    c.d = y.data;
    c.bias = bias.data;
    if (pre_act.empty()) {
      c.epilogue = has_bias ? GemmEpilogue::gelu_bias : GemmEpilogue::gelu;
      if (gemm.try_run(c)) return;
    } else if (N % 8 == 0) {  // cuBLASLt needs the aux leading dimension divisible by 8
      c.epilogue = has_bias ? GemmEpilogue::gelu_aux_bias : GemmEpilogue::gelu_aux;
      c.aux = pre_act.data;
      c.aux_ld = N;
      if (gemm.try_run(c)) return;
    }
  }
  // GEMM (+ bias) into the pre-activation, then the activation as its own kernel.
  const Tensor target = (act != Activation::none && !pre_act.empty()) ? pre_act : y;
  c.d = target.data;
  c.epilogue = has_bias ? GemmEpilogue::bias : GemmEpilogue::none;
  c.bias = bias.data;
  c.aux = nullptr;
  c.aux_ld = 0;
  gemm.run(c, "linear_forward");
  if (act != Activation::none) activation_forward(ctx, y, target, act);
}

void linear_backward_input(GemmRunner& gemm, const KernelContext& ctx, Tensor dx, Tensor dy, Tensor w,
                           bool accumulate, Activation act, Tensor pre_act) {
  const int64_t M = dy.rows(), N = dy.cols(), K = w.cols();
  MT_CHECK(w.rows() == N && dx.rows() == M && dx.cols() == K, "linear_backward_input: dx {} = dy {} . w {}",
           dx.shape_string(), dy.shape_string(), w.shape_string());
  MT_CHECK(dy.dtype == w.dtype && dx.dtype == dy.dtype, "linear_backward_input: dtypes of dx, dy, w differ");
  MT_CHECK(N > 0, "linear_backward_input: empty reduction dimension");
  if (M == 0 || K == 0) return;
  GemmCall c;
  c.m = K, c.n = M, c.k = N;
  c.a = w.data, c.a_type = w.dtype, c.lda = K;
  c.b = dy.data, c.b_type = dy.dtype, c.ldb = N;
  c.d = dx.data, c.d_type = dx.dtype, c.ldd = K;
  if (act == Activation::none) {
    c.beta = accumulate ? 1.0f : 0.0f;
    gemm.run(c, "linear_backward_input");
    return;
  }
  MT_CHECK(pre_act.numel() == M * K && pre_act.dtype == dx.dtype, "linear_backward_input: pre_act {} for dx {}",
           pre_act.shape_string(), dx.shape_string());
  if (!accumulate) {
    if (act == Activation::gelu_tanh && gemm.use_gelu_epilogue && K % 8 == 0) {
      c.epilogue = GemmEpilogue::dgelu;
      c.aux = pre_act.data;
      c.aux_ld = K;
      if (gemm.try_run(c)) return;
      c.epilogue = GemmEpilogue::none;
      c.aux = nullptr;
      c.aux_ld = 0;
    }
    gemm.run(c, "linear_backward_input");
    activation_grad_multiply(ctx, dx, dx, pre_act, act, false);
    return;
  }
  // dx += (dy . w) * act'(pre_act): the product goes through float32 scratch, a row chunk at a time.
  const int64_t chunk = std::min<int64_t>(M, static_cast<int64_t>(ctx.scratch->remaining() / (K * sizeof(float))));
  MT_CHECK(chunk >= 1, "linear_backward_input: scratch too small for one row of {} floats", K);
  float* tmp = ctx.scratch->take_array<float>(chunk * K, "linear_backward_input accumulate");
  const size_t dy_elem = dtype_size(dy.dtype);
  for (int64_t r0 = 0; r0 < M; r0 += chunk) {
    const int64_t rows = std::min(chunk, M - r0);
    GemmCall cc = c;
    cc.n = rows;
    cc.b = static_cast<const char*>(dy.data) + r0 * N * dy_elem;
    cc.d = tmp, cc.d_type = DType::f32, cc.ldd = K;
    gemm.run(cc, "linear_backward_input");
    activation_grad_multiply(ctx, dx.row_slice(r0, rows), Tensor(tmp, DType::f32, Device::cuda, {rows, K}),
                             pre_act.view({M, K}).row_slice(r0, rows), act, true);
  }
}

namespace {

// Rows of a bf16 weight gradient per float32 GEMM chunk: as many as the scratch holds, a multiple of
// 128 (dy's column offset stays 256-byte aligned; a chunk of 571 rows made the GEMM 4x slower). On an
// H200 (M 8192, bf16) the accumulating bf16 path took 5-20% longer than the float32 one with 48 MiB
// chunks (12 MiB: 9-30%), mostly the add's memory traffic.
constexpr int64_t kBf16GradChunkRowMultiple = 128;

// linear_backward_weight into a bf16 dw (--grad-reduce-in-bf16): dw = round_bf16(dw + dy^T x), the
// product in float32 and the sum rounded once. Without accumulate (bf16 inputs) that is the GEMM
// with a bf16 D (beta 0: one rounding of the float32 result; split-K only with float32 partial
// sums). With accumulate, cuBLASLt's bf16 C is NOT used: on an H200 (cuBLASLt 13.1) GEMMs with
// beta 1 and bf16 C/D gave results one rounding of the product away from round_bf16(C + product)
// (the product rounded to bf16 before C was added: all-ones k = 8193 onto C = -8192 gave 0, not 1).
// So the product goes to float32 scratch, a block of dw's rows at a time, and add_to_grad adds it
// (or, without accumulate and with float32/float16 inputs, cast writes it).
void linear_backward_weight_bf16(GemmRunner& gemm, const KernelContext& ctx, GemmCall c, Tensor dw, Tensor dbias,
                                 Tensor dy, bool accumulate) {
  const int64_t N = dw.rows(), K = dw.cols();
  if (!dbias.empty()) column_sum_accumulate(ctx, dbias, dy);  // first: its scratch is free again below
  if (!accumulate && dy.dtype == DType::bf16) {
    c.round_once = true;
    gemm.run(c, "linear_backward_weight");
    return;
  }
  ctx.scratch->reset();  // the column sums' kernels precede the GEMMs on the stream
  const size_t row_bytes = static_cast<size_t>(K) * sizeof(float);
  int64_t rows = static_cast<int64_t>(ctx.scratch->remaining() / row_bytes);
  if (rows < N && rows >= kBf16GradChunkRowMultiple) rows = rows / kBf16GradChunkRowMultiple * kBf16GradChunkRowMultiple;
  rows = std::min(rows, N);
  MT_CHECK(rows >= 1, "linear_backward_weight: scratch too small for one row of {} floats", K);
  float* tmp = ctx.scratch->take_array<float>(static_cast<size_t>(rows * K), "linear_backward_weight (bf16 dw)");
  const size_t dy_elem = dtype_size(dy.dtype);
  for (int64_t n0 = 0; n0 < N; n0 += rows) {
    const int64_t nn = std::min(rows, N - n0);
    GemmCall cc = c;  // D[K, nn] = x^T dy[:, n0 : n0 + nn] (column-major), float32, overwritten
    cc.n = nn;
    cc.b = static_cast<const char*>(dy.data) + n0 * dy_elem;
    cc.d = tmp, cc.d_type = DType::f32;
    cc.beta = 0.0f;
    gemm.run(cc, "linear_backward_weight");
    if (accumulate) add_to_grad(ctx, GradOut(dw.row_slice(n0, nn)), tmp, nn * K);
    else cast(ctx, dw.row_slice(n0, nn), Tensor(tmp, DType::f32, Device::cuda, {nn, K}));
  }
}

}  // namespace

void linear_backward_weight(GemmRunner& gemm, const KernelContext& ctx, Tensor dw, Tensor dbias, Tensor dy, Tensor x,
                            bool accumulate) {
  const int64_t M = dy.rows(), N = dy.cols(), K = x.cols();
  MT_CHECK(x.rows() == M && dw.rows() == N && dw.cols() == K, "linear_backward_weight: dw {} += dy {}^T . x {}",
           dw.shape_string(), dy.shape_string(), x.shape_string());
  MT_CHECK(dy.dtype == x.dtype, "linear_backward_weight: dtypes of dy and x differ");
  // dw: the float32 main grad, or bfloat16 (--grad-reduce-in-bf16), or the inputs' own dtype.
  if (dw.dtype != DType::f32 && dw.dtype != DType::bf16 && dw.dtype != x.dtype)
    fail("linear_backward_weight: dw is {} for {} inputs; it must be float32, bfloat16 or the inputs' dtype",
         dtype_name(dw.dtype), dtype_name(x.dtype));
  check_grad(dbias, N, "linear_backward_weight", "dbias");
  if (M == 0 || N == 0 || K == 0) return;
  GemmCall c;
  c.trans_b = true;
  c.m = K, c.n = N, c.k = M;
  c.a = x.data, c.a_type = x.dtype, c.lda = K;
  c.b = dy.data, c.b_type = dy.dtype, c.ldb = N;
  c.d = dw.data, c.d_type = dw.dtype, c.ldd = K;
  // beta 0 (the first write of a step's gradient): cuBLASLt does not read D, and the GEMM is one
  // the runner may autotune (GemmRunner::make_plan).
  c.beta = accumulate ? 1.0f : 0.0f;
  if (dw.dtype == DType::bf16) {
    linear_backward_weight_bf16(gemm, ctx, c, dw, dbias, dy, accumulate);
    return;
  }
  if (!dbias.empty() && gemm.use_bias_grad_epilogue && dw.dtype == DType::f32 && dbias.dtype == DType::f32) {
    float* tmp = ctx.scratch->take_array<float>(N, "bias gradient");
    c.epilogue = GemmEpilogue::bgradb;
    c.bias = tmp;
    if (gemm.try_run(c)) {
      add_f32(ctx, dbias.ptr<float>(), tmp, N);
      return;
    }
    c.epilogue = GemmEpilogue::none;
    c.bias = nullptr;
  }
  gemm.run(c, "linear_backward_weight");
  if (!dbias.empty()) column_sum_accumulate(ctx, dbias, dy);
}

void linear_backward_input_recompute(GemmRunner& gemm, const KernelContext& ctx, Tensor dx, Tensor act_out, Tensor dy,
                                     Tensor w, Activation act, Tensor pre_act) {
  MT_CHECK(act != Activation::none, "linear_backward_input_recompute needs an activation");
  MT_CHECK(pre_act.numel() == dx.numel() && act_out.numel() == dx.numel(),
           "linear_backward_input_recompute: pre_act {} and act_out {} for dx {}", pre_act.shape_string(),
           act_out.shape_string(), dx.shape_string());
  if (act == Activation::gelu_tanh && gemm.use_gelu_epilogue) {
    // The DGELU epilogue (faster than GEMM + kernel for the tanh form), then the activation. (The
    // forward's GELU_AUX epilogue computed the activation from the unrounded GEMM result; this
    // one starts from the stored pre-activation, so it can differ from it in the last bit.)
    linear_backward_input(gemm, ctx, dx, dy, w, false, act, pre_act);
    activation_forward(ctx, act_out, pre_act, act);
    return;
  }
  linear_backward_input(gemm, ctx, dx, dy, w, false, Activation::none, Tensor());
  activation_grad_recompute(ctx, dx, act_out, pre_act, act);
}

}  // namespace mt::cuda

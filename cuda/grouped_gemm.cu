// cuda/grouped_gemm.h. The row-major to column-major mappings are those of the linear layers
// (cuda/gemm_cublaslt.cu), per expert e with M_e rows:
//   forward         y_e[M_e,N]  = x_e[M_e,K] w_e[N,K]^T : m=N n=M_e k=K, A = w_e (T, ld K), B = x_e (N, ld K), C = y_e (ld N)
//   backward input  dx_e[M_e,K] = dy_e[M_e,N] w_e[N,K]  : m=K n=M_e k=N, A = w_e (N, ld K), B = dy_e (N, ld N), C = dx_e (ld K)
//   backward weight dw_e[N,K] (+)= dy_e^T x_e            : m=K n=N k=M_e, A = x_e (N, ld K), B = dy_e (T, ld N), C = dw_e (ld K)
// float32 accumulation (CUBLAS_COMPUTE_32F) for every dtype; C may be float32 (main gradients)
// with bf16/fp16 inputs.
#include "cuda/grouped_gemm.h"

#include <algorithm>
#include <limits>

#include "core/error.h"
#include "cuda/bench_choice.h"
#include "cuda/cuda_check.h"
#include "cuda/grouped_gemm_mma.h"

namespace mt::cuda {
namespace {

cudaDataType_t cublas_type(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
    default: fail("grouped GEMM: dtype {} is not supported (float32, bfloat16, float16)", dtype_name(t));
  }
}

void check_cublas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) fail("cuBLAS {} failed: status {}", what, static_cast<int>(s));
}

int as_int(int64_t v, const char* what) {
  MT_CHECK(v >= 0 && v <= std::numeric_limits<int>::max(), "grouped GEMM: {} = {} exceeds int", what, v);
  return static_cast<int>(v);
}

const char* byte_ptr(const Tensor& t, int64_t row) {
  return static_cast<const char*>(t.data) + row * t.cols() * static_cast<int64_t>(dtype_size(t.dtype));
}

}  // namespace

bool GroupedGemm::own_kernel(GroupedOp op, const Tensor& c, const Tensor& a, const Tensor& b,
                             const ExpertOffsets& o) const {
  using bench_choice::GroupedGemmPath;
  const int64_t E = o.experts();
  if (bench_choice::grouped_gemm_path == GroupedGemmPath::cublas || !grouped_mma_takes(op, c, a, b, E)) return false;
  if (bench_choice::grouped_gemm_path != GroupedGemmPath::automatic || !o.on_host()) return true;
  int64_t with_rows = 0;  // the mean over experts with rows, as run() takes it
  for (int64_t e = 0; e < E; ++e) with_rows += o.host[static_cast<size_t>(e) + 1] > o.host[static_cast<size_t>(e)];
  return o.host.back() / std::max<int64_t>(with_rows, 1) < kPerExpertRows;
}

GroupedKernel GroupedGemm::own_kernel_body() {
  switch (bench_choice::grouped_gemm_path) {
    case bench_choice::GroupedGemmPath::mma_cp_async: return GroupedKernel::wgmma;
    case bench_choice::GroupedGemmPath::mma_sync: return GroupedKernel::mma_sync;
    default: return GroupedKernel::best;
  }
}

const int32_t* GroupedGemm::device_offsets(const ExpertOffsets& o, int64_t rows) {
  if (!o.on_host()) {
    MT_CHECK(o.device.dtype == DType::i32 && o.device.device == Device::cuda,
             "grouped GEMM: device offsets must be int32 on the GPU");
    return static_cast<const int32_t*>(o.device.data);
  }
  const size_t n = o.host.size();
  MT_CHECK(n >= 2 && n <= static_cast<size_t>(max_groups_) + 1 && o.host.front() == 0 && o.host.back() == rows,
           "grouped GEMM: {} offsets ending at {} for {} rows (set up for {} experts)", n, o.host.back(), rows,
           max_groups_);
  for (size_t i = 0; i < n; ++i) offsets32_[i] = static_cast<int32_t>(o.host[i]);
  MT_CUDA_CHECK(cudaMemcpyAsync(device_offsets_, offsets32_.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  return device_offsets_;
}

std::span<const int64_t> GroupedGemm::host_offsets(const ExpertOffsets& o) {
  if (o.on_host()) return o.host;
  const size_t n = static_cast<size_t>(o.device.numel());
  MT_CHECK(o.device.dtype == DType::i32 && n <= offsets32_.size(), "grouped GEMM: device offsets must be int32, at most {}",
           offsets32_.size());
  MT_CUDA_CHECK(cudaMemcpyAsync(offsets32_.data(), o.device.data, n * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  MT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  offsets64_.assign(offsets32_.begin(), offsets32_.begin() + static_cast<std::ptrdiff_t>(n));
  return offsets64_;
}

GroupedGemm::GroupedGemm(cudaStream_t stream, int max_groups, size_t workspace_bytes)
    : stream_(stream), max_groups_(max_groups) {
  check_cublas(cublasCreate(&handle_), "cublasCreate");
  check_cublas(cublasSetStream(handle_, stream_), "cublasSetStream");
  check_cublas(cublasSetPointerMode(handle_, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode");
  MT_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes));
  workspace_bytes_ = workspace_bytes;
  // cuBLAS allocates nothing of its own later: its workspace is this one.
  check_cublas(cublasSetWorkspace(handle_, workspace_, workspace_bytes), "cublasSetWorkspace");
  MT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&device_ptrs_), 3 * sizeof(void*) * static_cast<size_t>(max_groups)));
  MT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&device_offsets_), sizeof(int32_t) * (static_cast<size_t>(max_groups) + 1)));
  device_bytes_ = workspace_bytes + 3 * sizeof(void*) * static_cast<size_t>(max_groups) +
                  sizeof(int32_t) * (static_cast<size_t>(max_groups) + 1);
  offsets32_.resize(static_cast<size_t>(max_groups) + 1);
  offsets64_.reserve(static_cast<size_t>(max_groups) + 1);
  const size_t g = static_cast<size_t>(max_groups);
  host_ptrs_.resize(3 * g);
  ta_.resize(g);
  tb_.resize(g);
  for (auto* v : {&m_, &n_, &k_, &lda_, &ldb_, &ldc_, &size_}) v->resize(g);
  alpha_.assign(g, 1.0f);
  beta_.resize(g);
  groups_.reserve(g);
}

GroupedGemm::~GroupedGemm() {
  if (handle_) cublasDestroy(handle_);
  cudaFree(workspace_);
  cudaFree(device_ptrs_);
  cudaFree(device_offsets_);
}

void GroupedGemm::run(const std::vector<Group>& groups, DType ab, DType c, float beta, int64_t rows) {
  const size_t n = groups.size();
  if (n == 0) return;
  // Experts with many rows each run as one cublasGemmEx per expert: measured on an H200 (bf16,
  // 2048 rows per expert, bench/RESULTS.md), cuBLAS's grouped batched GEMM reached 275-300 TFLOP/s
  // where the per-expert GEMMs reached 560-610. Smaller experts (and operands of different dtypes,
  // which the grouped GEMM does not take) as well: per expert below, grouped here.
  if (ab != c || rows / static_cast<int64_t>(n) >= kPerExpertRows) {
    const float alpha = 1.0f;
    for (const Group& g : groups)
      check_cublas(cublasGemmEx(handle_, g.ta, g.tb, g.m, g.n, g.k, &alpha, g.a, cublas_type(ab), g.lda, g.b,
                                cublas_type(ab), g.ldb, &beta, g.c, cublas_type(c), g.ldc, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT),
                   "cublasGemmEx");
    return;
  }
  MT_CHECK(n <= static_cast<size_t>(max_groups_), "grouped GEMM: {} groups, set up for {}", n, max_groups_);
  for (size_t i = 0; i < n; ++i) {
    const Group& g = groups[i];
    ta_[i] = g.ta;
    tb_[i] = g.tb;
    m_[i] = g.m;
    n_[i] = g.n;
    k_[i] = g.k;
    lda_[i] = g.lda;
    ldb_[i] = g.ldb;
    ldc_[i] = g.ldc;
    size_[i] = 1;
    beta_[i] = beta;
    host_ptrs_[i] = g.a;
    host_ptrs_[n + i] = g.b;
    host_ptrs_[2 * n + i] = g.c;
  }
  MT_CUDA_CHECK(cudaMemcpyAsync(device_ptrs_, host_ptrs_.data(), 3 * n * sizeof(void*), cudaMemcpyHostToDevice, stream_));
  void** d = device_ptrs_;
  check_cublas(cublasGemmGroupedBatchedEx(handle_, ta_.data(), tb_.data(), m_.data(), n_.data(), k_.data(), alpha_.data(),
                                          const_cast<const void* const*>(d), cublas_type(ab), lda_.data(),
                                          const_cast<const void* const*>(d + n), cublas_type(ab), ldb_.data(),
                                          beta_.data(), d + 2 * n, cublas_type(c), ldc_.data(), static_cast<int>(n),
                                          size_.data(), CUBLAS_COMPUTE_32F),
               "cublasGemmGroupedBatchedEx");
}

void GroupedGemm::forward(Tensor y, Tensor x, Tensor w, const ExpertOffsets& o) {
  const int64_t E = o.experts(), N = w.rows() / E, K = x.cols();
  MT_CHECK(y.cols() == N && w.cols() == K && x.dtype == w.dtype && y.dtype == x.dtype,
           "grouped forward: y [{}], x [{}], w [{}]", y.shape_string(), x.shape_string(), w.shape_string());
  if (own_kernel(GroupedOp::forward, y, x, w, o)) {
    grouped_mma_run(GroupedOp::forward, y, x, w, device_offsets(o, x.rows()), E, false, stream_, own_kernel_body());
    return;
  }
  const std::span<const int64_t> offsets = host_offsets(o);
  std::vector<Group>& groups = groups_;
  groups.clear();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    groups.push_back({CUBLAS_OP_T, CUBLAS_OP_N, as_int(N, "N"), as_int(rows, "rows"), as_int(K, "K"), as_int(K, "K"),
                      as_int(K, "K"), as_int(N, "N"), byte_ptr(w, e * N), byte_ptr(x, offsets[e]),
                      const_cast<char*>(byte_ptr(y, offsets[e]))});
  }
  run(groups, x.dtype, y.dtype, 0.0f, offsets.back());
}

void GroupedGemm::backward_input(Tensor dx, Tensor dy, Tensor w, const ExpertOffsets& o) {
  const int64_t E = o.experts(), N = w.rows() / E, K = w.cols();
  MT_CHECK(dy.cols() == N && dx.cols() == K && dy.dtype == w.dtype && dx.dtype == dy.dtype,
           "grouped backward_input: dx [{}], dy [{}], w [{}]", dx.shape_string(), dy.shape_string(), w.shape_string());
  if (own_kernel(GroupedOp::backward_input, dx, dy, w, o)) {
    grouped_mma_run(GroupedOp::backward_input, dx, dy, w, device_offsets(o, dy.rows()), E, false, stream_, own_kernel_body());
    return;
  }
  const std::span<const int64_t> offsets = host_offsets(o);
  std::vector<Group>& groups = groups_;
  groups.clear();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    groups.push_back({CUBLAS_OP_N, CUBLAS_OP_N, as_int(K, "K"), as_int(rows, "rows"), as_int(N, "N"), as_int(K, "K"),
                      as_int(N, "N"), as_int(K, "K"), byte_ptr(w, e * N), byte_ptr(dy, offsets[e]),
                      const_cast<char*>(byte_ptr(dx, offsets[e]))});
  }
  run(groups, dy.dtype, dx.dtype, 0.0f, offsets.back());
}

bool GroupedGemm::backward_weight(Tensor dw, Tensor dy, Tensor x, const ExpertOffsets& o, bool accumulate,
                                  float* sumsq) {
  const int64_t E = o.experts(), N = dw.rows() / E, K = dw.cols();
  MT_CHECK(dy.cols() == N && x.cols() == K && dy.dtype == x.dtype,
           "grouped backward_weight: dw [{}], dy [{}], x [{}]", dw.shape_string(), dy.shape_string(), x.shape_string());
  if (own_kernel(GroupedOp::backward_weight, dw, dy, x, o)) {
    // (The partial sums of squares in the start of cuBLAS's workspace, which no call of ours uses
    // meanwhile: the stream orders them.)
    GroupedSumSquares sq;
    if (sumsq != nullptr && !accumulate) {
      MT_CHECK(static_cast<size_t>(grouped_sumsq_partials()) * sizeof(double) <= workspace_bytes_,
               "grouped GEMM: its workspace holds no room for {} partial sums", grouped_sumsq_partials());
      sq = GroupedSumSquares{sumsq, static_cast<double*>(workspace_)};
    }
    return grouped_mma_run(GroupedOp::backward_weight, dw, dy, x, device_offsets(o, dy.rows()), E, accumulate,
                           stream_, own_kernel_body(), sq);
  }
  const std::span<const int64_t> offsets = host_offsets(o);
  std::vector<Group>& groups = groups_;
  groups.clear();
  const size_t expert_bytes = static_cast<size_t>(N * K) * dtype_size(dw.dtype);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    char* c = const_cast<char*>(byte_ptr(dw, e * N));
    if (rows == 0) {
      if (!accumulate) MT_CUDA_CHECK(cudaMemsetAsync(c, 0, expert_bytes, stream_));
      continue;
    }
    groups.push_back({CUBLAS_OP_N, CUBLAS_OP_T, as_int(K, "K"), as_int(N, "N"), as_int(rows, "rows"), as_int(K, "K"),
                      as_int(N, "N"), as_int(K, "K"), byte_ptr(x, offsets[e]), byte_ptr(dy, offsets[e]), c});
  }
  run(groups, dy.dtype, dw.dtype, accumulate ? 1.0f : 0.0f, offsets.back());
  return false;
}

}  // namespace mt::cuda

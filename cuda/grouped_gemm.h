// Grouped GEMMs for mixture-of-experts layers (Backend::grouped_linear_*): 16-bit experts of
// fewer than kPerExpertRows rows each on average run as one launch of our grouped MMA kernel
// (cuda/grouped_gemm_mma.h); other dtypes as one call of cuBLAS's grouped batched GEMM
// (cublasGemmGroupedBatchedEx), every expert with rows its own group; experts of many rows each
// as one cublasGemmEx per expert (cuBLAS picks its kernel per call: no cuBLASLt plan is made for
// each new row count).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <vector>

#include "core/tensor.h"
#include "cuda/grouped_gemm_mma.h"

namespace mt::cuda {

class GroupedGemm {
 public:
  // Its cuBLAS handle on `stream`, with a workspace of workspace_bytes and device room for the
  // pointer arrays of max_groups groups, all allocated here (set-up time): device_bytes() of them.
  GroupedGemm(cudaStream_t stream, int max_groups, size_t workspace_bytes);
  ~GroupedGemm();
  GroupedGemm(const GroupedGemm&) = delete;
  GroupedGemm& operator=(const GroupedGemm&) = delete;
  size_t device_bytes() const { return device_bytes_; }
  int max_groups() const { return max_groups_; }

  // The three ops of Backend::grouped_linear_* (engine/backend.h): rows [offsets[e], offsets[e+1])
  // of the row-major operands belong to expert e, whose weight is rows [e * Nw, (e+1) * Nw) of w.
  void forward(Tensor y, Tensor x, Tensor w, std::span<const int64_t> offsets);
  void backward_input(Tensor dx, Tensor dy, Tensor w, std::span<const int64_t> offsets);
  // Experts without rows are left out of the call; with accumulate = false their gradient is
  // zeroed (cudaMemsetAsync).
  void backward_weight(Tensor dw, Tensor dy, Tensor x, std::span<const int64_t> offsets, bool accumulate);

 private:
  struct Group {
    cublasOperation_t ta, tb;
    int m, n, k, lda, ldb, ldc;
    const void *a, *b;
    void* c;
  };
  // rows: all rows of the op (their mean per expert with rows picks the per-expert path).
  void run(const std::vector<Group>& groups, DType ab, DType c, float beta, int64_t rows);
  // Whether our grouped MMA kernel (cuda/grouped_gemm_mma.h) runs the op: where it takes it, for
  // experts of fewer than kPerExpertRows rows on average.
  bool own_kernel(GroupedOp op, const Tensor& c, const Tensor& a, const Tensor& b, std::span<const int64_t> offsets) const;
  static constexpr int64_t kPerExpertRows = 2048;

  cudaStream_t stream_;
  cublasHandle_t handle_ = nullptr;
  int max_groups_ = 0;
  void* workspace_ = nullptr;
  void** device_ptrs_ = nullptr;  // [3 * max_groups]: A, B, C pointer arrays
  size_t device_bytes_ = 0;
  // Host staging of the pointer arrays (pageable: cudaMemcpyAsync has read it when it returns, so
  // the next op may refill it) and the per-group parameters, sized at set-up.
  std::vector<const void*> host_ptrs_;
  std::vector<cublasOperation_t> ta_, tb_;
  std::vector<int> m_, n_, k_, lda_, ldb_, ldc_, size_;
  std::vector<float> alpha_, beta_;
  std::vector<Group> groups_;  // the op at hand's (capacity max_groups: no allocation per op)
};

}  // namespace mt::cuda

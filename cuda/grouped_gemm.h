// Grouped GEMMs for mixture-of-experts layers (Backend::grouped_linear_*): 16-bit experts whose
// offsets are on the device, or of fewer than kPerExpertRows rows each on average, run as one
// launch of our grouped MMA kernel (cuda/grouped_gemm_mma.h); other dtypes as one call of cuBLAS's
// grouped batched GEMM (cublasGemmGroupedBatchedEx), every expert with rows its own group; experts
// of many rows each as one cublasGemmEx per expert (cuBLAS picks its kernel per call: no cuBLASLt
// plan is made for each new row count).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <vector>

#include "core/tensor.h"
#include "cuda/grouped_gemm_mma.h"
#include "engine/backend.h"

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
  // Our kernel reads the offsets on the device (host offsets are copied there, stream-ordered);
  // cuBLAS takes them on the host (device offsets are copied back: the host waits for the stream).
  void forward(Tensor y, Tensor x, Tensor w, const ExpertOffsets& offsets);
  void backward_input(Tensor dx, Tensor dy, Tensor w, const ExpertOffsets& offsets);
  // Experts without rows are left out of the call; with accumulate = false their gradient is
  // zeroed (cudaMemsetAsync). sumsq (float32 [1] on the device, or null; without accumulate): +=
  // dw's sum of squares, where our TMA kernel takes it in its epilogue; returns whether it did.
  bool backward_weight(Tensor dw, Tensor dy, Tensor x, const ExpertOffsets& offsets, bool accumulate,
                       float* sumsq = nullptr);

 private:
  struct Group {
    cublasOperation_t ta, tb;
    int m, n, k, lda, ldb, ldc;
    const void *a, *b;
    void* c;
  };
  // rows: all rows of the op (their mean per expert with rows picks the per-expert path).
  void run(const std::vector<Group>& groups, DType ab, DType c, float beta, int64_t rows);
  // Whether our grouped MMA kernel (cuda/grouped_gemm_mma.h) runs the op, where it takes it: with
  // offsets on the device always (cuBLAS would have the host wait for them at every op: measured
  // slower end to end, bench/RESULTS.md), with host offsets for fewer than kPerExpertRows rows per
  // expert with rows on average.
  bool own_kernel(GroupedOp op, const Tensor& c, const Tensor& a, const Tensor& b, const ExpertOffsets& o) const;
  // Which of our kernel's bodies runs it (bench_choice::grouped_gemm_path; the best by default).
  static GroupedKernel own_kernel_body();
  // The offsets as our kernel reads them (device int32): the given device tensor, or the host's
  // copied into device_offsets_ on the stream. rows: what the host offsets must end at.
  const int32_t* device_offsets(const ExpertOffsets& o, int64_t rows);
  // The offsets on the host: as given, or the device's copied back (the host waits).
  std::span<const int64_t> host_offsets(const ExpertOffsets& o);
  static constexpr int64_t kPerExpertRows = 2048;

  cudaStream_t stream_;
  cublasHandle_t handle_ = nullptr;
  int max_groups_ = 0;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  void** device_ptrs_ = nullptr;  // [3 * max_groups]: A, B, C pointer arrays
  int32_t* device_offsets_ = nullptr;  // [max_groups + 1]: host offsets for our kernel
  std::vector<int32_t> offsets32_;     // their host staging (pageable, as host_ptrs_)
  std::vector<int64_t> offsets64_;     // device offsets copied back for cuBLAS
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

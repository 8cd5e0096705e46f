// A grouped GEMM of our own for mixture-of-experts layers: one kernel launch per op for every
// expert, tensor-core MMAs (Hopper's wgmma, or mma.sync; bf16/fp16 in, float32 accumulation),
// whatever the row count of each expert. The three ops of Backend::grouped_linear_* (cuda/grouped_gemm.h maps them):
//   forward         y_e  = x_e w_e^T        (rows of y grouped by expert)
//   backward input  dx_e = dy_e w_e         (rows of dx grouped by expert)
//   backward weight dw_e (+)= dy_e^T x_e    (the reduction over expert e's rows)
// A launch reads the experts' row offsets from device memory (int32, as the MoE block's
// permutation writes them), so the host need not wait for the routing: the grid covers the most
// tiles the rows can make, and each CTA finds its expert from the offsets.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/tensor.h"

namespace mt::cuda {

enum class GroupedOp { forward, backward_input, backward_weight };

// The most experts one launch takes (a CTA scans their tile counts in one pass of its threads).
inline constexpr int kGroupedMmaMaxGroups = 256;

// Whether the kernel takes this op: 16-bit inputs of one dtype, an output of that dtype or
// float32, feature sizes N (w's rows per expert) and K (w's columns) multiples of 8, 16-byte
// aligned operands, at most kGroupedMmaMaxGroups experts.
bool grouped_mma_takes(GroupedOp op, const Tensor& c, const Tensor& a, const Tensor& b, int64_t experts);

// Which body runs an op: best (on Hopper grouped_tma_run where it takes the op, else wgmma), wgmma
// (cp.async-fed wgmma), mma_sync. Without Hopper's wgmma every choice is mma.sync.
enum class GroupedKernel { best, wgmma, mma_sync };

// A weight gradient's sum of squares taken in the epilogue (Backend::grouped_linear_backward_weight's
// sumsq): out[0] (float32, device) += the sum of squares of C as stored. partials: device scratch
// for grouped_sumsq_partials() doubles (one per consumer warpgroup of each CTA).
struct GroupedSumSquares {
  float* out = nullptr;
  double* partials = nullptr;
};
// The doubles GroupedSumSquares::partials must hold (2 per SM).
int64_t grouped_sumsq_partials();

// op's operands as in cuda/grouped_gemm.h: forward (c = y, a = x, b = w), backward input
// (c = dx, a = dy, b = w), backward weight (c = dw, a = dy, b = x; accumulate adds to dw).
// offsets: experts + 1 int32 row offsets in device memory, offsets[experts] at most the rows of the
// row-grouped operands (a's rows; the forward's and input gradient's C has as many).
// sq (a weight gradient written, not accumulated): taken where the TMA kernel runs the op; returns
// whether it was (else the caller sums the squares itself).
bool grouped_mma_run(GroupedOp op, Tensor c, Tensor a, Tensor b, const int32_t* offsets, int64_t experts,
                     bool accumulate, cudaStream_t stream, GroupedKernel kernel = GroupedKernel::best,
                     const GroupedSumSquares& sq = {});

// The three ops on Hopper (cuda/grouped_gemm_tma.cu): TMA loads, a producer warpgroup and two
// wgmma consumers on 128 x 256 tiles, persistent CTAs. It takes what grouped_mma_takes takes where
// every operand is at least one of its boxes in size (64 columns; 64 to 256 rows) and, for the
// row-grouped ops, C has the inputs' dtype.
bool grouped_tma_takes(GroupedOp op, const Tensor& c, const Tensor& a, const Tensor& b, int64_t experts);
// sq: as grouped_mma_run's (a weight gradient without accumulate only), always taken.
void grouped_tma_run(GroupedOp op, Tensor c, Tensor a, Tensor b, const int32_t* offsets, int64_t experts,
                     bool accumulate, cudaStream_t stream, const GroupedSumSquares& sq = {});

}  // namespace mt::cuda

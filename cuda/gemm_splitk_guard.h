// Split-K and the tail of K: which cuBLASLt algorithms a GEMM may use.
//
// cuBLASLt 13.1 on an H100 computed dw = dy^T x over only the first 8192 of 8193 rows (k = 8193)
// with a split-K algorithm (algo 66, tile 32x64, numSplitsK 4, cluster 1x2x1): no error, a
// gradient short by one token's product (our GPU test "dbias over many rows"); on an
// H200 its first picks did the same for 9 of the 35 weight-gradient shapes of
// tests/gpu/gemm_k_tail_test.cpp (bench/RESULTS.md, sessions 7 and 8).
// facebookexperimental/triton PR 2767 reports the same for cuBLAS 12 and 13 on H100, GB200 and
// GB300: split-K kernels that sum only the first k - k % block_k values. So for a k that is not a
// multiple of kSplitKSafeMultiple (which every K block size of these kernels divides), no split-K
// algorithm sees the tail: GemmRunner runs a float32 output's tail as a GEMM of its own, and
// otherwise passes over split-K algorithms (splitk_safe_algos; the FP8 runner likewise). Engine
// shapes are mostly multiples of 256 (tokens, hidden and FFN sizes; not the GPT-2 vocabulary's
// 50304) and keep the heuristic's choices.
#pragma once

#include <cublasLt.h>

#include <cstdint>

namespace mt::cuda {

constexpr int64_t kSplitKSafeMultiple = 256;
inline bool k_has_tail(int64_t k) { return k % kSplitKSafeMultiple != 0; }
constexpr int kGuardedHeuristicResults = 16;

// The algorithm's CUBLASLT_ALGO_CONFIG_SPLITK_NUM (1 or 0: K is not split).
uint32_t splitk_of(const cublasLtMatmulAlgo_t& algo);
// The algorithm's CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME (how split-K partial sums are combined).
uint32_t reduction_scheme_of(const cublasLtMatmulAlgo_t& algo);

// The operands of one GEMM as the heuristic saw them (C and D share the layout d).
struct GemmDescs {
  cublasLtHandle_t handle;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a, b, d;
};

// The heuristic's successful results, in its order, that may run a GEMM of reduction length k:
// all when k has no tail (or when guard is false), else those that do not split K; if there are
// none of those, the first result that cublasLtMatmulAlgoCheck accepts with its split count set
// to 1. Writes at most max_out algorithms to out and returns how many (0: none is safe).
// Where k has a tail, ask the heuristic for kGuardedHeuristicResults.
// round_once: the output is narrower than float32 and must be rounded once from the float32 result
// (bf16 weight gradients): split-K algorithms whose partial sums are combined in the output type
// (in place or OUTPUT_TYPE) are passed over too; those that reduce in the compute type are kept.
int splitk_safe_algos(const GemmDescs& g, const cublasLtMatmulHeuristicResult_t* results, int found, int64_t k,
                      bool guard, cublasLtMatmulAlgo_t* out, int max_out, bool round_once = false);

}  // namespace mt::cuda

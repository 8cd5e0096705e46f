// See gemm_splitk_guard.h.
#include "cuda/gemm_splitk_guard.h"

namespace mt::cuda {

uint32_t splitk_of(const cublasLtMatmulAlgo_t& algo) {
  uint32_t splits = 0;
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof splits, &written) !=
      CUBLAS_STATUS_SUCCESS)
    return 0;
  return splits;
}

int splitk_safe_algos(const GemmDescs& g, const cublasLtMatmulHeuristicResult_t* results, int found, int64_t k,
                      bool guard, cublasLtMatmulAlgo_t* out, int max_out) {
  const bool avoid_split = guard && k_has_tail(k);
  int kept = 0, first = -1;
  for (int i = 0; i < found && kept < max_out; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    if (first < 0) first = i;
    if (avoid_split && splitk_of(results[i].algo) > 1) continue;
    out[kept++] = results[i].algo;
  }
  if (kept > 0 || first < 0 || max_out < 1) return kept;
  // Every candidate splits K: the first one, made to run unsplit if cuBLASLt accepts that.
  cublasLtMatmulAlgo_t algo = results[first].algo;
  const uint32_t one = 1;
  if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof one) !=
      CUBLAS_STATUS_SUCCESS)
    return 0;
  cublasLtMatmulHeuristicResult_t check{};
  if (cublasLtMatmulAlgoCheck(g.handle, g.desc, g.a, g.b, g.d, g.d, &algo, &check) != CUBLAS_STATUS_SUCCESS ||
      check.state != CUBLAS_STATUS_SUCCESS)
    return 0;
  out[0] = algo;
  return 1;
}

}  // namespace mt::cuda

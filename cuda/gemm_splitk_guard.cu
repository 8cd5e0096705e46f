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

uint32_t reduction_scheme_of(const cublasLtMatmulAlgo_t& algo) {
  uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, sizeof scheme,
                                           &written) != CUBLAS_STATUS_SUCCESS)
    return CUBLASLT_REDUCTION_SCHEME_NONE;
  return scheme;
}

int splitk_safe_algos(const GemmDescs& g, const cublasLtMatmulHeuristicResult_t* results, int found, int64_t k,
                      bool guard, cublasLtMatmulAlgo_t* out, int max_out, bool round_once) {
  const bool avoid_split = guard && k_has_tail(k);
  int kept = 0, first = -1;
  for (int i = 0; i < found && kept < max_out; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    if (first < 0) first = i;
    if ((avoid_split || round_once) && splitk_of(results[i].algo) > 1 &&
        (avoid_split || reduction_scheme_of(results[i].algo) != CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE))
      continue;
    out[kept++] = results[i].algo;
  }
  if (kept > 0 || first < 0 || max_out < 1) return kept;
  // Every candidate splits K: the first one cuBLASLt accepts made to run unsplit (one split, no
  // reduction scheme; a split count of 1 with a reduction scheme is an invalid configuration).
  const uint32_t one = 1, no_reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
  for (int i = first; i < found; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    cublasLtMatmulAlgo_t algo = results[i].algo;
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof one) ==
            CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &no_reduction,
                                             sizeof no_reduction) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulAlgoCheck(g.handle, g.desc, g.a, g.b, g.d, g.d, &algo, &check) == CUBLAS_STATUS_SUCCESS &&
        check.state == CUBLAS_STATUS_SUCCESS) {
      out[0] = algo;
      return 1;
    }
  }
  return 0;
}

}  // namespace mt::cuda

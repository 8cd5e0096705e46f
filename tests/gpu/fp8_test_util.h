// Helpers for the FP8 GPU tests: a host oracle of the two OCP FP8 formats written from their
// definitions (independent of the kernels and of core/dtype.h), and raw-buffer helpers.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda/cuda_backend.h"
#include "cuda/fp8_gemm_cublaslt.h"
#include "cuda/kernels.h"
#include "tests/gpu/gpu_test_util.h"

namespace mt::fp8test {

// Value of an fp8 code (NaN codes give NaN; e5m2 infinities give +-inf).
double decode_fp8(uint8_t code, cuda::Fp8Format f);
// Round to nearest even among the finite codes, saturating (|x| above the largest finite value,
// infinities included, give +-max); NaN gives the format's positive NaN code; the sign of zero kept.
uint8_t encode_fp8(float x, cuda::Fp8Format f);

CudaBackend& cuda_backend();
cuda::KernelContext context();  // the backend's stream and SM count, no scratch

void put(gputest::Buf& b, const void* host);  // b.t.nbytes() bytes, synchronized
void put_floats(gputest::Buf& b, const std::vector<float>& v);
std::vector<float> get_floats(gputest::Buf& b);
void fill_bytes(gputest::Buf& b, uint8_t value);
// Row-major [rows, cols] bytes -> [cols, rows].
std::vector<uint8_t> transpose_bytes(const std::vector<uint8_t>& v, int64_t rows, int64_t cols);

}  // namespace mt::fp8test

#include "tests/gpu/fp8_test_util.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstring>

#include "cuda/cuda_check.h"

namespace mt::fp8test {

double decode_fp8(uint8_t code, cuda::Fp8Format f) {
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  if (f == cuda::Fp8Format::e4m3) {
    const int e = (code >> 3) & 0xF, m = code & 0x7;
    if (e == 0xF && m == 0x7) return std::nan("");
    if (e == 0) return sign * std::ldexp(m, -9);  // subnormal: m/8 * 2^-6
    return sign * std::ldexp(8 + m, e - 7 - 3);
  }
  const int e = (code >> 2) & 0x1F, m = code & 0x3;
  if (e == 0x1F) return m == 0 ? sign * INFINITY : std::nan("");
  if (e == 0) return sign * std::ldexp(m, -16);  // m/4 * 2^-14
  return sign * std::ldexp(4 + m, e - 15 - 2);
}

uint8_t encode_fp8(float x, cuda::Fp8Format f) {
  if (std::isnan(x)) return f == cuda::Fp8Format::e4m3 ? 0x7F : 0x7E;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const int max_code = f == cuda::Fp8Format::e4m3 ? 0x7E : 0x7B;
  double a = std::fabs(static_cast<double>(x));
  const double max_value = decode_fp8(static_cast<uint8_t>(max_code), f);
  if (a >= max_value) return static_cast<uint8_t>(sign | max_code);
  // Positive codes are ordered by value: find the neighbours lo <= a < hi.
  int lo = 0;
  while (lo + 1 <= max_code && decode_fp8(static_cast<uint8_t>(lo + 1), f) <= a) ++lo;
  const double vlo = decode_fp8(static_cast<uint8_t>(lo), f), vhi = decode_fp8(static_cast<uint8_t>(lo + 1), f);
  int code = lo;
  if (a > vlo) {
    const double dlo = a - vlo, dhi = vhi - a;
    if (dhi < dlo || (dhi == dlo && ((lo + 1) & 1) == 0)) code = lo + 1;
  }
  return static_cast<uint8_t>(sign | code);
}

CudaBackend& cuda_backend() { return dynamic_cast<CudaBackend&>(gputest::dev()); }

cuda::KernelContext context() {
  CudaBackend& be = cuda_backend();
  cuda::KernelContext ctx;
  ctx.stream = be.cuda_stream();
  ctx.num_sms = be.num_sms();
  return ctx;
}

void put(gputest::Buf& b, const void* host) {
  b.be->copy_from_host(b.t, host);
  b.be->synchronize();
}

void put_floats(gputest::Buf& b, const std::vector<float>& v) {
  MT_CHECK(b.t.dtype == DType::f32 && static_cast<int64_t>(v.size()) == b.t.numel(), "put_floats: size mismatch");
  put(b, v.data());
}

std::vector<float> get_floats(gputest::Buf& b) {
  std::vector<float> v(static_cast<size_t>(b.t.numel()));
  b.be->copy_to_host(v.data(), b.t);
  return v;
}

void fill_bytes(gputest::Buf& b, uint8_t value) {
  MT_CUDA_CHECK(cudaMemsetAsync(b.t.data, value, b.t.nbytes(), cuda_backend().cuda_stream()));
}

std::vector<uint8_t> transpose_bytes(const std::vector<uint8_t>& v, int64_t rows, int64_t cols) {
  std::vector<uint8_t> t(v.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = v[r * cols + c];
  return t;
}

}  // namespace mt::fp8test

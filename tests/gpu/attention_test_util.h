// Small helpers of the attention GPU tests that compare with the reference on whole problems:
// device buffers of 16-bit and float32 values, the packed QKV / output layouts, error measures.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/philox.h"
#include "core/tensor.h"
#include "cuda/cuda_check.h"
#include "engine/backend.h"

namespace mt::test::attention {

inline uint16_t to_bits(float x, DType t) { return t == DType::bf16 ? float_to_bf16_bits(x) : float_to_f16_bits(x); }
inline float from_bits(uint16_t x, DType t) { return t == DType::bf16 ? bf16_bits_to_float(x) : f16_bits_to_float(x); }

// A device array of `count` values of dtype f32, bf16 or f16, filled from and read back as floats
// (16-bit values rounded to nearest even on the way in).
struct DeviceValues {
  void* ptr = nullptr;
  size_t count = 0;
  DType dtype;
  DeviceValues(size_t n, DType t) : count(n), dtype(t) { MT_CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(bytes(), 256))); }
  ~DeviceValues() { cudaFree(ptr); }
  DeviceValues(const DeviceValues&) = delete;
  DeviceValues& operator=(const DeviceValues&) = delete;
  size_t bytes() const { return count * dtype_size(dtype); }
  Tensor t() const { return Tensor(ptr, dtype, Device::cuda, {static_cast<int64_t>(count)}); }
  void poison() { MT_CUDA_CHECK(cudaMemset(ptr, 0xFF, bytes())); }  // NaN in every one of the three
  void upload(const std::vector<float>& v) {
    if (dtype == DType::f32) {
      MT_CUDA_CHECK(cudaMemcpy(ptr, v.data(), bytes(), cudaMemcpyHostToDevice));
      return;
    }
    std::vector<uint16_t> bits(v.size());
    for (size_t i = 0; i < v.size(); ++i) bits[i] = to_bits(v[i], dtype);
    MT_CUDA_CHECK(cudaMemcpy(ptr, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
  }
  std::vector<float> download() const {
    std::vector<float> v(count);
    if (dtype == DType::f32) {
      MT_CUDA_CHECK(cudaMemcpy(v.data(), ptr, bytes(), cudaMemcpyDeviceToHost));
      return v;
    }
    std::vector<uint16_t> bits(count);
    MT_CUDA_CHECK(cudaMemcpy(bits.data(), ptr, count * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < count; ++i) v[i] = from_bits(bits[i], dtype);
    return v;
  }
};

// Packed documents: document starts [b * s], sample-major (AttentionShape::doc_start), of documents
// of random lengths in [1, max_doc] (one document per sample when max_doc >= s).
inline std::vector<int32_t> random_documents(int b, int s, int max_doc, uint64_t key) {
  std::vector<int32_t> starts(static_cast<size_t>(b) * s);
  uint64_t draw = 0;
  for (int i = 0; i < b; ++i) {
    int t = 0;
    while (t < s) {
      const int len = max_doc >= s ? s : 1 + static_cast<int>(uniform_at(key, draw++) * max_doc) % max_doc;
      for (int j = t; j < std::min(s, t + len); ++j) starts[static_cast<size_t>(i) * s + j] = t;
      t += len;
    }
  }
  return starts;
}

// The value a float becomes in dtype t (what DeviceValues::upload stores).
inline float rounded(float x, DType t) { return t == DType::f32 ? x : from_bits(to_bits(x, t), t); }

// Sizes and offsets of the packed layouts (engine/backend.h).
struct Layout {
  int64_t b, s, heads, groups, d, hpg, row;
  explicit Layout(const AttentionShape& a)
      : b(a.batch), s(a.seq), heads(a.heads), groups(a.groups), d(a.head_dim), hpg(a.heads / a.groups),
        row(a.qkv_row_stride()) {}
  size_t qkv_count() const { return static_cast<size_t>(b * s * row); }
  size_t out_count() const { return static_cast<size_t>(b * s * heads * d); }
  size_t lse_count() const { return static_cast<size_t>(b * s * heads); }
  size_t v_offset(int64_t i, int64_t t, int64_t g) const { return (t * b + i) * row + g * (hpg + 2) * d + (hpg + 1) * d; }
  size_t out_offset(int64_t i, int64_t t, int64_t h) const { return ((t * b + i) * heads + h) * d; }
  size_t mask_index(int64_t i, int64_t h, int64_t q, int64_t k) const { return ((i * heads + h) * s + q) * s + k; }
};

inline double rel_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += double(want[i]) * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-6 * got.size()));
}

inline double max_abs(const std::vector<float>& got, const std::vector<float>& want) {
  double m = 0;
  for (size_t i = 0; i < got.size(); ++i) m = std::max(m, std::abs(double(got[i]) - want[i]));
  return m;
}

inline Tensor host(std::vector<float>& v) { return Tensor(v.data(), DType::f32, Device::cpu, {static_cast<int64_t>(v.size())}); }

}  // namespace mt::test::attention

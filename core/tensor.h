// Tensor: a view of contiguous, row-major memory (pointer, shape, dtype, device). It owns nothing;
// buffers are owned by the memory plan (engine/) and live as long as the run.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/dtype.h"
#include "core/error.h"

namespace mt {

enum class Device : uint8_t { cpu, cuda };

// Elements [offset, offset + count) of a flat tensor.
struct FlatRange {
  int64_t offset = 0, count = 0;
};

struct Tensor {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};

  Tensor() = default;
  Tensor(void* p, DType t, Device d, std::initializer_list<int64_t> dims) : data(p), dtype(t), device(d) {
    MT_CHECK(dims.size() <= kMaxDims, "too many dims");
    for (int64_t s : dims) shape[ndim++] = s;
  }

  bool empty() const { return data == nullptr; }
  int64_t size(int i) const { return shape[i < 0 ? ndim + i : i]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return ndim == 0 ? (data ? 1 : 0) : n;
  }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  // Rows = product of all dims but the last; cols = last dim. Most ops treat tensors as 2-D.
  int64_t cols() const { return ndim == 0 ? 1 : shape[ndim - 1]; }
  int64_t rows() const { return cols() == 0 ? 0 : numel() / cols(); }

  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }

  // Same memory, another shape with the same element count.
  Tensor view(std::initializer_list<int64_t> dims) const {
    Tensor t(data, dtype, device, dims);
    MT_CHECK(t.numel() == numel(), "view changes element count {} -> {}", numel(), t.numel());
    return t;
  }
  // Rows [begin, begin+count) of the 2-D view (last dim = cols).
  Tensor row_slice(int64_t begin, int64_t count) const {
    MT_CHECK(begin >= 0 && count >= 0 && begin + count <= rows(), "row slice out of range");
    Tensor t = *this;
    t.data = static_cast<char*>(data) + static_cast<size_t>(begin * cols()) * dtype_size(dtype);
    t.ndim = 2;
    t.shape = {count, cols(), 0, 0};
    return t;
  }
  // Elements [begin, begin+count) of the flat view.
  Tensor flat_slice(int64_t begin, int64_t count) const {
    MT_CHECK(begin >= 0 && count >= 0 && begin + count <= numel(), "flat slice out of range");
    Tensor t = *this;
    t.data = static_cast<char*>(data) + static_cast<size_t>(begin) * dtype_size(dtype);
    t.ndim = 1;
    t.shape = {count, 0, 0, 0};
    return t;
  }

  std::string shape_string() const;
};

}  // namespace mt

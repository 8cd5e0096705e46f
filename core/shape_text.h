// Shapes as plain vectors (checkpoint and safetensors headers, Hugging Face tensors): their element
// count and the "[a, b, c]" text that error messages print.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mt {

inline int64_t shape_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

inline std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace mt

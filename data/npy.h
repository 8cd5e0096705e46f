// Index arrays and their cache files. The GPT/blended indices are written in numpy's .npy format
// (version 1.0, little-endian, C order), the format Megatron caches them in, so they can be
// inspected or compared with numpy; loading maps them read-only instead of copying.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace mt {

// Element types the indices use: int16 (blend dataset ids), int32, uint32, int64.
enum class IndexType { i16, i32, u32, i64 };
size_t index_type_size(IndexType t);
const char* index_type_descr(IndexType t);  // numpy descr: "<i2", "<i4", "<u4", "<i8"

template <typename T>
constexpr IndexType index_type_of();
template <>
constexpr IndexType index_type_of<int16_t>() { return IndexType::i16; }
template <>
constexpr IndexType index_type_of<int32_t>() { return IndexType::i32; }
template <>
constexpr IndexType index_type_of<uint32_t>() { return IndexType::u32; }
template <>
constexpr IndexType index_type_of<int64_t>() { return IndexType::i64; }

// A read-only integer array of rows x cols elements (1-D when cols == 1), held in memory or mapped
// from a .npy file.
class IndexArray {
 public:
  IndexArray() = default;
  template <typename T>
  static IndexArray from_vector(std::vector<T>&& v, int64_t cols = 1) {
    auto owner = std::make_shared<std::vector<T>>(std::move(v));
    IndexArray a;
    a.type_ = index_type_of<T>();
    a.data_ = owner->data();
    a.rows_ = static_cast<int64_t>(owner->size()) / cols;
    a.cols_ = cols;
    a.owner_ = std::move(owner);
    return a;
  }
  // Maps a .npy file; returns an empty array (valid() false) when it is missing or not a simple
  // little-endian C-order integer array.
  static IndexArray map_npy(const std::string& path);

  bool valid() const { return data_ != nullptr || (owner_ && rows_ == 0); }
  IndexType type() const { return type_; }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  int64_t size() const { return rows_ * cols_; }
  const void* data() const { return data_; }

  int64_t operator[](int64_t i) const {
    switch (type_) {
      case IndexType::i16: return static_cast<const int16_t*>(data_)[i];
      case IndexType::i32: return static_cast<const int32_t*>(data_)[i];
      case IndexType::u32: return static_cast<const uint32_t*>(data_)[i];
      case IndexType::i64: return static_cast<const int64_t*>(data_)[i];
    }
    return 0;
  }
  int64_t at(int64_t row, int64_t col) const { return (*this)[row * cols_ + col]; }

  // Writes the array as .npy to path atomically: a temporary file in the same directory, then a
  // rename, so a concurrent reader sees either no file or the whole file.
  void write_npy(const std::string& path) const;

 private:
  IndexType type_ = IndexType::i32;
  const void* data_ = nullptr;
  int64_t rows_ = 0;
  int64_t cols_ = 1;
  std::shared_ptr<const void> owner_;
};

// Writes text to path atomically (temporary file + rename).
void write_file_atomically(const std::string& path, const std::string& contents);

}  // namespace mt

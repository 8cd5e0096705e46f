// safetensors files (huggingface/safetensors "Format"), read by memory map and written by streaming.
//
//   bytes 0..7     N, unsigned little-endian 64-bit: length of the header
//   bytes 8..8+N   UTF-8 JSON object {"__metadata__": {str: str}, name: {"dtype", "shape",
//                  "data_offsets": [begin, end]}, ...}, padded with spaces so 8+N is a multiple of 8
//   rest           the data buffer; offsets are relative to its start, tensors cover it exactly
//                  (no holes, no overlap, nothing after the last tensor), little-endian, row-major.
//
// The writer orders tensors by descending element size, then name (as the reference writer does),
// so every tensor starts aligned to its element size when the file is mapped.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/file_io.h"
#include "core/dtype.h"
#include "core/tensor.h"

namespace mt {

// "BF16", "F16", "F32", "F64", "I32", "I64", "U8" for the dtypes megatrain holds.
std::string_view safetensors_dtype_string(DType t);
// The megatrain dtype of a safetensors dtype string; nullopt for the others (BOOL, I8, F8_*, ...).
std::optional<DType> parse_safetensors_dtype(std::string_view s);

// One tensor of a mapped file.
struct SafetensorsEntry {
  std::string name;
  std::string dtype_string;    // as written in the file
  std::optional<DType> dtype;  // nullopt: a dtype megatrain does not hold
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets relative to the data buffer
  const unsigned char* data = nullptr;

  size_t nbytes() const { return static_cast<size_t>(end - begin); }
  int64_t numel() const;
  std::string shape_string() const;  // "[2, 3] BF16"
};

// A safetensors file mapped read-only and validated on open: header length and JSON, every entry's
// dtype/shape/offsets, and that the tensors cover the data buffer exactly (which is what catches a
// truncated file). Errors are mt::Error naming the file and what is wrong.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;

  const std::string& path() const { return path_; }
  size_t file_size() const { return size_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }  // in data order
  const SafetensorsEntry* find(const std::string& name) const;
  const SafetensorsEntry& get(const std::string& name) const;  // throws naming the file
  // A Tensor view of an entry (read-only memory; at most Tensor::kMaxDims dims, megatrain dtype).
  Tensor view(const std::string& name) const;

 private:
  std::string path_;
  std::unique_ptr<MappedFile> file_;
  size_t size_ = 0;
  std::map<std::string, std::string> metadata_;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t> index_;
};

// Writes a safetensors file without assembling it in memory: the header first, then each tensor's
// bytes straight from the caller's buffer, which must stay valid until finish().
class SafetensorsWriter {
 public:
  struct Written {
    std::string name;
    uint64_t begin = 0, end = 0;  // relative to the data buffer
    uint32_t crc32c = 0;          // of the tensor's bytes
  };

  explicit SafetensorsWriter(std::string path) : path_(std::move(path)) {}

  // Values must be strings (the format says so). Write {"format": "pt"} for Hugging Face loaders.
  void set_metadata(const std::string& key, const std::string& value);
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data);
  void add(const std::string& name, const Tensor& t);  // host tensor, its own shape

  // Writes the file. `durable`: fsync it before returning (checkpoints need this; the caller
  // still fsyncs the directory). A failed write (full disk...) removes the partial file and
  // throws mt::Error naming the file and the system error.
  std::vector<Written> finish(bool durable = true);

  // The header this writer will write (exposed for tests). Entries in data order.
  std::string header_json() const;

 private:
  struct Pending {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    const void* data;
    size_t nbytes;
  };
  void sort_entries();

  std::string path_;
  std::map<std::string, std::string> metadata_;
  std::vector<Pending> pending_;
  bool finished_ = false;
};

}  // namespace mt

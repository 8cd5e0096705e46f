// torch.save's file format, read without PyTorch: a zip archive (entries stored, not compressed)
// holding <prefix>/data.pkl, the pickled object, and <prefix>/data/<key>, the bytes of each storage
// its tensors view. A pickled tensor is torch._utils._rebuild_tensor_v2(storage, offset, size,
// stride, ...), its storage a persistent id ("storage", <dtype>Storage, key, location, numel).
// PyTorch Distributed Checkpoint's .distcp files are such archives laid end to end, so an archive
// can start anywhere in a file.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/file_io.h"
#include "checkpoint/hf_names.h"
#include "checkpoint/pickle.h"

namespace mt {

// The stored entries of a zip archive at [offset, offset + length) of a mapped file.
class ZipArchive {
 public:
  ZipArchive(std::shared_ptr<const MappedFile> file, uint64_t offset, uint64_t length);
  struct Entry {
    uint64_t data_offset = 0;  // within the file
    uint64_t size = 0;
  };
  const std::map<std::string, Entry>& entries() const { return entries_; }
  // The entry whose name ends with `suffix` ("/data.pkl"); throws naming `what` if none or several.
  const Entry& entry_ending_with(const std::string& suffix) const;
  const Entry* find(const std::string& name) const;
  const unsigned char* bytes(const Entry& e) const { return file_->data() + e.data_offset; }
  const std::string& what() const { return what_; }

 private:
  std::shared_ptr<const MappedFile> file_;
  std::string what_;  // "FILE" or "FILE at byte N"
  std::map<std::string, Entry> entries_;
};

// torch's storage types ("torch.FloatStorage") and their dtypes; nullopt / a throw for others.
std::optional<DType> torch_storage_dtype(const std::string& storage_type);
std::string torch_storage_type(DType dtype);

// A torch.Size (or plain tuple or list) of ints; throws naming `what` for anything else.
std::vector<int64_t> torch_size(const PickleValue& v, const std::string& what);

// One torch.save'd object.
class TorchFile {
 public:
  TorchFile(std::shared_ptr<const MappedFile> file, uint64_t offset, uint64_t length);
  explicit TorchFile(const std::string& path);
  explicit TorchFile(std::shared_ptr<const MappedFile> file);

  const PickleValue& root() const { return *root_; }
  const std::string& what() const { return archive_.what(); }

  // Whether `v` is a pickled tensor (or nn.Parameter); and its contents as a dense row-major
  // array (strides and storage offsets applied). `name` goes into error messages. Throws for
  // dtypes megatrain does not hold.
  static bool is_tensor(const PickleValue& v);
  HostArray tensor(const PickleValue& v, const std::string& name) const;
  // Elements [first, first + count) of a contiguous tensor, flattened (a 1-D array): one slice of
  // a large flat buffer without reading the rest.
  HostArray tensor_range(const PickleValue& v, const std::string& name, int64_t first, int64_t count) const;
  std::vector<int64_t> tensor_shape(const PickleValue& v, const std::string& name) const;

 private:
  struct StorageView;
  StorageView storage_view(const PickleValue& v, const std::vector<int64_t>& shape, const std::string& where) const;
  ZipArchive archive_;
  std::string prefix_;  // "<archive name>/"
  PickleRef root_;
};

}  // namespace mt

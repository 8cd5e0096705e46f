// torch.save's file format written without PyTorch (the reader is checkpoint/torch_file.h): a zip
// archive of stored (uncompressed) entries under one folder named after the file,
//   NAME/data.pkl               the pickled object (protocol 2: checkpoint/pickle_writer.h)
//   NAME/.format_version        "1"
//   NAME/.storage_alignment     "64"
//   NAME/byteorder              "little"
//   NAME/data/K                 the bytes of storage K ("0", "1", ...), each starting at a multiple
//                               of 64 bytes of the file (the local header's extra field pads it)
//   NAME/version                "3\n"
// A tensor pickles as torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False,
// OrderedDict()), its storage the persistent id ("storage", torch.<T>Storage, "K", "cpu", numel).
// Archives over 4 GiB get zip64 records, as PyTorch's writer does.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/file_io.h"
#include "checkpoint/hf_names.h"
#include "checkpoint/pickle.h"

namespace mt {

// CRC-32 of zip archives (the IEEE polynomial, reflected); crc32_zip("123456789") == 0xCBF43926.
uint32_t crc32_zip(const void* data, size_t n, uint32_t crc = 0);

// A zip archive of stored entries written front to back, each entry's data aligned to
// `alignment` bytes of the file.
class ZipWriter {
 public:
  // `zip64_at`: entries, offsets and directories from this size on get zip64 records (4 GiB; tests
  // lower it to check those records on small archives).
  explicit ZipWriter(std::string path, uint64_t alignment = 64, uint64_t zip64_at = 0xffffffffu);
  // An archive appended to `into` from its current end (offsets and alignment counted from there,
  // as in an archive torch.save writes into a buffer); `into` stays open.
  explicit ZipWriter(OutputFile& into, uint64_t alignment = 64, uint64_t zip64_at = 0xffffffffu);
  void add(const std::string& name, const void* data, uint64_t size);
  // The central directory; `durable`: fsync the file (and close it, unless it was given). Errors
  // throw mt::Error naming the file. Returns the archive's size in bytes.
  uint64_t finish(bool durable);

 private:
  struct Entry {
    std::string name;
    uint64_t offset = 0, size = 0;
    uint32_t crc = 0;
  };
  std::unique_ptr<OutputFile> owned_;
  OutputFile* file_;
  uint64_t base_;  // where the archive starts in the file
  uint64_t alignment_, zip64_at_;
  std::vector<Entry> entries_;
};

// One torch.save'd object: tensors are registered (their bytes made only when the file is
// written, one at a time), the object built around the values returned, then written.
class TorchSaveWriter {
 public:
  using Producer = std::function<HostArray()>;
  // A tensor of `dtype` and `shape` (contiguous) whose bytes `produce` returns at write time.
  PickleRef tensor(DType dtype, std::vector<int64_t> shape, Producer produce);
  PickleRef tensor(HostArray a);
  // Writes `root` to `path` (the archive folder is the file name without its extension), via a
  // temporary file renamed into place; `durable`: fsync it. Returns the bytes written.
  uint64_t write(const std::string& path, const PickleValue& root, bool durable = true);
  // Appends the archive (its folder "archive", as torch.save into a buffer names it) to `file`;
  // returns the archive's size in bytes.
  uint64_t append(OutputFile& file, const PickleValue& root);
  // Tests: zip64 records from this size on (ZipWriter's zip64_at).
  void set_zip64_threshold(uint64_t bytes) { zip64_at_ = bytes; }

 private:
  struct Storage {
    DType dtype;
    int64_t numel = 0;
    Producer produce;
  };
  // The entries into `zip`, under folder `base`; returns the storages' bytes.
  uint64_t write_entries(ZipWriter& zip, const std::string& base, const PickleValue& root, const std::string& what);

  std::vector<Storage> storages_;
  uint64_t zip64_at_ = 0xffffffffu;
};

// torch.float32, torch.bfloat16, ... (the dtype objects pickled in args, e.g. params_dtype).
std::string torch_dtype_name(DType dtype);

}  // namespace mt

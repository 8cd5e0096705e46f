// PyTorch Distributed Checkpoint's file layout (torch.distributed.checkpoint, FileSystemWriter)
// written by one process without PyTorch; the reader is checkpoint/megatron_checkpoint.h.
//   DIR/__0_0.distcp   the stored items end to end, each a torch.save archive (folder "archive"):
//                      a tensor chunk as the tensor itself, an object as the list [object] (how
//                      Megatron-Core stores a ShardedObject)
//   DIR/.metadata      a pickled torch.distributed.checkpoint.metadata.Metadata: for each key its
//                      TensorStorageMetadata (dtype, global size, chunks) or BytesStorageMetadata,
//                      and for each stored item (MetadataIndex: key and chunk offsets) its
//                      _StorageInfo (file, offset, length); version "1.0.0"
// The dataclasses are pickled as pickle does (NEWOBJ, then BUILD with their fields), so the file
// reads back with Python's pickle.load as PyTorch's own.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/file_io.h"
#include "checkpoint/pickle.h"
#include "checkpoint/torch_writer.h"

namespace mt {

class DcpWriter {
 public:
  // Creates DIR/__0_0.distcp (DIR must exist).
  explicit DcpWriter(std::string dir);

  // Chunk [offsets, offsets + shape) of tensor `key` of `global_shape` and `dtype`; `produce`
  // returns its bytes (contiguous, `shape`), called now. Every chunk of a key has its dtype and
  // global shape.
  void tensor_chunk(const std::string& key, DType dtype, const std::vector<int64_t>& global_shape,
                    const std::vector<int64_t>& offsets, const std::vector<int64_t>& shape,
                    const TorchSaveWriter::Producer& produce);
  // An object stored under `key`: `build` makes it (its tensors registered with the writer given).
  // object() stores it as Megatron's dist_checkpointing stores a ShardedObject (in a one-element
  // list); plain_object() as torch.distributed.checkpoint stores a value (Megatron-FSDP's format).
  void object(const std::string& key, const std::function<PickleRef(TorchSaveWriter&)>& build);
  void plain_object(const std::string& key, const std::function<PickleRef(TorchSaveWriter&)>& build);

  // Writes .metadata; `durable`: fsync both files. Returns the bytes of __0_0.distcp.
  uint64_t finish(bool durable);

 private:
  void store_object(const std::string& key, const std::function<PickleRef(TorchSaveWriter&)>& build, bool in_list);
  struct Chunk {
    std::vector<int64_t> offsets, sizes;
    uint64_t offset = 0, length = 0;
  };
  struct Item {
    bool tensor = false;
    DType dtype = DType::f32;
    std::vector<int64_t> global_shape;
    std::vector<Chunk> chunks;
  };
  std::string dir_;
  OutputFile file_;
  std::vector<std::string> keys_;  // in the order written
  std::map<std::string, Item> items_;
};

}  // namespace mt

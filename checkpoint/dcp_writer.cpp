#include "checkpoint/dcp_writer.h"

#include "checkpoint/pickle_writer.h"
#include "core/error.h"
#include "core/shape_text.h"

namespace mt {

namespace {

const std::string kFile = "__0_0.distcp";
const std::string kMeta = "torch.distributed.checkpoint.metadata.";

PickleRef torch_size(const std::vector<int64_t>& dims) {
  std::vector<PickleRef> items;
  for (int64_t d : dims) items.push_back(pickle_int(d));
  return pickle_object("torch.Size", {pickle_tuple(std::move(items))});
}

// TensorProperties' pickled state: (dtype, layout, requires_grad, memory format, pin_memory).
PickleRef tensor_properties(DType dtype) {
  return pickle_new_object(
      kMeta + "TensorProperties",
      pickle_tuple({pickle_global(torch_dtype_name(dtype)),
                    pickle_object("torch.serialization._get_layout", {pickle_str("torch.strided")}), pickle_bool(false),
                    pickle_object(kMeta + "_MEM_FORMAT_ENCODING", {pickle_int(0)}), pickle_bool(false)}));
}

}  // namespace

DcpWriter::DcpWriter(std::string dir) : dir_(std::move(dir)), file_(join_path(dir_, kFile)) {}

void DcpWriter::tensor_chunk(const std::string& key, DType dtype, const std::vector<int64_t>& global_shape,
                             const std::vector<int64_t>& offsets, const std::vector<int64_t>& shape,
                             const TorchSaveWriter::Producer& produce) {
  if (offsets.size() != global_shape.size() || shape.size() != global_shape.size())
    fail("{}: chunk {} at {} of '{}' does not match its {} dimensions", dir_, shape_text(shape), shape_text(offsets), key,
         global_shape.size());
  for (size_t d = 0; d < shape.size(); ++d)
    if (offsets[d] < 0 || offsets[d] + shape[d] > global_shape[d])
      fail("{}: chunk {} at {} lies outside '{}' {}", dir_, shape_text(shape), shape_text(offsets), key,
           shape_text(global_shape));
  auto [it, fresh] = items_.try_emplace(key);
  Item& item = it->second;
  if (fresh) {
    keys_.push_back(key);
    item.tensor = true;
    item.dtype = dtype;
    item.global_shape = global_shape;
  } else if (!item.tensor || item.dtype != dtype || item.global_shape != global_shape) {
    fail("{}: chunks of '{}' differ in kind, dtype or global shape", dir_, key);
  }
  TorchSaveWriter w;
  const PickleRef t = w.tensor(dtype, shape, produce);
  Chunk c;
  c.offsets = offsets;
  c.sizes = shape;
  c.offset = file_.bytes_written();
  c.length = w.append(file_, *t);
  item.chunks.push_back(std::move(c));
}

void DcpWriter::object(const std::string& key, const std::function<PickleRef(TorchSaveWriter&)>& build) {
  store_object(key, build, true);
}

void DcpWriter::plain_object(const std::string& key, const std::function<PickleRef(TorchSaveWriter&)>& build) {
  store_object(key, build, false);
}

void DcpWriter::store_object(const std::string& key, const std::function<PickleRef(TorchSaveWriter&)>& build,
                             bool in_list) {
  if (items_.count(key)) fail("{}: '{}' is written twice", dir_, key);
  keys_.push_back(key);
  Item& item = items_[key];
  TorchSaveWriter w;
  const PickleRef list = in_list ? pickle_list({build(w)}) : build(w);
  Chunk c;
  c.offset = file_.bytes_written();
  c.length = w.append(file_, *list);
  item.chunks.push_back(std::move(c));
}

uint64_t DcpWriter::finish(bool durable) {
  PickleRef state_dict_metadata = pickle_dict(), storage_data = pickle_dict();
  const PickleRef file = pickle_str(kFile);
  // Where a stored item lies: its MetadataIndex (key, and a tensor chunk's offsets) -> _StorageInfo.
  auto store = [&](const std::string& key, const Chunk& c, bool tensor) {
    PickleRef index = pickle_dict();
    pickle_set(*index, "fqn", pickle_str(key));
    if (tensor) pickle_set(*index, "offset", torch_size(c.offsets));
    pickle_set(*index, "index", pickle_none());
    PickleRef info = pickle_dict();
    pickle_set(*info, "relative_path", file);
    pickle_set(*info, "offset", pickle_int(static_cast<int64_t>(c.offset)));
    pickle_set(*info, "length", pickle_int(static_cast<int64_t>(c.length)));
    pickle_set(*storage_data, pickle_new_object(kMeta + "MetadataIndex", index),
               pickle_new_object("torch.distributed.checkpoint.filesystem._StorageInfo", info));
  };
  for (const std::string& key : keys_) {
    const Item& item = items_.at(key);
    if (!item.tensor) {
      pickle_set(*state_dict_metadata, key, pickle_new_object(kMeta + "BytesStorageMetadata"));
      store(key, item.chunks[0], false);
      continue;
    }
    PickleRef chunks = pickle_list();
    for (const Chunk& c : item.chunks) {
      PickleRef cs = pickle_dict();
      pickle_set(*cs, "offsets", torch_size(c.offsets));
      pickle_set(*cs, "sizes", torch_size(c.sizes));
      chunks->items.push_back(pickle_new_object(kMeta + "ChunkStorageMetadata", cs));
      store(key, c, true);
    }
    PickleRef ts = pickle_dict();
    pickle_set(*ts, "properties", tensor_properties(item.dtype));
    pickle_set(*ts, "size", torch_size(item.global_shape));
    pickle_set(*ts, "chunks", chunks);
    pickle_set(*state_dict_metadata, key, pickle_new_object(kMeta + "TensorStorageMetadata", ts));
  }
  PickleRef storage_meta = pickle_dict();
  pickle_set(*storage_meta, "checkpoint_id", pickle_str(dir_));
  pickle_set(*storage_meta, "save_id", pickle_none());
  pickle_set(*storage_meta, "load_id", pickle_none());
  pickle_set(*storage_meta, "modules", pickle_list());
  PickleRef meta = pickle_dict();
  pickle_set(*meta, "state_dict_metadata", state_dict_metadata);
  pickle_set(*meta, "planner_data", pickle_none());
  pickle_set(*meta, "storage_data", storage_data);
  pickle_set(*meta, "storage_meta", pickle_new_object(kMeta + "StorageMeta", storage_meta));
  pickle_set(*meta, "version", pickle_str("1.0.0"));
  if (durable) file_.sync();
  file_.close();
  const uint64_t bytes = file_.bytes_written();
  const std::string pkl = write_pickle(*pickle_new_object(kMeta + "Metadata", meta));
  const std::string path = join_path(dir_, ".metadata");
  OutputFile out(path);
  out.write(pkl.data(), pkl.size());
  if (durable) out.sync();
  out.close();
  return bytes;
}

}  // namespace mt

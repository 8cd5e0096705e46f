#include "checkpoint/torch_file.h"

#include <cerrno>
#include <cstring>
#include <optional>
#include <string_view>

#include "core/error.h"
#include "core/shape_text.h"

namespace mt {

namespace {

uint64_t le_at(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

constexpr uint32_t kEocd = 0x06054b50, kZip64Locator = 0x07064b50, kZip64Eocd = 0x06064b50, kCentral = 0x02014b50,
                   kLocal = 0x04034b50;

}  // namespace

ZipArchive::ZipArchive(std::shared_ptr<const MappedFile> file, uint64_t offset, uint64_t length)
    : file_(std::move(file)) {
  what_ = offset == 0 && length == file_->size() ? file_->path() : fmt::format("{} at byte {}", file_->path(), offset);
  if (offset > file_->size() || length > file_->size() - offset)
    fail("{}: {} bytes from byte {} run past the end of the file ({} bytes): the file is truncated", file_->path(),
         length, offset, file_->size());
  const unsigned char* base = file_->data() + offset;
  auto bad = [&](const std::string& why) { fail("{} is not a torch.save zip archive megatrain can read: {}", what_, why); };
  if (length < 22) bad("too short");
  // The end-of-central-directory record: the last 22 bytes unless a comment follows it.
  int64_t eocd = -1;
  const uint64_t lowest = length >= 22 + 65535 ? length - 22 - 65535 : 0;
  for (uint64_t i = length - 22 + 1; i-- > lowest;)
    if (le_at(base + i, 4) == kEocd) {
      eocd = static_cast<int64_t>(i);
      break;
    }
  if (eocd < 0) bad("no end-of-central-directory record (truncated?)");
  const unsigned char* e = base + eocd;
  uint64_t count = le_at(e + 10, 2), cd_size = le_at(e + 12, 4), cd_offset = le_at(e + 16, 4);
  if (count == 0xffff || cd_size == 0xffffffffu || cd_offset == 0xffffffffu) {
    if (eocd < 20 || le_at(e - 20, 4) != kZip64Locator) bad("a zip64 archive without its locator");
    const uint64_t z = le_at(e - 20 + 8, 8);
    if (z + 56 > length || le_at(base + z, 4) != kZip64Eocd) bad("a zip64 locator pointing nowhere");
    count = le_at(base + z + 32, 8);
    cd_size = le_at(base + z + 40, 8);
    cd_offset = le_at(base + z + 48, 8);
  }
  if (cd_offset + cd_size > length) bad("a central directory past the end");
  uint64_t p = cd_offset;
  for (uint64_t n = 0; n < count; ++n) {
    if (p + 46 > cd_offset + cd_size || le_at(base + p, 4) != kCentral) bad("a damaged central directory");
    const unsigned char* c = base + p;
    const uint64_t method = le_at(c + 10, 2);
    uint64_t csize = le_at(c + 20, 4), usize = le_at(c + 24, 4), local = le_at(c + 42, 4);
    const uint64_t name_len = le_at(c + 28, 2), extra_len = le_at(c + 30, 2), comment_len = le_at(c + 32, 2);
    std::string name(reinterpret_cast<const char*>(c + 46), name_len);
    // zip64 sizes and offset live in the extra field, in this order, for the fields that overflowed.
    for (uint64_t x = 0; x + 4 <= extra_len;) {
      const unsigned char* f = c + 46 + name_len + x;
      const uint64_t id = le_at(f, 2), len = le_at(f + 2, 2);
      if (id == 1) {
        uint64_t q = 4;
        if (usize == 0xffffffffu && q + 8 <= len + 4) usize = le_at(f + q, 8), q += 8;
        if (csize == 0xffffffffu && q + 8 <= len + 4) csize = le_at(f + q, 8), q += 8;
        if (local == 0xffffffffu && q + 8 <= len + 4) local = le_at(f + q, 8), q += 8;
      }
      x += 4 + len;
    }
    if (method != 0) bad("entry '" + name + "' is compressed (torch.save stores entries uncompressed)");
    if (csize != usize) bad("entry '" + name + "' has different stored and original sizes");
    if (local + 30 > length || le_at(base + local, 4) != kLocal) bad("entry '" + name + "' has no local header");
    const uint64_t data = local + 30 + le_at(base + local + 26, 2) + le_at(base + local + 28, 2);
    if (data + usize > length) bad("entry '" + name + "' runs past the end (truncated?)");
    entries_[name] = Entry{offset + data, usize};
    p += 46 + name_len + extra_len + comment_len;
  }
}

const ZipArchive::Entry* ZipArchive::find(const std::string& name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : &it->second;
}

const ZipArchive::Entry& ZipArchive::entry_ending_with(const std::string& suffix) const {
  const Entry* found = nullptr;
  for (const auto& [name, e] : entries_)
    if (name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      if (found) fail("{} has more than one entry ending with '{}'", what_, suffix);
      found = &e;
    }
  if (!found) fail("{} has no entry ending with '{}' (not a torch.save file?)", what_, suffix);
  return *found;
}

namespace {

std::shared_ptr<const MappedFile> map_whole(const std::string& path) { return std::make_shared<MappedFile>(path); }

// "archive/data.pkl" -> "archive/"
std::string archive_prefix(const ZipArchive& z) {
  for (const auto& [name, e] : z.entries())
    if (name.size() >= 9 && name.compare(name.size() - 9, 9, "/data.pkl") == 0) return name.substr(0, name.size() - 8);
  fail("{} has no data.pkl (not a torch.save file?)", z.what());
}

// The _rebuild_tensor_v2 call (its function and arguments) under a Parameter wrapper, or under
// _rebuild_from_type_v2(func, type, args, state), which torch.save writes for a tensor whose type
// is a subclass (Megatron's float32 main weights).
struct TensorCall {
  std::string_view callable;
  const std::vector<PickleRef>& items;
  bool is(std::string_view c) const { return callable == c; }
};
TensorCall tensor_call(const PickleValue& v) {
  if ((v.is_object("torch._utils._rebuild_parameter") || v.is_object("torch._utils._rebuild_parameter_with_state")) &&
      !v.items.empty())
    return tensor_call(*v.items[0]);
  if (v.is_object("torch._tensor._rebuild_from_type_v2") && v.items.size() >= 3 && v.items[0]->is(PickleKind::global) &&
      v.items[2]->is(PickleKind::tuple))
    return {v.items[0]->text, v.items[2]->items};
  return {v.is(PickleKind::object) ? std::string_view(v.text) : std::string_view(), v.items};
}

// torch's storage types and the dtypes they hold.
constexpr std::pair<const char*, DType> kStorageTypes[] = {
    {"torch.FloatStorage", DType::f32},  {"torch.BFloat16Storage", DType::bf16}, {"torch.HalfStorage", DType::f16},
    {"torch.DoubleStorage", DType::f64}, {"torch.LongStorage", DType::i64},      {"torch.IntStorage", DType::i32},
    {"torch.ByteStorage", DType::u8},    {"torch.ShortStorage", DType::i16}};

}  // namespace

std::optional<DType> torch_storage_dtype(const std::string& storage_type) {
  for (const auto& [n, d] : kStorageTypes)
    if (storage_type == n) return d;
  return std::nullopt;
}

std::string torch_storage_type(DType dtype) {
  for (const auto& [n, d] : kStorageTypes)
    if (dtype == d) return n;
  fail("torch has no storage type for {} here", dtype_name(dtype));
}

TorchFile::TorchFile(std::shared_ptr<const MappedFile> file, uint64_t offset, uint64_t length)
    : archive_(std::move(file), offset, length), prefix_(archive_prefix(archive_)) {
  if (const ZipArchive::Entry* bo = archive_.find(prefix_ + "byteorder")) {
    const std::string order(reinterpret_cast<const char*>(archive_.bytes(*bo)), bo->size);
    if (order != "little") fail("{} was saved on a {}-endian machine; megatrain reads little-endian files", what(), order);
  }
  const ZipArchive::Entry& pkl = archive_.entry_ending_with("/data.pkl");
  root_ = read_pickle(archive_.bytes(pkl), pkl.size, what());
}

TorchFile::TorchFile(const std::string& path) : TorchFile(map_whole(path)) {}

TorchFile::TorchFile(std::shared_ptr<const MappedFile> file) : TorchFile(file, 0, file->size()) {}

std::vector<int64_t> torch_size(const PickleValue& v, const std::string& what) {
  // torch.Size pickles as torch.Size((...,)).
  const PickleValue* t = &v;
  if (v.is_object("torch.Size") && v.items.size() == 1) t = v.items[0].get();
  if (!t->is(PickleKind::tuple) && !t->is(PickleKind::list)) fail("{}: expected a tuple of ints, found a {}", what, v.describe());
  std::vector<int64_t> out;
  for (const auto& i : t->items) {
    if (!i->is(PickleKind::integer)) fail("{}: expected a tuple of ints, found a {} in it", what, i->describe());
    out.push_back(i->integer);
  }
  return out;
}

bool TorchFile::is_tensor(const PickleValue& v) {
  const TensorCall t = tensor_call(v);
  return t.is("torch._utils._rebuild_tensor_v2") || t.is("torch._utils._rebuild_tensor_v3") ||
         t.is("torch._utils._rebuild_tensor");
}

std::vector<int64_t> TorchFile::tensor_shape(const PickleValue& v, const std::string& name) const {
  if (!is_tensor(v)) fail("{}: '{}' is a {}, not a tensor", what(), name, v.describe());
  const TensorCall t = tensor_call(v);
  if (t.items.size() < 4) fail("{}: tensor '{}' is pickled with {} arguments", what(), name, t.items.size());
  return torch_size(*t.items[2], what() + ": size of " + name);
}

// A tensor's storage: its dtype, storage offset, strides and bytes in the archive.
struct TorchFile::StorageView {
  DType dtype;
  int64_t storage_offset = 0;
  std::vector<int64_t> stride;
  const unsigned char* bytes = nullptr;
  uint64_t size = 0;  // bytes
};

TorchFile::StorageView TorchFile::storage_view(const PickleValue& v, const std::vector<int64_t>& shape,
                                               const std::string& where) const {
  const TensorCall t = tensor_call(v);
  const PickleValue& storage = *t.items[0];
  if (!storage.is(PickleKind::persistent) || storage.items.empty() || !storage.items[0]->is(PickleKind::tuple) ||
      storage.items[0]->items.size() < 5)
    fail("{} has no storage reference megatrain understands", where);
  const auto& id = storage.items[0]->items;  // ("storage", <dtype>Storage, key, location, numel)
  if (!id[1]->is(PickleKind::global) || !id[2]->is(PickleKind::string))
    fail("{} has a malformed storage reference", where);
  const std::optional<DType> dtype = torch_storage_dtype(id[1]->text);
  if (!dtype) fail("{} is stored as {}, which megatrain does not read", where, id[1]->text);
  if (!t.items[1]->is(PickleKind::integer)) fail("{} has a malformed storage offset", where);
  StorageView sv;
  sv.dtype = *dtype;
  sv.storage_offset = t.items[1]->integer;
  sv.stride = torch_size(*t.items[3], where + " stride");
  if (sv.stride.size() != shape.size()) fail("{} has {} strides for {} dimensions", where, sv.stride.size(), shape.size());
  const ZipArchive::Entry* data = archive_.find(prefix_ + "data/" + id[2]->text);
  if (!data) fail("{} names storage '{}', which the archive does not hold (truncated?)", where, id[2]->text);
  sv.bytes = archive_.bytes(*data);
  sv.size = data->size;
  return sv;
}

HostArray TorchFile::tensor_range(const PickleValue& v, const std::string& name, int64_t first, int64_t count) const {
  const std::vector<int64_t> shape = tensor_shape(v, name);
  const std::string where = what() + ": tensor '" + name + "'";
  const StorageView sv = storage_view(v, shape, where);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1, expect = 1; d >= 0; --d) {
    if (shape[static_cast<size_t>(d)] != 1 && sv.stride[static_cast<size_t>(d)] != expect)
      fail("{} is not contiguous: a range of it cannot be read", where);
    expect *= shape[static_cast<size_t>(d)];
  }
  const int64_t n = shape_numel(shape);
  if (first < 0 || count < 0 || first + count > n)
    fail("{}: elements [{}, {}) lie outside its {}", where, first, first + count, n);
  const size_t elem = dtype_size(sv.dtype);
  if (sv.storage_offset < 0 || static_cast<uint64_t>(sv.storage_offset + n) * elem > sv.size)
    fail("{} reaches past its storage ({} bytes)", where, sv.size);
  HostArray out;
  out.dtype = sv.dtype;
  out.shape = {count};
  out.bytes.resize(static_cast<size_t>(count) * elem);
  std::memcpy(out.bytes.data(), sv.bytes + static_cast<size_t>(sv.storage_offset + first) * elem, out.bytes.size());
  return out;
}

HostArray TorchFile::tensor(const PickleValue& v, const std::string& name) const {
  const std::vector<int64_t> shape = tensor_shape(v, name);
  const std::string where = what() + ": tensor '" + name + "'";
  const StorageView sv = storage_view(v, shape, where);
  const std::optional<DType> dtype = sv.dtype;
  const int64_t storage_offset = sv.storage_offset;
  const std::vector<int64_t>& stride = sv.stride;
  HostArray out;
  out.dtype = *dtype;
  out.shape = shape;
  const size_t elem = dtype_size(*dtype);
  const int64_t n = out.numel();
  out.bytes.resize(static_cast<size_t>(n) * elem);
  if (n == 0) return out;
  // The furthest element the view reaches must lie inside the storage.
  int64_t last = storage_offset;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] < 0 || stride[d] < 0) fail("{} has a negative size or stride", where);
    last += (shape[d] - 1) * stride[d];
  }
  if (storage_offset < 0 || static_cast<uint64_t>(last + 1) * elem > sv.size)
    fail("{} reaches past its storage ({} bytes)", where, sv.size);
  const unsigned char* src = sv.bytes;
  bool contiguous = true;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1, expect = 1; d >= 0; --d) {
    if (shape[static_cast<size_t>(d)] != 1 && stride[static_cast<size_t>(d)] != expect) contiguous = false;
    expect *= shape[static_cast<size_t>(d)];
  }
  if (contiguous) {
    std::memcpy(out.bytes.data(), src + static_cast<size_t>(storage_offset) * elem, out.bytes.size());
    return out;
  }
  std::vector<int64_t> index(shape.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t at = storage_offset;
    for (size_t d = 0; d < shape.size(); ++d) at += index[d] * stride[d];
    std::memcpy(out.bytes.data() + static_cast<size_t>(i) * elem, src + static_cast<size_t>(at) * elem, elem);
    for (size_t d = shape.size(); d-- > 0;) {
      if (++index[d] < shape[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

}  // namespace mt

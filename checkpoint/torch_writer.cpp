#include "checkpoint/torch_writer.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "checkpoint/pickle_writer.h"
#include "checkpoint/torch_file.h"
#include "core/error.h"

namespace mt {

namespace {

// Slicing-by-8 tables of the reflected polynomial 0xEDB88320.
const std::array<std::array<uint32_t, 256>, 8>& crc_tables() {
  static const auto tables = [] {
    std::array<std::array<uint32_t, 256>, 8> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (size_t s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
    return t;
  }();
  return tables;
}

// Little-endian fields of zip records.
struct Record {
  std::string bytes;
  Record& u16(uint64_t v) { return put(v, 2); }
  Record& u32(uint64_t v) { return put(v, 4); }
  Record& u64(uint64_t v) { return put(v, 8); }
  Record& put(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) bytes.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    return *this;
  }
};

constexpr uint64_t kMax32 = 0xffffffffu;
constexpr uint64_t kMax16 = 0xffffu;

}  // namespace

uint32_t crc32_zip(const void* data, size_t n, uint32_t crc) {
  const auto& t = crc_tables();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    const uint32_t lo = crc ^ (static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
                               static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24);
    crc = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^ t[3][p[4]] ^
          t[2][p[5]] ^ t[1][p[6]] ^ t[0][p[7]];
  }
  for (; n > 0; --n, ++p) crc = t[0][(crc ^ *p) & 0xff] ^ (crc >> 8);
  return ~crc;
}

ZipWriter::ZipWriter(std::string path, uint64_t alignment, uint64_t zip64_at)
    : owned_(std::make_unique<OutputFile>(std::move(path))),
      file_(owned_.get()),
      base_(0),
      alignment_(alignment),
      zip64_at_(std::min(zip64_at, kMax32)) {}

ZipWriter::ZipWriter(OutputFile& into, uint64_t alignment, uint64_t zip64_at)
    : file_(&into), base_(into.bytes_written()), alignment_(alignment), zip64_at_(std::min(zip64_at, kMax32)) {}

void ZipWriter::add(const std::string& name, const void* data, uint64_t size) {
  Entry e;
  e.name = name;
  e.offset = file_->bytes_written() - base_;
  e.size = size;
  e.crc = crc32_zip(data, static_cast<size_t>(size));
  const bool zip64 = size >= zip64_at_;
  Record extra;
  if (zip64) extra.u16(1).u16(16).u64(size).u64(size);
  // The padding field ("FB", as PyTorch's writer) brings the data to a multiple of the alignment.
  const uint64_t before = e.offset + 30 + name.size() + extra.bytes.size() + 4;
  const uint64_t pad = (alignment_ - before % alignment_) % alignment_;
  extra.u16(0x4246).u16(pad);
  extra.bytes.append(static_cast<size_t>(pad), 'Z');
  Record h;
  h.u32(0x04034b50).u16(zip64 ? 45 : 20).u16(0).u16(0).u16(0).u16(0).u32(e.crc);
  h.u32(zip64 ? kMax32 : size).u32(zip64 ? kMax32 : size).u16(name.size()).u16(extra.bytes.size());
  h.bytes += name;
  h.bytes += extra.bytes;
  file_->write(h.bytes.data(), h.bytes.size());
  if (size > 0) file_->write(data, static_cast<size_t>(size));
  entries_.push_back(std::move(e));
}

uint64_t ZipWriter::finish(bool durable) {
  const uint64_t cd_offset = file_->bytes_written() - base_;
  Record cd;
  for (const Entry& e : entries_) {
    const bool big = e.size >= zip64_at_, far = e.offset >= zip64_at_;
    Record extra;
    if (big || far) {
      extra.u16(1).u16((big ? 16 : 0) + (far ? 8 : 0));
      if (big) extra.u64(e.size).u64(e.size);
      if (far) extra.u64(e.offset);
    }
    const int version = big || far ? 45 : 20;
    cd.u32(0x02014b50).u16(version).u16(version).u16(0).u16(0).u16(0).u16(0).u32(e.crc);
    cd.u32(big ? kMax32 : e.size).u32(big ? kMax32 : e.size).u16(e.name.size()).u16(extra.bytes.size());
    cd.u16(0).u16(0).u16(0).u32(0).u32(far ? kMax32 : e.offset);
    cd.bytes += e.name;
    cd.bytes += extra.bytes;
  }
  const uint64_t cd_size = cd.bytes.size(), count = entries_.size();
  Record end;
  if (count >= kMax16 || cd_size >= zip64_at_ || cd_offset >= zip64_at_) {
    const uint64_t zip64_eocd = cd_offset + cd_size;
    end.u32(0x06064b50).u64(44).u16(45).u16(45).u32(0).u32(0).u64(count).u64(count).u64(cd_size).u64(cd_offset);
    end.u32(0x07064b50).u32(0).u64(zip64_eocd).u32(1);
    end.u32(0x06054b50).u16(0).u16(0).u16(kMax16).u16(kMax16).u32(kMax32).u32(kMax32).u16(0);
  } else {
    end.u32(0x06054b50).u16(0).u16(0).u16(count).u16(count).u32(cd_size).u32(cd_offset).u16(0);
  }
  cd.bytes += end.bytes;
  file_->write(cd.bytes.data(), cd.bytes.size());
  if (durable) file_->sync();
  if (owned_) file_->close();
  return file_->bytes_written() - base_;
}

std::string torch_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "torch.float32";
    case DType::f64: return "torch.float64";
    case DType::bf16: return "torch.bfloat16";
    case DType::f16: return "torch.float16";
    case DType::i32: return "torch.int32";
    case DType::i64: return "torch.int64";
    case DType::u8: return "torch.uint8";
    case DType::i16: return "torch.int16";
    default: fail("no torch dtype for {} here", dtype_name(dtype));
  }
}

PickleRef TorchSaveWriter::tensor(DType dtype, std::vector<int64_t> shape, Producer produce) {
  const std::string key = std::to_string(storages_.size());
  int64_t numel = 1;
  std::vector<PickleRef> size, stride(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    stride[d] = pickle_int(numel);
    numel *= shape[d];
  }
  for (int64_t s : shape) size.push_back(pickle_int(s));
  storages_.push_back({dtype, numel, std::move(produce)});
  PickleRef id = pickle_tuple({pickle_str("storage"), pickle_global(torch_storage_type(dtype)), pickle_str(key),
                               pickle_str("cpu"), pickle_int(numel)});
  auto storage = std::make_shared<PickleValue>();
  storage->kind = PickleKind::persistent;
  storage->items = {id};
  return pickle_object("torch._utils._rebuild_tensor_v2",
                       {storage, pickle_int(0), pickle_tuple(size), pickle_tuple(stride), pickle_bool(false),
                        pickle_ordered_dict()});
}

PickleRef TorchSaveWriter::tensor(HostArray a) {
  const DType dtype = a.dtype;
  std::vector<int64_t> shape = a.shape;
  auto held = std::make_shared<HostArray>(std::move(a));
  return tensor(dtype, std::move(shape), [held]() { return std::move(*held); });
}

uint64_t TorchSaveWriter::write_entries(ZipWriter& zip, const std::string& base, const PickleValue& root,
                                       const std::string& what) {
  uint64_t bytes = 0;
  const std::string pkl = write_pickle(root);
  auto text = [&](const std::string& name, const std::string& content) {
    zip.add(base + "/" + name, content.data(), content.size());
  };
  text("data.pkl", pkl);
  text(".format_version", "1");
  text(".storage_alignment", "64");
  text("byteorder", "little");
  for (size_t k = 0; k < storages_.size(); ++k) {
    Storage& s = storages_[k];
    const HostArray a = s.produce();
    s.produce = nullptr;  // whatever it held goes now
    if (a.dtype != s.dtype || a.numel() != s.numel)
      fail("{}: storage {} is {} with {} elements, but was registered as {} with {}", what, k, dtype_name(a.dtype),
           a.numel(), dtype_name(s.dtype), s.numel);
    zip.add(base + "/data/" + std::to_string(k), a.bytes.data(), a.bytes.size());
    bytes += a.bytes.size();
  }
  text("version", "3\n");
  storages_.clear();
  return bytes;
}

uint64_t TorchSaveWriter::write(const std::string& path, const PickleValue& root, bool durable) {
  // The archive's folder: the file name without directory and extension, as torch.save names it.
  std::string base = path.substr(path.find_last_of('/') == std::string::npos ? 0 : path.find_last_of('/') + 1);
  if (const size_t dot = base.rfind('.'); dot != std::string::npos && dot > 0) base.resize(dot);
  if (base.empty()) base = "archive";
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  uint64_t bytes = 0;
  try {
    ZipWriter zip(tmp, 64, zip64_at_);
    bytes = write_entries(zip, base, root, path);
    zip.finish(durable);
    rename_path(tmp, path);
  } catch (...) {
    try {
      remove_tree(tmp);
    } catch (...) {
    }
    throw;
  }
  return bytes;
}

uint64_t TorchSaveWriter::append(OutputFile& file, const PickleValue& root) {
  ZipWriter zip(file, 64, zip64_at_);
  write_entries(zip, "archive", root, file.path());
  return zip.finish(false);
}

}  // namespace mt

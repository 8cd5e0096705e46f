#include "data/npy.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace mt {

namespace {

constexpr char kNpyMagic[6] = {'\x93', 'N', 'U', 'M', 'P', 'Y'};

// An mmap kept alive by the arrays pointing into it.
struct Mapping {
  void* base = nullptr;
  size_t size = 0;
  ~Mapping() {
    if (base) munmap(base, size);
  }
};

std::string temporary_name(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return fmt::format("{}.tmp.{}.{}", path, getpid(), counter++);
}

void write_atomically(const std::string& path, const void* header, size_t header_size, const void* data,
                      size_t data_size) {
  const std::string tmp = temporary_name(path);
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail("{}: cannot create: {}", tmp, std::strerror(errno));
  bool ok = std::fwrite(header, 1, header_size, f) == header_size;
  if (ok && data_size) ok = std::fwrite(data, 1, data_size, f) == data_size;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    fail("{}: write failed: {}", tmp, std::strerror(errno));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    fail("{}: cannot rename into place: {}", path, why);
  }
}

}  // namespace

size_t index_type_size(IndexType t) {
  switch (t) {
    case IndexType::i16: return 2;
    case IndexType::i32:
    case IndexType::u32: return 4;
    case IndexType::i64: return 8;
  }
  return 0;
}

const char* index_type_descr(IndexType t) {
  switch (t) {
    case IndexType::i16: return "<i2";
    case IndexType::i32: return "<i4";
    case IndexType::u32: return "<u4";
    case IndexType::i64: return "<i8";
  }
  return "?";
}

void IndexArray::write_npy(const std::string& path) const {
  // numpy's format 1.0 header: a dict literal padded with spaces and a newline so that the data
  // starts on a 64-byte boundary.
  const std::string shape =
      cols_ == 1 ? fmt::format("({},)", rows_) : fmt::format("({}, {})", rows_, cols_);
  std::string dict =
      fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", index_type_descr(type_), shape);
  const size_t unpadded = sizeof kNpyMagic + 2 + 2 + dict.size() + 1;
  dict.append((64 - unpadded % 64) % 64, ' ');
  dict.push_back('\n');
  std::string header(kNpyMagic, sizeof kNpyMagic);
  header.push_back('\x01');
  header.push_back('\x00');
  const uint16_t len = static_cast<uint16_t>(dict.size());
  header.push_back(static_cast<char>(len & 0xff));
  header.push_back(static_cast<char>(len >> 8));
  header += dict;
  write_atomically(path, header.data(), header.size(), data_, static_cast<size_t>(size()) * index_type_size(type_));
}

IndexArray IndexArray::map_npy(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size < 10) {
    close(fd);
    return {};
  }
  auto mapping = std::make_shared<Mapping>();
  mapping->size = static_cast<size_t>(st.st_size);
  void* base = mmap(nullptr, mapping->size, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return {};
  mapping->base = base;
  const auto* bytes = static_cast<const uint8_t*>(base);
  if (std::memcmp(bytes, kNpyMagic, sizeof kNpyMagic) != 0 || bytes[6] != 1) return {};
  const size_t header_len = bytes[8] | (static_cast<size_t>(bytes[9]) << 8);
  if (10 + header_len > mapping->size) return {};
  const std::string dict(reinterpret_cast<const char*>(bytes + 10), header_len);

  IndexArray a;
  bool known = false;
  for (IndexType t : {IndexType::i16, IndexType::i32, IndexType::u32, IndexType::i64}) {
    if (dict.find(fmt::format("'descr': '{}'", index_type_descr(t))) != std::string::npos) {
      a.type_ = t;
      known = true;
    }
  }
  if (!known || dict.find("'fortran_order': False") == std::string::npos) return {};
  const size_t shape_at = dict.find("'shape': (");
  if (shape_at == std::string::npos) return {};
  long long rows = -1, cols = 1;
  const char* shape = dict.c_str() + shape_at + 10;
  if (std::sscanf(shape, "%lld, %lld)", &rows, &cols) < 1 || rows < 0 || cols < 1) return {};
  // A damaged shape must not overflow the size check below (the data would then be read past the
  // end of the file).
  if (rows > static_cast<long long>(mapping->size) || (rows > 0 && cols > static_cast<long long>(mapping->size) / rows))
    return {};
  a.rows_ = rows;
  a.cols_ = cols;
  const size_t need = static_cast<size_t>(rows * cols) * index_type_size(a.type_);
  if (10 + header_len + need != mapping->size) return {};
  a.data_ = bytes + 10 + header_len;
  a.owner_ = std::move(mapping);
  return a;
}

void write_cache_file_atomically(const std::string& path, const std::string& contents) {
  write_atomically(path, contents.data(), contents.size(), nullptr, 0);
}

}  // namespace mt

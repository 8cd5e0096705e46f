#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "checkpoint/file_io.h"
#include "core/crc32c.h"
#include "core/error.h"
#include "core/shape_text.h"

namespace mt {
namespace {

// The reference reader's limit on the header length.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Element size in bits of every dtype the format defines (sub-byte float formats included), so
// that files holding dtypes megatrain does not use are still validated and listed.
std::optional<uint64_t> dtype_bits(std::string_view s) {
  static const std::pair<const char*, uint64_t> table[] = {
      {"BOOL", 8},        {"F4", 4},          {"F6_E2M3", 6},     {"F6_E3M2", 6},   {"U8", 8},
      {"I8", 8},          {"F8_E5M2", 8},     {"F8_E4M3", 8},     {"F8_E8M0", 8},   {"F8_E4M3FNUZ", 8},
      {"F8_E5M2FNUZ", 8}, {"I16", 16},        {"U16", 16},        {"F16", 16},      {"BF16", 16},
      {"I32", 32},        {"U32", 32},        {"F32", 32},        {"C64", 64},      {"F64", 64},
      {"I64", 64},        {"U64", 64}};
  for (const auto& [name, bits] : table)
    if (s == name) return bits;
  return std::nullopt;
}

}  // namespace

std::string_view safetensors_dtype_string(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::u8: return "U8";
    case DType::fp8_e4m3: return "F8_E4M3";
    case DType::fp8_e5m2: return "F8_E5M2";
    case DType::i16: return "I16";
  }
  return "?";
}

std::optional<DType> parse_safetensors_dtype(std::string_view s) {
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8,
                  DType::fp8_e4m3, DType::fp8_e5m2, DType::i16})
    if (s == safetensors_dtype_string(t)) return t;
  return std::nullopt;
}

int64_t SafetensorsEntry::numel() const { return shape_numel(shape); }

std::string SafetensorsEntry::shape_string() const { return shape_text(shape) + " " + dtype_string; }

// ---------------------------------------------------------------------------------------------
// Reading

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path), file_(std::make_unique<MappedFile>(path)) {
  size_ = static_cast<size_t>(file_->size());
  if (size_ < 8)
    fail("{} is not a safetensors file: {} bytes, less than the 8-byte header length (truncated?)", path, size_);
  {
    const unsigned char* bytes = file_->data();
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
    if (n > kMaxHeaderBytes)
      fail("{}: header length {} exceeds the format's limit of {} bytes (not a safetensors file?)", path, n,
           kMaxHeaderBytes);
    if (8 + n > size_)
      fail("{}: truncated: the header needs {} bytes but the file has {}", path, 8 + n, size_);
    const char* hb = reinterpret_cast<const char*>(bytes + 8);
    // The format says the header must start with '{'; the reference reader also accepts leading
    // whitespace, and so do we. Trailing spaces are the alignment padding.
    size_t first = 0;
    while (first < n && (hb[first] == ' ' || hb[first] == '\n' || hb[first] == '\t' || hb[first] == '\r')) ++first;
    if (first == n || hb[first] != '{') fail("{}: header is not a JSON object (first byte is not '{{')", path);
    nlohmann::json header;
    std::set<std::string> top_keys;
    std::string duplicate;
    // The format forbids duplicate names; a JSON parser would silently keep the last one.
    auto watch_keys = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
      if (depth == 1 && event == nlohmann::json::parse_event_t::key && duplicate.empty()) {
        const std::string key = parsed.get<std::string>();
        if (!top_keys.insert(key).second) duplicate = key;
      }
      return true;
    };
    try {
      header = nlohmann::json::parse(hb, hb + n, watch_keys);
    } catch (const nlohmann::json::exception& e) {
      fail("{}: header is not valid JSON: {}", path, e.what());
    }
    if (!duplicate.empty()) fail("{}: the header names '{}' twice", path, duplicate);
    if (!header.is_object()) fail("{}: header is not a JSON object", path);

    const uint64_t data_size = size_ - 8 - n;
    const unsigned char* data = bytes + 8 + n;
    for (auto it = header.begin(); it != header.end(); ++it) {
      const std::string& name = it.key();
      const auto& v = it.value();
      if (name == "__metadata__") {
        if (!v.is_object()) fail("{}: __metadata__ is not an object", path);
        for (auto m = v.begin(); m != v.end(); ++m) {
          if (!m.value().is_string()) fail("{}: __metadata__ value for '{}' is not a string", path, m.key());
          metadata_[m.key()] = m.value().get<std::string>();
        }
        continue;
      }
      if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
        fail("{}: entry '{}' lacks dtype, shape or data_offsets", path, name);
      SafetensorsEntry e;
      e.name = name;
      if (!v["dtype"].is_string()) fail("{}: entry '{}': dtype is not a string", path, name);
      e.dtype_string = v["dtype"].get<std::string>();
      const auto bits = dtype_bits(e.dtype_string);
      if (!bits) fail("{}: entry '{}': unknown dtype '{}'", path, name, e.dtype_string);
      e.dtype = parse_safetensors_dtype(e.dtype_string);
      if (!v["shape"].is_array()) fail("{}: entry '{}': shape is not an array", path, name);
      for (const auto& d : v["shape"]) {
        if (!d.is_number_integer() || d.get<int64_t>() < 0)
          fail("{}: entry '{}': shape holds a value that is not a non-negative integer", path, name);
        e.shape.push_back(d.get<int64_t>());
      }
      const auto& off = v["data_offsets"];
      if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
        fail("{}: entry '{}': data_offsets is not [begin, end]", path, name);
      e.begin = off[0].get<uint64_t>();
      e.end = off[1].get<uint64_t>();
      if (e.end < e.begin) fail("{}: entry '{}': data_offsets end {} < begin {}", path, name, e.end, e.begin);
      const uint64_t want_bits = static_cast<uint64_t>(e.numel()) * *bits;
      if (want_bits % 8 != 0 || e.end - e.begin != want_bits / 8)
        fail("{}: entry '{}': {} needs {} bytes but data_offsets span {}", path, name, e.shape_string(),
             (want_bits + 7) / 8, e.end - e.begin);
      entries_.push_back(std::move(e));
    }
    std::sort(entries_.begin(), entries_.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    // The tensors must tile the data buffer: no holes, no overlaps, no trailing bytes.
    uint64_t expected = 0;
    for (const auto& e : entries_) {
      if (e.begin != expected)
        fail("{}: entry '{}' starts at data byte {} but the previous tensor ends at {} ({})", path, e.name,
             e.begin, expected, e.begin > expected ? "hole" : "overlap");
      expected = e.end;
    }
    if (expected > data_size)
      fail("{}: truncated: the header describes {} data bytes but the file holds {} (file is {} bytes, expected {})",
           path, expected, data_size, size_, 8 + n + expected);
    if (expected < data_size)
      fail("{}: {} bytes after the last tensor (the format allows none)", path, data_size - expected);
    for (size_t i = 0; i < entries_.size(); ++i) {
      entries_[i].data = data + entries_[i].begin;
      index_[entries_[i].name] = i;
    }
  }
}

SafetensorsFile::~SafetensorsFile() = default;
SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept = default;

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

const SafetensorsEntry& SafetensorsFile::get(const std::string& name) const {
  const SafetensorsEntry* e = find(name);
  if (!e) fail("{}: no tensor named '{}'", path_, name);
  return *e;
}

Tensor SafetensorsFile::view(const std::string& name) const {
  const SafetensorsEntry& e = get(name);
  if (!e.dtype) fail("{}: tensor '{}' has dtype {}, which megatrain does not handle", path_, name, e.dtype_string);
  if (e.shape.size() > static_cast<size_t>(Tensor::kMaxDims))
    fail("{}: tensor '{}' has {} dimensions (at most {} supported)", path_, name, e.shape.size(), Tensor::kMaxDims);
  Tensor t;
  t.data = const_cast<unsigned char*>(e.data);
  t.dtype = *e.dtype;
  t.device = Device::cpu;
  t.ndim = static_cast<int>(e.shape.size());
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = e.shape[i];
  return t;
}

// ---------------------------------------------------------------------------------------------
// Writing

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) {
  MT_CHECK(!finished_, "safetensors writer for {} already finished", path_);
  metadata_[key] = value;
}

void SafetensorsWriter::add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data) {
  MT_CHECK(!finished_, "safetensors writer for {} already finished", path_);
  MT_CHECK(name != "__metadata__", "tensor name __metadata__ is reserved");
  for (const auto& p : pending_) MT_CHECK(p.name != name, "duplicate tensor '{}' in {}", name, path_);
  for (int64_t d : shape) MT_CHECK(d >= 0, "negative dimension in '{}'", name);
  const size_t nbytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  MT_CHECK(data != nullptr || nbytes == 0, "tensor '{}' has no data", name);
  pending_.push_back({name, dtype, std::move(shape), data, nbytes});
}

void SafetensorsWriter::add(const std::string& name, const Tensor& t) {
  MT_CHECK(t.device == Device::cpu, "tensor '{}' for {} is not in host memory", name, path_);
  std::vector<int64_t> shape(t.shape.begin(), t.shape.begin() + t.ndim);
  add(name, t.dtype, std::move(shape), t.data);
}

// The reference serializer's order: dtype descending in the format's dtype enumeration (which is
// ordered by alignment), then name. Matching it makes our files byte-identical to Python's.
static int dtype_order(DType t) {
  switch (t) {
    case DType::u8: return 4;
    case DType::fp8_e5m2: return 6;
    case DType::fp8_e4m3: return 7;
    case DType::i16: return 11;
    case DType::f16: return 13;
    case DType::bf16: return 14;
    case DType::i32: return 15;
    case DType::f32: return 17;
    case DType::f64: return 19;
    case DType::i64: return 20;
  }
  return 0;
}

void SafetensorsWriter::sort_entries() {
  std::stable_sort(pending_.begin(), pending_.end(), [](const Pending& a, const Pending& b) {
    const int oa = dtype_order(a.dtype), ob = dtype_order(b.dtype);
    return oa != ob ? oa > ob : a.name < b.name;
  });
}

std::string SafetensorsWriter::header_json() const {
  std::vector<Pending> order = pending_;
  std::stable_sort(order.begin(), order.end(), [](const Pending& a, const Pending& b) {
    const int oa = dtype_order(a.dtype), ob = dtype_order(b.dtype);
    return oa != ob ? oa > ob : a.name < b.name;
  });
  std::string h = "{";
  bool first = true;
  if (!metadata_.empty()) {
    h += "\"__metadata__\":{";
    bool mfirst = true;
    for (const auto& [k, v] : metadata_) {
      if (!mfirst) h += ',';
      h += nlohmann::json(k).dump();
      h += ':';
      h += nlohmann::json(v).dump();
      mfirst = false;
    }
    h += "}";
    first = false;
  }
  uint64_t offset = 0;
  for (const auto& p : order) {
    if (!first) h += ',';
    first = false;
    h += nlohmann::json(p.name).dump();
    h += ":{\"dtype\":\"";
    h += safetensors_dtype_string(p.dtype);
    h += "\",\"shape\":[";
    for (size_t i = 0; i < p.shape.size(); ++i) {
      if (i) h += ',';
      h += std::to_string(p.shape[i]);
    }
    h += "],\"data_offsets\":[";
    h += std::to_string(offset);
    h += ',';
    h += std::to_string(offset + p.nbytes);
    h += "]}";
    offset += p.nbytes;
  }
  h += "}";
  // Pad with spaces so that the data buffer starts 8-byte aligned (8 + N is a multiple of 8).
  while (h.size() % 8 != 0) h += ' ';
  return h;
}

std::vector<SafetensorsWriter::Written> SafetensorsWriter::finish(bool durable) {
  MT_CHECK(!finished_, "safetensors writer for {} already finished", path_);
  finished_ = true;
  sort_entries();
  const std::string header = header_json();
  std::vector<Written> written;
  try {
    OutputFile f(path_);
    unsigned char len[8];
    uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>((n >> (8 * i)) & 0xff);
    f.write(len, 8);
    f.write(header.data(), header.size());
    uint64_t offset = 0;
    for (const auto& p : pending_) {
      // CRC as we stream; the data is read once from the caller's buffer.
      uint32_t crc = 0;
      const auto* src = static_cast<const unsigned char*>(p.data);
      constexpr size_t kChunk = size_t{16} << 20;
      for (size_t done = 0; done < p.nbytes; done += kChunk) {
        const size_t m = std::min(kChunk, p.nbytes - done);
        crc = crc32c_extend(crc, src + done, m);
        f.write(src + done, m);
      }
      written.push_back({p.name, offset, offset + p.nbytes, crc});
      offset += p.nbytes;
    }
    if (durable) f.sync();
    f.close();
  } catch (...) {
    ::unlink(path_.c_str());
    throw;
  }
  return written;
}

}  // namespace mt

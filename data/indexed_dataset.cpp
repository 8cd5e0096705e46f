#include "data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>

#include "core/error.h"
#include "data/hash.h"

static_assert(std::endian::native == std::endian::little, "the .idx/.bin format is little-endian");

namespace mt {

namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr uint64_t kHeaderSize = 9 + 8 + 1 + 8 + 8;  // 34
constexpr uint64_t kMiB = 1 << 20;

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

std::string errno_text() { return std::strerror(errno); }

// A token that failed the range check: where it is and what it was.
struct BadToken {
  size_t position = 0;
  double value = 0;
};

// Converts n tokens of type T at src to int32, checking 0 <= id < limit. Returns the first bad
// token, if any (out is then partly written).
template <typename T>
std::optional<BadToken> convert_tokens(const uint8_t* src, size_t n, int32_t* out, int64_t limit) {
  for (size_t i = 0; i < n; ++i) {
    const T v = load<T>(src + i * sizeof(T));
    int64_t id;
    if constexpr (std::is_floating_point_v<T>) {
      // numpy's float -> int64 cast truncates toward zero.
      if (!std::isfinite(v) || v <= -1.0 || v >= static_cast<double>(limit)) return BadToken{i, static_cast<double>(v)};
      id = static_cast<int64_t>(v);
    } else {
      id = static_cast<int64_t>(v);
    }
    if (id < 0 || id >= limit) return BadToken{i, static_cast<double>(v)};
    out[i] = static_cast<int32_t>(id);
  }
  return std::nullopt;
}

template <typename T>
std::optional<BadToken> scan_tokens(const uint8_t* src, size_t n, int64_t limit) {
  for (size_t i = 0; i < n; ++i) {
    const T v = load<T>(src + i * sizeof(T));
    if constexpr (std::is_floating_point_v<T>) {
      if (!std::isfinite(v) || v <= -1.0 || v >= static_cast<double>(limit)) return BadToken{i, static_cast<double>(v)};
    } else {
      if (static_cast<int64_t>(v) < 0 || static_cast<int64_t>(v) >= limit) return BadToken{i, static_cast<double>(v)};
    }
  }
  return std::nullopt;
}

std::optional<BadToken> convert_any(TokenDType dtype, const uint8_t* src, size_t n, int32_t* out, int64_t limit) {
  switch (dtype) {
    case TokenDType::uint8: return convert_tokens<uint8_t>(src, n, out, limit);
    case TokenDType::int8: return convert_tokens<int8_t>(src, n, out, limit);
    case TokenDType::int16: return convert_tokens<int16_t>(src, n, out, limit);
    case TokenDType::int32: return convert_tokens<int32_t>(src, n, out, limit);
    case TokenDType::int64: return convert_tokens<int64_t>(src, n, out, limit);
    case TokenDType::float64: return convert_tokens<double>(src, n, out, limit);
    case TokenDType::float32: return convert_tokens<float>(src, n, out, limit);
    case TokenDType::uint16: return convert_tokens<uint16_t>(src, n, out, limit);
  }
  return std::nullopt;
}

std::optional<BadToken> scan_any(TokenDType dtype, const uint8_t* src, size_t n, int64_t limit) {
  switch (dtype) {
    case TokenDType::uint8: return scan_tokens<uint8_t>(src, n, limit);
    case TokenDType::int8: return scan_tokens<int8_t>(src, n, limit);
    case TokenDType::int16: return scan_tokens<int16_t>(src, n, limit);
    case TokenDType::int32: return scan_tokens<int32_t>(src, n, limit);
    case TokenDType::int64: return scan_tokens<int64_t>(src, n, limit);
    case TokenDType::float64: return scan_tokens<double>(src, n, limit);
    case TokenDType::float32: return scan_tokens<float>(src, n, limit);
    case TokenDType::uint16: return scan_tokens<uint16_t>(src, n, limit);
  }
  return std::nullopt;
}

std::string format_token(double v) {
  if (std::isfinite(v) && v == std::floor(v) && std::abs(v) < 1e18) return fmt::format("{}", static_cast<int64_t>(v));
  return fmt::format("{}", v);
}

}  // namespace

bool is_valid_dtype_code(uint8_t code) { return code >= 1 && code <= 8; }

size_t dtype_itemsize(TokenDType dtype) {
  switch (dtype) {
    case TokenDType::uint8:
    case TokenDType::int8: return 1;
    case TokenDType::int16:
    case TokenDType::uint16: return 2;
    case TokenDType::int32:
    case TokenDType::float32: return 4;
    case TokenDType::int64:
    case TokenDType::float64: return 8;
  }
  return 0;
}

std::string_view dtype_name(TokenDType dtype) {
  switch (dtype) {
    case TokenDType::uint8: return "uint8";
    case TokenDType::int8: return "int8";
    case TokenDType::int16: return "int16";
    case TokenDType::int32: return "int32";
    case TokenDType::int64: return "int64";
    case TokenDType::float64: return "float64";
    case TokenDType::float32: return "float32";
    case TokenDType::uint16: return "uint16";
  }
  return "?";
}

TokenDType optimal_token_dtype(std::optional<int64_t> vocab_size) {
  return vocab_size && *vocab_size < 65500 ? TokenDType::uint16 : TokenDType::int32;
}

std::string idx_path_of(const std::string& prefix) { return prefix + ".idx"; }
std::string bin_path_of(const std::string& prefix) { return prefix + ".bin"; }

// ---------------------------------------------------------------------------------------------
// IndexedDataset

IndexedDataset::IndexedDataset(std::string prefix, Options options)
    : prefix_(std::move(prefix)), options_(options) {
  const std::string idx = idx_path_of(prefix_);
  const std::string bin = bin_path_of(prefix_);
  for (const std::string& path : {idx, bin}) {
    if (!std::filesystem::exists(path)) {
      fail("{}: no such file (the data prefix '{}' needs both {} and {})", path, prefix_, idx, bin);
    }
  }
  try {
    open_idx();
    open_bin();
  } catch (...) {
    release();
    throw;
  }
}

IndexedDataset::~IndexedDataset() { release(); }

void IndexedDataset::release() {
  if (idx_map_) munmap(const_cast<uint8_t*>(idx_map_), idx_size_);
  if (bin_map_) munmap(const_cast<uint8_t*>(bin_map_), bin_size_);
  if (bin_fd_ >= 0) close(bin_fd_);
  idx_map_ = nullptr;
  bin_map_ = nullptr;
  bin_fd_ = -1;
}

void IndexedDataset::open_idx() {
  const std::string path = idx_path_of(prefix_);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot open: {}", path, errno_text());
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    fail("{}: cannot stat: {}", path, errno_text());
  }
  idx_size_ = static_cast<uint64_t>(st.st_size);
  if (idx_size_ < kHeaderSize) {
    close(fd);
    fail("{}: truncated index: {} bytes, shorter than the {}-byte header", path, idx_size_, kHeaderSize);
  }
  void* map = mmap(nullptr, idx_size_, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (map == MAP_FAILED) fail("{}: cannot mmap: {}", path, errno_text());
  idx_map_ = static_cast<const uint8_t*>(map);

  if (std::memcmp(idx_map_, kMagic, sizeof kMagic) != 0) {
    fail("{}: not a Megatron indexed dataset index (the file does not start with the MMIDIDX magic)", path);
  }
  const uint64_t version = load<uint64_t>(idx_map_ + 9);
  if (version != 1) fail("{}: index version {} is not supported (expected 1)", path, version);
  const uint8_t code = idx_map_[17];
  if (!is_valid_dtype_code(code)) fail("{}: unknown token dtype code {} (expected 1..8)", path, code);
  dtype_ = static_cast<TokenDType>(code);
  itemsize_ = dtype_itemsize(dtype_);
  const uint64_t n = load<uint64_t>(idx_map_ + 18);
  const uint64_t d = load<uint64_t>(idx_map_ + 26);

  const uint64_t body = idx_size_ - kHeaderSize;
  const uint64_t per_sequence = 12 + (options_.multimodal ? 1 : 0);
  if (n > body / per_sequence || d > body / 8 || n * per_sequence + d * 8 > body) {
    fail("{}: truncated index: the header announces {} sequences and {} document indices, more than the "
         "file's {} bytes can hold",
         path, n, d, idx_size_);
  }
  if (n > static_cast<uint64_t>(INT32_MAX)) {
    fail("{}: {} sequences; at most 2^31-1 are supported (Megatron's document index is int32)", path, n);
  }
  if (d == 0) fail("{}: the index has no document indices (expected at least the leading 0)", path);
  document_count_ = static_cast<int64_t>(d);

  sequence_lengths_.resize(n);
  if (n) std::memcpy(sequence_lengths_.data(), idx_map_ + kHeaderSize, n * 4);
  pointers_offset_ = kHeaderSize + n * 4;
  doc_indices_offset_ = pointers_offset_ + n * 8;
  modes_offset_ = doc_indices_offset_ + d * 8;

  const int64_t last_doc = document_index(document_count_ - 1);
  if (last_doc != static_cast<int64_t>(n)) {
    fail("{}: inconsistent index: {} sequence lengths but the last document index is {} (they must be equal)",
         path, n, last_doc);
  }
  for (uint64_t i = 0; i < n; ++i) {
    if (sequence_lengths_[i] < 0) fail("{}: sequence {} has a negative length {}", path, i, sequence_lengths_[i]);
  }
}

void IndexedDataset::open_bin() {
  const std::string path = bin_path_of(prefix_);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot open: {}", path, errno_text());
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    fail("{}: cannot stat: {}", path, errno_text());
  }
  bin_size_ = static_cast<uint64_t>(st.st_size);
  if (options_.mmap_bin && bin_size_ > 0) {
    void* map = mmap(nullptr, bin_size_, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED) fail("{}: cannot mmap: {} (try --no-mmap-bin-files)", path, errno_text());
    bin_map_ = static_cast<const uint8_t*>(map);
  } else {
    bin_fd_ = fd;
  }
  check_pointers();
}

// Megatron's writer lays the sequences out back to back from byte 0, so in a well-formed dataset
// sequence i starts at (sum of the lengths before it) x itemsize and the last one ends exactly at
// the end of the .bin. Anything else (a .idx whose dtype byte was changed, a .bin from another
// dataset, a truncated or padded copy) would read other bytes than were written, so it is refused
// here. One linear pass over the mapped pointers and the copied lengths: about 1 ns per sequence.
void IndexedDataset::check_pointers() const {
  const std::string idx = idx_path_of(prefix_);
  const std::string bin = bin_path_of(prefix_);
  const int64_t n = num_sequences();
  const uint8_t* pointers = idx_map_ + pointers_offset_;
  uint64_t expected = 0;  // bytes of the sequences before i; at most 2^31 x 2^31 x 8, fits
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ptr = load<int64_t>(pointers + static_cast<uint64_t>(i) * 8);
    if (ptr < 0 || static_cast<uint64_t>(ptr) != expected) {
      // A hint for the usual cause: pointers written for another token width.
      std::string hint;
      const uint64_t tokens_before = expected / itemsize_;
      if (ptr > 0 && tokens_before > 0 && static_cast<uint64_t>(ptr) % tokens_before == 0) {
        const uint64_t width = static_cast<uint64_t>(ptr) / tokens_before;
        if (width == 1 || width == 2 || width == 4 || width == 8) {
          hint = fmt::format("; the pointers fit {}-byte tokens, not the index's dtype {} ({} bytes): was the .idx's "
                             "dtype changed?",
                             width, dtype_name(dtype_), itemsize_);
        }
      }
      fail("{} and {} disagree: sequence {} starts at byte {} by the index's pointers but at byte {} by the "
           "lengths before it x {} bytes per {} token{} (mismatched or corrupt files: rebuild the dataset)",
           idx, bin, i, ptr, expected, itemsize_, dtype_name(dtype_), hint);
    }
    expected += static_cast<uint64_t>(sequence_lengths_[static_cast<size_t>(i)]) * itemsize_;
    // Stops before the sum could overflow (each step adds at most 2^34 bytes, bin_size_ < 2^63).
    if (expected > bin_size_) {
      fail("{} and {} disagree: the data file is shorter than its index says: sequence {} ends at byte {} but the "
           "file has {} bytes (truncated copy? rebuild or re-copy the dataset)",
           idx, bin, i, expected, bin_size_);
    }
  }
  if (expected != bin_size_) {
    const std::string why = expected > 0 && bin_size_ % expected == 0
                                ? fmt::format("{} times the index's bytes: was the .idx's dtype changed?",
                                              bin_size_ / expected)
                                : std::string("a padded copy or a .bin of another dataset?");
    fail("{} and {} disagree: the index's {} sequences of dtype {} end at byte {} but the data file has {} bytes ({}; "
         "rebuild or re-copy the dataset)",
         idx, bin, n, dtype_name(dtype_), expected, bin_size_, why);
  }
}

int64_t IndexedDataset::sequence_pointer(int64_t seq) const {
  return load<int64_t>(idx_map_ + pointers_offset_ + static_cast<uint64_t>(seq) * 8);
}

int64_t IndexedDataset::document_index(int64_t i) const {
  return load<int64_t>(idx_map_ + doc_indices_offset_ + static_cast<uint64_t>(i) * 8);
}

std::string IndexedDataset::cache_identity() const {
  std::call_once(identity_once_, [&] {
    identity_ = fmt::format("{} sequences, lengths {:016x}", sequence_lengths_.size(),
                            hash_bytes(sequence_lengths_.data(), sequence_lengths_.size() * sizeof(int32_t)));
  });
  return identity_;
}

std::vector<int64_t> IndexedDataset::document_indices() const {
  std::vector<int64_t> out(static_cast<size_t>(document_count_));
  std::memcpy(out.data(), idx_map_ + doc_indices_offset_, out.size() * 8);
  return out;
}

std::vector<int8_t> IndexedDataset::sequence_modes() const {
  if (!options_.multimodal) return {};
  std::vector<int8_t> out(sequence_lengths_.size());
  std::memcpy(out.data(), idx_map_ + modes_offset_, out.size());
  return out;
}

void IndexedDataset::read_raw(uint64_t byte_offset, uint64_t nbytes, void* dst) const {
  if (byte_offset > bin_size_ || nbytes > bin_size_ - byte_offset) {
    fail("{}: read of {} bytes at offset {} runs past the end of the file ({} bytes): the index points outside "
         "the data (corrupt dataset; --full-data-check finds every such sequence)",
         bin_path_of(prefix_), nbytes, byte_offset, bin_size_);
  }
  if (bin_map_) {
    std::memcpy(dst, bin_map_ + byte_offset, nbytes);
    return;
  }
  auto* p = static_cast<uint8_t*>(dst);
  while (nbytes > 0) {
    const ssize_t got = pread(bin_fd_, p, nbytes, static_cast<off_t>(byte_offset));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) fail("{}: read failed at offset {}: {}", bin_path_of(prefix_), byte_offset, got < 0 ? errno_text() : "unexpected end of file");
    p += got;
    byte_offset += static_cast<uint64_t>(got);
    nbytes -= static_cast<uint64_t>(got);
  }
}

void IndexedDataset::read(int64_t seq, int64_t offset, int64_t count, int32_t* out) const {
  MT_CHECK(seq >= 0 && seq < num_sequences() && offset >= 0 && count >= 0, "read(seq={}, offset={}, count={}) of {}",
           seq, offset, count, prefix_);
  if (count == 0) return;
  const int64_t ptr = sequence_pointer(seq);
  const uint64_t byte_offset = static_cast<uint64_t>(ptr) + static_cast<uint64_t>(offset) * itemsize_;
  const uint64_t nbytes = static_cast<uint64_t>(count) * itemsize_;
  const uint8_t* src;
  thread_local std::vector<uint8_t> scratch;
  if (bin_map_ && ptr >= 0 && byte_offset <= bin_size_ && nbytes <= bin_size_ - byte_offset) {
    src = bin_map_ + byte_offset;
  } else {
    if (ptr < 0) fail("{}: sequence {} has a negative pointer {} (corrupt index)", idx_path_of(prefix_), seq, ptr);
    if (scratch.size() < nbytes) scratch.resize(nbytes);
    read_raw(byte_offset, nbytes, scratch.data());
    src = scratch.data();
  }
  if (auto bad = convert_any(dtype_, src, static_cast<size_t>(count), out, token_limit_)) {
    fail("{}: sequence {} holds token id {} at position {}, outside [0, {}) (the padded vocabulary): was the "
         "dataset made with another tokenizer?",
         bin_path_of(prefix_), seq, format_token(bad->value), offset + static_cast<int64_t>(bad->position), token_limit_);
  }
}

void IndexedDataset::check_range_in_bytes(uint64_t byte_offset, uint64_t nbytes, int64_t limit, const char* what) const {
  std::vector<uint8_t> buffer;
  const uint8_t* src;
  if (bin_map_) {
    src = bin_map_ + byte_offset;
  } else {
    buffer.resize(nbytes);
    read_raw(byte_offset, nbytes, buffer.data());
    src = buffer.data();
  }
  if (auto bad = scan_any(dtype_, src, nbytes / itemsize_, limit)) {
    fail("{}: token id {} at byte offset {} is outside [0, {}) (the padded vocabulary; found by {}): was the "
         "dataset made with another tokenizer?",
         bin_path_of(prefix_), format_token(bad->value), byte_offset + bad->position * itemsize_, limit, what);
  }
}

void IndexedDataset::check_tokens(int64_t limit, bool full) const {
  const std::string bin = bin_path_of(prefix_);
  const uint64_t usable = bin_size_ - bin_size_ % itemsize_;
  if (full) {
    const int64_t n = num_sequences();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t ptr = sequence_pointer(i);
      const uint64_t len = static_cast<uint64_t>(sequence_lengths_[i]) * itemsize_;
      if (ptr < 0 || static_cast<uint64_t>(ptr) > bin_size_ || len > bin_size_ - static_cast<uint64_t>(ptr)) {
        fail("{}: sequence {} spans bytes [{}, {}) but the data file has {} bytes (corrupt dataset)", bin, i, ptr,
             static_cast<uint64_t>(ptr) + len, bin_size_);
      }
    }
    for (int64_t i = 1; i < document_count_; ++i) {
      if (document_index(i) < document_index(i - 1)) {
        fail("{}: document indices decrease at document {} (corrupt index)", idx_path_of(prefix_), i);
      }
    }
    const uint64_t chunk = 16 * kMiB;
    for (uint64_t off = 0; off < usable; off += chunk) {
      check_range_in_bytes(off, std::min(chunk, usable - off), limit, "--full-data-check");
    }
    return;
  }
  // Cheap: the first and last MiB of tokens, and 64 whole sequences spread over the dataset.
  const uint64_t head = std::min(usable, kMiB);
  check_range_in_bytes(0, head, limit, "the check of the first MiB");
  if (usable > head) {
    uint64_t start = usable > kMiB ? usable - kMiB : 0;
    start -= start % itemsize_;
    check_range_in_bytes(start, usable - start, limit, "the check of the last MiB");
  }
  const int64_t n = num_sequences();
  const int64_t picks = std::min<int64_t>(n, 64);
  for (int64_t k = 0; k < picks; ++k) {
    const int64_t seq = k * n / picks;
    const uint64_t ptr = static_cast<uint64_t>(sequence_pointer(seq));
    const uint64_t len = std::min<uint64_t>(static_cast<uint64_t>(sequence_lengths_[seq]), kMiB) * itemsize_;
    if (ptr > bin_size_ || len > bin_size_ - ptr) {
      fail("{}: sequence {} spans bytes [{}, {}) but the data file has {} bytes (corrupt dataset)", bin, seq, ptr,
           ptr + len, bin_size_);
    }
    check_range_in_bytes(ptr, len, limit, "the sampled-sequence check");
  }
}

// ---------------------------------------------------------------------------------------------
// IndexedDatasetBuilder

IndexedDatasetBuilder::IndexedDatasetBuilder(std::string prefix, TokenDType dtype)
    : prefix_(std::move(prefix)), dtype_(dtype), itemsize_(dtype_itemsize(dtype)) {
  MT_CHECK(is_valid_dtype_code(static_cast<uint8_t>(dtype)), "dtype code {}", static_cast<int>(dtype));
  const std::string path = bin_path_of(prefix_);
  bin_ = std::fopen(path.c_str(), "wb");
  if (!bin_) fail("{}: cannot create: {}", path, errno_text());
  std::setvbuf(bin_, nullptr, _IOFBF, 1 << 20);
}

IndexedDatasetBuilder::~IndexedDatasetBuilder() {
  if (bin_) std::fclose(bin_);
}

void IndexedDatasetBuilder::write_tokens(std::span<const int32_t> tokens) {
  MT_CHECK(!finalized_, "{}: add after finalize()", prefix_);
  if (tokens.empty()) return;
  convert_buffer_.resize(tokens.size() * itemsize_);
  uint8_t* dst = convert_buffer_.data();
  auto store_int = [&](auto tag, int64_t lo, int64_t hi) {
    using T = decltype(tag);
    for (size_t i = 0; i < tokens.size(); ++i) {
      const int64_t v = tokens[i];
      if (v < lo || v > hi) {
        fail("{}: token id {} does not fit the dataset's dtype {} (use a wider dtype, e.g. int32)", bin_path_of(prefix_),
             v, dtype_name(dtype_));
      }
      const T t = static_cast<T>(v);
      std::memcpy(dst + i * sizeof(T), &t, sizeof(T));
    }
  };
  switch (dtype_) {
    case TokenDType::uint8: store_int(uint8_t{}, 0, 255); break;
    case TokenDType::int8: store_int(int8_t{}, -128, 127); break;
    case TokenDType::int16: store_int(int16_t{}, -32768, 32767); break;
    case TokenDType::uint16: store_int(uint16_t{}, 0, 65535); break;
    case TokenDType::int32: store_int(int32_t{}, INT32_MIN, INT32_MAX); break;
    case TokenDType::int64: store_int(int64_t{}, INT64_MIN, INT64_MAX); break;
    case TokenDType::float32: store_int(float{}, -(1 << 24), 1 << 24); break;  // exact in float32
    case TokenDType::float64: store_int(double{}, INT32_MIN, INT32_MAX); break;
  }
  if (std::fwrite(dst, 1, convert_buffer_.size(), bin_) != convert_buffer_.size()) {
    fail("{}: write failed: {}", bin_path_of(prefix_), errno_text());
  }
}

void IndexedDatasetBuilder::add_document(std::span<const int32_t> tokens) {
  if (tokens.empty()) {
    add_document(tokens, {});
  } else {
    const int32_t length = static_cast<int32_t>(tokens.size());
    add_document(tokens, std::span<const int32_t>(&length, 1));
  }
}

void IndexedDatasetBuilder::add_document(std::span<const int32_t> tokens, std::span<const int32_t> lengths) {
  int64_t total = 0;
  for (int32_t l : lengths) {
    if (l < 0) fail("{}: negative sequence length {}", prefix_, l);
    total += l;
  }
  if (total != static_cast<int64_t>(tokens.size())) {
    fail("{}: add_document: the sequence lengths sum to {} but the document has {} tokens", prefix_, total,
         tokens.size());
  }
  write_tokens(tokens);
  sequence_lengths_.insert(sequence_lengths_.end(), lengths.begin(), lengths.end());
  document_indices_.push_back(static_cast<int64_t>(sequence_lengths_.size()));
}

void IndexedDatasetBuilder::add_item(std::span<const int32_t> tokens) {
  if (tokens.size() > static_cast<size_t>(INT32_MAX)) fail("{}: a sequence of {} tokens is too long", prefix_, tokens.size());
  write_tokens(tokens);
  sequence_lengths_.push_back(static_cast<int32_t>(tokens.size()));
}

void IndexedDatasetBuilder::end_document() {
  document_indices_.push_back(static_cast<int64_t>(sequence_lengths_.size()));
}

void IndexedDatasetBuilder::add_index(const std::string& other_prefix) {
  MT_CHECK(!finalized_, "{}: add_index after finalize()", prefix_);
  IndexedDataset other(other_prefix);
  if (other.dtype() != dtype_) {
    fail("{}: cannot merge {}: its dtype is {}, this dataset's is {}", prefix_, idx_path_of(other_prefix),
         dtype_name(other.dtype()), dtype_name(dtype_));
  }
  const int64_t offset = static_cast<int64_t>(sequence_lengths_.size());
  const auto lengths = other.sequence_lengths();
  sequence_lengths_.insert(sequence_lengths_.end(), lengths.begin(), lengths.end());
  for (int64_t i = 1; i <= other.num_documents(); ++i) document_indices_.push_back(offset + other.document_index(i));

  // The whole .bin is appended, as Megatron's shutil.copyfileobj does.
  const std::string other_bin = bin_path_of(other_prefix);
  std::FILE* in = std::fopen(other_bin.c_str(), "rb");
  if (!in) fail("{}: cannot open: {}", other_bin, errno_text());
  std::vector<char> buffer(1 << 20);
  size_t got;
  while ((got = std::fread(buffer.data(), 1, buffer.size(), in)) > 0) {
    if (std::fwrite(buffer.data(), 1, got, bin_) != got) {
      std::fclose(in);
      fail("{}: write failed: {}", bin_path_of(prefix_), errno_text());
    }
  }
  const bool read_error = std::ferror(in);
  std::fclose(in);
  if (read_error) fail("{}: read failed", other_bin);
}

void IndexedDatasetBuilder::finalize() {
  MT_CHECK(!finalized_, "{}: finalize() twice", prefix_);
  finalized_ = true;
  const std::string bin = bin_path_of(prefix_);
  const bool bin_ok = std::fflush(bin_) == 0;
  const bool close_ok = std::fclose(bin_) == 0;
  bin_ = nullptr;
  if (!bin_ok || !close_ok) fail("{}: write failed: {}", bin, errno_text());

  const uint64_t n = sequence_lengths_.size();
  const uint64_t d = document_indices_.size();
  std::vector<uint8_t> out;
  out.reserve(kHeaderSize + n * 12 + d * 8);
  auto put = [&](const void* p, size_t size) {
    const auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + size);
  };
  const uint64_t version = 1;
  const uint8_t code = static_cast<uint8_t>(dtype_);
  put(kMagic, sizeof kMagic);
  put(&version, 8);
  put(&code, 1);
  put(&n, 8);
  put(&d, 8);
  put(sequence_lengths_.data(), n * 4);
  int64_t pointer = 0;
  for (uint64_t i = 0; i < n; ++i) {
    put(&pointer, 8);
    pointer += static_cast<int64_t>(sequence_lengths_[i]) * static_cast<int64_t>(itemsize_);
  }
  put(document_indices_.data(), d * 8);

  const std::string idx = idx_path_of(prefix_);
  std::FILE* f = std::fopen(idx.c_str(), "wb");
  if (!f) fail("{}: cannot create: {}", idx, errno_text());
  const bool ok = std::fwrite(out.data(), 1, out.size(), f) == out.size();
  if (std::fclose(f) != 0 || !ok) fail("{}: write failed: {}", idx, errno_text());
}

}  // namespace mt

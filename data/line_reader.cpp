#include "data/line_reader.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <initializer_list>

#include "core/error.h"

namespace mt {

namespace {

// The first bytes of the compressed formats a corpus comes in. gzip is read; the others are refused
// by name (read as text they would fail as "not valid JSON" at line 1, or worse, partway through).
bool starts_with(const unsigned char* head, size_t n, std::initializer_list<unsigned char> magic) {
  return n >= magic.size() && std::equal(magic.begin(), magic.end(), head);
}
const char* other_compression(const unsigned char* head, size_t n) {
  if (starts_with(head, n, {0x28, 0xb5, 0x2f, 0xfd})) return "zstd (decompress it with zstd -d)";
  if (starts_with(head, n, {0xfd, '7', 'z', 'X', 'Z', 0x00})) return "xz (decompress it with xz -d)";
  if (starts_with(head, n, {0x04, 0x22, 0x4d, 0x18})) return "lz4 (decompress it with lz4 -d)";
  // bzip2: "BZh", the block size '1'..'9', then a block's or the end of stream's magic number.
  if (n >= 10 && starts_with(head, n, {'B', 'Z', 'h'}) && head[3] >= '1' && head[3] <= '9' &&
      (starts_with(head + 4, n - 4, {0x31, 0x41, 0x59, 0x26, 0x53, 0x59}) ||
       starts_with(head + 4, n - 4, {0x17, 0x72, 0x45, 0x38, 0x50, 0x90})))
    return "bzip2 (decompress it with bzip2 -d)";
  return nullptr;
}

bool ends_with_gz(const std::string& path) { return path.size() > 3 && path.compare(path.size() - 3, 3, ".gz") == 0; }

[[noreturn]] void refuse_empty_gzip(const std::string& name) {
  fail("--input '{}': the gzip stream is truncated (the file is empty): the file is incomplete", name);
}
[[noreturn]] void refuse_not_gzip(const std::string& name) {
  fail("--input '{}': not in gzip format (the name ends in .gz but the file does not start with gzip's magic bytes "
       "1f 8b)", name);
}

}  // namespace

// A gzip file read to its end as gzip(1) reads it: one or more members back to back (pigz, bgzip
// and `cat a.gz b.gz` write several), each a deflate stream followed by its trailer, whose CRC-32
// and length (mod 2^32) inflate verifies before it returns Z_STREAM_END. Zero bytes after the last
// member are padding (gzip and Python's gzip module skip them). Everything else is refused in one
// line naming the file: input that ends inside a member (a cut file, wherever the cut falls, even at
// a line boundary of the text or just before the trailer), a wrong trailer or damaged deflate data,
// bytes after a member that do not start another, and an empty file. The text inflated before such
// an end is never handed out as a shorter input.
class GzipInput {
 public:
  GzipInput(int fd, std::string name) : fd_(fd), name_(std::move(name)) {
    // 15 + 16: a 32 KiB window and the gzip wrapper only (no zlib or raw deflate streams).
    if (inflateInit2(&zs_, 15 + 16) != Z_OK) fail("--input '{}': cannot start the gzip decoder (out of memory)", name_);
  }
  ~GzipInput() { inflateEnd(&zs_); }
  GzipInput(const GzipInput&) = delete;
  GzipInput& operator=(const GzipInput&) = delete;

  // Inflated bytes (0 at the verified end of the file).
  size_t read(char* dst, size_t n) {
    zs_.next_out = reinterpret_cast<unsigned char*>(dst);
    zs_.avail_out = static_cast<unsigned>(std::min<size_t>(n, 1u << 30));
    const unsigned asked = zs_.avail_out;
    while (zs_.avail_out > 0 && !finished_) {
      if (!in_member_ && !start_member()) {
        finished_ = true;
        break;
      }
      if (zs_.avail_in == 0) refill();
      const int ret = inflate(&zs_, Z_NO_FLUSH);
      if (ret == Z_STREAM_END) {  // the member's trailer matched its data
        in_member_ = false;
        ++members_;
        continue;
      }
      if (ret == Z_DATA_ERROR || ret == Z_NEED_DICT) damaged(zs_.msg);
      if (ret == Z_MEM_ERROR) fail("--input '{}': out of memory while decompressing", name_);
      // Z_OK or Z_BUF_ERROR: inflate took all the input it had and wants more. At the end of the
      // file the member (its data or its trailer) is incomplete.
      if (zs_.avail_in == 0 && input_end_ && zs_.avail_out > 0) truncated();
    }
    return asked - zs_.avail_out;
  }

 private:
  // Reads more of the file after the bytes not yet inflated (moved to the front).
  void refill() {
    if (input_end_) return;
    if (in_.empty()) in_.resize(size_t{1} << 20);
    if (zs_.avail_in > 0 && zs_.next_in != in_.data()) std::memmove(in_.data(), zs_.next_in, zs_.avail_in);
    zs_.next_in = in_.data();
    while (true) {
      const ssize_t got = ::read(fd_, in_.data() + zs_.avail_in, in_.size() - zs_.avail_in);
      if (got > 0) {
        zs_.avail_in += static_cast<unsigned>(got);
        offset_ += static_cast<uint64_t>(got);
        return;
      }
      if (got == 0) {
        input_end_ = true;
        return;
      }
      if (errno != EINTR) fail("--input '{}': read error: {}", name_, std::strerror(errno));
    }
  }

  // Between members: true when another member starts here (the decoder is reset for it), false at
  // the end of the file (after any zero padding). Refuses what is neither.
  bool start_member() {
    bool padding = false;
    while (true) {
      while (zs_.avail_in < 2 && !input_end_) refill();
      if (members_ == 0 || zs_.avail_in == 0 || zs_.next_in[0] != 0) break;
      ++zs_.next_in;  // a zero byte of padding after the last member
      --zs_.avail_in;
      padding = true;
    }
    if (zs_.avail_in == 0) {
      if (members_ == 0) refuse_empty_gzip(name_);
      return false;
    }
    if (zs_.avail_in >= 2 && zs_.next_in[0] == 0x1f && zs_.next_in[1] == 0x8b && !padding) {
      inflateReset(&zs_);
      in_member_ = true;
      return true;
    }
    if (members_ == 0) refuse_not_gzip(name_);
    if (zs_.avail_in == 1 && zs_.next_in[0] == 0x1f && !padding) truncated();  // cut in the next member's header
    fail("--input '{}': the gzip stream is damaged (byte {} follows the end of gzip member {} but does not start "
         "another member; gzip -t calls this trailing garbage): the file is corrupt",
         name_, offset_ - zs_.avail_in, members_);
  }

  [[noreturn]] void truncated() const {
    fail("--input '{}': the gzip stream is truncated (the file ends at byte {}, inside gzip member {}, before its "
         "trailer): the file is incomplete",
         name_, offset_, members_ + 1);
  }

  [[noreturn]] void damaged(const char* what) const {
    std::string why = what ? what : "invalid deflate data";
    // inflate's words for a trailer that does not match the data.
    if (why == "incorrect data check") why = "the CRC-32 in its trailer does not match the data";
    if (why == "incorrect length check") why = "the length in its trailer does not match the data";
    fail("--input '{}': the gzip stream is damaged (gzip member {}, near byte {}: {}): the file is corrupt",
         name_, members_ + 1, offset_ - zs_.avail_in, why);
  }

  int fd_;
  std::string name_;
  z_stream zs_{};
  std::vector<unsigned char> in_;  // read from the file; [next_in, next_in + avail_in) not yet inflated
  uint64_t offset_ = 0;            // bytes read from the file
  uint64_t members_ = 0;           // members inflated and verified
  bool in_member_ = false, input_end_ = false, finished_ = false;
};

struct LineChunkReader::Source {
  int fd = -1;
  std::unique_ptr<GzipInput> gz;
  std::string name;

  // Files whose first bytes are gzip's magic are read as gzip whatever their name; a name ending
  // in .gz must hold gzip (as Python's gzip module, which Megatron's tool uses for them, requires).
  explicit Source(const std::string& path) : name(path) {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("--input '{}': cannot open: {}", path, std::strerror(errno));
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    unsigned char head[10];
    ssize_t n;
    do n = ::pread(fd, head, sizeof head, 0);
    while (n < 0 && errno == EINTR);
    if (n < 0) {
      const int e = errno;
      ::close(fd);
      fail("--input '{}': read error: {}", path, std::strerror(e));
    }
    const size_t got = static_cast<size_t>(n);
    if (const char* format = other_compression(head, got)) {
      ::close(fd);
      fail("--input '{}' is compressed with {}: preprocess-data reads JSONL, plain or gzip-compressed", path, format);
    }
    const bool gzip_magic = got >= 2 && head[0] == 0x1f && head[1] == 0x8b;
    if (ends_with_gz(path) && !gzip_magic) {
      ::close(fd);
      if (got == 0) refuse_empty_gzip(path);
      refuse_not_gzip(path);
    }
    if (gzip_magic) {
      try {
        gz = std::make_unique<GzipInput>(fd, path);
      } catch (...) {
        ::close(fd);
        throw;
      }
    }
  }
  ~Source() {
    gz.reset();
    if (fd >= 0) ::close(fd);
  }
  bool compressed() const { return gz != nullptr; }
  // Bytes read (0 at the end).
  size_t read(char* dst, size_t n) {
    if (gz) return gz->read(dst, n);
    while (true) {
      const ssize_t got = ::read(fd, dst, n);
      if (got >= 0) return static_cast<size_t>(got);
      if (errno != EINTR) fail("--input '{}': read error: {}", name, std::strerror(errno));
    }
  }
};

LineChunkReader::LineChunkReader(std::vector<std::string> files, size_t chunk_bytes)
    : files_(std::move(files)), chunk_bytes_(std::max<size_t>(chunk_bytes, 1)) {
  for (const std::string& f : files_) Source check(f);  // every file opens, before any work
  if (!files_.empty()) source_ = std::make_unique<Source>(files_[0]);
}

LineChunkReader::~LineChunkReader() = default;

bool LineChunkReader::inside_compressed(size_t file) const {
  return file == file_ && source_ && source_->compressed() && !eof_;
}

void LineChunkReader::check_rest_of_file(size_t file) {
  if (!inside_compressed(file)) return;
  std::vector<char> sink(size_t{1} << 20);
  while (source_->read(sink.data(), sink.size()) > 0) {
  }
  eof_ = true;
}

bool LineChunkReader::fill() {
  constexpr size_t kRead = size_t{4} << 20;
  if (begin_ > 0) {  // drop what was handed out
    pending_.erase(0, begin_);
    begin_ = 0;
  }
  const size_t old = pending_.size();
  pending_.resize(old + kRead);
  const size_t got = source_->read(pending_.data() + old, kRead);
  pending_.resize(old + got);
  if (got == 0) return false;
  // Universal newlines: "\r\n" -> "\n", lone "\r" -> "\n". A "\r" that ended the previous read
  // was already turned into "\n"; drop a "\n" that completes it.
  char* p = pending_.data() + old;
  char* end = p + got;
  char* out = p;
  if (pending_cr_ && p < end && *p == '\n') ++p;
  pending_cr_ = false;
  if (!std::memchr(p, '\r', static_cast<size_t>(end - p))) {
    if (out != p) std::memmove(out, p, static_cast<size_t>(end - p));
    out += end - p;
  } else {
    while (p < end) {
      const char c = *p++;
      if (c == '\r') {
        *out++ = '\n';
        if (p < end && *p == '\n') ++p;
        else if (p == end) pending_cr_ = true;
      } else {
        *out++ = c;
      }
    }
  }
  pending_.resize(static_cast<size_t>(out - pending_.data()));
  if (!newline_seen_ && std::memchr(pending_.data() + old, '\n', pending_.size() - old)) newline_seen_ = true;
  return true;
}

bool LineChunkReader::next(LineChunk& chunk) {
  while (file_ < files_.size()) {
    // Read until the pending text holds a whole chunk's worth of lines, or the file ends.
    while (!eof_ && !(pending_.size() - begin_ >= chunk_bytes_ && newline_seen_))
      if (!fill()) eof_ = true;
    const size_t avail = pending_.size() - begin_;
    if (avail > 0) {
      const char* base = pending_.data() + begin_;
      size_t cut;
      if (eof_ && avail <= chunk_bytes_) {
        cut = avail;
      } else {
        // The last newline within chunk_bytes_, else the first one after (a long line).
        const size_t window = std::min(avail, chunk_bytes_);
        const void* nl = memrchr(base, '\n', window);
        if (!nl) nl = std::memchr(base + window, '\n', avail - window);
        cut = nl ? static_cast<size_t>(static_cast<const char*>(nl) - base) + 1 : avail;
      }
      chunk.data.assign(base, cut);
      begin_ += cut;
      newline_seen_ = std::memchr(pending_.data() + begin_, '\n', pending_.size() - begin_) != nullptr;
      if (chunk.data.back() != '\n') chunk.data += '\n';
      chunk.file = file_;
      chunk.first_line = line_;
      chunk.first_global = global_;
      chunk.lines = static_cast<uint64_t>(std::count(chunk.data.begin(), chunk.data.end(), '\n'));
      chunk.sequence = sequence_++;
      line_ += chunk.lines;
      global_ += chunk.lines;
      return true;
    }
    // Next file.
    ++file_;
    source_.reset();
    pending_.clear();
    begin_ = 0;
    eof_ = false;
    pending_cr_ = false;
    newline_seen_ = false;
    line_ = 1;
    if (file_ < files_.size()) source_ = std::make_unique<Source>(files_[file_]);
  }
  return false;
}

}  // namespace mt

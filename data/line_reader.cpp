#include "data/line_reader.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace mt {

struct LineChunkReader::Source {
  int fd = -1;
  gzFile gz = nullptr;
  std::string name;

  explicit Source(const std::string& path) : name(path) {
    const bool gzip = path.size() > 3 && path.compare(path.size() - 3, 3, ".gz") == 0;
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("--input '{}': cannot open: {}", path, std::strerror(errno));
    if (gzip) {
      gz = gzdopen(fd, "rb");
      if (!gz) fail("--input '{}': cannot read as gzip", path);
      gzbuffer(gz, 1 << 20);
    } else {
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    }
  }
  ~Source() {
    if (gz) gzclose(gz);  // closes fd too
    else if (fd >= 0) ::close(fd);
  }
  // Bytes read (0 at the end).
  size_t read(char* dst, size_t n) {
    if (gz) {
      const int got = gzread(gz, dst, static_cast<unsigned>(n));
      // zlib checks each member's trailer (CRC-32 and length) when its deflate stream ends; a
      // bad one is an error here. gzread reports input that ends before the stream and trailer
      // do (a cut file) only through gzerror's Z_BUF_ERROR after returning 0, so look there too:
      // otherwise a truncated file would read as a shorter, valid one.
      int err = Z_OK;
      const char* msg = nullptr;
      if (got < 0 || (got == 0 && (msg = gzerror(gz, &err), err != Z_OK))) {
        if (!msg) msg = gzerror(gz, &err);
        // zlib prefixes its message with "<fd:N>: " for a gzdopen'ed file; the file is named here.
        if (msg && std::strncmp(msg, "<fd:", 4) == 0 && std::strstr(msg, ": ")) msg = std::strstr(msg, ": ") + 2;
        fail("--input '{}': truncated or damaged gzip stream ({}): re-download or re-compress the file", name,
             msg && *msg ? msg : "read error");
      }
      return static_cast<size_t>(got);
    }
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

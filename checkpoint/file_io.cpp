#include "checkpoint/file_io.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include "core/error.h"

namespace mt {
namespace {

std::mutex g_hook_mutex;
WriteFaultHook g_hook;

WriteFaultHook current_hook() {
  std::lock_guard<std::mutex> lock(g_hook_mutex);
  return g_hook;
}

std::string errno_text(int e) { return std::strerror(e); }

}  // namespace

void set_write_fault_hook(WriteFaultHook hook) {
  std::lock_guard<std::mutex> lock(g_hook_mutex);
  g_hook = std::move(hook);
}

OutputFile::OutputFile(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("cannot create {}: {}", path_, errno_text(errno));
}

OutputFile::~OutputFile() {
  if (fd_ >= 0) ::close(fd_);
}

void OutputFile::write(const void* data, size_t n) {
  MT_CHECK(fd_ >= 0, "write to closed file {}", path_);
  const auto* p = static_cast<const char*>(data);
  // Chunks of at most 64 MiB: write() may not take more than ~2 GiB at once, and the fault hook
  // gets a chance between chunks.
  constexpr size_t kChunk = size_t{64} << 20;
  while (n > 0) {
    const size_t want = std::min(n, kChunk);
    if (auto hook = current_hook()) {
      if (int e = hook(path_, offset_, want)) fail("writing {}: {}", path_, errno_text(e));
    }
    const ssize_t got = ::write(fd_, p, want);
    if (got < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      fail("writing {} (at byte {}): {}{}", path_, offset_, errno_text(e),
           e == ENOSPC ? " (free space on the checkpoint file system or save elsewhere)" : "");
    }
    p += got;
    n -= static_cast<size_t>(got);
    offset_ += static_cast<uint64_t>(got);
  }
}

void OutputFile::sync() {
  MT_CHECK(fd_ >= 0, "sync of closed file {}", path_);
  if (::fsync(fd_) != 0) fail("fsync of {}: {}", path_, errno_text(errno));
}

void OutputFile::close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("closing {}: {}", path_, errno_text(errno));
}

void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail("cannot open directory {} to sync it: {}", dir, errno_text(errno));
  const int rc = ::fsync(fd);
  const int e = errno;
  ::close(fd);
  // Some file systems do not support fsync on directories (EINVAL); their renames are durable
  // by other means, so that is not an error.
  if (rc != 0 && e != EINVAL) fail("fsync of directory {}: {}", dir, errno_text(e));
}

void write_file_atomically(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  try {
    OutputFile f(tmp);
    f.write(content.data(), content.size());
    f.sync();
    f.close();
    rename_path(tmp, path);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_directory(parent_directory(path));
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read {}: {}", path, errno_text(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool path_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void make_directories(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) fail("cannot create directory {}: {}", dir, ec.message());
}

void remove_tree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) fail("cannot remove {}: {}", path, ec.message());
}

void rename_path(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) fail("cannot rename {} to {}: {}", from, to, errno_text(errno));
}

std::vector<std::string> list_directory(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (!d) fail("cannot list directory {}: {}", dir, errno_text(errno));
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

std::string parent_directory(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const size_t slash = p.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return p.substr(0, slash);
}

std::string join_path(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  if (a.back() == '/') return a + b;
  return a + "/" + b;
}

MappedFile::MappedFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open {}: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    fail("cannot stat {}: {}", path, std::strerror(e));
  }
  size_ = static_cast<uint64_t>(st.st_size);
  if (size_ > 0) {
    map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map_ == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      map_ = nullptr;
      fail("cannot map {}: {}", path, std::strerror(e));
    }
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (map_) ::munmap(map_, size_);
}

}  // namespace mt

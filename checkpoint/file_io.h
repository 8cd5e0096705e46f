// Durable file writing for checkpoints: full writes with clear errors (ENOSPC names the file),
// fsync of files and directories, atomic replacement by temp + rename.
//
// A fault hook lets tests make a write fail (or kill the process) at a chosen point, to check that
// a crash or a full disk during a save leaves the previous checkpoint intact.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace mt {

// Called before each write() of `bytes` at `offset` into `path`. Tests install one that throws,
// returns an errno to simulate (e.g. ENOSPC), or raises SIGKILL. Returns 0 to let the write go on.
using WriteFaultHook = std::function<int(const std::string& path, uint64_t offset, size_t bytes)>;
void set_write_fault_hook(WriteFaultHook hook);  // empty function: none

// A file opened for writing (created or truncated). Errors throw mt::Error naming the file.
class OutputFile {
 public:
  explicit OutputFile(std::string path);
  ~OutputFile();  // closes (no sync); a file not closed() is considered abandoned
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  void write(const void* data, size_t n);
  void sync();   // fsync
  void close();  // close, reporting deferred write errors
  uint64_t bytes_written() const { return offset_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t offset_ = 0;
};

void fsync_directory(const std::string& dir);
// Writes `content` to path via path.tmp-<pid>, fsync, rename, fsync of the directory.
void write_file_atomically(const std::string& path, const std::string& content);
std::string read_text_file(const std::string& path);  // throws naming the file
bool path_exists(const std::string& path);
bool is_directory(const std::string& path);
void make_directories(const std::string& dir);  // mkdir -p
void remove_tree(const std::string& path);      // rm -rf (no error if absent)
void rename_path(const std::string& from, const std::string& to);
std::vector<std::string> list_directory(const std::string& dir);  // names, sorted
std::string parent_directory(const std::string& path);
std::string join_path(const std::string& a, const std::string& b);

// A whole file mapped read-only (safetensors files, torch.save archives). An empty file maps
// to no memory: data() is null, size() 0.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);  // throws naming the file
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const unsigned char* data() const { return static_cast<const unsigned char*>(map_); }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  void* map_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace mt

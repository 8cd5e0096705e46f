// Reads JSONL input files (plain, or gzip when the name ends in .gz or the file starts with gzip's
// magic bytes) in chunks of whole lines, as Python's text mode iterates them (universal newlines:
// "\n", "\r\n" and "\r" all end a line). Memory stays bounded by the chunk size (plus the longest line).
// gzip input is verified to its end (data/line_reader.cpp, GzipInput): a truncated or damaged file
// throws mt::Error naming it, never reads as a shorter file; other compressed formats (zstd, xz,
// lz4, bzip2) are refused up front.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace mt {

struct LineChunk {
  std::string data;          // whole lines, each ending in '\n' (a file's unterminated last line gets one)
  size_t file = 0;           // index into the reader's file list
  uint64_t first_line = 0;   // 1-based line number (within its file) of the first line
  uint64_t first_global = 0; // 0-based index of the first line across all files
  uint64_t lines = 0;
  uint64_t sequence = 0;     // chunk number, 0, 1, 2, ...
};

class LineChunkReader {
 public:
  // Throws mt::Error if a file cannot be opened (checked up front for all files).
  LineChunkReader(std::vector<std::string> files, size_t chunk_bytes);
  ~LineChunkReader();
  LineChunkReader(const LineChunkReader&) = delete;
  LineChunkReader& operator=(const LineChunkReader&) = delete;

  // The next chunk (chunks never span files); false at the end of the last file.
  bool next(LineChunk& chunk);
  const std::vector<std::string>& files() const { return files_; }
  // The index of the file being read (files().size() after the last).
  size_t current_file() const { return file_; }
  // True while files()[file] is compressed and being read (not yet to its verified end).
  bool inside_compressed(size_t file) const;
  // For a failure found in the text of files()[file]: when inside_compressed(file), reads (and
  // verifies) the rest of it, throwing as next() would if it is truncated or damaged. Damaged
  // compressed data can inflate to wrong text long before the damage is detected (a CRC-32 mismatch
  // shows only at the end of a gzip member), and then the damage is the failure to report. A file
  // the reader has moved past was verified already. next() must not be called afterwards.
  void check_rest_of_file(size_t file);

 private:
  struct Source;
  bool fill();  // reads more of the current file into pending_; false at its end
  std::vector<std::string> files_;
  size_t chunk_bytes_;
  size_t file_ = 0;
  std::unique_ptr<Source> source_;
  std::string pending_;   // read; [begin_, size) not yet handed out; '\r' already translated
  size_t begin_ = 0;
  bool newline_seen_ = false;  // pending_[begin_..] holds a '\n'
  bool pending_cr_ = false;  // the last byte read was '\r' (a following '\n' belongs to it)
  bool eof_ = false;
  uint64_t line_ = 1, global_ = 0, sequence_ = 0;
};

}  // namespace mt

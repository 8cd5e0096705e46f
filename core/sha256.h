// SHA-256 (FIPS 180-4), streaming: the checkpoint integrity manifest (--verify-integrity) records
// each file's digest as Megatron-LM's does (hashlib.sha256, lowercase hex).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace mt {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  // The digest of everything updated so far; the object is finished afterwards.
  std::array<uint8_t, 32> digest();
  std::string hex_digest();  // 64 lowercase hex digits

 private:
  void block(const uint8_t* p);

  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buffered_ = 0;
  uint64_t length_ = 0;  // bytes
};

// The SHA-256 of a file's bytes as lowercase hex, read in 1 MiB pieces; throws mt::Error naming
// the file when it cannot be opened or read.
std::string sha256_file_hex(const std::string& path);

}  // namespace mt

#include "data/idx_header.h"

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "data/indexed_dataset.h"

namespace mt {

int idx_dtype_size(uint8_t code) {
  switch (code) {
    case 1: case 2: return 1;
    case 3: case 8: return 2;
    case 4: case 7: return 4;
    case 5: case 6: return 8;
    default: return 0;
  }
}

namespace {
uint64_t le64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
}  // namespace

IdxHeader read_idx_header(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open the index file", path);
  unsigned char buf[34];
  in.read(reinterpret_cast<char*>(buf), sizeof buf);
  if (in.gcount() != static_cast<std::streamsize>(sizeof buf))
    fail("{}: too short for a Megatron .idx header (34 bytes)", path);
  if (std::memcmp(buf, "MMIDIDX\x00\x00", 9) != 0)
    fail("{}: not a Megatron indexed dataset (.idx magic is not MMIDIDX); build it with megatrain preprocess-data "
         "or Megatron's tools/preprocess_data.py", path);
  IdxHeader h;
  h.version = le64(buf + 9);
  if (h.version != 1) fail("{}: .idx version {} (only version 1 exists)", path, h.version);
  h.dtype_code = buf[17];
  if (idx_dtype_size(h.dtype_code) == 0) fail("{}: unknown token dtype code {}", path, int(h.dtype_code));
  h.sequence_count = le64(buf + 18);
  h.document_count = le64(buf + 26);
  const uint64_t need = 34 + 12 * h.sequence_count + 8 * h.document_count;
  const uint64_t size = std::filesystem::file_size(path);
  if (size < need)
    fail("{}: truncated ({} bytes; the header announces {} sequences and {} document indices = {} bytes)", path, size,
         h.sequence_count, h.document_count, need);
  return h;
}

IdxHeader check_indexed_dataset(const std::string& prefix, const std::string& flag) {
  namespace fs = std::filesystem;
  const std::string idx = prefix + ".idx", bin = prefix + ".bin";
  if (!fs::is_regular_file(idx))
    fail("{} {}: {} not found (a dataset prefix names <prefix>.bin and <prefix>.idx)", flag, prefix, idx);
  if (!fs::is_regular_file(bin))
    fail("{} {}: {} not found (a dataset prefix names <prefix>.bin and <prefix>.idx)", flag, prefix, bin);
  IdxHeader h = read_idx_header(idx);
  const uint64_t bin_size = fs::file_size(bin);
  if (bin_size % idx_dtype_size(h.dtype_code) != 0)
    fail("{}: size {} is not a multiple of the token size {} given by {}", bin, bin_size,
         idx_dtype_size(h.dtype_code), idx);
  // The index against its .bin, as training opens it (a .idx whose dtype byte was changed passes
  // every check above: the .bin's size is a multiple of any smaller token size). Opening runs the
  // index's own consistency checks and the pointer/size cross-check (one pass over the pointers);
  // the .bin is opened for its size, not mapped or read.
  [[maybe_unused]] const IndexedDataset cross_checked(prefix, IndexedDataset::Options{.mmap_bin = false});
  return h;
}

}  // namespace mt

// The header of a Megatron indexed dataset's .idx file, read and checked
// without touching the rest of the file, and the check of a dataset prefix's two files that
// --dry-run and start-up run to reject a wrong path or a damaged dataset early. The data pipeline
// reads the arrays that follow.
#pragma once

#include <cstdint>
#include <string>

namespace mt {

struct IdxHeader {
  uint64_t version = 0;
  uint8_t dtype_code = 0;       // 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
  uint64_t sequence_count = 0;  // N
  uint64_t document_count = 0;  // D (entries of document_indices = documents + 1)
};

// Bytes per token of a dtype code (0 for an unknown code).
int idx_dtype_size(uint8_t dtype_code);

// Reads and validates <path>: magic "MMIDIDX\0\0", version 1, a known dtype code, and a file long
// enough for the arrays the header announces. Throws mt::Error naming the file.
IdxHeader read_idx_header(const std::string& path);

// Checks both files of a dataset prefix (<prefix>.idx, <prefix>.bin): the header as above, then
// the whole index against its .bin as IndexedDataset opens it (the pointers are the running byte
// offsets of the lengths x the dtype size, and the last sequence ends at the .bin's end), so
// --dry-run refuses what training would. `flag` names the flag the prefix came from in error
// messages.
IdxHeader check_indexed_dataset(const std::string& prefix, const std::string& flag);

}  // namespace mt

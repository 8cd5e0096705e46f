// ShardIndex: where a local [rows, cols] block sits inside a global [global_rows, global_cols]
// tensor. Used for layout-independent initialization (each element is drawn from its *global*
// index) and by checkpoints (each shard file records its slice of the global tensor).
//
// The global rows may form `chunks` equal chunks whose every chunk is sharded the same way: the
// SwiGLU fc1 weight is [gate(f); up(f)] globally and a TP rank holds [gate slice; up slice]. A
// block may hold only some consecutive chunks, [chunk_offset, chunk_offset + chunk_count): the
// experts' fc1 weight [E x (gate; up)] on an expert-parallel rank holds its experts' chunks.
#pragma once

#include <cstdint>

#include "core/philox.h"

namespace mt {

struct ShardIndex {
  int64_t global_rows = 0;
  int64_t global_cols = 0;
  int64_t row_offset = 0;  // first global row of the block, within each chunk
  int64_t col_offset = 0;  // first global col of the block
  int64_t local_rows = 0;  // rows of the local block per chunk
  int64_t local_cols = 0;
  int64_t chunks = 1;
  int64_t chunk_offset = 0;  // first chunk held
  int64_t chunk_count = 0;   // chunks held; 0: all from chunk_offset on

  static ShardIndex whole(int64_t rows, int64_t cols) { return {rows, cols, 0, 0, rows, cols, 1}; }
  MT_HOST_DEVICE int64_t local_chunks() const { return chunk_count > 0 ? chunk_count : chunks - chunk_offset; }
  int64_t local_numel() const { return local_rows * local_chunks() * local_cols; }
};

// Global flat index of local flat element `i` (local layout: chunk-major rows, then cols).
MT_HOST_DEVICE int64_t shard_global_index(const ShardIndex& s, int64_t i) {
  const int64_t local_row = i / s.local_cols, col = i % s.local_cols;
  const int64_t chunk = local_row / s.local_rows, row_in_chunk = local_row % s.local_rows;
  const int64_t global_chunk_rows = s.global_rows / s.chunks;
  const int64_t grow = (s.chunk_offset + chunk) * global_chunk_rows + s.row_offset + row_in_chunk;
  return grow * s.global_cols + s.col_offset + col;
}

}  // namespace mt

// CRC-32C (Castagnoli: reflected polynomial 0x82F63B78, init and final xor 0xFFFFFFFF).
// Used by checkpoints (per-shard checksums) and TensorBoard event files (TFRecord framing).
// Check value: crc32c("123456789") == 0xE3069283.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mt {

// Continues a CRC: crc32c_extend(crc32c(a), b) == crc32c(a || b). Start with crc = 0.
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);

inline uint32_t crc32c(const void* data, size_t n) { return crc32c_extend(0, data, n); }

// The table-driven implementation, exposed so tests can compare it with the hardware path.
uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n);

// TFRecord's masked CRC: rotate right by 15 and add a constant, so that a CRC stored inside
// the data it covers does not checksum to a trivial value.
inline uint32_t crc32c_mask(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u; }

}  // namespace mt

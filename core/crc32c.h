// CRC32C (Castagnoli), the per-tensor checksum of the wire protocol.
//
// Debian 12 packages no C++ CRC32C library (Abseil's arrived after 20220623),
// so this uses the SSE4.2 crc32 instruction when the CPU has it and a table
// otherwise; both are checked against RFC 3720's test vectors.
#ifndef WEIGHTSTORE_CORE_CRC32C_H_
#define WEIGHTSTORE_CORE_CRC32C_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace weightstore {

// Returns the CRC32C of `data` appended to data whose CRC32C was `crc`.
uint32_t Crc32cExtend(uint32_t crc, absl::string_view data);
inline uint32_t Crc32c(absl::string_view data) { return Crc32cExtend(0, data); }

// The table implementation, exposed for tests.
uint32_t Crc32cExtendPortable(uint32_t crc, absl::string_view data);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_CRC32C_H_

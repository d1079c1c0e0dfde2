#include "core/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace weightstore {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78;  // reflected Castagnoli

constexpr std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPolynomial : c >> 1;
    table[i] = c;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kTable = MakeTable();

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t ExtendHardware(uint32_t crc, const unsigned char* p, size_t n) {
  // One stream: the instruction's latency (3 cycles per 8 bytes) bounds it at
  // several GB/s, well above what a tensor stream needs.
  uint64_t c = static_cast<uint32_t>(~crc);
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  while (n > 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  return static_cast<uint32_t>(~c);
}
#endif

}  // namespace

uint32_t Crc32cExtendPortable(uint32_t crc, absl::string_view data) {
  uint32_t c = ~crc;
  for (unsigned char b : data) c = kTable[(c ^ b) & 0xFF] ^ (c >> 8);
  return ~c;
}

uint32_t Crc32cExtend(uint32_t crc, absl::string_view data) {
#if defined(__x86_64__)
  static const bool kHasSse42 = __builtin_cpu_supports("sse4.2");
  if (kHasSse42) return ExtendHardware(crc, reinterpret_cast<const unsigned char*>(data.data()), data.size());
#endif
  return Crc32cExtendPortable(crc, data);
}

}  // namespace weightstore

#include "core/crc32c.h"

#include <isa-l/crc.h>

#include <algorithm>
#include <array>

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

}  // namespace

uint32_t Crc32cExtendPortable(uint32_t crc, absl::string_view data) {
  uint32_t c = ~crc;
  for (unsigned char b : data) c = kTable[(c ^ b) & 0xFF] ^ (c >> 8);
  return ~c;
}

uint32_t Crc32cExtend(uint32_t crc, absl::string_view data) {
  // ISA-L takes and returns the register without the final inversion, and an
  // int length: pieces of at most 1 GiB. It only reads the buffer, though its
  // signature is not const.
  uint32_t c = ~crc;
  auto* p = reinterpret_cast<unsigned char*>(const_cast<char*>(data.data()));
  for (size_t left = data.size(); left > 0;) {
    const size_t n = std::min<size_t>(left, size_t{1} << 30);
    c = crc32_iscsi(p, static_cast<int>(n), c);
    p += n;
    left -= n;
  }
  return ~c;
}

}  // namespace weightstore

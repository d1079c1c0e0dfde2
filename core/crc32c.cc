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

// Polynomials over GF(2) modulo the Castagnoli polynomial, in the CRC's
// reflected order: bit 31 is the coefficient of x^0, bit 0 that of x^31.
constexpr uint32_t kOne = 0x80000000;

// a * b mod P: for each term x^i of `a`, add b * x^i.
uint32_t MultiplyModP(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (int i = 0; i < 32 && a != 0; ++i) {
    if (a & (kOne >> i)) {
      product ^= b;
      a &= ~(kOne >> i);
    }
    b = (b & 1) ? (b >> 1) ^ kPolynomial : b >> 1;  // b * x
  }
  return product;
}

// x^(8 * bytes) mod P, by squaring.
uint32_t ShiftByBytes(uint64_t bytes) {
  uint32_t result = kOne;
  uint32_t power = kOne >> 8;  // x^8
  for (; bytes != 0; bytes >>= 1) {
    if (bytes & 1) result = MultiplyModP(result, power);
    power = MultiplyModP(power, power);
  }
  return result;
}

}  // namespace

uint32_t Crc32cConcat(uint32_t crc_a, uint32_t crc_b, uint64_t length_b) {
  // The inversions before and after each CRC cancel: A's CRC register moved
  // past B's length of bytes, plus B's.
  return MultiplyModP(ShiftByBytes(length_b), crc_a) ^ crc_b;
}

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

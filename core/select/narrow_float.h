// The narrow floating-point types: the F8 family (E4M3FN, E5M2, their FNUZ
// variants, E8M0), F6 (E2M3, E3M2) and F4 (E2M1), as codes of their bits.
//
// Decoding is exact: every value of every narrow type is a double (and an
// F32). The F4 and F6 values are those of the OCP Microscaling (MX) spec
// v1.0: no infinities or NaNs; E8M0 is 2^(code - 127), 0xFF its NaN.
//
// Encoding into the four F8 types torch 2.13 casts into follows its .to(),
// bit for bit (tests/python/test_dtypes.py checks it against torch): round to
// nearest, ties to even; E4M3FN saturates (past 448, infinities too, is ±448)
// and keeps a NaN's sign (0x7F | sign); E5M2 overflows to infinity; the FNUZ
// types turn overflow, infinities and NaN into their one NaN (0x80) and have
// no negative zero. Other sources convert to F32 first, as torch does (an F64
// is rounded twice).
#ifndef WEIGHTSTORE_CORE_SELECT_NARROW_FLOAT_H_
#define WEIGHTSTORE_CORE_SELECT_NARROW_FLOAT_H_

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace weightstore {

// True for the types above (the F8 family, F6, F4).
bool IsNarrowFloat(DType dtype);
// True for the narrow types torch converts into: F8_E4M3, F8_E5M2,
// F8_E4M3FNUZ, F8_E5M2FNUZ.
bool IsF8Target(DType dtype);

// The value of `code` (the element's bits, low bits first) of narrow `dtype`.
double DecodeNarrow(DType dtype, uint32_t code);

// The F8 code of the F32 value with bits `f32`. REQUIRES: IsF8Target(dtype).
uint8_t EncodeF8(DType dtype, uint32_t f32);

// Element i's code in packed storage of narrow `dtype` (core/dtype.h's bit
// order: F4's first element in the low nibble).
inline uint32_t NarrowCode(DType dtype, const std::byte* p, size_t i) {
  const uint32_t bits = DTypeBits(dtype);
  if (bits == 8) return static_cast<uint8_t>(p[i]);
  const size_t bit = i * bits, byte = bit / 8, shift = bit % 8;
  uint32_t window = static_cast<uint8_t>(p[byte]);
  if (shift + bits > 8) window |= static_cast<uint32_t>(static_cast<uint8_t>(p[byte + 1])) << 8;
  return (window >> shift) & ((1u << bits) - 1);
}

// Decodes `count` elements of narrow `from` into F32, F16 or BF16 (`to`)
// through lookup tables: the fast path of CastElements. REQUIRES: `count` a
// whole number of `from`'s storage units. Returns false (nothing written)
// for another `to`.
bool DecodeNarrowRun(DType from, const std::byte* src, DType to, std::byte* dst, size_t count);

// Encodes `count` F32, F16 or BF16 elements into F8 target `to`; false (nothing
// written) for another pair.
bool EncodeF8Run(DType from, const std::byte* src, DType to, std::byte* dst, size_t count);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_SELECT_NARROW_FLOAT_H_

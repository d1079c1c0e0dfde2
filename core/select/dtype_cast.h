// Element conversions between dtypes, and the fused transpose+cast kernel.
//
// Floats (F64, F32, F16, BF16) convert to each other with a single rounding to
// nearest, ties to even, straight from the source value (F64 -> BF16 is not
// rounded twice through F32). NaN stays NaN (quiet, sign kept), infinities stay
// infinite, and values past the target's range become infinities. The narrow
// floats (F8 family, F6, F4: core/select/narrow_float.h) are decoded exactly
// and convert to those four the same way, as torch 2.13's .to() does. Floats
// narrow into F8_E4M3, F8_E5M2 and their FNUZ variants as torch does; nothing
// casts into F4, F6 or F8_E8M0. Integers widen (I8 -> I16 -> I32 -> I64,
// U8 -> U16 -> U32 -> U64, and unsigned to any wider signed type). BOOL
// converts to U8. Nothing else is allowed: it could lose data. Counts are in
// elements; for a sub-byte source, a whole number of its storage units.
#ifndef WEIGHTSTORE_CORE_SELECT_DTYPE_CAST_H_
#define WEIGHTSTORE_CORE_SELECT_DTYPE_CAST_H_

#include <cstddef>
#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "core/dtype.h"

namespace weightstore {

// The dtypes a selection may cast floating-point tensors to, and their names.
bool IsCastTarget(DType dtype);
inline constexpr char kCastTargets[] = "F64, F32, F16, BF16, F8_E4M3, F8_E5M2, F8_E4M3FNUZ, F8_E5M2FNUZ";

// Returns OK if CastElements can convert `from` to `to`, else InvalidArgument
// naming both.
absl::Status CheckCast(DType from, DType to);

// Converts `count` elements. REQUIRES: CheckCast(from, to).ok(), buffers sized
// for `count` elements of their dtypes, and not overlapping.
void CastElements(DType from, const std::byte* src, DType to, std::byte* dst, size_t count);

// CastElements without its fast paths (F32 <-> F16, F32 <-> BF16): one element
// at a time through double. The reference the fast paths are tested against.
void CastElementsReference(DType from, const std::byte* src, DType to, std::byte* dst, size_t count);

// Converts `count` elements read `stride` elements apart from `src` into
// consecutive elements at `dst`. REQUIRES: as CastElements.
void CastStrided(DType from, const std::byte* src, uint64_t stride, DType to, std::byte* dst, size_t count);

// Writes the transpose of a row-major [rows, cols] matrix of `from` elements as
// a row-major [cols, rows] matrix of `to` elements, in one pass.
void TransposeCast(DType from, const std::byte* src, DType to, std::byte* dst, size_t rows, size_t cols);
// Rows [first, end) of that transpose only (columns [first, end) of `src`),
// written from `dst` on: a transposed tensor produced a band at a time. With
// `row_stride` (in elements; 0: `cols`), `src`'s rows lie that far apart: the
// transpose of a block of a larger matrix (a slice of it).
void TransposeCastRows(DType from, const std::byte* src, DType to, std::byte* dst, size_t rows, size_t cols,
                       size_t first, size_t end, size_t row_stride = 0);

// Encodes `value` in a binary floating-point format with `exponent_bits` and
// `mantissa_bits` (F16: 5, 10; BF16: 8, 7; F32: 8, 23), rounding to nearest even.
uint32_t EncodeFloat(double value, int exponent_bits, int mantissa_bits);
// Decodes such a format exactly.
double DecodeFloat(uint32_t bits, int exponent_bits, int mantissa_bits);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_SELECT_DTYPE_CAST_H_

// Element types, named as SafeTensors names them: all 22 of safetensors 0.8
// (`Dtype` in safetensors/src/tensor.rs).
//
// Sub-byte types (F4, F6_*) are packed: element i occupies bits
// [i * bits, (i + 1) * bits) of the little-endian bit stream, so F4's first
// element is the low nibble of byte 0 (torch's float4_e2m1fn_x2) and F6's four
// elements fill three bytes. Their unit of storage is the smallest whole number
// of bytes holding whole elements: one byte (two F4), three bytes (four F6).
// A tensor of them must be a whole number of bytes, as in the reference.
#ifndef WEIGHTSTORE_CORE_DTYPE_H_
#define WEIGHTSTORE_CORE_DTYPE_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace weightstore {

enum class DType : uint8_t {
  kF64,
  kF32,
  kF16,
  kBF16,
  kI64,
  kI32,
  kI16,
  kI8,
  kU8,
  kBool,
  kU16,
  kU32,
  kU64,
  kF8E4M3,  // float8_e4m3fn: no infinities, NaN S.1111.111
  kF8E5M2,
  kF4,          // E2M1 (OCP MX), two a byte
  kF6E2M3,      // OCP MX, four in three bytes
  kF6E3M2,      // OCP MX, four in three bytes
  kF8E8M0,      // float8_e8m0fnu: a power of two 2^(e - 127), NaN 0xFF (MX scales)
  kF8E4M3FNUZ,  // bias 8, no infinities or negative zero, NaN 0x80
  kF8E5M2FNUZ,  // bias 16, no infinities or negative zero, NaN 0x80
  kC64,         // complex64: two F32, real first
};

inline constexpr DType kAllDTypes[] = {
    DType::kF64,    DType::kF32,        DType::kF16,        DType::kBF16, DType::kI64,    DType::kI32,
    DType::kI16,    DType::kI8,         DType::kU8,         DType::kBool, DType::kU16,    DType::kU32,
    DType::kU64,    DType::kF8E4M3,     DType::kF8E5M2,     DType::kF4,   DType::kF6E2M3, DType::kF6E3M2,
    DType::kF8E8M0, DType::kF8E4M3FNUZ, DType::kF8E5M2FNUZ, DType::kC64,
};

// Returns the SafeTensors name: "F32", "BF16", "BOOL", "F8_E4M3", "F4", ...
absl::string_view DTypeName(DType dtype);

// Parses a SafeTensors dtype name (case-sensitive). Returns nullopt if unknown.
std::optional<DType> ParseDType(absl::string_view name);

// Bits of one element: 4 (F4), 6 (F6_*), else 8 times its bytes.
uint32_t DTypeBits(DType dtype);
// Bytes of one unit of storage: one element for the byte-sized types, one
// byte (two F4) or three bytes (four F6). Strides, offsets and slices of the
// storage move in these units.
uint64_t DTypeSize(DType dtype);
// Elements in one unit of storage: 1, or 2 (F4), 4 (F6).
uint32_t DTypeUnitElements(DType dtype);
inline bool IsSubByte(DType dtype) { return DTypeUnitElements(dtype) > 1; }

// Bytes of `elements` elements; nullopt when that overflows or is not a whole
// number of bytes (an odd count of F4).
std::optional<uint64_t> DTypeBytes(DType dtype, uint64_t elements);

// Floating-point types, the narrow ones included: F64, F32, F16, BF16, the F8
// family, F6 and F4. Complex is not.
bool IsFloatingPoint(DType dtype);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_DTYPE_H_

// Element types, named as SafeTensors names them.
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
  kF8E4M3,
  kF8E5M2,
};

inline constexpr DType kAllDTypes[] = {
    DType::kF64, DType::kF32,  DType::kF16, DType::kBF16, DType::kI64, DType::kI32,    DType::kI16,    DType::kI8,
    DType::kU8,  DType::kBool, DType::kU16, DType::kU32,  DType::kU64, DType::kF8E4M3, DType::kF8E5M2,
};

// Returns the SafeTensors name: "F32", "BF16", "BOOL", "F8_E4M3", ...
absl::string_view DTypeName(DType dtype);

// Parses a SafeTensors dtype name (case-sensitive). Returns nullopt if unknown.
std::optional<DType> ParseDType(absl::string_view name);

// Returns the size of one element in bytes.
uint64_t DTypeSize(DType dtype);

bool IsFloatingPoint(DType dtype);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_DTYPE_H_

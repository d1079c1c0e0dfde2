#include "core/dtype.h"

#include "core/checked_math.h"

namespace weightstore {
namespace {

struct DTypeInfo {
  DType dtype;
  const char* name;
  uint32_t bits;
  uint32_t unit_elements;
  bool is_float;
};

// Indexed by the enum's value.
constexpr DTypeInfo kInfo[] = {
    {DType::kF64, "F64", 64, 1, true},
    {DType::kF32, "F32", 32, 1, true},
    {DType::kF16, "F16", 16, 1, true},
    {DType::kBF16, "BF16", 16, 1, true},
    {DType::kI64, "I64", 64, 1, false},
    {DType::kI32, "I32", 32, 1, false},
    {DType::kI16, "I16", 16, 1, false},
    {DType::kI8, "I8", 8, 1, false},
    {DType::kU8, "U8", 8, 1, false},
    {DType::kBool, "BOOL", 8, 1, false},
    {DType::kU16, "U16", 16, 1, false},
    {DType::kU32, "U32", 32, 1, false},
    {DType::kU64, "U64", 64, 1, false},
    {DType::kF8E4M3, "F8_E4M3", 8, 1, true},
    {DType::kF8E5M2, "F8_E5M2", 8, 1, true},
    {DType::kF4, "F4", 4, 2, true},
    {DType::kF6E2M3, "F6_E2M3", 6, 4, true},
    {DType::kF6E3M2, "F6_E3M2", 6, 4, true},
    {DType::kF8E8M0, "F8_E8M0", 8, 1, true},
    {DType::kF8E4M3FNUZ, "F8_E4M3FNUZ", 8, 1, true},
    {DType::kF8E5M2FNUZ, "F8_E5M2FNUZ", 8, 1, true},
    {DType::kC64, "C64", 64, 1, false},
};
static_assert(sizeof(kInfo) / sizeof(kInfo[0]) == sizeof(kAllDTypes) / sizeof(kAllDTypes[0]));

constexpr bool InfoIsIndexed() {
  for (size_t i = 0; i < sizeof(kInfo) / sizeof(kInfo[0]); ++i) {
    if (static_cast<size_t>(kInfo[i].dtype) != i) return false;
  }
  return true;
}
static_assert(InfoIsIndexed());

const DTypeInfo& Info(DType dtype) { return kInfo[static_cast<int>(dtype)]; }

}  // namespace

absl::string_view DTypeName(DType dtype) { return Info(dtype).name; }

std::optional<DType> ParseDType(absl::string_view name) {
  for (const DTypeInfo& info : kInfo) {
    if (name == info.name) return info.dtype;
  }
  return std::nullopt;
}

uint32_t DTypeBits(DType dtype) { return Info(dtype).bits; }

uint64_t DTypeSize(DType dtype) { return uint64_t{Info(dtype).bits} * Info(dtype).unit_elements / 8; }

uint32_t DTypeUnitElements(DType dtype) { return Info(dtype).unit_elements; }

std::optional<uint64_t> DTypeBytes(DType dtype, uint64_t elements) {
  const DTypeInfo& info = Info(dtype);
  if (elements % info.unit_elements != 0) return std::nullopt;
  return CheckedMul(elements / info.unit_elements, DTypeSize(dtype));
}

bool IsFloatingPoint(DType dtype) { return Info(dtype).is_float; }

}  // namespace weightstore

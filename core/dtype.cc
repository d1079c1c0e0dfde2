#include "core/dtype.h"

namespace weightstore {
namespace {

struct DTypeInfo {
  DType dtype;
  const char* name;
  uint64_t size;
  bool is_float;
};

constexpr DTypeInfo kInfo[] = {
    {DType::kF64, "F64", 8, true},    {DType::kF32, "F32", 4, true},        {DType::kF16, "F16", 2, true},
    {DType::kBF16, "BF16", 2, true},  {DType::kI64, "I64", 8, false},       {DType::kI32, "I32", 4, false},
    {DType::kI16, "I16", 2, false},   {DType::kI8, "I8", 1, false},         {DType::kU8, "U8", 1, false},
    {DType::kBool, "BOOL", 1, false}, {DType::kU16, "U16", 2, false},       {DType::kU32, "U32", 4, false},
    {DType::kU64, "U64", 8, false},   {DType::kF8E4M3, "F8_E4M3", 1, true}, {DType::kF8E5M2, "F8_E5M2", 1, true},
};

const DTypeInfo& Info(DType dtype) { return kInfo[static_cast<int>(dtype)]; }

}  // namespace

absl::string_view DTypeName(DType dtype) { return Info(dtype).name; }

std::optional<DType> ParseDType(absl::string_view name) {
  for (const DTypeInfo& info : kInfo) {
    if (name == info.name) return info.dtype;
  }
  return std::nullopt;
}

uint64_t DTypeSize(DType dtype) { return Info(dtype).size; }

bool IsFloatingPoint(DType dtype) { return Info(dtype).is_float; }

}  // namespace weightstore

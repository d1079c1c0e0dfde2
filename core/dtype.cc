#include "core/dtype.h"

namespace weightstore {
namespace {

struct DTypeInfo {
  DType dtype;
  const char* name;
  uint64_t size;
  bool is_float;
  int safetensors_order;  // BOOL < U8 < I8 < F8_E5M2 < F8_E4M3 < I16 < U16 < F16 < BF16 <
                          // I32 < U32 < F32 < F64 < I64 < U64 (safetensors 0.7 enum order)
};

constexpr DTypeInfo kInfo[] = {
    {DType::kF64, "F64", 8, true, 12},       {DType::kF32, "F32", 4, true, 11},
    {DType::kF16, "F16", 2, true, 7},        {DType::kBF16, "BF16", 2, true, 8},
    {DType::kI64, "I64", 8, false, 13},      {DType::kI32, "I32", 4, false, 9},
    {DType::kI16, "I16", 2, false, 5},       {DType::kI8, "I8", 1, false, 2},
    {DType::kU8, "U8", 1, false, 1},         {DType::kBool, "BOOL", 1, false, 0},
    {DType::kU16, "U16", 2, false, 6},       {DType::kU32, "U32", 4, false, 10},
    {DType::kU64, "U64", 8, false, 14},      {DType::kF8E4M3, "F8_E4M3", 1, true, 4},
    {DType::kF8E5M2, "F8_E5M2", 1, true, 3},
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

int SafeTensorsOrder(DType dtype) { return Info(dtype).safetensors_order; }

}  // namespace weightstore

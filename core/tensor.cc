#include "core/tensor.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace weightstore {

uint64_t TensorSpec::num_elements() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

uint64_t TensorSpec::byte_size() const {
  return num_elements() / DTypeUnitElements(dtype) * DTypeSize(dtype);  // whole units: checked where specs come in
}

absl::Status CheckDestination(const TensorSpec& spec, size_t destination_bytes) {
  if (destination_bytes == spec.byte_size()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("tensor '", spec.name, "' has ", spec.byte_size(),
                                                 " bytes; the destination holds ", destination_bytes));
}

std::string ShapeToString(std::span<const uint64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace weightstore

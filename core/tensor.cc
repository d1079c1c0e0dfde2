#include "core/tensor.h"

#include "absl/strings/str_join.h"

namespace weightstore {

uint64_t TensorSpec::num_elements() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

uint64_t TensorSpec::byte_size() const { return num_elements() * DTypeSize(dtype); }

std::string ShapeToString(std::span<const uint64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace weightstore

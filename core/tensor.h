// Tensor descriptions and tensors with bytes.
//
// TensorSpec describes a tensor without its data. SharedTensor owns (shares) its
// bytes; TensorView borrows them and is valid only while the owner lives.
#ifndef WEIGHTSTORE_CORE_TENSOR_H_
#define WEIGHTSTORE_CORE_TENSOR_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"
#include "core/shared_bytes.h"

namespace weightstore {

// Most dimensions a tensor may have (PyTorch's own limit is 64).
inline constexpr size_t kMaxRank = 64;

struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;  // empty for a scalar
  // Burn's ParamId, carried through Burnpack files; absent for other formats.
  std::optional<uint64_t> param_id;

  // Returns the element count (1 for a scalar). REQUIRES: validated shape (no overflow).
  uint64_t num_elements() const;
  // Returns the bytes of num_elements() elements (DTypeBytes; a sub-byte
  // tensor's elements are whole units where specs come in).
  uint64_t byte_size() const;

  friend bool operator==(const TensorSpec&, const TensorSpec&) = default;
};

// Returns OK if `destination_bytes` can hold exactly `spec`'s bytes, else
// InvalidArgument naming the tensor.
absl::Status CheckDestination(const TensorSpec& spec, size_t destination_bytes);

// Returns "[2, 3]" for shape {2, 3} and "[]" for a scalar.
std::string ShapeToString(std::span<const uint64_t> shape);

// A tensor and its row-major, little-endian bytes, shared with their owner.
struct SharedTensor {
  TensorSpec spec;
  SharedBytes bytes;
};

// A borrowed tensor: passed by value, valid only while its owner lives.
struct TensorView {
  const TensorSpec* spec = nullptr;
  std::span<const std::byte> bytes;
};

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_TENSOR_H_

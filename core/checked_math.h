// Overflow-checked arithmetic for sizes read from untrusted files.
#ifndef WEIGHTSTORE_CORE_CHECKED_MATH_H_
#define WEIGHTSTORE_CORE_CHECKED_MATH_H_

#include <cstdint>
#include <optional>
#include <span>

namespace weightstore {

// Returns a * b, or nullopt on overflow.
inline std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) {
  uint64_t out;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// Returns a + b, or nullopt on overflow.
inline std::optional<uint64_t> CheckedAdd(uint64_t a, uint64_t b) {
  uint64_t out;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// Returns the product of `shape` (1 for a scalar), or nullopt on overflow.
inline std::optional<uint64_t> CheckedNumElements(std::span<const uint64_t> shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) {
    auto next = CheckedMul(n, d);
    if (!next) return std::nullopt;
    n = *next;
  }
  return n;
}

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_CHECKED_MATH_H_

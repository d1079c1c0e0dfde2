// SharedBytes: an immutable byte range plus a shared owner that keeps it alive.
//
// The `Shared` prefix owns (STYLE.md §7): copying a SharedBytes shares its owner, and
// Subspan() views share it too, like Arrow's SliceBuffer. A range inside a memory
// mapping keeps the whole mapping alive. Thread-safe: immutable after construction.
#ifndef WEIGHTSTORE_CORE_SHARED_BYTES_H_
#define WEIGHTSTORE_CORE_SHARED_BYTES_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace weightstore {

class SharedBytes {
 public:
  SharedBytes() = default;
  SharedBytes(std::shared_ptr<const void> owner, std::span<const std::byte> bytes)
      : owner_(std::move(owner)), bytes_(bytes) {}

  // Takes ownership of `bytes` (no copy of the contents).
  static SharedBytes FromVector(std::vector<std::byte> bytes);
  // Copies `data` into a new owned buffer.
  static SharedBytes Copy(absl::string_view data);

  const std::byte* data() const { return bytes_.data(); }
  size_t size() const { return bytes_.size(); }
  bool empty() const { return bytes_.empty(); }
  std::span<const std::byte> span() const { return bytes_; }
  absl::string_view view() const {
    return absl::string_view(reinterpret_cast<const char*>(bytes_.data()), bytes_.size());
  }
  const std::shared_ptr<const void>& owner() const { return owner_; }

  // Returns the bytes [offset, offset + length) sharing this owner.
  // REQUIRES: offset + length <= size().
  SharedBytes Subspan(size_t offset, size_t length) const {
    return SharedBytes(owner_, bytes_.subspan(offset, length));
  }

 private:
  std::shared_ptr<const void> owner_;
  std::span<const std::byte> bytes_;
};

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_SHARED_BYTES_H_

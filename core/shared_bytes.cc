#include "core/shared_bytes.h"

#include <cstring>

namespace weightstore {

SharedBytes SharedBytes::FromVector(std::vector<std::byte> bytes) {
  auto owner = std::make_shared<std::vector<std::byte>>(std::move(bytes));
  std::span<const std::byte> span(owner->data(), owner->size());
  return SharedBytes(std::move(owner), span);
}

SharedBytes SharedBytes::Copy(absl::string_view data) {
  std::vector<std::byte> bytes(data.size());
  if (!data.empty()) std::memcpy(bytes.data(), data.data(), data.size());
  return FromVector(std::move(bytes));
}

}  // namespace weightstore

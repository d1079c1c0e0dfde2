// Fuzzes element patches (core/element_patch.h), which arrive from
// clients (a patched push) and daemons (an update): a patch body checked,
// applied, streamed through and composed with itself; and a diff of two
// buffers made from the input, which must apply back exactly.
// Input: [encoding][element size][elements: u16 LE][changed: u16 LE][body...].
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/element_patch.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weightstore;
  if (size < 6) return 0;
  ElementPatch patch;
  patch.encoding = static_cast<PatchEncoding>(data[0] % 3);
  patch.element_size = 1 + data[1] % 16;
  patch.elements = data[2] | (data[3] << 8);
  patch.changed = data[4] | (data[5] << 8);
  patch.body = SharedBytes::Copy(absl::string_view(reinterpret_cast<const char*>(data + 6), size - 6));
  std::vector<std::byte> tensor(patch.tensor_bytes(), std::byte{0x11});
  const std::vector<std::byte> base = tensor;
  if (CheckPatch(patch).ok()) {
    if (!ApplyPatch(patch, tensor).ok()) __builtin_trap();
    std::vector<std::byte> streamed;
    const absl::Status written = WritePatched(patch, base, [&](absl::string_view piece) {
      streamed.insert(streamed.end(), reinterpret_cast<const std::byte*>(piece.data()),
                      reinterpret_cast<const std::byte*>(piece.data()) + piece.size());
      return absl::OkStatus();
    });
    if (!written.ok() || streamed != tensor) __builtin_trap();  // the two ways agree
    auto twice = ComposePatches(patch, patch);
    if (!twice.ok()) __builtin_trap();
    if (twice->has_value()) {
      std::vector<std::byte> again = base;
      if (!ApplyPatch(**twice, again).ok() || again != tensor) __builtin_trap();
    }
  } else if (ApplyPatch(patch, tensor).ok() || tensor != base) {
    __builtin_trap();  // refused, and nothing written
  }
  // A diff of the body's two halves (as element-sized buffers) applies back.
  const size_t e = patch.element_size, half = (size - 6) / 2 / e * e;
  if (half > 0) {
    std::span<const std::byte> a(reinterpret_cast<const std::byte*>(data + 6), half);
    std::span<const std::byte> b(reinterpret_cast<const std::byte*>(data + 6 + half), half);
    if (std::optional<ElementPatch> diff = DiffElements(a, b, e)) {
      std::vector<std::byte> out(a.begin(), a.end());
      if (!ApplyPatch(*diff, out).ok() || std::memcmp(out.data(), b.data(), half) != 0) __builtin_trap();
    }
  }
  return 0;
}

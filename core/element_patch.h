// Element patches: the elements of one tensor that changed between two
// versions, by position, with their new values. What an update sends instead
// of a whole tensor when few of its elements changed (docs/updates.md).
//
// An element is `element_size` bytes of the tensor as stored (its dtype's
// size; one byte of a packed sub-byte dtype). A patch's body is one of two
// encodings, varints being unsigned LEB128 of at most 10 bytes:
//
//   kPositions  varint n; n varint gaps (the first element's position, then
//               each position minus the previous one minus 1); n values.
//   kRuns       varint r; r pairs of varint skip (the first run's start, then
//               each start minus the previous run's end, at least 1) and
//               varint length minus 1; the runs' values, in order.
//
// Values are the new elements' bytes, concatenated in position order. Neither
// encoding can say a position twice or out of order; every other fault (a
// position past the tensor, a varint too long, values short or in excess) is
// refused before anything is written. The smaller encoding is chosen per
// tensor: positions cost a varint per changed element, runs two per run.
#ifndef WEIGHTSTORE_CORE_ELEMENT_PATCH_H_
#define WEIGHTSTORE_CORE_ELEMENT_PATCH_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"
#include "core/shared_bytes.h"

namespace weightstore {

enum class PatchEncoding : uint8_t { kPositions = 1, kRuns = 2 };

// "positions" or "runs"; ParsePatchEncoding is its inverse.
absl::string_view PatchEncodingName(PatchEncoding encoding);
std::optional<PatchEncoding> ParsePatchEncoding(absl::string_view name);

// The element size patches of `dtype` use: its size, at least 1.
uint32_t PatchElementSize(DType dtype);

// A patch to a tensor of `elements` elements of `element_size` bytes. A value
// type: copies share the body.
struct ElementPatch {
  PatchEncoding encoding = PatchEncoding::kPositions;
  uint32_t element_size = 1;
  uint64_t elements = 0;  // of the tensor it patches
  uint64_t changed = 0;   // elements it writes
  SharedBytes body;

  uint64_t tensor_bytes() const { return elements * element_size; }
};

// The patch that turns `before` into `after` (equal sizes, a multiple of
// `element_size`), in the smaller encoding; nullopt when it would not be
// smaller than `after` itself (then send the tensor). Stops early once that
// is certain.
std::optional<ElementPatch> DiffElements(std::span<const std::byte> before, std::span<const std::byte> after,
                                         uint32_t element_size);

// Checks every position and length of `patch` against its tensor without
// writing anything. InvalidArgument saying what is wrong; callers add the
// tensor's name.
absl::Status CheckPatch(const ElementPatch& patch);

// Writes `patch`'s values into `tensor` (tensor_bytes() bytes), after
// CheckPatch: on error nothing was written.
absl::Status ApplyPatch(const ElementPatch& patch, std::span<std::byte> tensor);

// Calls on_run(start, length, values) for each run of `patch` (consecutive
// positions joined), in order: elements [start, start + length) take the
// length * element_size bytes at `values` (in the body). Checks the whole
// patch first (CheckPatch): on error on_run was never called. What writers
// into memory this process cannot address (a GPU's) plan their copies from.
absl::Status ForEachRun(const ElementPatch& patch,
                        const std::function<void(uint64_t start, uint64_t length, const std::byte* values)>& on_run);

// Streams `base` (tensor_bytes() bytes) with `patch` applied to `out`, in
// order, in pieces: what a patched push stages without holding the tensor.
// InvalidArgument (before `out` is called) for a patch CheckPatch refuses or a
// base of another size; `out`'s errors.
absl::Status WritePatched(const ElementPatch& patch, std::span<const std::byte> base,
                          const std::function<absl::Status(absl::string_view)>& out);

// One patch that does what `first` and then `second` do (both checked, to
// one tensor); nullopt when it would not be smaller than the tensor.
absl::StatusOr<std::optional<ElementPatch>> ComposePatches(const ElementPatch& first, const ElementPatch& second);

// One tensor of an update: its name (for errors), its patch, and where its
// bytes are.
struct PatchTarget {
  absl::string_view name;
  const ElementPatch* patch = nullptr;
  std::span<std::byte> tensor;
};

// Applies every patch of an update in one call, on up to `threads` threads
// (the caller's among them). Every patch is checked against its target first,
// so on error (InvalidArgument naming the tensor) nothing was written.
absl::Status ApplyPatches(std::span<const PatchTarget> targets, unsigned threads);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_ELEMENT_PATCH_H_

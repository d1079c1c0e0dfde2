// HostBuffer: an owned, writable, page-aligned CPU buffer for materialized tensors.
//
// Buffers of 2 MiB or more are 2 MiB-aligned anonymous mappings advised to use
// transparent huge pages: first-touch page faults, not the copy, dominate filling
// fresh memory, and a 2 MiB page takes one fault where 4 KiB ones take 512
// (and the TLB holds more of the weights later). Not on a VM whose virtio
// balloon reports free pages to the hypervisor: there every fresh huge page is
// memory the host takes back and must back again at its first touch, and
// 4 KiB pages (recycled, never reported) fill about 4x faster (measured in
// docs/benchmarks.md). WEIGHTSTORE_HUGE_PAGES=1 or 0 overrides the choice. Smaller buffers come from the heap.
// Move-only; Freeze() turns it into immutable SharedBytes without a copy. Thread-compatible.
#ifndef WEIGHTSTORE_CORE_HOST_BUFFER_H_
#define WEIGHTSTORE_CORE_HOST_BUFFER_H_

#include <cstddef>
#include <memory>
#include <span>

#include "absl/status/statusor.h"
#include "core/shared_bytes.h"

namespace weightstore {

class HostBuffer {
 public:
  // Returns ResourceExhausted if the memory cannot be had.
  static absl::StatusOr<HostBuffer> Allocate(size_t size);

  HostBuffer(HostBuffer&&) = default;
  HostBuffer& operator=(HostBuffer&&) = default;

  std::byte* data() { return span_.data(); }
  size_t size() const { return span_.size(); }
  std::span<std::byte> span() { return span_; }

  // Returns the bytes as SharedBytes; this buffer is left empty.
  SharedBytes Freeze() &&;

  // The bytes of `bytes` as writable memory when they are a frozen
  // HostBuffer's and `bytes` holds the only reference to it: writing them then
  // changes no one else's view. Else empty.
  static std::span<std::byte> SoleWritable(const SharedBytes& bytes);

 private:
  struct Release;
  HostBuffer() = default;
  std::shared_ptr<void> owner_;
  std::span<std::byte> span_;
};

// Takes the page faults of the pages under `range` in one call
// (MADV_POPULATE_WRITE, Linux 5.14 and later) just before they are written:
// a fault per page traps once per 4 KiB, and in one call the kernel fills
// them about 1.25x faster (docs/benchmarks.md#owned-memory-from-files).
// Contents are unchanged, and so is errno. A range whose first whole page is
// mapped already (memory written before) is left alone: populating present
// pages costs about as much as writing them. Advice only: for a range under
// 64 KiB, on an older kernel, or on memory it cannot populate, it does
// nothing and the writes fault as before; WEIGHTSTORE_PREFAULT=0 turns it off
// for the process. Call it only on memory the caller is about to write, a
// piece at a time (what it populates stays resident if the write never comes).
void PrefaultForWriting(std::span<std::byte> range);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_HOST_BUFFER_H_

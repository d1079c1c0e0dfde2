// The served-tensor plan: for each tensor a snapshot serves, which bytes of its
// checkpoint are read and how they become the served bytes, under a key that
// names those bytes within the checkpoint version. Every transport asks it:
// gRPC fetches (server/service.cc), the socket's segments
// (server/shm_server.cc) and the local store (client/local_store.cc), so
// materialization and the checksum cache work the same everywhere.
//
// Plans are values; the functions that read through one are thread-safe.
#ifndef WEIGHTSTORE_CORE_SELECT_SERVED_H_
#define WEIGHTSTORE_CORE_SELECT_SERVED_H_

#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "core/checksum_cache.h"
#include "core/select/snapshot.h"

namespace weightstore {

struct ServedTensorPlan {
  const SnapshotTensor* tensor = nullptr;  // in the snapshot the plan was made for
  size_t entry = 0;                        // index into the checkpoint's entries()
  // The transforms from stored to served bytes, applied in one pass.
  bool gather = false;     // not one run of the stored bytes: a strided tensor
                           // (PyTorch views) or a slice of scattered elements
  bool transpose = false;  // stored rank-2 [r, c], served [c, r]
  bool cast = false;       // the served dtype is not the stored one
  uint64_t byte_size = 0;  // of the served bytes
  // Names the served bytes within one checkpoint version: the entry, the served
  // dtype, the transpose and the slice, e.g. "12:F16:T" or "3:F32:[0:512, :]".
  // The checksum cache and the socket's segment cache are keyed by it.
  std::string key;

  // No transform: the served bytes are one byte range of the tensor's storage,
  // served as a view of it (of the file mapping, when the storage is a file).
  bool is_byte_range() const { return !gather && !transpose && !cast; }
};

// The plan for `tensor`, one of `snapshot`'s.
ServedTensorPlan PlanServedTensor(const Snapshot& snapshot, const SnapshotTensor& tensor);

// The served bytes of a byte-range plan, as a view that keeps its storage
// alive (zero-copy); a copy only for a PyTorch BOOL tensor that must be fixed
// up. REQUIRES: plan.is_byte_range().
absl::StatusOr<SharedBytes> ReadServedView(const Snapshot& snapshot, const ServedTensorPlan& plan);

// Writes the served bytes [offset, offset + out.size()) into `out`, reading,
// gathering, transposing and casting only that range (Snapshot::ReadRange).
absl::Status MaterializeServed(const Snapshot& snapshot, const ServedTensorPlan& plan, uint64_t offset,
                               std::span<std::byte> out);

// A piece size of about `about` bytes for producing a plan's served bytes a
// range at a time: whole elements, and for a transpose whole rows of the
// served matrix (at least one), which are made by tiles rather than an element
// at a time.
uint64_t ServedPieceBytes(const ServedTensorPlan& plan, uint64_t about);

// Writes all of the served bytes into `out` (plan.byte_size of them), about
// `piece_bytes` at a time (ServedPieceBytes), asking `cancelled` (may be empty)
// before each piece: Cancelled, naming the tensor, once it says so. Each
// piece's pages are faulted in one call first (PrefaultForWriting).
absl::Status MaterializeServedInPieces(const Snapshot& snapshot, const ServedTensorPlan& plan, std::span<std::byte> out,
                                       uint64_t piece_bytes, const std::function<bool()>& cancelled);

// The CRC32C of the served bytes: from `cache` when known, else computed (a
// view, or a chunk at a time: never the whole produced tensor in memory) and
// stored. Returns the cache's CheckUnchanged error if the source changed, and
// Cancelled once `cancelled` (asked every 1 MiB; may be empty) says so.
absl::StatusOr<uint32_t> ServedChecksum(const Snapshot& snapshot, const ServedTensorPlan& plan,
                                        const ChecksumCache& cache, const std::function<bool()>& cancelled = {});

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_SELECT_SERVED_H_

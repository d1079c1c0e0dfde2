// Filling memory the process owns on several cores at once. Fresh memory is
// bound by its page faults (the kernel zeroing each new page), which one
// core takes one at a time: docs/benchmarks.md#owned-memory-from-files.
#ifndef WEIGHTSTORE_CLIENT_PARALLEL_COPY_H_
#define WEIGHTSTORE_CLIENT_PARALLEL_COPY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightstore::client {

// About how many bytes each thread copies at a time.
inline constexpr uint64_t kCopyPieceBytes = uint64_t{4} << 20;

// Threads a large copy uses: the usable cores (client/usable_cores.h), at
// most 8; $WEIGHTSTORE_COPY_THREADS (1 to 64) overrides it. Read once.
unsigned CopyThreads();

// Calls copy(offset, length) for consecutive pieces of [0, size) of `piece`
// bytes (the last one shorter), on CopyThreads() threads when there are at
// least two pieces, else on this one. Returns the first error; the pieces
// not started by then are not.
absl::Status CopyInPieces(uint64_t size, uint64_t piece,
                          const std::function<absl::Status(uint64_t offset, uint64_t length)>& copy);

// One tensor's share of a batch: `size` bytes written by copy(at, length)
// in consecutive pieces of at most `piece` bytes.
struct CopyJob {
  uint64_t size = 0;
  uint64_t piece = kCopyPieceBytes;
  std::function<absl::Status(uint64_t at, uint64_t length)> copy;
};

// Runs the pieces of every job, on CopyThreads() threads when there are at
// least two pieces in all, else on this one: tensors under a piece each fill
// every core together instead of one core each in turn. Returns the first
// error; the pieces not started by then are not.
absl::Status RunCopyJobs(std::span<const CopyJob> jobs);

// Where a piece's bytes come from: `fd` read with pread from `offset` (named
// `what` in errors) when fd >= 0, else the memory at `from`, whose pages are
// dropped as they are copied with `release_from` (ReleaseCopiedPages, whose
// rules `from` must meet).
struct CopySource {
  const std::byte* from = nullptr;
  int fd = -1;
  uint64_t offset = 0;
  absl::string_view what;
  bool release_from = false;
};

// Copies bytes [at, at + out.size()) of `source` into `out`, its pages
// faulted in first (PrefaultForWriting); with `checksum` returns their
// CRC32C (else 0), each 256 KiB slice checksummed right after its copy, while
// it is in cache.
absl::StatusOr<uint32_t> CopyPiece(std::span<std::byte> out, const CopySource& source, uint64_t at, bool checksum);

// memcpy of out.size() bytes from `from` into `out`, so; each piece's
// pages are faulted in one call first (PrefaultForWriting). With
// `release_from`, the source's pages are dropped as the pieces are copied
// (ReleaseCopiedPages, whose rules `from` must meet).
void ParallelMemcpy(std::span<std::byte> out, const std::byte* from, bool release_from = false);

// ParallelMemcpy (pieces prefaulted too) that returns the CRC32C of the
// bytes written: each thread checksums what it wrote while it is still in
// cache, and the pieces' CRCs are concatenated. With `release_from`, the source's pages are dropped as
// the pieces are copied (ReleaseCopiedPages, whose rules `from` must meet).
uint32_t CopyWithCrc32c(std::span<std::byte> out, const std::byte* from, bool release_from);

// Reads out.size() bytes of `fd` from `offset` into `out` with pread, in
// pieces on CopyThreads() threads (each piece's pages faulted in first), and
// with `checksum` returns their CRC32C (else 0), each slice checksummed while
// it is in cache. Nothing
// is mapped: the kernel copies from the page cache or shared memory, so no
// page tables are built or torn down for the source (for a memfd on the
// 2-core VM, 1.10-1.13x a fresh mapping's copy; for a file, whose page cache
// maps in large folios, 0.89-0.93x: shm_bench). `what` names the source in
// errors.
absl::StatusOr<uint32_t> ParallelPread(std::span<std::byte> out, int fd, uint64_t offset, absl::string_view what,
                                       bool checksum);

// Drops this process's mappings of the whole pages inside `source`, a
// range of a read-only or not yet written copy-on-write mapping of a file or
// segment, once it was copied (Query::release_source_pages): the pages stay
// in the page cache or segment, and a later read maps them again. Never call
// it on anonymous memory or a written private mapping: their pages would be
// lost. Pages the range shares with its neighbours are kept.
void ReleaseCopiedPages(std::span<const std::byte> source);

}  // namespace weightstore::client

#endif  // WEIGHTSTORE_CLIENT_PARALLEL_COPY_H_

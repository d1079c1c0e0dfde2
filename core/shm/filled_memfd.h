// FilledMemfd: a memfd that is handed out while the daemon is still filling
// it, a range at a time: the socket's copy of a checkpoint file that a peer
// could write (server/shm_server.cc), filled with the tensors requests ask
// for, so a checkpoint is copied per tensor on its first request and not per
// checkpoint or per selection.
//
// It is sealed from its creation against shrinking, growth and further
// seals, and against writes through any descriptor and any mapping made from
// then on (F_SEAL_FUTURE_WRITE, Linux 5.1): a peer that reopens its
// descriptor writable through /proc cannot write it. The daemon writes
// through the one shared writable mapping it made before sealing.
//
// The contract that makes it as safe as a segment sealed whole: a byte range
// is written once, before any reader is told of it (Claim, write, Finish,
// then WaitFilled), and never again. Bytes a reader was pointed at never
// change; bytes around them (the rest of a shared page) may still go from
// zero to their final value. Thread-safe.
#ifndef WEIGHTSTORE_CORE_SHM_FILLED_MEMFD_H_
#define WEIGHTSTORE_CORE_SHM_FILLED_MEMFD_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "boost/icl/interval_set.hpp"
#include "core/mapped_file.h"

namespace weightstore {

// The seals a filled memfd carries: F_SEAL_SHRINK | F_SEAL_GROW |
// F_SEAL_FUTURE_WRITE | F_SEAL_SEAL.
int FilledSeals();

// Returns OK if `fd` is a memfd that carries every FilledSeals() (a segment
// sealed whole, with F_SEAL_WRITE, passes too); otherwise FailedPrecondition
// naming `what` and the missing seals.
absl::Status CheckFilledSeals(int fd, absl::string_view what);

class FilledMemfd {
 public:
  // [offset, offset + length) of the segment.
  struct Range {
    uint64_t offset = 0;
    uint64_t length = 0;
  };

  // Creates an empty (all zero, no memory used) memfd of `size` bytes named
  // `name`, maps it writable, seals it, and opens the read-only view handed
  // out, whose path() is `path`. Unimplemented where the kernel lacks
  // F_SEAL_FUTURE_WRITE or refuses it (seccomp), or is older than 5.18
  // (before it, a private writable mapping of such a memfd was not
  // copy-on-write across fork): callers copy a segment sealed whole instead.
  // ResourceExhausted if no mapping or descriptor can be had. Its pages are
  // small ones (no huge-page advice), so charging whole pages is exact.
  static absl::StatusOr<std::shared_ptr<FilledMemfd>> Create(const std::string& name, uint64_t size, std::string path);
  ~FilledMemfd();
  FilledMemfd(const FilledMemfd&) = delete;
  FilledMemfd& operator=(const FilledMemfd&) = delete;

  // What readers map (a read-only descriptor).
  const std::shared_ptr<const MappedFile>& view() const { return view_; }
  uint64_t size() const { return size_; }

  // The parts of `wanted` that nobody has filled or is filling, now claimed
  // by the caller, who must write them (Writable) and then Finish them.
  // InvalidArgument if a range passes the end.
  absl::StatusOr<std::vector<Range>> Claim(std::span<const Range> wanted);
  // Where a claimed range is written. REQUIRES: `range` lies in one the
  // caller claimed and has not finished.
  std::span<std::byte> Writable(const Range& range) const;
  // Ends a claim: with `written`, its bytes are final and readers may be
  // told of them; without, the ranges are given up (whoever claims them next
  // writes them over).
  void Finish(std::span<const Range> claimed, bool written);
  // Blocks until every byte of `wanted` is filled: kFilled. kGivenUp as soon
  // as part of it is neither filled nor being filled (its filler gave it
  // up): the caller claims it again. kCancelled once `cancelled` (asked every
  // 100 ms; may be empty) says so.
  enum class Wait { kFilled, kGivenUp, kCancelled };
  Wait WaitFilled(std::span<const Range> wanted, const std::function<bool()>& cancelled = {});

  // The bytes of the whole pages under `ranges` that no MarkCharged call has
  // marked: what filling them adds to the memory in use.
  uint64_t UnchargedBytes(std::span<const Range> ranges) const;
  void MarkCharged(std::span<const Range> ranges);

  // Bytes filled so far.
  uint64_t filled_bytes() const;

 private:
  using Intervals = boost::icl::interval_set<uint64_t>;
  FilledMemfd(uint64_t size, std::byte* writable, std::shared_ptr<const MappedFile> view)
      : size_(size), writable_(writable), view_(std::move(view)) {}

  const uint64_t size_;
  std::byte* const writable_;  // the daemon's shared writable mapping, made before sealing
  const std::shared_ptr<const MappedFile> view_;
  mutable absl::Mutex mu_;
  Intervals filled_ ABSL_GUARDED_BY(mu_);
  Intervals filling_ ABSL_GUARDED_BY(mu_);
  Intervals charged_ ABSL_GUARDED_BY(mu_);  // whole pages
};

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_SHM_FILLED_MEMFD_H_

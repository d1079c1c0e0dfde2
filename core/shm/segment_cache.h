// SegmentCache: the sealed shared-memory segments a daemon hands to same-host
// processes, under one memory budget.
//
// Two kinds of memory count against the budget: segments, held under keys and
// evicted least recently used first, which are either derived (what a
// transformed selection had to materialize: gathered strided tensors, casts,
// transposes), produced once per key, or filled (a file's copy that grows a
// tensor at a time: core/shm/filled_memfd.h), charged as they grow; and
// reservations (preloaded checkpoints), which are never evicted and are
// released when their Reservation is destroyed. Evicting a segment only drops
// the cache's reference: processes that mapped it keep valid, unchanging bytes
// until they unmap. Thread-safe.
#ifndef WEIGHTSTORE_CORE_SHM_SEGMENT_CACHE_H_
#define WEIGHTSTORE_CORE_SHM_SEGMENT_CACHE_H_

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <span>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/mapped_file.h"
#include "core/shm/filled_memfd.h"
#include "core/shm/sealed_memfd.h"

namespace weightstore {

class SegmentCache {
 public:
  // Bytes of budget held until destroyed (movable, not copyable).
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& other) noexcept;
    Reservation& operator=(Reservation&& other) noexcept;
    ~Reservation();
    uint64_t bytes() const { return bytes_; }

   private:
    friend class SegmentCache;
    SegmentCache* cache_ = nullptr;
    uint64_t bytes_ = 0;
  };

  // Keeps a filled segment from eviction while it lives (movable).
  class FilledLease {
   public:
    FilledLease() = default;
    FilledLease(FilledLease&& other) noexcept;
    FilledLease& operator=(FilledLease&& other) noexcept;
    ~FilledLease();
    FilledMemfd& segment() const { return *segment_; }
    const std::shared_ptr<FilledMemfd>& shared() const { return segment_; }

   private:
    friend class SegmentCache;
    void Unpin();
    SegmentCache* cache_ = nullptr;
    std::string key_;
    std::shared_ptr<FilledMemfd> segment_;
  };

  struct Stats {
    uint64_t budget_bytes = 0;
    uint64_t segment_bytes = 0;   // segments held (a filled one: what it has filled)
    uint64_t reserved_bytes = 0;  // reservations (preloads)
    uint64_t segments = 0;
    uint64_t hits = 0, misses = 0, evictions = 0;
  };

  // Default most segments held: each holds a descriptor and a mapping.
  static constexpr size_t kDefaultMaxSegments = 1024;

  // A segment is charged its size rounded up to whole pages (at least one),
  // plus its key's bytes (kept three times): requests choose keys (slices make them unbounded in
  // number), so even empty segments count. At most `max_segments` are held;
  // past that the least recently used goes.
  explicit SegmentCache(uint64_t budget_bytes, size_t max_segments = kDefaultMaxSegments)
      : budget_(budget_bytes), max_segments_(max_segments) {}
  SegmentCache(const SegmentCache&) = delete;
  SegmentCache& operator=(const SegmentCache&) = delete;

  // Returns the segment stored under `key`, or creates it: evicts until `size`
  // bytes fit, then lets `fill` write a new memfd of `size` bytes (by pwrite:
  // core/shm/sealed_memfd.h) and seals it. Callers
  // asking for a key being built wait for it and share the result. Returns
  // ResourceExhausted, naming `what` and the budget, when `size` cannot fit even
  // after evicting everything; the error of `fill` otherwise.
  absl::StatusOr<std::shared_ptr<const MappedFile>> GetOrCreate(
      const std::string& key, uint64_t size, absl::string_view what,
      const std::function<absl::Status(SegmentWriter&)>& fill);

  // Returns the filled segment held under `key`, or creates an empty one of
  // `size` bytes (FilledMemfd::Create's errors), charged as a segment of no
  // bytes; `what` names it. While the returned lease lives, the segment is
  // not evicted. A key names either a filled or a derived segment, never both.
  absl::StatusOr<FilledLease> GetOrCreateFilled(const std::string& key, uint64_t size, absl::string_view what);

  // Charges `bytes` more to `lease`'s segment, evicting other segments to
  // make room; ResourceExhausted naming `what` and the budget if they cannot
  // fit. Callers charge what they are about to fill, in whole pages.
  absl::Status Grow(const FilledLease& lease, uint64_t bytes, absl::string_view what);

  // Holds `bytes` of the budget (evicting segments to make room) until the
  // returned Reservation is destroyed. ResourceExhausted naming `what` if they
  // cannot fit.
  absl::StatusOr<Reservation> Reserve(uint64_t bytes, absl::string_view what);

  // Drops every segment but those leased (mappings already handed out stay
  // valid).
  void Clear();
  Stats stats() const;

 private:
  struct Slot {
    absl::Mutex mu;  // held while the segment is built
    std::shared_ptr<const MappedFile> segment ABSL_GUARDED_BY(mu);
    std::shared_ptr<FilledMemfd> filled ABSL_GUARDED_BY(mu);
  };
  // Evicts least recently used segments (none leased) until `bytes` more fit
  // (and, with `new_segment`, until one more segment may be held). False if
  // they cannot.
  bool MakeRoom(uint64_t bytes, bool new_segment = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Release(uint64_t bytes);
  // The slot under `key`, made empty if there is none.
  std::shared_ptr<Slot> SlotFor(const std::string& key);
  // GetOrCreateFilled's creation, with `slot` locked and empty.
  absl::StatusOr<FilledLease> CreateFilled(const std::shared_ptr<Slot>& slot, const std::string& key, uint64_t size,
                                           absl::string_view what, FilledLease lease)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(slot->mu);

  const uint64_t budget_;
  const size_t max_segments_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);
  // A built segment's key, size, and what it is charged against the budget.
  struct Held {
    std::string key;
    uint64_t size = 0, charge = 0;
    const FilledMemfd* filled = nullptr;  // a filled segment's
    int leases = 0;                       // its live leases: not evicted while > 0
  };
  // Built segments, most recently used first.
  std::list<Held> lru_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::list<Held>::iterator> lru_pos_ ABSL_GUARDED_BY(mu_);
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;  // segments + reservations + builds in progress
  uint64_t segment_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t hits_ ABSL_GUARDED_BY(mu_) = 0, misses_ ABSL_GUARDED_BY(mu_) = 0, evictions_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_SHM_SEGMENT_CACHE_H_

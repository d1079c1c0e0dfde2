// ChecksumCache: the CRC32C of each served tensor of one checkpoint version,
// keyed by its served-tensor plan (core/select/served.h), so each is computed
// once however often and over whichever transport it is asked for.
//
// A checksum vouches for the bytes as they were opened: Store() keeps one only
// while `check_unchanged` passes, and returns its error otherwise. Requests
// choose the keys (slices are unbounded in number), so at most `max_entries`
// keys of at most `max_key_bytes` together are kept: a key that would pass
// either bound empties the cache first (what was dropped is computed again
// when next asked for). FindOrCompute computes each key once however many ask
// at the same time. Thread-safe.
#ifndef WEIGHTSTORE_CORE_CHECKSUM_CACHE_H_
#define WEIGHTSTORE_CORE_CHECKSUM_CACHE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace weightstore {

class ChecksumCache {
 public:
  static constexpr size_t kDefaultMaxEntries = 1 << 18;
  static constexpr size_t kDefaultMaxKeyBytes = 16 << 20;

  // `check_unchanged` (may be empty: always OK) says whether the source is
  // still as opened.
  explicit ChecksumCache(std::function<absl::Status()> check_unchanged = {}, size_t max_entries = kDefaultMaxEntries,
                         size_t max_key_bytes = kDefaultMaxKeyBytes)
      : check_unchanged_(std::move(check_unchanged)), max_entries_(max_entries), max_key_bytes_(max_key_bytes) {}

  std::optional<uint32_t> Find(const std::string& key) const {
    absl::MutexLock lock(&mu_);
    auto it = crc_.find(key);
    if (it == crc_.end()) return std::nullopt;
    return it->second;
  }
  // The checksum of `key`: kept, or `compute`d and kept. While one caller
  // computes a key, others asking for it wait for its outcome (an error
  // too) instead of computing it again; if it was Cancelled (that caller's
  // client left), one of them computes it.
  // `cancelled` (may be empty), asked every 100 ms while waiting, ends the
  // wait with Cancelled.
  absl::StatusOr<uint32_t> FindOrCompute(const std::string& key,
                                         const std::function<absl::StatusOr<uint32_t>()>& compute,
                                         const std::function<bool()>& cancelled = {}) const {
    std::shared_ptr<Pending> pending;
    {
      absl::MutexLock lock(&mu_);
      for (;;) {
        if (auto it = crc_.find(key); it != crc_.end()) return it->second;
        auto [it, added] = computing_.try_emplace(key);
        if (added) {
          it->second = pending = std::make_shared<Pending>();
          break;
        }
        std::shared_ptr<Pending> theirs = it->second;
        while (!mu_.AwaitWithTimeout(absl::Condition(&theirs->done), absl::Milliseconds(100))) {
          if (cancelled && cancelled()) return absl::CancelledError("stopped waiting for a checksum");
        }
        if (!absl::IsCancelled(theirs->result.status())) return theirs->result;
      }
    }
    auto publish = [&](const absl::StatusOr<uint32_t>& result) {
      absl::MutexLock lock(&mu_);
      pending->result = result;
      pending->done = true;
      computing_.erase(key);
    };
    absl::Cleanup thrown = [&] { publish(absl::InternalError("the checksum computation threw")); };
    absl::StatusOr<uint32_t> crc = compute();
    if (crc.ok()) {
      if (absl::Status stored = Store(key, *crc); !stored.ok()) crc = stored;
    }
    std::move(thrown).Cancel();
    publish(crc);
    return crc;
  }
  // Keeps `crc` for `key` once CheckUnchanged() passes; returns its error else.
  absl::Status Store(const std::string& key, uint32_t crc) const {
    if (absl::Status unchanged = CheckUnchanged(); !unchanged.ok()) return unchanged;
    absl::MutexLock lock(&mu_);
    if (auto it = crc_.find(key); it != crc_.end()) {
      it->second = crc;
      return absl::OkStatus();
    }
    if (crc_.size() >= max_entries_ || key_bytes_ + key.size() > max_key_bytes_) {
      crc_.clear();
      key_bytes_ = 0;
    }
    if (key.size() <= max_key_bytes_) {
      crc_.emplace(key, crc);
      key_bytes_ += key.size();
    }
    return absl::OkStatus();
  }
  size_t size() const {
    absl::MutexLock lock(&mu_);
    return crc_.size();
  }
  absl::Status CheckUnchanged() const { return check_unchanged_ ? check_unchanged_() : absl::OkStatus(); }

 private:
  std::function<absl::Status()> check_unchanged_;
  const size_t max_entries_, max_key_bytes_;
  mutable absl::Mutex mu_;
  mutable size_t key_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  mutable absl::flat_hash_map<std::string, uint32_t> crc_ ABSL_GUARDED_BY(mu_);
  // A computation in progress; its fields are guarded by mu_.
  struct Pending {
    bool done = false;
    absl::StatusOr<uint32_t> result;
  };
  mutable absl::flat_hash_map<std::string, std::shared_ptr<Pending>> computing_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_CHECKSUM_CACHE_H_

// ChecksumCache: the CRC32C of each served tensor of one checkpoint version,
// keyed by its served-tensor plan (core/select/served.h), so each is computed
// once however often and over whichever transport it is asked for.
//
// A checksum vouches for the bytes as they were opened: Store() keeps one only
// while `check_unchanged` passes, and returns its error otherwise. Entries are
// bounded by what a version can serve (entries x dtypes x transposes).
// Thread-safe.
#ifndef WEIGHTSTORE_CORE_CHECKSUM_CACHE_H_
#define WEIGHTSTORE_CORE_CHECKSUM_CACHE_H_

#include <cstdint>
#include <functional>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace weightstore {

class ChecksumCache {
 public:
  // `check_unchanged` (may be empty: always OK) says whether the source is
  // still as opened.
  explicit ChecksumCache(std::function<absl::Status()> check_unchanged = {})
      : check_unchanged_(std::move(check_unchanged)) {}

  std::optional<uint32_t> Find(uint64_t key) const {
    absl::MutexLock lock(&mu_);
    auto it = crc_.find(key);
    if (it == crc_.end()) return std::nullopt;
    return it->second;
  }
  // Keeps `crc` for `key` once CheckUnchanged() passes; returns its error else.
  absl::Status Store(uint64_t key, uint32_t crc) const {
    if (absl::Status unchanged = CheckUnchanged(); !unchanged.ok()) return unchanged;
    absl::MutexLock lock(&mu_);
    crc_[key] = crc;
    return absl::OkStatus();
  }
  absl::Status CheckUnchanged() const { return check_unchanged_ ? check_unchanged_() : absl::OkStatus(); }

 private:
  std::function<absl::Status()> check_unchanged_;
  mutable absl::Mutex mu_;
  mutable absl::flat_hash_map<uint64_t, uint32_t> crc_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_CHECKSUM_CACHE_H_

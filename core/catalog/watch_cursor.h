// WatchCursor: what one watcher of the registry has been told, and what to
// tell it next. Transport-free: the gRPC WatchCheckpoints call drives one per
// stream (server/watch.cc).
//
// Level-triggered: the cursor keeps the version the watcher holds of each
// checkpoint in its scope and, when told a name changed, reports the step from
// that version to the current one. A watcher that falls behind (or reconnects
// saying what it holds) gets one update per checkpoint, from what it has to
// what is served, never a backlog; what it is owed is one entry per name, so
// it is bounded by the names served.
//
// Thread-safe: MarkChanged may be called from any thread; Next from one at a
// time.
#ifndef WEIGHTSTORE_CORE_CATALOG_WATCH_CURSOR_H_
#define WEIGHTSTORE_CORE_CATALOG_WATCH_CURSOR_H_

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/catalog/manifest.h"
#include "core/catalog/registry.h"

namespace weightstore {

// Which checkpoints a watcher follows: one by name, or all whose names start
// with `prefix` ("" for all).
struct WatchScope {
  std::string name;
  std::string prefix;

  bool Contains(const std::string& checkpoint) const;
};

struct CheckpointUpdate {
  enum class Kind {
    kAdded,     // served, and the watcher held no version of it
    kReplaced,  // served at another version than the watcher's
    kRemoved,   // no longer served
    kSynced,    // once, after the updates owed when the watch began
  };
  Kind kind = Kind::kSynced;
  std::string name;
  std::string old_version;  // the watcher's (empty for kAdded)
  std::string new_version;  // the current one (empty for kRemoved)
  // kReplaced: how the new version's tensors differ from the old one's, by
  // file name, when both manifests are known. nullptr otherwise, with the
  // reason in `full_reason`: the watcher should fetch the checkpoint in full.
  // Shared: every watcher of one step holds the same diff.
  std::shared_ptr<const ManifestDiff> diff;
  std::string full_reason;
};

// The diffs between versions of checkpoints, each computed once however many
// watchers ask for it (one at a time computes it; the others wait and share
// it). Keeps the last `capacity` steps, and at most `max_bytes` of them (the
// newest always). Thread-safe.
class DiffCache {
 public:
  explicit DiffCache(size_t capacity = 64, uint64_t max_bytes = uint64_t{64} << 20)
      : capacity_(capacity), max_bytes_(max_bytes) {}
  std::shared_ptr<const ManifestDiff> Get(const std::string& name, const CheckpointManifest& base,
                                          const CheckpointManifest& current);
  // Lets every kept diff go (those a watcher holds stay alive with it).
  void Clear();
  // Bytes the kept diffs hold (their names and the strings' own size).
  uint64_t bytes() const;

 private:
  const size_t capacity_;
  const uint64_t max_bytes_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::pair<std::shared_ptr<const ManifestDiff>, uint64_t>> diffs_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> order_ ABSL_GUARDED_BY(mu_);  // oldest first
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

class WatchCursor {
 public:
  // `known`: the version the watcher holds of each checkpoint (from an earlier
  // watch); those outside `scope` are ignored. `diffs` (may be null: each
  // cursor diffs alone) shares diffs among cursors; it must outlive this.
  WatchCursor(const CheckpointRegistry* registry, WatchScope scope, std::map<std::string, std::string> known,
              DiffCache* diffs = nullptr);

  // Owes the watcher an update for every checkpoint in scope that is served or
  // known (none comes for one at its known version). Call it once, after the
  // registry listener that calls MarkChanged is added, so that no change falls
  // between the two.
  void Start();

  // Tells the cursor `name` may have changed. Returns true when the cursor
  // owed nothing before (the caller should wake its writer).
  bool MarkChanged(const std::string& name);

  // The next update the watcher is owed, or nullopt when it is up to date.
  std::optional<CheckpointUpdate> Next();

 private:
  // What to tell the watcher about `name` now, if anything.
  std::optional<CheckpointUpdate> UpdateFor(const std::string& name);

  const CheckpointRegistry* registry_;
  DiffCache* const diffs_;
  const WatchScope scope_;
  std::map<std::string, std::string> known_;  // only Next() touches it
  bool synced_ = false;                       // kSynced was returned
  absl::Mutex mu_;
  std::set<std::string> owed_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_CATALOG_WATCH_CURSOR_H_

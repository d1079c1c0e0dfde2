// Puller: how the daemon asks for a checkpoint it does not have (read-through:
// a request naming it, PullCheckpoint, --pull). The node cache
// (origin/node_cache.h) is the one implementation; the server sees only this.
#ifndef WEIGHTSTORE_CORE_CATALOG_PULL_H_
#define WEIGHTSTORE_CORE_CATALOG_PULL_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace weightstore {

struct PullResult {
  // Bytes this call transferred from the origin: 0 when the checkpoint was
  // already there, or when the call waited on another caller's transfer.
  uint64_t bytes_pulled = 0;
  // Bytes of the checkpoint's tensors.
  uint64_t bytes = 0;
  bool already_present = false;
  // This call joined a transfer another call had started.
  bool joined = false;
  double seconds = 0;
};

// Following (origin/follower.h): one checkpoint kept at its upstream's
// newest version.
struct FollowedStats {
  std::string name;
  // The newest version the upstream announced ("" when none since start).
  std::string newest;
  // Upstream versions announced since the one held, not applied yet; and
  // seconds since the oldest of them was announced (0 when current).
  uint64_t lag_versions = 0;
  double lag_seconds = 0;
  // Steps applied: every changed tensor as an element patch, or some whole;
  // or, from an origin of whole files, only the changed tensors' byte ranges
  // (a SafeTensors header that states its digests).
  uint64_t steps_patched = 0, steps_whole = 0, steps_ranged = 0;
  uint64_t failures = 0;
  // Not followed until the upstream's next version: a step that cannot
  // succeed as things are (the log says why).
  bool blocked = false;
  std::string blocked_reason;
  // Bytes received from the upstream: element patches, whole tensors.
  uint64_t patch_bytes = 0, whole_bytes = 0;
  // Steps where changed tensors came whole, by reason ("not_kept": the
  // upstream keeps no patches from the version held; "patch_failed": a patch
  // did not apply or its result failed its digest; "not_delta": the upstream
  // could not tell what changed; "index_changed": a sharded checkpoint's
  // version that adds, drops or moves tensors, pulled as its files).
  std::map<std::string, uint64_t> fallbacks;
};

struct FollowStats {
  bool following = false;                  // --follow
  bool upstream_connected = false;         // the watch is up
  std::vector<FollowedStats> checkpoints;  // sorted by name
};

// Figures for metrics, read at scrape time.
struct PullStats {
  std::string origin;  // Describe() of the origin
  uint64_t bytes_pulled = 0;
  uint64_t pulls = 0, pull_errors = 0;
  uint64_t pulls_in_flight = 0;
  uint64_t hits = 0, misses = 0;  // read-through lookups
  uint64_t cache_bytes = 0, cache_budget_bytes = 0;
  uint64_t evictions = 0;
  FollowStats follow;
};

class Puller {
 public:
  using Done = std::function<void(absl::StatusOr<PullResult>)>;
  virtual ~Puller() = default;
  // Makes checkpoint `name` served, pulling its files from the origin unless
  // they are already here, and calls `done` with the outcome: at once (on this
  // thread) when nothing is to be transferred or the pull is refused, else on
  // the transfer's own thread once it ends. Concurrent calls for one name share
  // one transfer and its outcome. Never blocks on the transfer: gRPC handlers
  // call it. Returns a ticket for Abandon while `done` waits; 0 when `done`
  // was called already.
  virtual uint64_t PullAsync(const std::string& name, Done done) = 0;
  // The caller holding `ticket` (from PullAsync of `name`) stopped waiting (its
  // client went away): unless its `done` was called already, it is called now,
  // on this thread, with Cancelled, and no longer counts among the waiters.
  // The transfer goes on for the others. Any ticket, at any time: a stale one
  // does nothing.
  virtual void Abandon(const std::string& name, uint64_t ticket) = 0;
  // Checkpoints held as pulled (served as placed, or mid-step) that are to be
  // followed (--follow, --follow-only) and that the follower does not follow:
  // 0 on a healthy node; more means following stopped for them. Counted from
  // the node cache's own records against the follower's, for the metric
  // (not on a request's path: it matches names against patterns).
  virtual uint64_t UnfollowedCheckpoints() const { return 0; }
  // PullAsync, waiting for the outcome.
  absl::StatusOr<PullResult> Pull(const std::string& name);
  // Notes that `name` was just used (least recently used eviction).
  virtual void Touch(const std::string& name) = 0;
  virtual PullStats Stats() const = 0;
  // Stats() with the follow figures of checkpoint `name` alone (what a
  // GetCheckpoint shows): not a copy of every followed checkpoint's.
  virtual PullStats StatsOf(const std::string& name) const { return Stats(); }
  // Ends the transfers in progress (their callers get Unavailable), cancelling
  // the origin's reads, and refuses new pulls. For shutdown.
  virtual void Shutdown() = 0;
};

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_CATALOG_PULL_H_

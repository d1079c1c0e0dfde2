// Follower: keeps the checkpoints a node pulled at its upstream daemon's
// newest version (weightstored --follow; docs/origin.md, Following).
//
// It watches the upstream (WatchCheckpoints) for the checkpoints the node
// holds as pulled (or polls an S3 origin's listing; see FollowUpstream). For each new version it fetches, pinned to
// that version, only the tensors that changed since the one held: as element patches where the upstream keeps them,
// else whole. It writes the new version through the registry's push (core/catalog/push.h) from the held file and what
// came, checks every tensor against the upstream's digests before anything is published, and publishes it under the
// upstream's version id. The node's own clients then see a normal replacement: their watches fire, and their updates
// get element patches from the node. Clients see the old version or the new one, whole, never a mix.
//
// Steps run one at a time on a thread of their own, never on gRPC's. A step
// that fails (the upstream went away, a patch that does not apply, a result
// unlike the upstream's digests) publishes nothing and is retried, with
// backoff; a patch that fails is retried at once with whole tensors. A step
// that cannot succeed as things are (no digests, a checkpoint the push cannot
// write, a step over the bound) is blocked until the upstream announces
// another version. An upstream that goes away leaves the node serving what it
// holds; the watch is reopened, with backoff, and a version missed meanwhile
// arrives then.
//
// What it can follow: what the registry's push can write, single-file
// checkpoints of a writable format (SafeTensors, Burnpack) and sharded
// SafeTensors ones whose steps keep their tensors' names, dtypes and shapes;
// from S3, single-file checkpoints of any format and sharded ones whose index
// stays, pulled whole (a sharded one's changed shards only). Others are
// served as pulled, blocked with the reason in the log.
//
// Thread-safe.
#ifndef WEIGHTSTORE_ORIGIN_FOLLOWER_H_
#define WEIGHTSTORE_ORIGIN_FOLLOWER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/store.h"
#include "core/catalog/pull.h"
#include "core/catalog/registry.h"

namespace weightstore::origin {

// What a follower needs of the node cache that holds the checkpoints.
class FollowedCache {
 public:
  virtual ~FollowedCache() = default;
  // The checkpoints held as pulled and not replaced since, with the origin's
  // version id of each: what is followed.
  virtual std::map<std::string, std::string> Followed() const = 0;
  // A step of `name` from `base` (the version served) begins: until
  // EndStep, the replacement of its files does not make the cache forget
  // it, and it is not evicted. False, and no step, when `base` is not the
  // cache's (an operator's file, a local push, being placed): it is then no
  // longer followed.
  virtual bool BeginStep(const std::string& name, const CheckpointVersion& base) = 0;
  // Within a step: room under the cache's budget for the new version's
  // `bytes`, written beside the version held until it replaces it; held
  // until EndStep. Makes room as a pull does (the least recently used, never
  // one in use); ResourceExhausted, evicting nothing, when the budget cannot
  // hold both versions.
  virtual absl::Status ReserveStep(const std::string& name, uint64_t bytes) = 0;
  // The step ends. With `published` (the version the step published, under
  // the origin's id), the cache takes its files as the ones it holds.
  virtual void EndStep(const std::string& name, const CheckpointVersion* published) = 0;

  // For an origin without element patches (S3), within a step: pulls the
  // origin's current version of `name` whole and places it over `base`'s
  // files, served under the origin's id. `version` is null when the origin
  // still has `base`'s. Errors as a pull's; FailedPrecondition for what
  // cannot be followed so (an index changed, a format changed).
  struct Repulled {
    std::shared_ptr<const CheckpointVersion> version;
    uint64_t bytes = 0;  // read from the origin
    // Only the changed tensors' ranges were read (NodeCache::RangeStep).
    bool ranged = false;
  };
  virtual absl::StatusOr<Repulled> Repull(const std::string& name, const CheckpointVersion& base) = 0;
};

struct FollowOptions {
  // Waits after a failed watch or step: from retry_min, doubling, at most
  // retry_max, each with up to 25% jitter.
  absl::Duration retry_min = absl::Milliseconds(200);
  absl::Duration retry_max = absl::Seconds(5);
  // Most bytes one step may receive (the changed tensors' listed sizes, all
  // held in memory until written): the registry's push bound.
  uint64_t max_step_bytes = uint64_t{64} << 30;
};

// What is followed. An upstream daemon, as two remote stores: one watches
// it (a broken watch ends, and the follower reopens it), the other fetches
// the steps (resuming a broken stream, as any client does). Or an origin
// without element patches (S3): `poll` says its current version id of a
// checkpoint, asked every `poll_interval` (with up to 20% jitter either
// way), and a step pulls the new version whole (FollowedCache::Repull).
struct FollowUpstream {
  std::string name;  // as logs and metrics say it: "grpc://host:port", "s3://bucket/prefix"
  // The checkpoints followed among those held (--follow-only): names or
  // fnmatch(3) patterns ('*' matches '/' too: "org/*" is every revision of
  // every checkpoint of org). Empty: all. Those not matched are served as
  // pulled, never stepped.
  std::vector<std::string> only;
  std::unique_ptr<client::Store> watch, steps;
  std::function<absl::StatusOr<std::string>(const std::string& name)> poll;
  absl::Duration poll_interval = absl::Seconds(10);
};

// Checks --follow-only's patterns (FollowUpstream::only): at most 1,024, each
// 1 to 1,024 bytes with at most two '*' (fnmatch backtracks over the name
// once per '*', and names come from clients' pulls). InvalidArgument naming
// the pattern otherwise.
absl::Status CheckFollowPatterns(const std::vector<std::string>& patterns);

class Follower {
 public:
  // Follows what `cache` holds of `registry` from `upstream`. Both must
  // outlive it. Start() starts its threads.
  Follower(CheckpointRegistry* registry, FollowedCache* cache, FollowUpstream upstream, FollowOptions options = {});
  ~Follower();  // Stop()s and joins
  Follower(const Follower&) = delete;
  Follower& operator=(const Follower&) = delete;

  void Start();
  // What is held changed (a pull finished): the watch is reopened with it.
  void Refresh() ABSL_LOCKS_EXCLUDED(mu_);
  // The cache holds `name` anew (a pull placed it, a scan served it): a
  // Refresh when it is to be followed, else (--follow-only) said once in the
  // log.
  void Held(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the watch and the step in progress (cancelled); nothing is
  // published after it returns. For shutdown.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  // Whether `name`, when held, is to be followed (FollowUpstream::only).
  bool Follows(const std::string& name) const;

  FollowStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);
  // The names of the checkpoints followed now.
  std::set<std::string> FollowedNames() const ABSL_LOCKS_EXCLUDED(mu_);
  // Stats() of checkpoint `name` alone (none when it is not followed).
  FollowStats StatsOf(const std::string& name) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Followed {
    // Versions the upstream announced (watch events), and how many of them
    // the version held has caught up with: a step that ends at the
    // upstream's current version catches up with those announced before it
    // began. Behind while they differ, since `behind_since`.
    uint64_t announced = 0, caught_up = 0;
    std::string newest;  // the last one announced
    absl::Time behind_since = absl::InfinitePast();
    absl::Time retry_at = absl::InfinitePast();
    int failures_in_a_row = 0;
    // A step that cannot succeed as things are (a checkpoint the push cannot
    // write, an upstream without digests): not tried again until the
    // upstream announces another version. Logged once.
    std::string blocked;
    FollowedStats stats;
  };
  void WatchLoop();
  void PollLoop();
  // The cache's Followed(), less what FollowUpstream::only leaves out (each
  // name left out logged once).
  std::map<std::string, std::string> Known() ABSL_LOCKS_EXCLUDED(mu_);
  // Logs, once per name, that `names` are held but left out.
  void SayLeftOut(const std::vector<std::string>& names) ABSL_LOCKS_EXCLUDED(mu_);
  // A version `version` of `f` seen upstream (an event, a poll).
  void Announce(Followed& f, const std::string& version) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Prunes followed_ to `known` (what the cache holds) and the step in
  // progress, and adds what is new.
  void Track(const std::map<std::string, std::string>& known) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StepLoop();
  // Brings `name` to the upstream's current version. OK also when there was
  // nothing to do.
  absl::Status Step(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  // One attempt: `patches` asks for element patches.
  absl::Status StepOnce(const std::string& name, bool patches, bool* patch_failed) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Duration Backoff(int failures) const;
  // Waits `d` unless stopped or refreshed; false once stopped.
  bool Sleep(absl::Duration d) ABSL_LOCKS_EXCLUDED(mu_);

  CheckpointRegistry* registry_;
  FollowedCache* cache_;
  const FollowUpstream upstream_;
  const FollowOptions options_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool refresh_ ABSL_GUARDED_BY(mu_) = false;
  bool connected_ ABSL_GUARDED_BY(mu_) = false;
  // Cancels the watch (a refresh, Stop) and the step in progress (Stop).
  std::shared_ptr<std::atomic<bool>> watch_cancel_ ABSL_GUARDED_BY(mu_);
  const std::shared_ptr<std::atomic<bool>> step_cancel_ = std::make_shared<std::atomic<bool>>(false);
  std::map<std::string, Followed> followed_ ABSL_GUARDED_BY(mu_);
  // Stats() of every followed checkpoint, or of `*only`.
  FollowStats StatsFor(const std::string* only) const ABSL_LOCKS_EXCLUDED(mu_);
  std::string stepping_ ABSL_GUARDED_BY(mu_);  // the step in progress (kept followed)
  // Names --follow-only left out that the log has said so of (at most
  // kMaxLeftOutSaid: names come from clients' pulls).
  static constexpr size_t kMaxLeftOutSaid = 4096;
  std::set<std::string> left_out_said_ ABSL_GUARDED_BY(mu_);
  std::thread watcher_, stepper_;
};

}  // namespace weightstore::origin

#endif  // WEIGHTSTORE_ORIGIN_FOLLOWER_H_

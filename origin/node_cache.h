// NodeCache: pulls checkpoints the node does not have from an Origin into the
// models folder, and serves them through the registry like any other file.
//
// A pull reads each file in parts, several at once, into a partial file under
// <models>/.weightstore-cache/partial/ (hidden from the registry's scans), and
// records after every part and on every error how many bytes of each part were
// written and verified, so a failed or interrupted pull (origin down, daemon
// killed) resumes from there as long as the origin still has the same version
// (and, once it has another, for the files it lists unchanged).
// Once every byte is in, each file is checked whole (CRC32C when the origin
// gives one, the MD5 of a single-part S3 ETag), fsynced, renamed into place
// (never over an existing file) and the checkpoint loaded; if it does not open,
// its files are removed. Nothing is served before that.
//
// Concurrent pulls of one name share one transfer (single flight): every
// caller gets its outcome. Pulled checkpoints are listed in a ledger
// (<models>/.weightstore-cache/ledger.json) with their size and last use;
// when a pull needs room under the disk budget, the least recently used are
// evicted, whole, and never one in use: a stream holding its version, or a
// same-host process mapping one of its files (the socket hands out
// descriptors that carry a shared flock; see server/shm_server.cc). Files the
// operator put in the models folder are never evicted and do not count.
//
// Thread-safe.
#ifndef WEIGHTSTORE_ORIGIN_NODE_CACHE_H_
#define WEIGHTSTORE_ORIGIN_NODE_CACHE_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/catalog/pull.h"
#include "core/catalog/registry.h"
#include "core/shm/unix_socket.h"
#include "origin/follower.h"
#include "origin/origin.h"

namespace weightstore::origin {

struct NodeCacheOptions {
  // Disk budget for pulled checkpoints; 0: no limit (the disk's free space
  // still is one).
  uint64_t max_bytes = 0;
  // Distinct checkpoints pulled at once; a pull past it is ResourceExhausted.
  int max_concurrent_pulls = 4;
  // Unit of parallel reads, of fsync, and of the progress record.
  uint64_t part_bytes = uint64_t{64} << 20;
  // Ranges read at once per pull; 0: the origin's parallel_reads().
  int parallel_reads = 0;
  // How long a name the origin does not have (NotFound), or whose pull was
  // refused for what the origin holds (FailedPrecondition: more than
  // max_files files, a file in the way), is refused again without asking the
  // origin, and how many such names are remembered.
  absl::Duration not_found_ttl = absl::Seconds(10);
  size_t max_not_found = 10000;
  // Largest checkpoint a pull accepts (the origin's listing says its size).
  uint64_t max_checkpoint_bytes = uint64_t{4} << 40;
  // Most files one checkpoint may have (shards and index); a pull holds a
  // descriptor for each.
  size_t max_files = 4096;
  // Transfers waiting on one flight, besides the one that started it.
  size_t max_waiters = 10000;
  // A partial pull nobody resumed for this long is removed at start.
  absl::Duration abandoned_partial = absl::Hours(24);
};

class NodeCache : public Puller, public FollowedCache {
 public:
  // Opens the cache of `registry`'s models folder, reading its ledger (and
  // dropping entries whose files are gone). `registry` must outlive it.
  // With `follow` (the origin as remote stores: an upstream daemon; or a
  // poll of the origin's versions), what the cache holds follows the
  // origin's new versions (origin/follower.h).
  static absl::StatusOr<std::unique_ptr<NodeCache>> Open(CheckpointRegistry* registry, std::unique_ptr<Origin> origin,
                                                         NodeCacheOptions options, FollowUpstream follow = {});
  ~NodeCache() override;

  // Puller. Transfers run on threads of their own, at most
  // max_concurrent_pulls; the destructor waits for them (after Shutdown).
  // Errors name the checkpoint and what failed: the origin's status
  // codes (NotFound, Unavailable, Unauthenticated, PermissionDenied, Aborted),
  // DataLoss for bytes that fail a check, ResourceExhausted when it does not
  // fit the budget or the disk, or too many pulls run.
  uint64_t PullAsync(const std::string& name, Done done) override;
  void Abandon(const std::string& name, uint64_t ticket) override ABSL_LOCKS_EXCLUDED(mu_);
  void Touch(const std::string& name) override;
  PullStats Stats() const override;
  PullStats StatsOf(const std::string& name) const override;
  void Shutdown() override;

  const Origin& origin() const { return *origin_; }

  // FollowedCache.
  std::map<std::string, std::string> Followed() const override ABSL_LOCKS_EXCLUDED(mu_);
  // The ledger's checkpoints held as placed (or mid-step) that follower_ is
  // to follow, less those it follows. Counted apart from Followed(), whose
  // omissions it exists to show.
  uint64_t UnfollowedCheckpoints() const override ABSL_LOCKS_EXCLUDED(mu_);
  bool BeginStep(const std::string& name, const CheckpointVersion& base) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ReserveStep(const std::string& name, uint64_t bytes) override ABSL_LOCKS_EXCLUDED(mu_, evict_mu_);
  void EndStep(const std::string& name, const CheckpointVersion* published) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<Repulled> Repull(const std::string& name, const CheckpointVersion& base) override
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Stats() with the follow figures of every followed checkpoint, or of `*only`.
  PullStats StatsFor(const std::string* only) const;

  struct Flight;
  struct Cached {
    std::vector<std::string> paths;  // relative to the models folder; the main file last
    // Files placed beside a checkpoint kept apart (OriginFile::beside: its
    // quantization configs), in its apart folder: counted in bytes, removed
    // with it, and kept as placed by a following step.
    std::vector<std::string> beside;
    uint64_t bytes = 0;
    int64_t last_used_unix_ms = 0;
    std::string version;  // the origin's
    // FileVersion of the files as placed: files replaced since (a push, an
    // upload, an operator) are no longer the cache's, and never evicted.
    std::string file_version;
    // Recorded before its files are renamed into place, until it is loaded:
    // the device, inode, size and mtime (ns) of each, which a rename keeps,
    // so that after a crash in between, Open tells the files this cache
    // placed from any an operator put there. Not in cached_bytes_ (its pull's
    // reservation counts it).
    bool placing = false;
    std::vector<std::array<uint64_t, 4>> identities;
    // While a follower's Repull places a new version over the files held:
    // the version and FileVersion they had, which a crash before the rename
    // leaves in place (FinishPlacing then keeps them as the cache's).
    std::string replacing_version, replacing_file_version;
    // The origin's etag of each file as placed (OriginFile::etag), when
    // known: a sharded checkpoint's step from S3 fetches only the shards
    // whose etag moved. Empty for entries of older ledgers.
    std::vector<std::string> etags;
  };

  NodeCache(CheckpointRegistry* registry, std::unique_ptr<Origin> origin, NodeCacheOptions options);
  // Runs one flight's transfer and delivers its outcome to its waiters.
  void RunFlight(const std::string& name, const std::shared_ptr<Flight>& flight) ABSL_LOCKS_EXCLUDED(mu_);
  // Serves what is held apart (node_cache_internal::ApartFolder), which no
  // scan finds: what the ledger lists as the cache's, and what it lost as the
  // operator's; removes the folders a killed pull left empty.
  void ServeApart() ABSL_LOCKS_EXCLUDED(mu_);
  // The transfer one flight runs. `pulled` counts its bytes from the origin.
  absl::Status Transfer(const std::string& name, std::atomic<uint64_t>* pulled);
  // A checkpoint's files, read into partial files (Download).
  struct Staged {
    std::string folder;              // <models>/.weightstore-cache/partial/<SHA-256 of the name>
    std::vector<std::string> paths;  // one per file, in the checkpoint's order
    std::vector<UniqueFd> fds;
  };
  // A step of a single SafeTensors file whose new header states every
  // tensor's digest (kDigestsMetadataKey, core/catalog/manifest.h): the
  // tensors whose name, dtype, shape and digest are held are copied from the
  // file `base`, and only the other ranges are read from the origin, into a
  // staged file checked whole where the origin vouches for it and tensor by
  // tensor against the digests (origin/node_cache_ranges.cc). False, nothing
  // staged, where it does not apply: another format, no digests stated, or
  // more than half the bytes changed. Errors: the origin's (Aborted,
  // Unavailable ...), InvalidArgument for digests that cannot be taken,
  // DataLoss for bytes unlike them.
  absl::StatusOr<bool> RangeStep(const std::string& name, const OriginCheckpoint& checkpoint,
                                 const CheckpointVersion& base, std::atomic<uint64_t>* pulled, Staged* staged);
  // Download for a step: bytes unlike what the origin vouches for are
  // FailedPrecondition (blocked until its next version), and dropped.
  absl::Status DownloadStep(const std::string& name, const OriginCheckpoint& checkpoint, std::atomic<uint64_t>* pulled,
                            Staged* staged);
  // A Repull's ledger: BeginReplacing records (durably) before any rename
  // that `name`'s files held (`held`) are being replaced by `version`, whose
  // files will have `identities` (Aborted if the entry changed since);
  // UndoReplacing puts `held` back when nothing was renamed; EndReplacing
  // takes the files on disk, at `file_version`, as `checkpoint`'s (their
  // etags only when `published`), and moves the step's `reserved` bytes into
  // the cache's count under the same lock.
  absl::Status BeginReplacing(const std::string& name, const Cached& held, const std::string& version,
                              std::vector<std::array<uint64_t, 4>> identities) ABSL_LOCKS_EXCLUDED(mu_);
  void UndoReplacing(const std::string& name, const Cached& held) ABSL_LOCKS_EXCLUDED(mu_);
  void EndReplacing(const std::string& name, const std::string& file_version, const OriginCheckpoint& checkpoint,
                    bool published, uint64_t reserved) ABSL_LOCKS_EXCLUDED(mu_);
  // Repull of a sharded checkpoint `held` (its ledger entry): only the
  // files whose etag moved are pulled, and put in place over theirs as one
  // step (CheckpointRegistry::ReplaceShards), a new index last. The shards
  // must stay the same files: none added, dropped or renamed.
  absl::StatusOr<Repulled> RepullShards(const std::string& name, const CheckpointVersion& base, const Cached& held,
                                        const OriginCheckpoint& listed) ABSL_LOCKS_EXCLUDED(mu_);
  // Reads `checkpoint`'s files from the origin into partial files, resuming
  // what an earlier attempt at the same version left (of another version,
  // the files listed by the same path, size and strong etag); each is checked whole
  // and fsynced. `pulled` counts the bytes read.
  absl::Status Download(const std::string& name, const OriginCheckpoint& checkpoint, std::atomic<uint64_t>* pulled,
                        Staged* staged);
  struct Victim;
  // Reserves `bytes` under the budget for a pull of `name`, choosing what to
  // evict to make room: the least recently used not in use, moved out of the
  // ledger into `victims` for the caller to Evict. The in-use probes (a file
  // open and flock each) run outside mu_, which every hit's Touch takes; what
  // they chose is committed only if the ledger did not change meanwhile
  // (else chosen again, three times at most). ResourceExhausted, choosing
  // nothing, when evicting all that may go would not be enough.
  absl::Status Reserve(const std::string& name, uint64_t bytes, std::vector<Victim>* victims)
      ABSL_LOCKS_EXCLUDED(mu_, evict_mu_);
  // Unloads and removes `victims`. Outside mu_: unloading notifies the
  // registry's listeners.
  void Evict(std::vector<Victim>* victims) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets checkpoints whose files were replaced since they were pulled (a
  // push, an upload, an operator): no longer the cache's, never evicted.
  void ForgetReplaced() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The origin's version of `name` when its files are as this cache placed
  // them (FileVersion `file_version`); the registry's version ids (see
  // CheckpointRegistry::SetVersionIds).
  std::optional<std::string> OriginVersion(const std::string& name, const std::string& file_version) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The registry's listener: a pulled checkpoint the registry had to give
  // an id of its own (its files written in place, keeping every stat field)
  // no longer carries the origin's, in this run or the next.
  void OnServedChanged(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  // Nothing when a stream or a mapping uses a file of `name`; else, for each
  // of its files that is a regular file, its path and a descriptor holding an
  // exclusive flock (taken without waiting), so that no same-host process
  // maps one until they are dropped, and Evict removes that file only.
  std::optional<std::vector<std::pair<std::string, UniqueFd>>> Claim(const std::string& name,
                                                                     const Cached& cached) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // At Open, for a ledger entry `c` of `name` recorded while its files were
  // being placed: true (and `c` completed) when every file is in place and is
  // the one this cache placed; otherwise removes those that are, and false.
  // Files an operator put at those paths are never touched.
  bool FinishPlacing(const std::string& name, Cached* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // At Open: reads the ledger into ledger_, dropping entries whose files are
  // gone or were replaced (FinishPlacing those recorded while being placed).
  // Nothing on a first run or an unreadable ledger.
  void ReadLedger() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the size on disk of `c`'s files (one of ledger_'s) as its bytes.
  void Recount(Cached* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Before ReadLedger: a sharded checkpoint's step from S3 that a crash cut
  // between the renames of its shards is finished from the registry's record
  // (CheckpointRegistry::FinishInterruptedPublish), so that FinishPlacing
  // finds its files placed. (The registry's lock comes before mu_.)
  void FinishInterruptedSteps() ABSL_LOCKS_EXCLUDED(mu_);
  // Writes the ledger as it is now.
  absl::Status SaveLedger() ABSL_LOCKS_EXCLUDED(mu_, ledger_file_mu_);

  CheckpointRegistry* registry_;
  std::unique_ptr<Origin> origin_;
  const NodeCacheOptions options_;
  const std::string models_dir_, state_dir_;

  // One Reserve at a time: two choosing at once would each find the other's
  // claimed files in use. Not mu_, which hits take.
  absl::Mutex evict_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Flight>> flights_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Cached> ledger_ ABSL_GUARDED_BY(mu_);
  uint64_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of pulls in flight
  // Names the origin lacks (NotFound), or whose pull was refused for what
  // the origin holds (FailedPrecondition: too many files, a file in the
  // way): asked again only once `until` passes.
  struct Refusal {
    absl::Time until;
    absl::Status status;
  };
  absl::flat_hash_map<std::string, Refusal> not_found_ ABSL_GUARDED_BY(mu_);
  uint64_t ledger_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t last_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Mutex ledger_file_mu_ ABSL_ACQUIRED_AFTER(mu_);
  uint64_t ledger_written_ ABSL_GUARDED_BY(ledger_file_mu_) = 0;

  // What the registry's listener reaches; cleared by the destructor, which
  // so waits for a call in progress.
  struct ListenerTarget {
    absl::Mutex mu;
    NodeCache* cache ABSL_GUARDED_BY(mu) = nullptr;
  };
  std::shared_ptr<ListenerTarget> listener_target_ = std::make_shared<ListenerTarget>();
  uint64_t listener_id_ = 0;
  // Threads running a flight; shared with them (see PullAsync).
  struct Running {
    absl::Mutex mu;
    int threads ABSL_GUARDED_BY(mu) = 0;
  };
  const std::shared_ptr<Running> running_ = std::make_shared<Running>();
  // Checkpoints a follower's step is rewriting (BeginStep), and the bytes
  // reserved for their new versions (ReserveStep), released by EndStep.
  std::set<std::string> stepping_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> step_reserved_ ABSL_GUARDED_BY(mu_);
  // Set by Open with `follow`; stopped first by the destructor.
  std::unique_ptr<Follower> follower_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> bytes_pulled_{0}, pulls_{0}, pull_errors_{0}, hits_{0}, misses_{0}, evictions_{0};
};

}  // namespace weightstore::origin

#endif  // WEIGHTSTORE_ORIGIN_NODE_CACHE_H_

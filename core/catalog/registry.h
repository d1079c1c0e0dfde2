// CheckpointRegistry: the checkpoints under a models folder, by name (what
// weightstored serves and what a LocalStore reads).
//
// Every checkpoint under the models folder is served under its relative path
// without extension ("llama/7b" for llama/7b.safetensors); a sharded SafeTensors
// index ("x/model.safetensors.index.json") is one checkpoint ("x/model") and its
// shards are not served on their own. Rescan() picks up new, replaced and removed
// files; a replaced file becomes a new version, and holders of the old version
// (streams in flight) keep it, mapped and immutable, until they drop it.
// Thread-safe.
#ifndef WEIGHTSTORE_CORE_CATALOG_REGISTRY_H_
#define WEIGHTSTORE_CORE_CATALOG_REGISTRY_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/atomic_file.h"
#include "core/catalog/manifest.h"
#include "core/catalog/push.h"
#include "core/catalog/version_patches.h"
#include "core/checkpoint.h"
#include "core/checksum_cache.h"
#include "core/file_watcher.h"
#include "core/shm/segment_cache.h"

namespace weightstore {

// Seconds since the Unix epoch, now: a version's creation time.
int64_t NowUnixSeconds();

// One version of one served checkpoint. Immutable, except for the CRC cache and
// becoming stale: once one of its files is written in place, it may no longer
// be served (see CheckUnchanged).
class CheckpointVersion {
 public:
  // `file_version` identifies the files as opened (FileVersion); `version` is
  // the id clients see, the same unless the registry had to issue another.
  CheckpointVersion(std::string name, std::string path, std::shared_ptr<const Checkpoint> checkpoint,
                    std::string file_version, std::string version, int64_t loaded_at_unix_seconds)
      : name_(std::move(name)),
        path_(std::move(path)),
        checkpoint_(std::move(checkpoint)),
        file_version_(std::move(file_version)),
        version_(std::move(version)),
        loaded_at_(loaded_at_unix_seconds) {}

  const std::string& name() const { return name_; }
  // Where it was opened from (absolute, or as configured).
  const std::string& path() const { return path_; }
  // path() relative to the models folder, or to the load root it lies in: what
  // clients are told, so that no server path leaks.
  const std::string& relative_path() const { return relative_path_; }
  void SetRelativePath(std::string path) { relative_path_ = std::move(path); }
  const std::shared_ptr<const Checkpoint>& checkpoint() const { return checkpoint_; }
  // With digests kept (RegistryOptions::tensor_digests), its content's name
  // (ContentVersion, core/catalog/manifest.h): the same on every daemon and
  // across a touch or a copy. Without, a hash of the files' device, inode,
  // size, mtime and ctime (and, when a rewrite in place kept all of those, a
  // reopening count). Or the id its files were given (SetVersionIds). Never
  // the same for two contents of one name in one run.
  const std::string& version() const { return version_; }
  // FileVersion of the files as opened: what a rescan compares.
  const std::string& file_version() const { return file_version_; }
  int64_t loaded_at_unix_seconds() const { return loaded_at_; }
  // Bytes of this version held in sealed memory (preloaded); 0 when mapped from
  // its files.
  uint64_t preloaded_bytes() const { return preload_.bytes(); }
  // Keeps `reservation` (the preload's share of the memory budget) for as long
  // as this version lives. Called once, before the version is published.
  void HoldReservation(SegmentCache::Reservation reservation) { preload_ = std::move(reservation); }

  // Every tensor's digest (core/catalog/manifest.h), computed when the version was
  // opened; nullptr when the registry computes none (RegistryOptions).
  const std::shared_ptr<const CheckpointManifest>& manifest() const { return manifest_; }
  // Called once, before the version is published.
  void SetManifest(std::shared_ptr<const CheckpointManifest> manifest) { manifest_ = std::move(manifest); }

  // CRC32C of its tensors as served, by served-tensor plan (core/select/served.h).
  // Keeps a checksum only while CheckUnchanged() passes.
  const ChecksumCache& checksums() const { return checksums_; }

  // True once a file of this version is known to have been written in place
  // (reported by the registry's file watcher, or seen by CheckUnchanged).
  bool stale() const;
  // Marks it stale. Returns false if it already was.
  bool MarkModified() const;
  // OK while the bytes this version serves are those it opened: none of its
  // mapped files was written or truncated in place. Otherwise Aborted naming
  // the file, and the version becomes stale and asks the registry to reopen it.
  // Readers of mapped bytes call it before vouching for them (a checksum).
  absl::Status CheckUnchanged() const;
  // Called once, when CheckUnchanged first finds a change. Set before the
  // version is published.
  void SetOnStale(std::function<void()> on_stale) { on_stale_ = std::move(on_stale); }

 private:
  std::string name_, path_, relative_path_;
  std::shared_ptr<const Checkpoint> checkpoint_;
  std::string file_version_, version_;
  int64_t loaded_at_;
  SegmentCache::Reservation preload_;
  std::shared_ptr<const CheckpointManifest> manifest_;
  std::function<void()> on_stale_;
  mutable std::atomic<bool> modified_{false};
  ChecksumCache checksums_{[this] { return CheckUnchanged(); }};
};

struct RegistryOptions {
  // Folder scanned for checkpoints. Required.
  std::string models_dir;
  OpenOptions open;
  // Longest checkpoint name, in requests and in the models folder.
  // Default: 512 bytes.
  size_t max_name_bytes = 512;
  // Largest upload accepted by Put. Default: 64 GiB.
  uint64_t max_put_bytes = uint64_t{64} << 30;
  // Largest element patch a push may send for one tensor (held in memory
  // while it arrives), checked from its header before anything is allocated.
  // Default: 1 GiB.
  uint64_t max_push_patch_bytes = uint64_t{1} << 30;
  // Folders besides models_dir whose files Load() may serve (after resolving
  // symlinks). Default: none.
  std::vector<std::string> load_roots;
  // A rescan removes upload temporaries no writer holds (left by a killed
  // daemon) once they are this old. Default: 60 s.
  int64_t abandoned_temporary_seconds = 60;
  // Watch served files (inotify): one written in place stops being served and
  // is reopened as a new version, `watch_settle` after its writer pauses.
  // Default: off (the daemon turns it on).
  bool watch_files = false;
  std::chrono::milliseconds watch_settle{200};
  // Read every checkpoint (preload_all) or the named ones into sealed memory
  // when loaded, instead of mapping their files: for models on network storage.
  // The memory is reserved from `shm`, which must then be set; a checkpoint that
  // does not fit is not served (the scan reports it). Default: off.
  bool preload_all = false;
  std::set<std::string> preload;
  SegmentCache* shm = nullptr;
  // Digest every tensor of each version as it is opened (core/catalog/manifest.h), for
  // weight updates: watch events name the tensors that changed, and a fetch
  // since an earlier version sends only those. Costs one read of every byte at
  // load. Default: off (the daemon turns it on).
  bool tensor_digests = false;
  // Manifests kept per checkpoint, the current version's included: the
  // versions a delta can start from. Default: 8.
  size_t kept_versions = 8;
  // Bytes all kept manifests may hold; past it the oldest earlier versions'
  // are dropped first (a current version's never). Default: 256 MiB.
  uint64_t kept_manifest_bytes = uint64_t{256} << 20;
  // Bytes the element patches between consecutive versions may hold, all
  // checkpoints together (core/catalog/version_patches.h): when a version
  // replaces another (a rescan, a push) the changed tensors are diffed while
  // both are mapped, and a client that holds an earlier version gets patches
  // for them. Past the bound the oldest steps go first; a checkpoint keeps at
  // most kept_versions - 1 steps. Needs tensor_digests. 0: off (the default;
  // the daemon turns it on). The patches composed from them for clients
  // several versions behind (PatchCompositions) may hold as much again,
  // counted while cached or being sent; one that does not fit is not made
  // and its tensor goes whole.
  uint64_t kept_patch_bytes = 0;
  // Called after every attempt to open a checkpoint version (metrics).
  std::function<void(const std::string& name, double seconds, const absl::Status& status)> on_load;
};

struct ScanReport {
  std::vector<std::string> added, replaced, removed;
  // Files that could not be served, with the reason ("path: message").
  std::vector<std::string> errors;
  // Abandoned upload temporaries removed.
  std::vector<std::string> cleaned;
  // Publishes a crash interrupted, finished ("index: n files renamed").
  std::vector<std::string> rolled_forward;
  // Indexes held at what is served (or unserved) by a publishing record
  // that could not be finished: an operator must look (docs/updates.md).
  std::vector<std::string> held_back;
};

// What the last scan left, for metrics: the errors it reported (the files it
// could not serve among them), and the checkpoints publishing records hold
// back.
struct ScanHealth {
  uint64_t errors = 0;
  uint64_t held_back = 0;
};

// An upload in progress: bytes go to a temporary sibling of the final file.
class PutSession {
 public:
  absl::Status Append(absl::string_view data);
  const std::string& name() const { return name_; }
  uint64_t bytes() const { return bytes_; }
  // CRC32C of the bytes appended so far.
  uint32_t crc32c() const { return crc32c_; }

 private:
  friend class CheckpointRegistry;
  std::string name_, path_;
  uint64_t expected_size_ = 0, max_bytes_ = 0, bytes_ = 0;
  uint32_t crc32c_ = 0;
  std::unique_ptr<AtomicFile> file_;
};

// True for an id a version may take from elsewhere (SetVersionIds, a
// follower's push): 1 to 64 bytes of [0-9A-Za-z._-].
bool ValidVersionId(absl::string_view id);

class CheckpointRegistry {
 public:
  explicit CheckpointRegistry(RegistryOptions options);
  ~CheckpointRegistry();

  // Scans the models folder and updates what is served.
  ScanReport Rescan();

  // Returns the current version of `name`, or nullptr.
  std::shared_ptr<const CheckpointVersion> Get(const std::string& name) const;
  // The current version of `name`: InvalidArgument for a name no checkpoint can
  // have (CheckCheckpointName), NotFound when it is not served, Unavailable
  // while it is stale (written in place, being reopened), Aborted when
  // `pinned_version` is given and is no longer the current one.
  absl::StatusOr<std::shared_ptr<const CheckpointVersion>> Find(const std::string& name,
                                                                const std::string& pinned_version = "") const;
  // Every served checkpoint, sorted by name.
  std::vector<std::shared_ptr<const CheckpointVersion>> List() const;

  // Serves the file or folder at `path` (relative paths resolve against the
  // models folder) as `name` (derived from the path when empty). The path,
  // symlinks resolved, must lie in the models folder or a load root, else
  // PermissionDenied. Checkpoints loaded from a load root survive rescans.
  absl::StatusOr<std::shared_ptr<const CheckpointVersion>> Load(const std::string& path, const std::string& name);
  // Load(), unless `name` is served already (AlreadyExists, and nothing is
  // opened): checked and published under the scan lock, so that an upload or
  // a rescan serving the name meanwhile is never replaced.
  absl::StatusOr<std::shared_ptr<const CheckpointVersion>> LoadIfAbsent(const std::string& path,
                                                                        const std::string& name);
  // Stops serving `name`. Returns NotFound if it is not served. A checkpoint in
  // the models folder comes back at the next rescan unless its file is removed.
  absl::Status Unload(const std::string& name);

  // Starts an upload of <models>/<name>.<extension>. Returns InvalidArgument for a
  // name that is not a relative path inside the folder or an unknown extension,
  // AlreadyExists unless `overwrite`.
  absl::StatusOr<std::unique_ptr<PutSession>> BeginPut(const std::string& name, const std::string& extension,
                                                       bool overwrite, uint64_t expected_size);
  // Checks the upload is a valid checkpoint, then commits and serves it. On error
  // nothing is left behind.
  absl::StatusOr<std::shared_ptr<const CheckpointVersion>> FinishPut(std::unique_ptr<PutSession> session);

  // Starts a push (core/catalog/push.h): a new version of `name` from its current
  // version, options.base_version, and the tensors pushed. NotFound for a name
  // not served, Aborted when the base is no longer current, FailedPrecondition
  // for a checkpoint a push cannot rewrite (a multi-file index, a format
  // without a writer, one loaded from a load root), InvalidArgument for a
  // removed tensor the base lacks.
  absl::StatusOr<std::unique_ptr<PushSession>> BeginPush(const std::string& name, PushOptions options);
  // Writes the whole checkpoint in the base's format, atomically, over its
  // file, and publishes it as the new version (digests of unchanged tensors
  // taken from the base's). Aborted, publishing nothing, if the base was
  // replaced meanwhile. On error nothing is left behind.
  absl::StatusOr<std::shared_ptr<const CheckpointVersion>> FinishPush(std::unique_ptr<PushSession> session);

  // Publishes the file at `path` (on the models folder's filesystem) as the
  // next version after `base`, renamed over base's file, under `version_id`
  // (empty: the registry's own id): a node cache following an origin that
  // serves whole files. As FinishPush: it must open first, and nothing is
  // renamed unless `base` is still served and its file unchanged (Aborted);
  // FailedPrecondition for a base served from several files or a load root.
  // Element patches from `base` are kept for its clients. `what` starts
  // every error ("following 'm' from s3://...").
  absl::StatusOr<std::shared_ptr<const CheckpointVersion>> ReplaceFile(const CheckpointVersion& base,
                                                                       const std::string& path,
                                                                       const std::string& version_id,
                                                                       absl::string_view what);
  // ReplaceFile for a sharded checkpoint: each `replacements` pair is a new
  // file (on the models folder's filesystem) and the shard of `base`, or
  // its index, that it replaces; the other files stay. A new index must name
  // the same shards (tensors may be added, removed or moved between them).
  // The files are moved beside those they replace and renamed into place as
  // one step, as a sharded push's, the index last (a crash between the
  // renames is finished by the next scan or load). No replacements publish
  // the same files under `version_id` (an origin's new id for bytes it
  // uploaded again). FailedPrecondition for a base that is no sharded
  // checkpoint of the models folder, a path that is none of its files, or a
  // new index naming other shards.
  absl::StatusOr<std::shared_ptr<const CheckpointVersion>> ReplaceShards(
      const CheckpointVersion& base, const std::vector<std::pair<std::string, std::string>>& replacements,
      const std::string& version_id, absl::string_view what);
  // Finishes the publish a crash interrupted beside the index at
  // `index_path`, if its record is there (RollForwardPublishing). False, with
  // the reason in `error`, when a record is there that cannot be finished.
  bool FinishInterruptedPublish(const std::string& index_path, std::string* error) ABSL_LOCKS_EXCLUDED(scan_mu_);

  // The manifest of `name` at `version`: the current one's, or a kept earlier
  // one's. nullptr when it is not kept (or digests are off).
  std::shared_ptr<const CheckpointManifest> FindManifest(const std::string& name, const std::string& version) const;

  // The element patches that bring `name` from version `since` to version
  // `to` (core/catalog/version_patches.h), when every step between is kept;
  // nullptr otherwise (patches off, a version that arrived without them, or
  // steps dropped for the bounds).
  std::shared_ptr<const PatchChain> FindPatches(const std::string& name, const std::string& since,
                                                const std::string& to) const;
  // What the chains' compositions hold and did (PatchCompositions).
  PatchCompositions::Stats CompositionStats() const { return compositions_->stats(); }
  // The errors of the last Rescan, and the indexes held back now: by a
  // publishing record a scan, a publish or a load could not finish, until it
  // is finished or gone (ScanHealth).
  ScanHealth LastScan() const ABSL_LOCKS_EXCLUDED(held_mu_);
  // Files pushes (and followers' steps) wrote, by how: the base's file
  // cloned (shared extents) or copied in the kernel with the changed tensors
  // written over it, or written whole (CheckpointWriter::SetCloneSource).
  struct PushWrites {
    uint64_t cloned = 0, copied = 0, whole = 0;
  };
  PushWrites PushWriteStats() const {
    return {files_cloned_.load(std::memory_order_relaxed), files_copied_.load(std::memory_order_relaxed),
            files_whole_.load(std::memory_order_relaxed)};
  }

  // Calls `listener` with a checkpoint's name after each change of what is
  // served under it (added, replaced, removed), on the thread that made it and
  // outside the registry's locks; it may call the registry, and must be quick.
  // Listeners are called in no particular order across names. Returns an id
  // for RemoveListener. A call that began before RemoveListener may still be
  // running after it: what a listener uses must outlive that (hold it by
  // shared_ptr).
  uint64_t AddListener(std::function<void(const std::string& name)> listener);
  void RemoveListener(uint64_t id);

  // Ids a version takes from elsewhere: `ids(name, file_version)` returns the
  // id of files exactly as someone placed them (a node cache: the origin's
  // version, so that it carries over), or nullopt for the registry's own. An
  // id must be 1 to 64 bytes of [0-9A-Za-z._-] and never name two contents of
  // one checkpoint; one that is not is ignored. Called while a version opens,
  // with no registry lock but this setter's held: `ids` must not call the
  // registry. Replacing or clearing it (empty) waits for calls in progress.
  using VersionIds =
      std::function<std::optional<std::string>(const std::string& name, const std::string& file_version)>;
  void SetVersionIds(VersionIds ids) ABSL_LOCKS_EXCLUDED(ids_mu_);

  const RegistryOptions& options() const { return options_; }

 private:
  // A new file of a checkpoint: written beside the base's file it replaces,
  // under a temporary's name.
  struct NewFile {
    std::string path;
    int fd = -1;           // open on it
    std::string replaces;  // the base's file (a single-file checkpoint's, or one shard)
  };
  // A checkpoint's new files, and what their publication is checked against.
  struct Replacement {
    std::vector<NewFile> files;  // in the order they are renamed; a sharded one's index is never among them
    std::string version_id;
    std::optional<std::vector<ManifestTensor>> expected;
    std::vector<ManifestTensor> known;                                        // digests known of its tensors
    const absl::flat_hash_map<std::string, ElementPatch>* patches = nullptr;  // from the base, known
    std::string what;                                                         // starts every error
  };
  // FinishPush's and ReplaceFile's end: opens the new version from `r`'s
  // files (and the base's unchanged shards, mapped once for both), names it,
  // then under the scan lock checks that `base` is still served and
  // unchanged, renames `r`'s files over the base's (*renamed counts them) and
  // publishes it with patches from `base`. More than one file is renamed
  // under a publishing record (PublishingRecordPath), so that a crash between
  // the renames is rolled forward by the next scan, never served as a mix.
  absl::StatusOr<std::shared_ptr<const CheckpointVersion>> PublishOver(const CheckpointVersion& base, Replacement r,
                                                                       size_t* renamed);
  // Finishes the renames of a publish that a crash interrupted, from the
  // record at `record` (a hidden file beside the checkpoint's index), then
  // removes the record; what it did goes into `report`. A record that does
  // not describe this daemon's step from the files on disk is refused (an
  // error in `report`) and nothing is renamed: false, and then the index is
  // neither opened nor its folder's temporaries removed until an operator
  // has looked (the files may hold a mix). A record of a step that renamed
  // nothing yet, over files that are no longer its base, is dropped. Called
  // with the scan lock held. Counts the index as held back (LastScan) while
  // its record cannot be finished.
  bool RollForwardPublishing(const std::string& record, ScanReport* report) ABSL_EXCLUSIVE_LOCKS_REQUIRED(scan_mu_);
  bool FinishPublishingRecord(const std::string& record, ScanReport* report) ABSL_EXCLUSIVE_LOCKS_REQUIRED(scan_mu_);
  struct Entry {
    std::shared_ptr<const CheckpointVersion> current;
    // Loaded by path from where no scan looks (a load root, a hidden folder
    // of the models folder): kept across rescans.
    bool pinned = false;
    // Loaded from a load root, outside the models folder: never written.
    bool outside_models = false;
  };
  // Opens `path` as a new version of `name`. `previous`, when it is the stale
  // version being replaced, keeps the new one from reusing its id.
  absl::StatusOr<std::shared_ptr<const CheckpointVersion>> OpenVersion(
      const std::string& name, const std::string& path, const CheckpointVersion* previous = nullptr) const;
  absl::StatusOr<std::shared_ptr<const CheckpointVersion>> OpenVersionUntimed(const std::string& name,
                                                                              const std::string& path,
                                                                              const CheckpointVersion* previous) const;
  // Sets what every version has besides its files, before it is published:
  // its relative path, and how it asks to be reopened once stale.
  void Prepare(CheckpointVersion* version) const;
  // `path` relative to the models folder or the load root it lies in (its file
  // name alone if neither).
  std::string RelativePath(const std::string& path) const;
  // Watches the files of `version`, just published as `name`. Returns an error
  // line for the scan report, or "".
  std::string Watch(const std::string& name, const CheckpointVersion& version);
  // The file watcher's report: `names` were written in place.
  void OnFilesModified(const std::set<std::string>& names);
  // Records that `name` now serves `version` (nullptr: nothing), keeping its
  // manifest and `patches` (from the version it replaces; nullptr: none, and
  // the chain of steps to it is broken) within the bounds.
  void Published(const std::string& name, const CheckpointVersion* version,
                 std::shared_ptr<const VersionPatches> patches = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The patches from `from` (may be null) to `to`, diffed while both are
  // mapped (`known` ones taken as they are: DiffVersions); nullptr when
  // patches are off, either has no manifest, or `from`'s files changed in
  // place.
  std::shared_ptr<const VersionPatches> PatchesBetween(
      const CheckpointVersion* from, const CheckpointVersion& to,
      const absl::flat_hash_map<std::string, ElementPatch>* known = nullptr) const;
  // Tells the listeners about `names`. Called without mu_ or scan_mu_.
  void Notify(const std::vector<std::string>& names);
  // Collects names and tells the listeners about them when it goes out of
  // scope: declared before a scan lock, that is after the lock is released.
  class NotifyOnExit {
   public:
    explicit NotifyOnExit(CheckpointRegistry* registry) : registry_(registry) {}
    ~NotifyOnExit() { registry_->Notify(names_); }
    void Add(const std::string& name) { names_.push_back(name); }

   private:
    CheckpointRegistry* registry_;
    std::vector<std::string> names_;
  };
  // Load(), with scan_mu_ held; the name published goes to `notify`.
  absl::StatusOr<std::shared_ptr<const CheckpointVersion>> LoadLocked(const std::string& path, const std::string& name,
                                                                      NotifyOnExit* notify)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(scan_mu_);

  // The id `name` takes for files at `file_version` from version_ids_, if any.
  std::optional<std::string> TakenId(const std::string& name, const std::string& file_version) const
      ABSL_LOCKS_EXCLUDED(ids_mu_);

  RegistryOptions options_;
  mutable absl::Mutex ids_mu_;
  VersionIds version_ids_ ABSL_GUARDED_BY(ids_mu_);
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> served_ ABSL_GUARDED_BY(mu_);
  // Manifests of the versions each name served, oldest first, the current last.
  std::map<std::string, std::deque<std::shared_ptr<const CheckpointManifest>>> kept_ ABSL_GUARDED_BY(mu_);
  uint64_t kept_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Patches between each name's consecutive versions, oldest first, each
  // step's `to` the next one's `from`, the last one's `to` the current version.
  std::map<std::string, std::deque<std::shared_ptr<const VersionPatches>>> patches_ ABSL_GUARDED_BY(mu_);
  // What the chains FindPatches hands out compose, shared per (name, since,
  // version, tensor) and bounded by kept_patch_bytes of its own.
  const std::shared_ptr<PatchCompositions> compositions_;
  uint64_t patch_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  mutable absl::Mutex listeners_mu_;
  std::map<uint64_t, std::shared_ptr<const std::function<void(const std::string&)>>> listeners_
      ABSL_GUARDED_BY(listeners_mu_);
  uint64_t next_listener_ ABSL_GUARDED_BY(listeners_mu_) = 1;
  absl::Mutex scan_mu_;                                                       // one scan at a time
  std::atomic<uint64_t> last_errors_{0};                                      // LastScan()
  std::atomic<uint64_t> files_cloned_{0}, files_copied_{0}, files_whole_{0};  // PushWriteStats()
  mutable absl::Mutex held_mu_;
  std::set<std::string> held_back_ ABSL_GUARDED_BY(held_mu_);  // index paths
  // Reopened versions whose file identity did not change get a new version
  // string all the same, mixed with this; it starts at a random value, so
  // that another run (whose ids a node may have kept) issues others.
  mutable std::atomic<uint64_t> reopen_generation_;
  std::string watch_error_;               // why files are not watched, reported by Rescan once
  std::shared_ptr<FileWatcher> watcher_;  // last: stopped first
};

// One file a checkpoint version is stored in (StoredFiles).
struct StoredFile {
  // The main file (the one the checkpoint is served from: an index, or its
  // only file) lies at the name plus this suffix (".safetensors"); a shard is
  // its file name, in the main file's folder.
  std::string path;
  std::string local_path;  // where it is on this machine
  bool main = false;
  uint64_t size = 0;
  // The version's mapping of it; nullptr for an index or a file beside, which
  // are read by path.
  const MappedFile* mapped = nullptr;
  // A file beside the checkpoint that serving it reads (its quantization
  // config: QuantizationConfig::kFileNames), by its file name in the main
  // file's folder. Not one of the version's files: its bytes may change
  // while the version stays.
  bool beside = false;
};

// The files `version` is stored in, as stored, its main file last: what a node
// pulling from this daemon copies. For a checkpoint not served from a file at
// its name (a hub snapshot: a node keeps it in a folder of its own), the
// quantization configs in its folder (regular files, symlinks followed, of at
// most QuantizationConfig::kMaxFileBytes) come first, beside. FailedPrecondition
// for a version held in memory (preloaded) or whose shards lie outside its
// index's folder.
absl::StatusOr<std::vector<StoredFile>> StoredFiles(const CheckpointVersion& version);

// Returns the version string of the file(s) behind `path`: a hash of device,
// inode, size, mtime and ctime (for an index, of the index and its shards).
absl::StatusOr<std::string> FileVersion(const std::string& path);

// Where a new file that is to replace `path` is written: beside it, named as
// an AtomicFile temporary (a rescan neither serves it nor, while it is young
// or locked, removes it), with a random part so that a name does not recur
// across restarts (pids do, in a container).
std::string NewFilePathBeside(const std::string& path);

// The paths of the files the index at `path` names (nothing for a file that
// is no index, or one that does not parse).
std::set<std::string> FilesOfIndex(const std::string& path);

// Where a push to the sharded checkpoint of `index_path`, or a follower's
// step, records the files it renames into place (".<index>.publishing",
// hidden beside it) while it does: a line a shard, and one for the index
// when a new one naming the same shards comes last, "<new file>\t<file>\t
// <new file's inode>\t<file's inode>\t<file's size>\t<file's mtime in ns>".
// A scan that finds one finishes the renames.
inline constexpr absl::string_view kPublishingRecordSuffix = ".publishing";
std::string PublishingRecordPath(const std::string& index_path);

// Returns OK if `name` can name a served checkpoint: 1 to `max_bytes` bytes of
// UTF-8 without control characters. Otherwise InvalidArgument showing the name
// escaped and shortened, so it is safe to echo in logs and trailers.
absl::Status CheckCheckpointName(absl::string_view name, size_t max_bytes);

// True when `name` is a path this daemon may create under its models folder
// (an upload, a load, a pulled file): 1 to `max_bytes` bytes of ASCII letters,
// digits, '-', '_', '.' and '/', relative, with no empty, ".", ".." or hidden
// part, and no part over 255 bytes.
bool IsPlaceableName(absl::string_view name, size_t max_bytes);

// True when `name` may be given to a checkpoint loaded by path (Load): a
// placeable name, or a hub revision of one ("acme/tiny@v1.0",
// "acme/tiny@refs/pr/1", core/catalog/hub_cache.h): two placeable names
// joined by one '@'.
bool IsLoadableName(absl::string_view name, size_t max_bytes);

// Returns the served name of a checkpoint file relative to the models folder, or
// nullopt if the file is not a checkpoint by its extension.
std::optional<std::string> NameForPath(const std::string& relative_path);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_CATALOG_REGISTRY_H_

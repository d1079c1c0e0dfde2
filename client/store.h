// Store: one interface to checkpoints wherever they are. LocalStore reads files
// in this process through core; RemoteStore talks to weightstored over gRPC;
// SharedMemoryStore maps the daemon's segments through its same-host socket.
// Both take the same Query (selection, optional target), so code written against
// one works against the other.
//
// Fetched bytes are written straight into the buffer a TensorSink hands out, so
// no whole-tensor copy sits between the source and the caller's memory.
#ifndef WEIGHTSTORE_CLIENT_STORE_H_
#define WEIGHTSTORE_CLIENT_STORE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "core/checkpoint.h"
#include "core/element_patch.h"
#include "core/host_buffer.h"
#include "core/mapped_file.h"
#include "core/select/apply.h"
#include "core/select/selection.h"
#include "core/select/slice.h"
#include "core/select/snapshot.h"
#include "core/tensor.h"

namespace weightstore::client {

struct CheckpointSummary {
  std::string name;
  std::string format;     // "safetensors", "pytorch", "burnpack"
  std::string container;  // "zip", "legacy", ... (may be empty)
  std::string path;
  uint64_t total_bytes = 0;
  uint64_t tensor_count = 0;
  Metadata metadata;
  std::string version;
  int64_t loaded_at_unix_seconds = 0;
  // QuantizationConfig::Describe() of the config beside it; empty: none.
  std::string quantization;
  // On a node that follows this checkpoint's origin (weightstored --follow),
  // over gRPC: how it stands against the origin.
  struct Following {
    std::string upstream;          // "grpc://host:port", "s3://bucket/prefix"
    std::string upstream_version;  // the origin's newest version as last seen
    uint64_t lag_versions = 0;     // announced, not applied yet
    double lag_seconds = 0;        // since the oldest of those (0 when current)
    bool upstream_connected = false;
    std::string blocked;  // why its steps cannot succeed; empty when they can
  };
  std::optional<Following> follow;
};

// What to read: burn-store's selection and, optionally, a target to load into.
struct Query {
  SelectionOptions selection;
  std::optional<TargetSchema> target;
  bool allow_partial = false;
  // Compute (or fetch) each tensor's CRC32C in listings. Default: false.
  bool with_checksums = false;
  // Serve exactly this checkpoint version (a listing's `version`), or fail
  // with ABORTED once it was replaced: a listing and the fetch that follows it
  // then describe the same bytes. Default: empty, the current version.
  std::string version;
  // When set (by another thread), a fetch stops before its next tensor and
  // returns Cancelled. Default: none.
  std::shared_ptr<const std::atomic<bool>> cancel;
  // The version the caller holds (weight updates): listings mark the tensors
  // unchanged since, and a fetch leaves them out (MapTensors maps only the
  // others). A version the daemon keeps no digests of makes every tensor
  // changed (TensorListing::delta says so). The remote and socket stores
  // honour it; the local store lists and sends every tensor as changed.
  // Default: empty, off.
  std::string since_version;
  // With since_version, from a remote or socket store: a changed tensor the
  // daemon keeps an element patch of (docs/updates.md) arrives as that patch
  // (through TensorSink::BeginPatch; MapTensors maps it, in
  // MappedTensors::patches), for a caller that holds the tensor at
  // since_version. Default: off.
  bool patches = false;
  // A fetch that copies out of a mapping (a socket store's segments, a local
  // store's mapped files) drops this process's mappings of the whole pages it
  // copied, piece by piece as it copies, so a copy of a checkpoint never holds
  // the checkpoint in this process's RSS beside it. The pages stay in the
  // page cache or the daemon's segment; a later read of the same mapping maps
  // them again (minor faults). Default: off.
  bool release_source_pages = false;
};

struct TensorDescription {
  TensorSpec spec;          // as served (after renaming, casting and slicing)
  std::string source_name;  // name in the file
  std::optional<uint32_t> crc32c;
  // When part of the tensor is served (a shard or slice): the whole tensor's
  // shape (after any transpose) and the part. Both empty otherwise.
  std::vector<uint64_t> unsliced_shape;
  TensorSlice slice;
  // The source tensor's digest (core/catalog/manifest.h), when the daemon computes them.
  std::string digest;
  // With Query::since_version: the same as in that version.
  bool unchanged = false;
  // With Query::patches: the tensor came as an element patch, not as bytes
  // (through a socket: MappedTensors::patches).
  bool patched = false;
  // A scale served as its weight's shard asks (ShardSpec::scales): the
  // weight's name, and whether a block it serves is shared with another rank.
  std::string scale_of;
  bool shares_scale_blocks = false;
  std::vector<uint64_t> scale_block;  // weight elements per scale element
  // A weight its checkpoint's quantization config describes (SnapshotTensor).
  std::string quantization;
};

// A snapshot's tensor as a listing describes it (no checksum).
TensorDescription Describe(const SnapshotTensor& tensor);

// How a listing used Query::since_version.
struct DeltaInfo {
  std::string since_version;
  // True: `unchanged` marks what the caller holds. False: every tensor is to be
  // fetched, for `full_reason`.
  bool delta = false;
  std::string full_reason;
  uint64_t changed_tensors = 0, unchanged_tensors = 0;
  // With Query::patches: why changed tensors come whole
  // because no element patches from since_version are kept (empty if they are).
  std::string patch_reason;
};

struct TensorListing {
  std::string version;
  std::vector<TensorDescription> tensors;
  std::optional<ApplyResult> apply_result;  // with a target
  std::optional<DeltaInfo> delta;           // with Query::since_version
};

// Where fetched tensors go. Begin() (or BeginPatch()) may be called again for
// the tensor begun last, whose transfer restarted, while it is the only one
// open; the previous buffer is then abandoned. Calls come one at a time and in order, but not necessarily
// on the thread that called the store (a remote store copies on a helper
// thread; see RemoteOptions::pipeline).
class TensorSink {
 public:
  virtual ~TensorSink() = default;
  // Returns the destination for `spec`'s bytes (exactly spec.byte_size() long).
  virtual absl::StatusOr<std::span<std::byte>> Begin(const TensorSpec& spec) = 0;
  // Called once the tensor's bytes are complete and verified.
  virtual absl::Status End(const TensorSpec& spec) = 0;
  // With Query::patches: returns the destination for an element patch of
  // `spec` (`header` without its body) of `bytes` bytes (less than the
  // tensor's), whose digest once applied is `digest`. Default: Unimplemented.
  virtual absl::StatusOr<std::span<std::byte>> BeginPatch(const TensorSpec& spec, const ElementPatch& header,
                                                          uint64_t bytes, const std::string& digest);
  // Called once the patch's bytes are complete and their CRC32C verified.
  virtual absl::Status EndPatch(const TensorSpec& spec);
  // How many tensors may be begun before the first of them ends, their bytes
  // then written at once on several threads (a store that copies in
  // batches); End comes in Begin's order all the same. The spans Begin hands
  // out meanwhile must not overlap, and stay valid until their End. Default
  // 1: one tensor at a time.
  virtual size_t OpenAhead() const { return 1; }
  // Called with the version whose tensors are sent, once it is known
  // (before the first tensor, or at the end of a selection of none), where
  // the store can tell. Default: ignored.
  virtual void OnVersion(const std::string& version) {}
};

// An element patch received for a tensor, and the digest (32 hex digits) its
// result must have.
struct ReceivedPatch {
  TensorSpec spec;
  std::string digest;
  ElementPatch patch;
};

// Collects tensors into HostBuffers (2 MiB-aligned, huge-page backed).
class CollectingSink : public TensorSink {
 public:
  // With `cancel`: Begin() returns Cancelled once it is set. With
  // `take_patches` (a fetch that asked for them) element patches are
  // collected in patches(); else one is DataLoss: a caller of tensors()
  // alone would otherwise lose that tensor without a word.
  explicit CollectingSink(std::shared_ptr<const std::atomic<bool>> cancel = nullptr, bool take_patches = false)
      : cancel_(std::move(cancel)), take_patches_(take_patches) {}
  CollectingSink(const CollectingSink&) = delete;
  CollectingSink& operator=(const CollectingSink&) = delete;
  CollectingSink(CollectingSink&&) = default;
  CollectingSink& operator=(CollectingSink&&) = default;
  absl::StatusOr<std::span<std::byte>> Begin(const TensorSpec& spec) override;
  absl::Status End(const TensorSpec& spec) override;
  // Collects patches too, in patches(), when constructed to take them.
  absl::StatusOr<std::span<std::byte>> BeginPatch(const TensorSpec& spec, const ElementPatch& header, uint64_t bytes,
                                                  const std::string& digest) override;
  absl::Status EndPatch(const TensorSpec& spec) override;
  // Tensors it lets a store begin ahead (their buffers are allocated at
  // Begin either way). A subclass that keeps state per tensor begun returns
  // 1 instead.
  static constexpr size_t kOpenAhead = 1024;
  size_t OpenAhead() const override { return kOpenAhead; }
  void OnVersion(const std::string& version) override { version_ = version; }
  std::vector<SharedTensor>& tensors() { return tensors_; }
  std::vector<ReceivedPatch>& patches() { return patches_; }
  // The version sent (empty: the store did not tell).
  const std::string& version() const { return version_; }

 private:
  std::shared_ptr<const std::atomic<bool>> cancel_;
  std::string version_;
  bool take_patches_ = false;
  // Tensors begun and not yet ended, oldest first: their names and buffers;
  // with current_patch_, the one open entry is that patch's.
  std::deque<std::pair<std::string, HostBuffer>> open_;
  std::optional<ReceivedPatch> current_patch_;
  std::vector<SharedTensor> tensors_;
  std::vector<ReceivedPatch> patches_;
};

// Writes each tensor into memory the caller holds for it (`places`, by
// served name) when that memory is of the tensor's dtype and shape, and
// collects every other tensor as CollectingSink does: what loading into a
// model's parameters is made of, with no copy between the source and the
// parameter. The caller keeps the places alive, and unread by anyone else,
// until the fetch returns. A fetch that fails may have written some places
// (written_any() says whether).
class PlacingSink final : public TensorSink {
 public:
  struct Place {
    DType dtype = DType::kU8;
    std::vector<uint64_t> shape;
    std::span<std::byte> bytes;  // exactly the byte size of dtype and shape
  };
  explicit PlacingSink(absl::flat_hash_map<std::string, Place> places,
                       std::shared_ptr<const std::atomic<bool>> cancel = nullptr)
      : places_(std::move(places)), cancel_(cancel), rest_(std::move(cancel)) {}
  absl::StatusOr<std::span<std::byte>> Begin(const TensorSpec& spec) override;
  absl::Status End(const TensorSpec& spec) override;
  size_t OpenAhead() const override { return rest_.OpenAhead(); }
  void OnVersion(const std::string& version) override { rest_.OnVersion(version); }

  // The served names written into their places, in the order they came.
  const std::vector<std::string>& placed() const { return placed_; }
  // Whether any place was handed out to be written (a failed fetch may have
  // written it in part).
  bool written_any() const { return written_any_; }
  // What had no place, or one of another dtype or shape, and the version.
  CollectingSink& rest() { return rest_; }
  // After a fetch that returned OK: whether it delivered exactly the tensors
  // `listing` names (less those it left unchanged), each once, with its
  // listed dtype and shape. DataLoss naming the first that was not: what a
  // daemon's bug or a forged stream sends, placed or not.
  absl::Status CheckDelivered(const TensorListing& listing);

 private:
  absl::flat_hash_map<std::string, Place> places_;
  std::shared_ptr<const std::atomic<bool>> cancel_;
  CollectingSink rest_;
  std::vector<std::string> placed_;
  // Whether `place` overlaps an open place but the one starting at `skip`
  // (may be null), or a deferred one.
  bool Overlaps(std::span<const std::byte> place, const std::byte* skip) const;

  // The tensors begun and not yet ended, oldest first; the places among
  // them that hold bytes, by start address (to end), for the overlap check.
  struct OpenTensor {
    std::string name;
    bool placed = false;  // else in rest_
    std::span<std::byte> place;
  };
  std::deque<OpenTensor> open_;
  std::map<const std::byte*, const std::byte*> open_places_;
  // Places whose tensor went to rest_ for overlapping an open one: a later
  // tensor over any of them goes there too, so the caller's copies (after
  // the fetch, in order) leave what one tensor at a time would. [start, end).
  std::vector<std::pair<const std::byte*, const std::byte*>> deferred_places_;
  bool written_any_ = false;
};

// A change of what a daemon serves, relative to what the watcher holds
// (WatchCheckpoints in proto/weightstore/v1/weight_store.proto).
struct CheckpointEvent {
  enum class Kind { kAdded, kReplaced, kRemoved, kSynced };
  Kind kind = Kind::kSynced;
  std::string name, old_version, new_version;
  // kReplaced: the tensor lists are known, and a fetch with since_version =
  // old_version sends only what changed. Else fetch in full, for full_reason.
  bool delta = false;
  std::string full_reason;
  // By file name; empty with names_omitted when there were too many to send.
  std::vector<std::string> changed, added, removed;
  uint64_t changed_count = 0, added_count = 0, removed_count = 0, unchanged_count = 0;
  bool names_omitted = false;
};

struct WatchOptions {
  // One checkpoint by name, or every one whose name starts with `prefix`.
  std::string name, prefix;
  // The versions the caller holds: events start from them.
  std::map<std::string, std::string> known;
  // Set by another thread to end the watch (Cancelled) within about 20 ms.
  std::shared_ptr<const std::atomic<bool>> cancel;
};

// A new version of a served checkpoint, as changes to its current one
// (PushCheckpoint in proto/weightstore/v1/weight_store.proto).
struct PushRequest {
  // The version the changes were made against; the push is refused (Aborted)
  // if it is no longer current when it commits.
  std::string base_version;
  // Tensors that replace the base's (same dtype and shape), or new ones.
  std::vector<SharedTensor> tensors;
  // Tensors that replace the base's as element patches of them (docs/
  // updates.md): the daemon applies each to its base tensor, whose digest
  // must be `base_digest`, and checks the result against `digest`.
  struct Patched {
    TensorSpec spec;
    ElementPatch patch;
    std::string base_digest, digest;  // 32 hex digits each
  };
  std::vector<Patched> patched;
  // Base tensors to leave out.
  std::vector<std::string> remove;
  // Allow tensors the base does not have.
  bool allow_new_tensors = false;
};

struct MappedTensors;

class Store {
 public:
  virtual ~Store() = default;

  // Every checkpoint served, and one by name. Once `cancel` (may be null) is
  // set, a call waiting for the daemon ends within about 20 ms (Cancelled).
  absl::StatusOr<std::vector<CheckpointSummary>> ListCheckpoints() { return ListCheckpoints(nullptr); }
  absl::StatusOr<CheckpointSummary> GetCheckpoint(const std::string& name) { return GetCheckpoint(name, nullptr); }
  virtual absl::StatusOr<std::vector<CheckpointSummary>> ListCheckpoints(
      const std::shared_ptr<const std::atomic<bool>>& cancel) = 0;
  virtual absl::StatusOr<CheckpointSummary> GetCheckpoint(const std::string& name,
                                                          const std::shared_ptr<const std::atomic<bool>>& cancel) = 0;
  // The tensors `query` selects, without their data. With a target, the apply
  // result too; a failing load is FailedPrecondition with the summary.
  virtual absl::StatusOr<TensorListing> ListTensors(const std::string& name, const Query& query) = 0;
  // Streams every selected tensor into `sink`, in listing order, verifying
  // CRC32C end to end (DataLoss on a mismatch).
  virtual absl::Status FetchTensors(const std::string& name, const Query& query, TensorSink* sink) = 0;

  // Every selected tensor, in owned memory.
  absl::StatusOr<std::vector<SharedTensor>> FetchAll(const std::string& name, const Query& query);
  // FetchAll, and the version the tensors are (where the store can tell;
  // empty otherwise): what a caller records to update them later.
  struct Fetched {
    std::string version;
    std::vector<SharedTensor> tensors;
  };
  virtual absl::StatusOr<Fetched> FetchVersioned(const std::string& name, const Query& query);
  // Whether MapTensors maps the selected tensors as views of the daemon's
  // memory, copying nothing (a same-host socket store). Callers that can use
  // views ask this rather than the store's type.
  virtual bool maps() const { return false; }
  // Maps every selected tensor without copying it; Unimplemented unless
  // maps().
  virtual absl::StatusOr<MappedTensors> MapTensors(const std::string& name, const Query& query);
  // One tensor by its served name (after the query's renaming).
  absl::StatusOr<SharedTensor> FetchTensor(const std::string& name, const std::string& tensor, Query query = {});

  // Follows checkpoints as they change: calls `on_event` with each event until
  // it returns false (then OK), the cancel flag is set (Cancelled), or the
  // daemon refuses the watch (its error). A broken stream is reopened saying
  // which versions the caller now holds, so a change made while disconnected
  // arrives once it reconnects, as one event per checkpoint; SYNCED follows
  // each (re)connection's catch-up. Only a remote store can watch; the others
  // return Unimplemented.
  virtual absl::Status Watch(const WatchOptions& options, const std::function<bool(const CheckpointEvent&)>& on_event);

  // Admin: publishes a new version of `name` from request.base_version and
  // the tensors that changed; the daemon writes the whole checkpoint
  // atomically and serves it. Returns the new version's summary. Only a
  // remote store can push; the others return Unimplemented.
  virtual absl::StatusOr<CheckpointSummary> Push(const std::string& name, const PushRequest& request);
};

// Reads the checkpoints under `models_dir` (or the single file or sharded
// folder `path`) in this process, each opened with `open` (default: a
// daemon's defaults).
absl::StatusOr<std::unique_ptr<Store>> OpenLocalStore(const std::string& path, const OpenOptions& open = {});

struct RemoteOptions {
  // Per-call deadline. Default: 10 minutes.
  std::chrono::milliseconds deadline{10 * 60 * 1000};
  // Reconnects after a broken stream, resuming from the last complete tensor.
  // A call that fails before the daemon's first answer is not retried: a wrong
  // address or a daemon that is down is said at once, as gRPC's fail-fast
  // default does. Default: 3.
  int max_resumes = 3;
  // Wait before resume n: this, doubled each time, at most 5 s. Default: 500 ms.
  std::chrono::milliseconds resume_backoff{500};
  // A resume waits this long for the daemon to come back (it may be
  // restarting) before the fetch fails with DeadlineExceeded. Default: 60 s.
  std::chrono::milliseconds resume_window{60 * 1000};
  // Chunk size asked of the server (it caps it at 4 MiB). Default: 0, the
  // server's (1 MiB). Measured on loopback: no gain from larger chunks.
  uint32_t chunk_bytes = 0;
  // HTTP/2 receive window per stream, fixed (no BDP probe). Default: 0,
  // gRPC's own (BDP-probed).
  int stream_window_bytes = 0;
  // FetchAll splits the selection into this many contiguous ranges of about
  // equal bytes, each streamed over a connection of its own, in parallel. One
  // gRPC stream tops out at what one receiving thread can copy and checksum;
  // with cores to spare, several go much further, and with few they only
  // compete (docs/benchmarks.md: on 16 cores, 4 streams load 5.2 GB/s against
  // 1.5 for one; on 2 cores, 0.8 against 1.5). Default: 0, automatic:
  // AutomaticParallelStreams().
  int parallel_streams = 0;
  // Each stream is received by two threads: one runs gRPC's reads and HTTP/2
  // parsing, the other copies and checksums the chunks into the sink. With
  // cores to spare this is 1.5-1.7x one thread; on 2 cores, shared with a
  // loopback daemon, it was 0.7x (docs/benchmarks.md). Default: unset,
  // automatic: AutomaticPipeline().
  std::optional<bool> pipeline;
  // Asks for the daemon's data lane (weightstored --data-listen): a fetch's
  // bytes then come over a plain TCP connection beside its stream, straight
  // from the kernel into the tensors, one copy fewer than gRPC's. Used only
  // where the daemon offers one, never with TLS, and never for a delta (those
  // come on the stream). Default: true.
  bool data_lane = true;
  // TLS: the CA that signed the server's certificate (PEM file). Empty: plaintext.
  std::string tls_ca_file;
  // Mutual TLS: this client's certificate chain and key (PEM files).
  std::string tls_cert_file, tls_key_file;
  // Sent as "authorization: Bearer <token>" on every call. Empty: none.
  std::string token;
};

// What RemoteOptions' automatic settings resolve to in this process, from its
// usable cores (CPU affinity and cgroup quota; client/usable_cores.h), read
// once. Streams: a quarter of the cores, from 1 to 4. Pipeline: 4 or more cores.
int AutomaticParallelStreams();
bool AutomaticPipeline();

// Opt-in, process-wide: keeps freed large blocks in the heap instead of returning
// them with munmap, so gRPC's receive buffers are reused rather than faulted in
// afresh. glibc serves allocations over 128 KiB with new mappings, and first-touch
// page faults dominated fetches on the CI machine (grpc_bench: 0.9-1.4 GB/s
// without, 1.8-2.2 GB/s with). Call once, early, in processes that fetch a lot.
void TuneAllocatorForStreaming();

// Connects to weightstored at `address` ("host:port"), with TLS when
// options.tls_ca_file is set. Each Store has a connection of its own. NotFound or
// InvalidArgument naming the file for unreadable PEM files.
absl::StatusOr<std::unique_ptr<Store>> ConnectRemoteStore(const std::string& address, RemoteOptions options = {});

// Tensors mapped from weightstored's same-host socket. Each tensor's bytes point
// into a read-only mapping of the checkpoint file or of a sealed memfd the
// daemon filled (copy-on-write with SharedMemoryOptions::copy_on_write), and
// keep it alive; nothing was copied. Mappings stay valid after the daemon
// unloads the checkpoint, evicts the segment or dies.
struct MappedTensors {
  std::string version;
  std::vector<SharedTensor> tensors;            // in listing order
  std::vector<TensorDescription> descriptions;  // the same order: source names, CRC32C
  std::optional<ApplyResult> apply_result;      // with a target
  // With Query::since_version: how it was used. A tensor unchanged since
  // (descriptions[i].unchanged) is not mapped again: its entry in `tensors`
  // has the spec and no bytes, and the caller keeps the mapping it holds.
  std::optional<DeltaInfo> delta;
  // With Query::patches: the changed tensors that came as element patches
  // (descriptions[i].patched; their entry in `tensors` has no bytes), in
  // listing order, each body a view of its mapped segment.
  std::vector<ReceivedPatch> patches;
  std::vector<std::shared_ptr<const MappedFile>> segments;

  // Reads every byte once and checks each tensor's CRC32C (DataLoss naming the
  // tensor on a mismatch). Mapping does not verify, to stay free of reads.
  absl::Status Verify() const;
};

struct SharedMemoryOptions {
  // Socket send/receive timeout. Default: 60 s.
  std::chrono::milliseconds timeout{60 * 1000};
  // Largest response accepted (tensor tables of huge checkpoints). Default: 256 MiB.
  uint32_t max_response_bytes = 256u << 20;
  // Map segments private and copy-on-write instead of read-only: a write
  // through a tensor's address (a Python tensor modified in place) copies the
  // page for this process instead of crashing it; the daemon's bytes never
  // change. Off by default: cudaHostRegister of such a mapping of a file hung
  // on the H100 test machine (CUDA 13, driver 580), so the CUDA paths need the
  // read-only mapping. The Python package turns it on. Default: false.
  bool copy_on_write = false;
};

// A Store over weightstored's same-host socket (--socket). FetchTensors copies
// out of the mappings into the sink (verifying checksums); MapTensors is the
// zero-copy way. Reconnects once per call if the daemon restarted.
class SharedMemoryStore : public Store {
 public:
  bool maps() const override { return true; }
  // Segments are checked before mapping: sizes against fstat, and memfds for
  // all four seals.
  absl::StatusOr<MappedTensors> MapTensors(const std::string& name, const Query& query) override = 0;
};

// Connects to weightstored's socket at `socket_path`. PermissionDenied if the
// daemon refuses this process's uid/gid.
absl::StatusOr<std::unique_ptr<SharedMemoryStore>> ConnectSharedMemoryStore(const std::string& socket_path,
                                                                            SharedMemoryOptions options = {});

}  // namespace weightstore::client

#endif  // WEIGHTSTORE_CLIENT_STORE_H_

// Weight updates on the client: bring tensors fetched earlier up to a
// checkpoint's current version, fetching only what changed (the daemon leaves
// out tensors whose source digest, dtype and shape are those of the version
// the caller holds; core/catalog/manifest.h).
#ifndef WEIGHTSTORE_CLIENT_UPDATES_H_
#define WEIGHTSTORE_CLIENT_UPDATES_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/store.h"

namespace weightstore::client {

// Tensors fetched by one query, at one version.
struct HeldTensors {
  std::string version;                // empty: nothing held yet
  std::vector<SharedTensor> tensors;  // in listing order
  // The selection that chose them, as SelectionKey() gives it (UpdateTensors
  // records it): another selection (a shard rank, a dtype) refetches
  // everything, even where names, dtypes and shapes agree. Empty: not known,
  // and then a held version is fetched whole too, since a same-shaped tensor
  // of another shard rank would otherwise pass as unchanged.
  std::string selection;
};

// What `query` selects (not which version), as bytes equal exactly when two
// queries select alike: for HeldTensors::selection of tensors a caller
// fetched itself.
std::string SelectionKey(const Query& query);

struct UpdateResult {
  std::string old_version, new_version;
  // True when only the changed tensors were fetched; false for a full fetch,
  // for `full_reason`.
  bool delta = false;
  std::string full_reason;
  // By served name: fetched again, fetched for the first time, dropped.
  std::vector<std::string> changed, added, removed;
  // Of `changed`, those that came as element patches (docs/updates.md).
  std::vector<std::string> patched;
  // Bytes received: whole tensors and patches.
  uint64_t fetched_bytes = 0;
  uint64_t fetched_tensors = 0;
  // Set when patches came but could not be used (a malformed one, a result
  // unlike its digest): the changed tensors were then fetched whole.
  std::string patch_failure;
  // Set when the daemon keeps no patches from the version held (past
  // --kept-patch-bytes or --kept-versions, or a version between arrived
  // without them): the changed tensors came whole.
  std::string patch_reason;
};

// The tensors changed since query.since_version (empty: all of them): the
// listing, each tensor marked unchanged or not, and the tensors received.
struct ChangedTensors {
  std::string version;  // the version listed and received
  // True when only the changed tensors were received; else all were, for
  // `full_reason`.
  bool delta = false;
  std::string full_reason;
  std::vector<TensorDescription> listed;
  std::vector<SharedTensor> received;  // the changed ones (all, without a delta), in listing order
  // With Query::patches: the changed tensors that came as element patches
  // instead (not in `received`), in listing order; and why none could, when
  // the daemon keeps none from since_version.
  std::vector<ReceivedPatch> patched;
  std::string patch_reason;
};

// Applies an update's patches in one call, on several threads: patches[i]
// into destinations[i] (its tensor as held at the since version, overwritten
// in place), then checks each result against the patch's digest. On a
// malformed patch, InvalidArgument naming the tensor, and nothing was
// written; on a result unlike its digest, DataLoss naming the tensor (the
// patches were written).
absl::Status ApplyReceivedPatches(std::span<const ReceivedPatch> patches,
                                  std::span<const std::span<std::byte>> destinations);

// Through a socket store the changed tensors are mapped (the unchanged get
// no mapping: the caller keeps its own; with Query::patches, a patch is
// mapped instead of a tensor it patches); from the others they are fetched,
// pinned to the version listed. A local store tells nothing: all of them.
// What UpdateInto and the Python package's changes() are made of.
// `max_bytes` bounds what is received into memory (the listed sizes of the
// changed tensors, patches counted at their tensor's size): past it,
// ResourceExhausted before anything is fetched. Mapped tensors (a socket
// store) take no memory and are not counted.
absl::StatusOr<ChangedTensors> FetchChanged(Store& store, const std::string& name, Query query,
                                            uint64_t max_bytes = UINT64_MAX);

// Memory an element patch is written into, holding its tensor's bytes as of
// the version held: on the host (device < 0), or in CUDA device `device`'s
// memory (`bytes` then spans device addresses, never read on the host).
struct PatchDestination {
  std::span<std::byte> bytes;
  int device = -1;
};

// ApplyReceivedPatches for host and device memory alike: patches[i] into
// destinations[i], each result checked against its digest. Every patch is
// parsed and every destination's size checked first (InvalidArgument naming
// the tensor, nothing written); GPUs are written before host memory, so a GPU
// that cannot be used (client/device_patches.h) fails the call before host
// memory is written.
absl::Status ApplyPatchesAt(std::span<const ReceivedPatch> patches, std::span<const PatchDestination> destinations);

// What an update brings to the current version: tensors a caller holds by
// served name. HeldTensors is one; the Python package's are a module's
// parameters and buffers, or a dict of torch tensors or numpy arrays, on the
// CPU or a GPU. UpdateInto asks it what is held and where each element patch
// goes; the caller then takes in what arrived (Updated).
class UpdateDestination {
 public:
  struct Held {
    std::optional<DType> dtype;   // nullopt: held as no served dtype
    std::vector<uint64_t> shape;  // as served (F4 counts elements, not bytes)
    bool patchable = false;       // an element patch can be written into it, or into a copy of it
  };
  virtual ~UpdateDestination() = default;
  // The tensor held as `name`, or nullopt.
  virtual std::optional<Held> Find(const std::string& name) const = 0;
  // Every name held.
  virtual std::vector<std::string> Names() const = 0;
  // True when every tensor an update writes must be held already, with its
  // listed shape (a module's parameters: their dtype may differ, and the
  // caller converts). Else UpdateInto fails FailedPrecondition before it
  // writes anything.
  virtual bool fixed_names() const { return false; }
  // Memory for each of `patches` (each held as Find says, with the patch's
  // dtype and shape, and patchable), holding the held bytes: the held memory
  // itself (`*in_place` set: held memory will be written), or a copy the
  // destination keeps for the caller to take in. Called at most once per
  // update.
  virtual absl::StatusOr<std::vector<PatchDestination>> PatchInto(std::span<const ReceivedPatch> patches,
                                                                  bool* in_place) = 0;
};

// What UpdateInto brought, for its destination to take in.
struct Updated {
  UpdateResult result;
  // Every served name of the new version, in listing order.
  std::vector<std::string> listed;
  // The changed and added tensors that came whole, in listing order. Those
  // in result.patched were written where PatchInto said; the rest of
  // `listed` are unchanged, and stay as held.
  std::vector<SharedTensor> received;
  // SelectionKey(query): what to record with result.new_version.
  std::string selection;
};

// The update algorithm. Brings `destination`, holding version `since`
// (empty: nothing) of `name` as selected by a query whose SelectionKey was
// `since_selection` (empty: not known), to the current version:
// - Lists with Query::since_version = since, and fetches, pinned to the
//   listed version, only the tensors not unchanged. Everything is fetched,
//   and UpdateResult::full_reason says why, when the store or daemon cannot
//   tell what changed, when `since_selection` is not this query's (a shard
//   rank or dtype elsewhere gives same-shaped tensors of other bytes), or
//   when a tensor listed unchanged is not held with its dtype and shape.
// - Element patches are asked for (from a remote or socket store) when
//   every held tensor is patchable; they are applied in one call on several
//   threads (or a GPU's scatter) into PatchInto's memory, and each result is
//   checked against its digest. Patches that fail are followed by the
//   changed tensors whole (UpdateResult::patch_failure says why). Patches
//   that were not asked for are DataLoss.
// - A fixed_names() destination that does not hold every tensor to be
//   written, with its shape, fails FailedPrecondition, nothing written.
// On error nothing was written, but where PatchInto handed out held memory
// and a patch or the refetch after it failed: the message then says that
// tensors may be partly written, and the holder updates again from nothing.
absl::StatusOr<Updated> UpdateInto(Store& store, const std::string& name, Query query, const std::string& since,
                                   const std::string& since_selection, UpdateDestination& destination);

// UpdateInto for tensors held in C++: brings `held` (tensors `query` fetched
// earlier from `name`, or nothing) to the current version. Unchanged tensors
// keep their memory. A patch is written in place into a held tensor whose
// memory an earlier UpdateTensors made and that `held` alone references (a
// caller that kept a copy of it keeps its bytes), else into a copy. On error
// `held` is left as it was, but that its version is cleared (the next update
// fetches everything) when a patch was written in place.
absl::StatusOr<UpdateResult> UpdateTensors(Store& store, const std::string& name, Query query, HeldTensors* held);

// What to push to make `next` (every tensor of the new version) the version
// after the one `served` lists (ListTensors of the whole checkpoint):
// tensors whose dtype, shape and digest are the served ones' are left out; a
// changed one that `base` (what the caller pushed last, as it was) holds
// with the served digest goes as an element patch where that is smaller and
// at most `max_patch_bytes` (the daemon's --max-push-patch-bytes); the rest
// go whole; served tensors `next` lacks are removed, and tensors the served
// version lacks (or holds with another dtype or shape) are added. Without
// digests in `served` (a daemon with --tensor-digests=false) every tensor of
// `next` goes whole. Bytes are shared, not copied; digests and diffs run on
// several threads. InvalidArgument for two tensors of one name in `next`.
struct PushPlan {
  PushRequest request;  // for Store::Push(name, request)
  uint64_t whole_bytes = 0, patch_bytes = 0;
  size_t unchanged = 0;
  bool digests = true;  // false: `served` had none, and nothing was left out
};
absl::StatusOr<PushPlan> PlanPush(const TensorListing& served, std::span<const SharedTensor> next,
                                  std::span<const SharedTensor> base = {},
                                  uint64_t max_patch_bytes = uint64_t{1} << 30);

}  // namespace weightstore::client

#endif  // WEIGHTSTORE_CLIENT_UPDATES_H_

// Resolve: what every read request does first, whatever its transport (gRPC or
// the same-host socket): find the checkpoint, check the pinned version, compile
// the selection and select (or apply to the target).
#ifndef WEIGHTSTORE_SERVER_RESOLVE_H_
#define WEIGHTSTORE_SERVER_RESOLVE_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/catalog/registry.h"
#include "core/catalog/version_patches.h"
#include "core/element_patch.h"
#include "core/select/apply.h"
#include "core/select/served.h"
#include "core/select/snapshot.h"
#include "server/admission_gate.h"
#include "weightstore/v1/weight_store.pb.h"

namespace weightstore::server {

struct Resolved {
  std::shared_ptr<const CheckpointVersion> version;
  std::shared_ptr<const Snapshot> snapshot;
  std::optional<ApplyResult> apply_result;  // with a target

  // With a since_version: the manifest of that version, when kept (else why
  // not, and every tensor counts as changed).
  std::string since_version;
  std::shared_ptr<const CheckpointManifest> since;
  std::string full_reason;

  // True when `tensor` (one of the snapshot's) has the same source tensor in
  // the since version: the same served bytes under the same request.
  bool Unchanged(const SnapshotTensor& tensor) const;
  // The source tensor's digest; nullptr without digests.
  const ManifestTensor* Digest(const SnapshotTensor& tensor) const;
  // DeltaInfo for the snapshot's tensors in [begin, end).
  v1::DeltaInfo DeltaInfo(size_t begin, size_t end) const;
  // What every transport says of `tensor` (one of the snapshot's): its
  // spec, source and quantization, its digest when kept, and `unchanged`.
  void Describe(const SnapshotTensor& tensor, v1::TensorInfo* out) const;
};

// The element patches that bring `resolved`'s checkpoint from its since
// version to its version (CheckpointRegistry::FindPatches), or why there are
// none; nothing without a delta.
struct PatchesFound {
  std::shared_ptr<const PatchChain> chain;
  std::string reason;  // for DeltaInfo.patch_reason
};
PatchesFound FindPatches(const CheckpointRegistry& registry, const Resolved& resolved);

// The element patch of `chain` (may be null) for the tensor `plan` serves,
// when one is kept and the tensor is served as stored (no cast, shard, slice
// or transpose; not BOOL, which is normalized when served); what both
// transports send instead of the tensor.
std::optional<ElementPatch> ServedPatch(const PatchChain* chain, const Snapshot& snapshot,
                                        const ServedTensorPlan& plan);
// ServedPatch when it needs neither compose nor wait for a composition
// another caller is making (PatchChain::TryFor), into `*out`; false (`*out`
// untouched) when it would: what callers on gRPC's threads run elsewhere.
bool TryServedPatch(const PatchChain* chain, const Snapshot& snapshot, const ServedTensorPlan& plan,
                    std::optional<ElementPatch>* out);

// Returns NotFound for an unknown checkpoint, Aborted when `pinned_version` is
// set and no longer current, InvalidArgument for a bad selection (naming the
// field or pattern), FailedPrecondition with the load summary when applying to
// a target fails.
// `limits` bound what the selection may cost (core/selection.h). A
// `since_version` (may be empty) the daemon keeps no digests of is not an
// error: every tensor is then changed.
absl::StatusOr<Resolved> Resolve(const CheckpointRegistry& registry, const std::string& name,
                                 const v1::Selection& selection, const std::string& pinned_version,
                                 const SelectionLimits& limits, const std::string& since_version = "");

// Whether resolving `selection` runs patterns or a target over every name
// (include, exclude, renames, shard, scale and expert rules, a target): the
// selections counted
// by --max-concurrent-selections, on every transport.
bool IsCostlySelection(const v1::Selection& selection);

// The slot of `gate` (--max-concurrent-selections; may be null) that a costly
// `selection` holds while it is resolved, whatever the transport; an empty
// ticket for a plain one. ResourceExhausted when none is free.
absl::StatusOr<GateTicket> AdmitSelection(AdmissionGate* gate, absl::string_view peer, const v1::Selection& selection);

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_RESOLVE_H_

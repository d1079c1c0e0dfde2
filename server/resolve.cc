#include "server/resolve.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "server/proto_convert.h"

namespace weightstore::server {

namespace {

size_t EntryIndex(const Resolved& r, const SnapshotTensor& tensor) {
  return static_cast<size_t>(tensor.source - r.version->checkpoint()->entries().data());
}

}  // namespace

const ManifestTensor* Resolved::Digest(const SnapshotTensor& tensor) const {
  const CheckpointManifest* manifest = version->manifest().get();
  if (manifest == nullptr) return nullptr;
  return &manifest->tensors()[EntryIndex(*this, tensor)];
}

bool Resolved::Unchanged(const SnapshotTensor& tensor) const {
  if (since == nullptr) return false;
  const ManifestTensor* now = Digest(tensor);
  if (now == nullptr) return false;
  const ManifestTensor* before = since->Find(now->name);
  return before != nullptr && before->SameContentAs(*now);
}

v1::DeltaInfo Resolved::DeltaInfo(size_t begin, size_t end) const {
  v1::DeltaInfo info;
  info.set_since_version(since_version);
  info.set_delta(since != nullptr);
  info.set_full_reason(full_reason);
  uint64_t unchanged = 0;
  for (size_t i = begin; i < end; ++i) unchanged += Unchanged(snapshot->tensors()[i]) ? 1 : 0;
  info.set_unchanged_tensors(unchanged);
  info.set_changed_tensors(end - begin - unchanged);
  return info;
}

PatchesFound FindPatches(const CheckpointRegistry& registry, const Resolved& resolved) {
  PatchesFound found;
  if (resolved.since == nullptr || resolved.since_version == resolved.version->version()) return found;
  found.chain = registry.FindPatches(resolved.version->name(), resolved.since_version, resolved.version->version());
  if (found.chain == nullptr) {
    found.reason = absl::StrCat("no element patches are kept from version ", resolved.since_version, " to ",
                                resolved.version->version(),
                                " (a version between came without them, or they passed --kept-patch-bytes or "
                                "--kept-versions)");
  }
  return found;
}

namespace {

// The stored name of the tensor `plan` serves, when it may go as a patch:
// served as stored (no cast, shard, slice or transpose), not BOOL.
const std::string* PatchableName(const PatchChain* chain, const Snapshot& snapshot, const ServedTensorPlan& plan) {
  if (chain == nullptr || !plan.is_byte_range()) return nullptr;
  const CheckpointEntry& entry = snapshot.checkpoint().entries()[plan.entry];
  if (plan.byte_size != entry.spec.byte_size() || entry.spec.dtype == DType::kBool) return nullptr;
  return &entry.spec.name;
}

}  // namespace

std::optional<ElementPatch> ServedPatch(const PatchChain* chain, const Snapshot& snapshot,
                                        const ServedTensorPlan& plan) {
  const std::string* name = PatchableName(chain, snapshot, plan);
  if (name == nullptr) return std::nullopt;
  absl::StatusOr<std::optional<ElementPatch>> patch = chain->For(*name);
  return patch.ok() ? *std::move(patch) : std::nullopt;  // a patch that cannot compose: the tensor
}

bool TryServedPatch(const PatchChain* chain, const Snapshot& snapshot, const ServedTensorPlan& plan,
                    std::optional<ElementPatch>* out) {
  const std::string* name = PatchableName(chain, snapshot, plan);
  if (name == nullptr) {
    *out = std::nullopt;
    return true;
  }
  absl::StatusOr<std::optional<ElementPatch>> patch;
  if (!chain->TryFor(*name, &patch)) return false;
  *out = patch.ok() ? *std::move(patch) : std::nullopt;  // a patch that cannot compose: the tensor
  return true;
}

bool IsCostlySelection(const v1::Selection& selection) {
  return !selection.include().empty() || !selection.exclude().empty() || !selection.renames().empty() ||
         !selection.shard().rules().empty() || !selection.shard().scales().empty() ||
         !selection.shard().experts().empty() || selection.has_target();
}

absl::StatusOr<GateTicket> AdmitSelection(AdmissionGate* gate, absl::string_view peer, const v1::Selection& selection) {
  if (gate == nullptr || !IsCostlySelection(selection)) return GateTicket();
  return gate->Admit(peer);
}

void Resolved::Describe(const SnapshotTensor& tensor, v1::TensorInfo* out) const {
  ToProto(tensor, out);
  if (const ManifestTensor* digest = Digest(tensor)) out->set_digest(digest->digest.Hex());
  if (Unchanged(tensor)) out->set_unchanged(true);
}

absl::StatusOr<Resolved> Resolve(const CheckpointRegistry& registry, const std::string& name,
                                 const v1::Selection& selection, const std::string& pinned_version,
                                 const SelectionLimits& limits, const std::string& since_version) {
  Resolved r;
  auto version = registry.Find(name, pinned_version);
  if (!version.ok()) return version.status();
  r.version = *std::move(version);
  if (!since_version.empty()) {
    if (since_version.size() > 64) {
      return absl::InvalidArgumentError(
          absl::StrCat("since_version of ", since_version.size(), " bytes is not one this daemon issues"));
    }
    r.since_version = since_version;
    if (r.version->manifest() == nullptr) {
      r.full_reason = "this daemon computes no tensor digests (weightstored --tensor-digests=false)";
    } else {
      r.since = registry.FindManifest(name, since_version);
      if (r.since == nullptr) {
        r.full_reason = absl::StrCat("version '", absl::CHexEscape(since_version), "' of '", name,
                                     "' is not one this daemon keeps digests of");
      }
    }
  }
  SelectionRequest request;
  absl::Status status = FromProto(selection, limits, &request);
  if (!status.ok()) return status;
  auto compiled = Selection::Compile(request.options, limits);
  if (!compiled.ok()) return compiled.status();
  // A served name maps to its source tensor by the name alone (filters,
  // renames, top-level key, shards and slices are functions of it and the
  // shape), unless contiguous indices renumber or a target's adapter matches
  // by the whole set of names: then a tensor added or removed can move a
  // served name to another source, and the delta holds only when the two
  // versions have the same tensor names.
  if (r.since != nullptr && (request.target || request.options.contiguous_indices.value_or(false))) {
    const CheckpointManifest& now = *r.version->manifest();
    bool same_names = now.tensors().size() == r.since->tensors().size();
    for (size_t i = 0; same_names && i < now.tensors().size(); ++i) {
      same_names = r.since->Find(now.tensors()[i].name) != nullptr;
    }
    if (!same_names) {
      r.full_reason = absl::StrCat("tensors were added or removed since version ", r.since->version(),
                                   ", and this selection (contiguous indices or a target) may serve a name from "
                                   "another tensor than before");
      r.since = nullptr;
    }
  }
  if (!request.target) {
    auto snapshot = Snapshot::Select(r.version->checkpoint(), **compiled);
    if (!snapshot.ok()) return snapshot.status();
    r.snapshot = *std::move(snapshot);
    return r;
  }
  ApplyOptions options;
  options.allow_partial = request.allow_partial;
  auto applied = Apply(r.version->checkpoint(), **compiled, *request.target, options);
  if (!applied.ok()) return applied.status();
  if (!applied->status.ok()) return applied->status;
  r.snapshot = applied->snapshot;
  r.apply_result = std::move(applied->result);
  return r;
}

}  // namespace weightstore::server

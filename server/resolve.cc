#include "server/resolve.h"

#include "absl/strings/str_cat.h"
#include "server/proto_convert.h"

namespace weightstore::server {

absl::StatusOr<Resolved> Resolve(const CheckpointRegistry& registry, const std::string& name,
                                 const v1::Selection& selection, const std::string& pinned_version,
                                 const SelectionLimits& limits) {
  Resolved r;
  auto version = registry.Find(name, pinned_version);
  if (!version.ok()) return version.status();
  r.version = *std::move(version);
  SelectionRequest request;
  absl::Status status = FromProto(selection, limits, &request);
  if (!status.ok()) return status;
  auto compiled = Selection::Compile(request.options, limits);
  if (!compiled.ok()) return compiled.status();
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

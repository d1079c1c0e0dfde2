#include "server/resolve.h"

#include "absl/strings/str_cat.h"
#include "core/crc32c.h"
#include "server/proto_convert.h"

namespace weightstore::server {

absl::StatusOr<Resolved> Resolve(const CheckpointRegistry& registry, const std::string& name,
                                 const v1::Selection& selection, const std::string& pinned_version) {
  Resolved r;
  auto version = registry.Find(name, pinned_version);
  if (!version.ok()) return version.status();
  r.version = *std::move(version);
  SelectionRequest request;
  absl::Status status = FromProto(selection, &request);
  if (!status.ok()) return status;
  auto compiled = Selection::Compile(request.options);
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

std::optional<size_t> ChecksumCacheKey(const Snapshot& snapshot, const SnapshotTensor& tensor) {
  if (!tensor.is_identity()) return std::nullopt;
  return static_cast<size_t>(tensor.source - snapshot.checkpoint().entries().data());
}

absl::StatusOr<uint32_t> ChecksumOf(const Resolved& resolved, const SnapshotTensor& tensor) {
  std::optional<size_t> key = ChecksumCacheKey(*resolved.snapshot, tensor);
  if (key) {
    if (std::optional<uint32_t> crc = resolved.version->CachedCrc(*key)) return *crc;
  }
  absl::StatusOr<SharedTensor> bytes = resolved.snapshot->Read(tensor);
  if (!bytes.ok()) return bytes.status();
  uint32_t crc = Crc32c(bytes->bytes.view());
  if (key) resolved.version->StoreCrc(*key, crc);
  return crc;
}

}  // namespace weightstore::server

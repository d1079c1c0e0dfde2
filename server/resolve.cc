#include "server/resolve.h"

#include "absl/strings/str_cat.h"
#include "core/crc32c.h"
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
  absl::Status status = FromProto(selection, &request);
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

uint64_t ChecksumCacheKey(const Snapshot& snapshot, const SnapshotTensor& tensor) {
  const auto entry = static_cast<uint64_t>(tensor.source - snapshot.checkpoint().entries().data());
  return entry | (static_cast<uint64_t>(tensor.spec.dtype) << 40) | (uint64_t{tensor.transpose} << 48);
}

bool IsServedAsStored(const SnapshotTensor& tensor) {
  return tensor.is_identity() && Checkpoint::IsZeroCopy(*tensor.source);
}

absl::StatusOr<uint32_t> ChecksumOf(const Resolved& resolved, const SnapshotTensor& tensor) {
  const uint64_t key = ChecksumCacheKey(*resolved.snapshot, tensor);
  if (std::optional<uint32_t> crc = resolved.version->CachedCrc(key)) return *crc;
  uint32_t crc = 0;
  if (IsServedAsStored(tensor)) {
    absl::StatusOr<SharedTensor> bytes = resolved.snapshot->Read(tensor);
    if (!bytes.ok()) return bytes.status();
    crc = Crc32c(bytes->bytes.view());
  } else {  // produced a chunk at a time: never the whole tensor in memory
    constexpr uint64_t kChunk = 1 << 20;
    std::vector<std::byte> chunk;
    const uint64_t size = tensor.spec.byte_size();
    for (uint64_t at = 0; at < size; at += kChunk) {
      chunk.resize(std::min(kChunk, size - at));
      absl::Status status = resolved.snapshot->ReadRange(tensor, at, chunk);
      if (!status.ok()) return status;
      crc = Crc32cExtend(crc, absl::string_view(reinterpret_cast<const char*>(chunk.data()), chunk.size()));
    }
  }
  if (absl::Status unchanged = resolved.version->CheckUnchanged(); !unchanged.ok()) return unchanged;
  resolved.version->StoreCrc(key, crc);
  return crc;
}

}  // namespace weightstore::server

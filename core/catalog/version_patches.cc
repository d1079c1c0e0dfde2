#include "core/catalog/version_patches.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/parallel_for.h"
#include "core/status_macros.h"

namespace weightstore {

absl::StatusOr<std::shared_ptr<const VersionPatches>> DiffVersions(
    const Checkpoint& from, const CheckpointManifest& from_manifest, const Checkpoint& to,
    const CheckpointManifest& to_manifest, uint64_t max_bytes, unsigned threads,
    const absl::flat_hash_map<std::string, ElementPatch>* known) {
  auto out = std::make_shared<VersionPatches>();
  out->from = from_manifest.version();
  out->to = to_manifest.version();
  absl::flat_hash_map<std::string, size_t> from_entry;
  for (size_t i = 0; i < from.entries().size(); ++i) from_entry.emplace(from.entries()[i].spec.name, i);

  // (entry in `to`, entry in `from`) of each tensor worth diffing.
  std::vector<std::pair<size_t, size_t>> todo;
  for (size_t i = 0; i < to_manifest.tensors().size(); ++i) {
    const ManifestTensor& now = to_manifest.tensors()[i];
    const ManifestTensor* before = from_manifest.Find(now.name);
    if (before != nullptr && before->SameContentAs(now)) continue;
    auto entry = from_entry.find(now.name);
    if (before == nullptr || before->dtype != now.dtype || before->shape != now.shape || now.dtype == DType::kBool ||
        entry == from_entry.end()) {
      out->whole.insert(now.name);
      continue;
    }
    todo.emplace_back(i, entry->second);
  }

  std::vector<std::optional<ElementPatch>> patches(todo.size());
  std::atomic<uint64_t> kept{0};
  WEIGHTSTORE_RETURN_IF_ERROR(ParallelFor(todo.size(), threads, [&](size_t t) -> absl::Status {
    const CheckpointEntry& now = to.entries()[todo[t].first];
    const CheckpointEntry& before = from.entries()[todo[t].second];
    if (known != nullptr) {
      if (auto it = known->find(now.spec.name); it != known->end()) {
        if (kept.fetch_add(it->second.body.size()) + it->second.body.size() <= max_bytes) {
          patches[t] = it->second;
          patches[t]->body = SharedBytes::Copy(it->second.body.view());  // kept: its own memory
        }
        return absl::OkStatus();
      }
    }
    absl::StatusOr<SharedTensor> a = from.Read(before);
    absl::StatusOr<SharedTensor> b = to.Read(now);
    if (!a.ok() || !b.ok()) {
      return absl::DataLossError(
          absl::StrCat("cannot diff tensor '", now.spec.name, "': ", (a.ok() ? b.status() : a.status()).message()));
    }
    std::optional<ElementPatch> patch =
        DiffElements(a->bytes.span(), b->bytes.span(), PatchElementSize(now.spec.dtype));
    if (patch && kept.fetch_add(patch->body.size()) + patch->body.size() <= max_bytes) patches[t] = std::move(patch);
    return absl::OkStatus();
  }));
  for (size_t t = 0; t < todo.size(); ++t) {
    const std::string& name = to.entries()[todo[t].first].spec.name;
    if (!patches[t]) {
      out->whole.insert(name);
      continue;
    }
    out->memory_bytes += patches[t]->body.size() + name.size() + sizeof(ElementPatch);
    out->patches.emplace(name, *std::move(patches[t]));
  }
  for (const std::string& name : out->whole) out->memory_bytes += name.size() + 32;
  return std::shared_ptr<const VersionPatches>(std::move(out));
}

absl::StatusOr<std::optional<ElementPatch>> PatchChain::For(const std::string& name) const {
  if (steps_.size() > 1) {
    absl::MutexLock lock(&mu_);
    if (auto it = composed_.find(name); it != composed_.end()) return it->second;
  }
  std::optional<ElementPatch> composed;
  for (const auto& step : steps_) {
    if (step->whole.contains(name)) return std::nullopt;
    auto it = step->patches.find(name);
    if (it == step->patches.end()) continue;  // unchanged in this step
    if (!composed) {
      composed = it->second;
      continue;
    }
    WEIGHTSTORE_ASSIGN_OR_RETURN(composed, ComposePatches(*composed, it->second));
    if (!composed) break;
  }
  if (steps_.size() > 1) {
    absl::MutexLock lock(&mu_);
    composed_.emplace(name, composed);
  }
  return composed;
}

}  // namespace weightstore

// Version patches: the element patches (core/element_patch.h) from one
// version of a checkpoint to the next, computed while both are mapped (a
// rescan that finds a file replaced, a push), and chains of them that bring a
// client several versions behind up to date.
#ifndef WEIGHTSTORE_CORE_CATALOG_VERSION_PATCHES_H_
#define WEIGHTSTORE_CORE_CATALOG_VERSION_PATCHES_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/catalog/manifest.h"
#include "core/checkpoint.h"
#include "core/element_patch.h"

namespace weightstore {

// The patches from version `from` to version `to`. Immutable once built.
struct VersionPatches {
  std::string from, to;
  // By tensor name in the file: the changed tensors a patch is smaller than.
  absl::flat_hash_map<std::string, ElementPatch> patches;
  // Tensors of `to` that changed without a patch (new, another dtype or shape,
  // BOOL, changed throughout, or past the byte bound): sent whole.
  absl::flat_hash_set<std::string> whole;
  // What the patches hold in memory, about.
  uint64_t memory_bytes = 0;
};

// Diffs every tensor whose digest, dtype or shape differs between the two
// versions (their manifests say which), reading both. Patches are kept up to
// `max_bytes` in all (the rest are whole), computed on up to `threads`
// threads. `known` (may be null): patches by tensor name already known to
// turn `from`'s tensor into `to`'s (a patched push's, checked against the
// result's digest), taken instead of a diff (a body kept is copied: it may
// be a view of a temporary file). DataLoss naming the tensor if either
// cannot be read.
absl::StatusOr<std::shared_ptr<const VersionPatches>> DiffVersions(
    const Checkpoint& from, const CheckpointManifest& from_manifest, const Checkpoint& to,
    const CheckpointManifest& to_manifest, uint64_t max_bytes, unsigned threads,
    const absl::flat_hash_map<std::string, ElementPatch>* known = nullptr);

// The steps from one version to a later one, oldest first, each step's `to`
// the next one's `from`. Thread-safe.
class PatchChain {
 public:
  explicit PatchChain(std::vector<std::shared_ptr<const VersionPatches>> steps) : steps_(std::move(steps)) {}

  const std::string& from() const { return steps_.front()->from; }
  const std::string& to() const { return steps_.back()->to; }
  size_t steps() const { return steps_.size(); }

  // The patch that brings tensor `name` from from() to to(): the steps that
  // changed it composed (once: kept for the next caller, so what the chain
  // holds is at most its steps' patches again); nullopt when one of them sent
  // it whole, when none changed it, or when the composition is not smaller
  // than the tensor.
  absl::StatusOr<std::optional<ElementPatch>> For(const std::string& name) const;

 private:
  std::vector<std::shared_ptr<const VersionPatches>> steps_;
  mutable absl::Mutex mu_;
  mutable absl::flat_hash_map<std::string, std::optional<ElementPatch>> composed_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_CATALOG_VERSION_PATCHES_H_

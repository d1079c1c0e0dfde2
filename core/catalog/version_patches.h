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

// Compositions of kept steps for clients several versions behind, shared by
// every chain a registry hands out: one per (checkpoint, since, version,
// tensor), made once (an asker finding it being made waits for it), and
// counted against `max_bytes` for as long as anyone holds its body (cached,
// or being sent). One that would not fit, after the least recently used
// cached ones are dropped, is not made: its tensor goes whole. At most
// `max_composing` are made at once, whatever threads ask. Thread-safe; the
// bodies it made may outlive it.
class PatchCompositions {
 public:
  struct Stats {
    uint64_t bytes = 0;         // bodies of compositions alive, cached or held
    uint64_t budget_bytes = 0;  // max_bytes
    uint64_t cached = 0;        // compositions cached
    uint64_t made = 0;          // compositions made
    uint64_t shared = 0;        // asks answered by one made before or in flight
    uint64_t over_budget = 0;   // compositions not made for the budget
  };

  explicit PatchCompositions(uint64_t max_bytes, int max_composing = 2);
  PatchCompositions(const PatchCompositions&) = delete;
  PatchCompositions& operator=(const PatchCompositions&) = delete;

  Stats stats() const ABSL_LOCKS_EXCLUDED(mu_);
  // Drops the cached compositions of `checkpoint` except those to version
  // `keep_to` (empty: all); those held elsewhere stay counted until let go.
  void Forget(const std::string& checkpoint, const std::string& keep_to = "") ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class PatchChain;
  struct Budget;
  struct Entry;

  // The composition of `name` over `steps` (more than one changed it), made
  // here or by the asker already making it.
  absl::StatusOr<std::optional<ElementPatch>> Compose(const std::string& key, const std::string& checkpoint,
                                                      const std::string& to,
                                                      const std::vector<const ElementPatch*>& parts)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The composition cached under `key`, if made (an ask answered).
  std::optional<std::optional<ElementPatch>> Cached(const std::string& key) ABSL_LOCKS_EXCLUDED(mu_);
  // Takes `bytes` from the budget, dropping cached compositions (least
  // recently used first) to make room; false when it cannot.
  bool Reserve(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  bool MayCompose() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return composing_ < max_composing_; }

  const std::shared_ptr<Budget> budget_;
  const int max_composing_;
  mutable absl::Mutex mu_;
  int composing_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, std::shared_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t tick_ ABSL_GUARDED_BY(mu_) = 0;  // for least recently used
  uint64_t made_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t shared_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t over_budget_ ABSL_GUARDED_BY(mu_) = 0;
};

// The steps from one version to a later one, oldest first, each step's `to`
// the next one's `from`, of checkpoint `checkpoint`. Thread-safe.
class PatchChain {
 public:
  // `compositions` (may be null: each For composes anew, uncounted) shares
  // and bounds what For composes.
  explicit PatchChain(std::vector<std::shared_ptr<const VersionPatches>> steps, std::string checkpoint = "",
                      std::shared_ptr<PatchCompositions> compositions = nullptr)
      : steps_(std::move(steps)), checkpoint_(std::move(checkpoint)), compositions_(std::move(compositions)) {}

  const std::string& from() const { return steps_.front()->from; }
  const std::string& to() const { return steps_.back()->to; }
  size_t steps() const { return steps_.size(); }

  // The patch that brings tensor `name` from from() to to(): the steps that
  // changed it composed (through the shared compositions: made once, and
  // only within their budget); nullopt when one of them sent it whole, when
  // none changed it, when the composition is not smaller than the tensor, or
  // when it does not fit the budget. May compose, or wait for another
  // asker's composition: see TryFor.
  absl::StatusOr<std::optional<ElementPatch>> For(const std::string& name) const;
  // For(name) when it needs neither compose nor wait, into `*out`; false
  // (`*out` untouched) when it would: more than one step changed the tensor
  // and no composition of it is cached. Callers that must not block run For
  // elsewhere then.
  bool TryFor(const std::string& name, absl::StatusOr<std::optional<ElementPatch>>* out) const;

 private:
  // The steps' patches of `name`, in order; nullopt when a step sent it whole.
  std::optional<std::vector<const ElementPatch*>> Parts(const std::string& name) const;
  std::string Key(const std::string& name) const;

  std::vector<std::shared_ptr<const VersionPatches>> steps_;
  std::string checkpoint_;
  std::shared_ptr<PatchCompositions> compositions_;
};

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_CATALOG_VERSION_PATCHES_H_

#include "core/catalog/version_patches.h"

#include <algorithm>
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

namespace {

// `parts` (at least one) composed in order.
absl::StatusOr<std::optional<ElementPatch>> ComposeAll(const std::vector<const ElementPatch*>& parts) {
  std::optional<ElementPatch> composed = *parts.front();
  for (size_t i = 1; i < parts.size() && composed; ++i) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(composed, ComposePatches(*composed, *parts[i]));
  }
  return composed;
}

}  // namespace

// Bytes taken lock-free: a body's last holder gives them back from any
// thread, perhaps after the PatchCompositions is gone.
struct PatchCompositions::Budget {
  explicit Budget(uint64_t max) : max(max) {}

  bool TryTake(uint64_t n) {
    uint64_t now = bytes.load();
    while (now + n <= max) {
      if (bytes.compare_exchange_weak(now, now + n)) return true;
    }
    return false;
  }

  const uint64_t max;
  std::atomic<uint64_t> bytes{0};
};

struct PatchCompositions::Entry {
  std::string checkpoint, to;
  bool ready = false;  // made (or failed); until then askers wait
  absl::Status status;
  std::optional<ElementPatch> patch;
  uint64_t used = 0;  // tick of the last ask
};

PatchCompositions::PatchCompositions(uint64_t max_bytes, int max_composing)
    : budget_(std::make_shared<Budget>(max_bytes)), max_composing_(std::max(1, max_composing)) {}

PatchCompositions::Stats PatchCompositions::stats() const {
  absl::MutexLock lock(&mu_);
  Stats s;
  s.bytes = budget_->bytes.load();
  s.budget_bytes = budget_->max;
  for (const auto& [key, entry] : entries_) s.cached += entry->ready && entry->patch ? 1 : 0;
  s.made = made_;
  s.shared = shared_;
  s.over_budget = over_budget_;
  return s;
}

void PatchCompositions::Forget(const std::string& checkpoint, const std::string& keep_to) {
  std::vector<std::shared_ptr<Entry>> dropped;  // let go outside the lock
  absl::MutexLock lock(&mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    const Entry& e = *it->second;
    if (e.checkpoint == checkpoint && (keep_to.empty() || e.to != keep_to)) {
      dropped.push_back(std::move(it->second));
      entries_.erase(it++);
    } else {
      ++it;
    }
  }
}

std::optional<std::optional<ElementPatch>> PatchCompositions::Cached(const std::string& key) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end() || !it->second->ready) return std::nullopt;
  it->second->used = ++tick_;
  ++shared_;
  return it->second->patch;  // a ready entry kept made it (failures are not kept)
}

bool PatchCompositions::Reserve(uint64_t bytes) {
  if (bytes > budget_->max) return false;  // dropping the cache would not help
  while (!budget_->TryTake(bytes)) {
    std::shared_ptr<Entry> victim;  // dropped after the lock: gives its bytes back unless held
    absl::MutexLock lock(&mu_);
    auto oldest = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      const Entry& e = *it->second;
      if (e.ready && e.patch && (oldest == entries_.end() || e.used < oldest->second->used)) oldest = it;
    }
    if (oldest == entries_.end()) return false;
    victim = std::move(oldest->second);
    entries_.erase(oldest);
  }
  return true;
}

absl::StatusOr<std::optional<ElementPatch>> PatchCompositions::Compose(const std::string& key,
                                                                       const std::string& checkpoint,
                                                                       const std::string& to,
                                                                       const std::vector<const ElementPatch*>& parts) {
  std::shared_ptr<Entry> entry;
  {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = entries_.try_emplace(key);
    if (!inserted) {
      entry = it->second;
      entry->used = ++tick_;
      ++shared_;
      mu_.Await(absl::Condition(&entry->ready));
      if (!entry->status.ok()) return entry->status;
      return entry->patch;
    }
    it->second = entry = std::make_shared<Entry>();
    entry->checkpoint = checkpoint;
    entry->to = to;
    entry->used = ++tick_;
  }
  // What the composition can hold: the union of what the parts change, so
  // about their sum, and never the tensor (else it is not made). Checked
  // against the real size once made.
  uint64_t estimate = 0;
  for (const ElementPatch* part : parts) estimate += part->body.size();
  estimate = std::min(estimate, parts.front()->tensor_bytes());
  const bool fits = Reserve(estimate);
  absl::StatusOr<std::optional<ElementPatch>> made = std::nullopt;
  bool counted = fits;
  if (fits) {
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &PatchCompositions::MayCompose));
      ++composing_;
    }
    made = ComposeAll(parts);
    {
      absl::MutexLock lock(&mu_);
      --composing_;
    }
    const uint64_t size = made.ok() && made->has_value() ? (*made)->body.size() : 0;
    if (size > estimate && !budget_->TryTake(size - estimate)) {
      budget_->bytes.fetch_sub(estimate);
      made = std::nullopt;
      counted = false;
    } else if (size < estimate) {
      budget_->bytes.fetch_sub(estimate - size);
    }
    if (counted && size > 0) {
      // The bytes go back when the last holder lets the body go.
      struct Held {
        SharedBytes body;
        std::shared_ptr<Budget> budget;
        uint64_t bytes = 0;
        ~Held() {
          if (budget != nullptr) budget->bytes.fetch_sub(bytes);
        }
      };
      auto held = std::make_shared<Held>();
      held->body = (*made)->body;
      held->budget = budget_;
      held->bytes = size;
      (*made)->body = SharedBytes(std::shared_ptr<const void>(held, held.get()), (*made)->body.span());
    }
  }
  absl::MutexLock lock(&mu_);
  entry->ready = true;
  if (!made.ok()) entry->status = made.status();
  if (made.ok()) entry->patch = *made;
  if (counted && made.ok()) {
    ++made_;
  } else {
    if (made.ok()) ++over_budget_;
    // Not kept: a later ask tries again, when room may have been freed.
    if (auto it = entries_.find(key); it != entries_.end() && it->second == entry) entries_.erase(it);
  }
  return made;
}

std::optional<std::vector<const ElementPatch*>> PatchChain::Parts(const std::string& name) const {
  std::vector<const ElementPatch*> parts;
  for (const auto& step : steps_) {
    if (step->whole.contains(name)) return std::nullopt;
    if (auto it = step->patches.find(name); it != step->patches.end()) parts.push_back(&it->second);
  }
  return parts;
}

std::string PatchChain::Key(const std::string& name) const {
  return absl::StrCat(checkpoint_.size(), ":", checkpoint_, "|", from(), "|", to(), "|", name);
}

absl::StatusOr<std::optional<ElementPatch>> PatchChain::For(const std::string& name) const {
  std::optional<std::vector<const ElementPatch*>> parts = Parts(name);
  if (!parts || parts->empty()) return std::nullopt;  // sent whole, or unchanged
  if (parts->size() == 1) return *parts->front();
  if (compositions_ == nullptr) return ComposeAll(*parts);
  return compositions_->Compose(Key(name), checkpoint_, to(), *parts);
}

bool PatchChain::TryFor(const std::string& name, absl::StatusOr<std::optional<ElementPatch>>* out) const {
  std::optional<std::vector<const ElementPatch*>> parts = Parts(name);
  if (!parts || parts->size() < 2) {
    *out = parts && !parts->empty() ? std::optional<ElementPatch>(*parts->front()) : std::nullopt;
    return true;
  }
  if (compositions_ == nullptr) return false;
  std::optional<std::optional<ElementPatch>> cached = compositions_->Cached(Key(name));
  if (!cached) return false;
  *out = *std::move(cached);
  return true;
}

}  // namespace weightstore

#include "core/catalog/watch_cursor.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace weightstore {

bool WatchScope::Contains(const std::string& checkpoint) const {
  if (!name.empty()) return checkpoint == name;
  return absl::StartsWith(checkpoint, prefix);
}

namespace {

// What a diff's names hold on the heap, roughly: the characters and each
// string's own size.
uint64_t DiffBytes(const ManifestDiff& diff) {
  uint64_t bytes = sizeof(ManifestDiff);
  for (const auto* names : {&diff.changed, &diff.added, &diff.removed}) {
    for (const std::string& n : *names) bytes += sizeof(std::string) + n.size();
  }
  return bytes;
}

}  // namespace

std::shared_ptr<const ManifestDiff> DiffCache::Get(const std::string& name, const CheckpointManifest& base,
                                                   const CheckpointManifest& current) {
  const std::string key = absl::StrCat(name.size(), ":", name, "|", base.version(), "|", current.version());
  absl::MutexLock lock(&mu_);  // held while diffing: the others want the same diff
  if (auto it = diffs_.find(key); it != diffs_.end()) return it->second.first;
  auto diff = std::make_shared<const ManifestDiff>(DiffManifests(base, current));
  const uint64_t bytes = DiffBytes(*diff);
  diffs_.emplace(key, std::make_pair(diff, bytes));
  order_.push_back(key);
  bytes_ += bytes;
  while (order_.size() > std::max<size_t>(capacity_, 1) || (bytes_ > max_bytes_ && order_.size() > 1)) {
    auto oldest = diffs_.find(order_.front());
    bytes_ -= oldest->second.second;
    diffs_.erase(oldest);
    order_.pop_front();
  }
  return diff;
}

void DiffCache::Clear() {
  absl::MutexLock lock(&mu_);
  diffs_.clear();
  order_.clear();
  bytes_ = 0;
}

uint64_t DiffCache::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

WatchCursor::WatchCursor(const CheckpointRegistry* registry, WatchScope scope, std::map<std::string, std::string> known,
                         DiffCache* diffs)
    : registry_(registry), diffs_(diffs), scope_(std::move(scope)) {
  for (auto& [name, version] : known) {
    if (scope_.Contains(name)) known_.emplace(name, std::move(version));
  }
}

void WatchCursor::Start() {
  absl::MutexLock lock(&mu_);
  for (const auto& [name, version] : known_) owed_.insert(name);
  for (const auto& version : registry_->List()) {
    if (scope_.Contains(version->name())) owed_.insert(version->name());
  }
}

bool WatchCursor::MarkChanged(const std::string& name) {
  if (!scope_.Contains(name)) return false;
  absl::MutexLock lock(&mu_);
  const bool was_idle = owed_.empty() && synced_;
  owed_.insert(name);
  return was_idle;
}

std::optional<CheckpointUpdate> WatchCursor::Next() {
  while (true) {
    std::string name;
    {
      absl::MutexLock lock(&mu_);
      if (owed_.empty()) {
        if (synced_) return std::nullopt;
        synced_ = true;
        return CheckpointUpdate{};  // kSynced
      }
      name = *owed_.begin();
      owed_.erase(owed_.begin());
    }
    if (std::optional<CheckpointUpdate> update = UpdateFor(name)) return update;
  }
}

std::optional<CheckpointUpdate> WatchCursor::UpdateFor(const std::string& name) {
  std::shared_ptr<const CheckpointVersion> current = registry_->Get(name);
  auto known = known_.find(name);
  CheckpointUpdate update;
  update.name = name;
  if (current == nullptr) {
    if (known == known_.end()) return std::nullopt;
    update.kind = CheckpointUpdate::Kind::kRemoved;
    update.old_version = known->second;
    known_.erase(known);
    return update;
  }
  // A version written in place is being reopened: its successor is reported
  // when published.
  if (current->stale()) return std::nullopt;
  update.new_version = current->version();
  if (known == known_.end()) {
    update.kind = CheckpointUpdate::Kind::kAdded;
    known_.emplace(name, current->version());
    return update;
  }
  if (known->second == current->version()) return std::nullopt;
  update.kind = CheckpointUpdate::Kind::kReplaced;
  update.old_version = known->second;
  known->second = current->version();
  std::shared_ptr<const CheckpointManifest> base = registry_->FindManifest(name, update.old_version);
  if (current->manifest() == nullptr) {
    update.full_reason = "this daemon computes no tensor digests (weightstored --tensor-digests=false)";
  } else if (base == nullptr) {
    update.full_reason =
        absl::StrCat("version ", update.old_version, " of '", name, "' is not one this daemon keeps digests of");
  } else {
    update.diff = diffs_ != nullptr ? diffs_->Get(name, *base, *current->manifest())
                                    : std::make_shared<const ManifestDiff>(DiffManifests(*base, *current->manifest()));
  }
  return update;
}

}  // namespace weightstore

// The ledger (<models>/.weightstore-cache/ledger.json): what the cache
// pulled, its size, last use and versions, kept across restarts, and the
// origin's version ids the registry serves pulled checkpoints under.
#include <sys/stat.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <system_error>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"
#include "origin/node_cache.h"
#include "origin/node_cache_internal.h"

namespace weightstore::origin {

namespace fs = std::filesystem;

using node_cache_internal::Identity;
using node_cache_internal::IsApartPath;
using node_cache_internal::kApartFolder;
using node_cache_internal::kApartNameFile;
using node_cache_internal::LedgerPath;
using node_cache_internal::NowMs;
using node_cache_internal::ReadSmallFile;
using node_cache_internal::RemoveApartFolderIfEmpty;
using node_cache_internal::WriteAtomically;

void NodeCache::ReadLedger() {
  auto text = ReadSmallFile((fs::path(state_dir_) / "ledger.json").string(), size_t{64} << 20);
  if (!text.ok()) return;  // a first run
  nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return;  // unreadable: forget it (pulled files stay, as the operator's)
  for (const auto& [name, entry] : j.items()) {
    try {
      Cached c;
      c.paths = entry.at("paths").get<std::vector<std::string>>();
      c.last_used_unix_ms = entry.at("last_used_unix_ms").get<int64_t>();
      c.version = entry.value("version", "");
      c.file_version = entry.value("file_version", "");
      if (entry.contains("etags")) c.etags = entry.at("etags").get<std::vector<std::string>>();
      if (c.etags.size() != c.paths.size()) c.etags.clear();
      // Configs beside lie in the checkpoint's own apart folder, or are not
      // the cache's to count or remove.
      if (entry.contains("beside")) c.beside = entry.at("beside").get<std::vector<std::string>>();
      const std::string& owner = name;  // a structured binding: not captured by clang 14
      std::erase_if(c.beside, [&](const std::string& p) {
        return !node_cache_internal::IsBesidePath(owner, p) || absl::c_linear_search(c.paths, p);
      });
      if (entry.value("placing", false)) {
        c.identities = entry.at("identities").get<std::vector<std::array<uint64_t, 4>>>();
        c.replacing_version = entry.value("replacing_version", "");
        c.replacing_file_version = entry.value("replacing_file_version", "");
        if (!FinishPlacing(name, &c)) continue;
      }
      bool present = !c.paths.empty();
      for (const std::string& p : c.paths) {
        std::error_code size_ec;
        const uint64_t size = LedgerPath(p) ? fs::file_size(fs::path(models_dir_) / p, size_ec) : 0;
        present = present && LedgerPath(p) && !size_ec;
        c.bytes += size;
      }
      for (const std::string& p : c.beside) {
        std::error_code size_ec;
        const uint64_t size = fs::file_size(fs::path(models_dir_) / p, size_ec);
        if (!size_ec) c.bytes += size;
      }
      // Files replaced since they were placed are no longer the cache's.
      if (!present || FileVersion((fs::path(models_dir_) / c.paths.back()).string()).value_or("") != c.file_version) {
        continue;
      }
      cached_bytes_ += c.bytes;
      ledger_[name] = std::move(c);
    } catch (const nlohmann::json::exception&) {
      continue;
    }
  }
}

void NodeCache::ServeApart() {
  std::map<std::string, std::string> listed;  // name -> main file
  std::set<std::string> folders;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, c] : ledger_) {
      if (c.paths.empty() || !IsApartPath(c.paths.back())) continue;
      listed[name] = (fs::path(models_dir_) / c.paths.back()).string();
      folders.insert(fs::path(c.paths.back()).parent_path().filename().string());
    }
  }
  for (const auto& [name, path] : listed) {
    if (registry_->Get(name) != nullptr) continue;
    absl::StatusOr<std::shared_ptr<const CheckpointVersion>> loaded = registry_->Load(path, name);
    if (loaded.ok()) continue;
    // Its files stay; the next start tries them again, as the operator's.
    std::fprintf(stderr, "weightstored: node cache: '%s' is not served: %s\n", name.c_str(),
                 loaded.status().ToString().c_str());
    absl::MutexLock lock(&mu_);
    if (auto it = ledger_.find(name); it != ledger_.end()) {
      cached_bytes_ -= it->second.bytes;
      ledger_.erase(it);
    }
  }
  // Folders the ledger does not list: emptied by FinishPlacing (a pull killed
  // before it was recorded), which go; or a checkpoint whose entry was
  // dropped (its files replaced since, by a push or a step whose ledger write
  // was lost), served again under the name its folder records, as the
  // operator's: neither counted nor evicted. Nothing else is removed, and a
  // folder linked elsewhere is not looked into.
  const fs::path placed = fs::path(models_dir_) / std::string(kApartFolder);
  std::error_code ec;
  if (fs::symlink_status(placed, ec).type() != fs::file_type::directory) return;
  std::map<std::string, std::string> unlisted;  // name -> main file
  for (auto it = fs::directory_iterator(placed, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    std::error_code item_ec;
    if (folders.contains(it->path().filename().string()) || it->is_symlink(item_ec) || !it->is_directory(item_ec)) {
      continue;
    }
    // Configs beside weights that are gone (removed by hand) would be in
    // the way of the next pull: they go with the folder.
    RemoveApartFolderIfEmpty(it->path().string(), /*configs=*/true);
    absl::StatusOr<std::string> name = ReadSmallFile((it->path() / kApartNameFile).string(), 4096);
    if (!name.ok() || !IsLoadableName(*name, 4096)) continue;
    for (const auto& file : fs::directory_iterator(it->path(), item_ec)) {
      if (NameForPath(file.path().filename().string()) == "checkpoint") unlisted.emplace(*name, file.path().string());
    }
  }
  for (const auto& [name, path] : unlisted) {
    if (listed.contains(name)) continue;
    absl::StatusOr<std::shared_ptr<const CheckpointVersion>> loaded = registry_->LoadIfAbsent(path, name);
    if (!loaded.ok() && !absl::IsAlreadyExists(loaded.status())) {
      std::fprintf(stderr, "weightstored: node cache: '%s' (no longer the cache's) is not served: %s\n", name.c_str(),
                   loaded.status().ToString().c_str());
    }
  }
}

absl::Status NodeCache::SaveLedger() {
  std::string text;
  uint64_t sequence;
  {
    absl::MutexLock lock(&mu_);
    nlohmann::json j = nlohmann::json::object();
    for (const auto& [name, c] : ledger_) {
      j[name] = {{"paths", c.paths},
                 {"bytes", c.bytes},
                 {"last_used_unix_ms", c.last_used_unix_ms},
                 {"version", c.version},
                 {"file_version", c.file_version}};
      if (!c.etags.empty()) j[name]["etags"] = c.etags;
      if (!c.beside.empty()) j[name]["beside"] = c.beside;
      if (c.placing) {
        j[name]["placing"] = true;
        j[name]["identities"] = c.identities;
        if (!c.replacing_file_version.empty()) {
          j[name]["replacing_version"] = c.replacing_version;
          j[name]["replacing_file_version"] = c.replacing_file_version;
        }
      }
    }
    text = j.dump(1);
    sequence = ++ledger_sequence_;
  }
  // Written (and fsynced) outside mu_, which every Find takes to note a use;
  // a snapshot older than one already written is dropped.
  absl::MutexLock lock(&ledger_file_mu_);
  if (sequence < ledger_written_) return absl::OkStatus();
  ledger_written_ = sequence;
  return WriteAtomically((fs::path(state_dir_) / "ledger.json").string(), text);
}

void NodeCache::Touch(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = ledger_.find(name);
  if (it != ledger_.end()) it->second.last_used_unix_ms = NowMs();
}

void NodeCache::OnServedChanged(const std::string& name) {
  if (follower_ != nullptr) {
    // A checkpoint of the cache served anew (the first scan, a reload): the
    // follower watches what is held now. Not for a step's own publish.
    bool held = false;
    {
      absl::MutexLock lock(&mu_);
      held = ledger_.contains(name) && !stepping_.contains(name);
    }
    if (held) follower_->Held(name);
  }
  std::shared_ptr<const CheckpointVersion> served = registry_->Get(name);
  if (served == nullptr) return;
  {
    absl::MutexLock lock(&mu_);
    auto it = ledger_.find(name);
    if (it == ledger_.end() || it->second.placing || it->second.version.empty() ||
        it->second.file_version != served->file_version() || it->second.version == served->version()) {
      return;
    }
    it->second.version.clear();
  }
  (void)SaveLedger();
}

std::optional<std::string> NodeCache::OriginVersion(const std::string& name, const std::string& file_version) const {
  Cached c;
  {
    absl::MutexLock lock(&mu_);
    auto it = ledger_.find(name);
    if (it == ledger_.end() || it->second.version.empty()) return std::nullopt;
    if (!it->second.placing) {
      return it->second.file_version == file_version ? std::optional<std::string>(it->second.version) : std::nullopt;
    }
    c = it->second;
  }
  // A follower's replacement not renamed yet: the files held keep their id.
  if (!c.replacing_file_version.empty() && c.replacing_file_version == file_version) return c.replacing_version;
  // Being placed: the origin's id if every file is the one placed, and the
  // files opened are those (no file written or replaced since).
  if (c.paths.empty() || c.identities.size() != c.paths.size()) return std::nullopt;
  for (size_t i = 0; i < c.paths.size(); ++i) {
    struct stat st;
    const std::string path = (fs::path(models_dir_) / c.paths[i]).string();
    if (::lstat(path.c_str(), &st) != 0 || Identity(st) != c.identities[i]) return std::nullopt;
  }
  if (FileVersion((fs::path(models_dir_) / c.paths.back()).string()).value_or("") != file_version) return std::nullopt;
  return c.version;
}

void NodeCache::ForgetReplaced() {
  for (auto it = ledger_.begin(); it != ledger_.end();) {
    // A follower's step replaces the files, and then the ledger's entry.
    auto served = it->second.placing || stepping_.contains(it->first) ? nullptr : registry_->Get(it->first);
    if (served != nullptr && served->file_version() != it->second.file_version) {
      cached_bytes_ -= it->second.bytes;
      it = ledger_.erase(it);
    } else {
      ++it;
    }
  }
}

std::map<std::string, std::string> NodeCache::Followed() const {
  std::map<std::string, Cached> ledger;
  std::set<std::string> stepping;
  {
    absl::MutexLock lock(&mu_);
    ledger = ledger_;
    stepping = stepping_;
  }
  std::map<std::string, std::string> followed;
  for (const auto& [name, c] : ledger) {
    std::shared_ptr<const CheckpointVersion> served = registry_->Get(name);
    if (stepping.contains(name)) {
      // Mid-step the ledger lags what was published, and is marked placing
      // from just before the renames until the step's end; still followed
      // (a watch reopened or a poll taken now must not lose it), at the
      // version served.
      if (served != nullptr) {
        followed[name] = served->version();
      } else if (!c.version.empty()) {
        followed[name] = c.replacing_version.empty() ? c.version : c.replacing_version;
      }
    } else if (c.placing || c.version.empty()) {
      continue;
    } else if (served != nullptr && served->file_version() == c.file_version) {
      followed[name] = c.version;
    }
  }
  return followed;
}

uint64_t NodeCache::UnfollowedCheckpoints() const {
  // follower_ is set by Open and reset by the destructor, after the servers
  // that scrape this are gone.
  if (follower_ == nullptr) return 0;
  std::vector<std::pair<std::string, std::string>> held;  // name, file version as placed ("": mid-step)
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, c] : ledger_) {
      if (c.version.empty()) continue;
      // Mid-step, whatever the registry serves is the step's; a pull's
      // placing is not held yet.
      if (stepping_.contains(name)) {
        held.emplace_back(name, "");
      } else if (!c.placing) {
        held.emplace_back(name, c.file_version);
      }
    }
  }
  const std::set<std::string> followed = follower_->FollowedNames();
  uint64_t count = 0;
  for (const auto& [name, file_version] : held) {
    if (followed.contains(name) || !follower_->Follows(name)) continue;
    std::shared_ptr<const CheckpointVersion> served = registry_->Get(name);
    if (served != nullptr && (file_version.empty() || served->file_version() == file_version)) ++count;
  }
  return count;
}

void NodeCache::Recount(Cached* c) {
  uint64_t bytes = 0;
  for (const std::vector<std::string>* paths : {&c->paths, &c->beside}) {
    for (const std::string& path : *paths) {
      std::error_code ec;
      const uint64_t size = fs::file_size(fs::path(models_dir_) / path, ec);
      if (!ec) bytes += size;
    }
  }
  cached_bytes_ = cached_bytes_ - c->bytes + bytes;
  c->bytes = bytes;
}

bool NodeCache::BeginStep(const std::string& name, const CheckpointVersion& base) {
  absl::MutexLock lock(&mu_);
  auto it = ledger_.find(name);
  if (it == ledger_.end() || it->second.placing || it->second.file_version != base.file_version()) return false;
  stepping_.insert(name);
  return true;
}

absl::Status NodeCache::ReserveStep(const std::string& name, uint64_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    if (!stepping_.contains(name) || step_reserved_.contains(name)) {
      return absl::FailedPreconditionError(absl::StrCat("'", name, "': a step reserves once, within the step"));
    }
  }
  if (options_.max_bytes != 0 && bytes > options_.max_bytes) {  // never fits: blocked, not retried
    return absl::FailedPreconditionError(
        absl::StrCat("its new version needs ", bytes, " bytes on disk, over the cache budget of ", options_.max_bytes));
  }
  std::vector<Victim> victims;
  WEIGHTSTORE_RETURN_IF_ERROR(Reserve(name, bytes, &victims));
  {
    absl::MutexLock lock(&mu_);
    step_reserved_[name] = bytes;
  }
  if (!victims.empty()) {
    Evict(&victims);
    return SaveLedger();
  }
  return absl::OkStatus();
}

void NodeCache::EndStep(const std::string& name, const CheckpointVersion* published) {
  {
    absl::MutexLock lock(&mu_);
    stepping_.erase(name);
    if (auto r = step_reserved_.find(name); r != step_reserved_.end()) {
      reserved_bytes_ -= r->second;
      step_reserved_.erase(r);
    }
    auto it = ledger_.find(name);
    if (published == nullptr || it == ledger_.end() || it->second.placing) return;
    // The step rewrote files in place (a push): their sizes may differ.
    Cached& c = it->second;
    Recount(&c);
    c.file_version = published->file_version();
    c.version = published->version();
    c.last_used_unix_ms = NowMs();
  }
  // Unsaved, the next start finds the files unlike the ledger's and serves
  // them as the operator's: no longer followed, nor evicted.
  if (absl::Status saved = SaveLedger(); !saved.ok()) {
    std::fprintf(stderr, "weightstored: follow: '%s' is at version %s, but the ledger was not saved: %s\n",
                 name.c_str(), published->version().c_str(), saved.ToString().c_str());
  }
}

}  // namespace weightstore::origin

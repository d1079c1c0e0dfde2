// The disk budget: reserving room for a pull, choosing who leaves (the least
// recently used, never one in use) and removing them.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "core/shm/unix_socket.h"
#include "origin/node_cache.h"
#include "origin/node_cache_internal.h"

namespace weightstore::origin {

namespace fs = std::filesystem;

std::optional<std::vector<std::pair<std::string, UniqueFd>>> NodeCache::Claim(const std::string& name,
                                                                              const Cached& cached) const {
  // The registry holds one reference and so does this call: any other is a
  // stream or a request.
  if (auto version = registry_->Get(name); version != nullptr && version.use_count() > 2) return std::nullopt;
  std::vector<std::pair<std::string, UniqueFd>> locks;
  for (const std::string& p : cached.paths) {
    const std::string path = (fs::path(models_dir_) / p).string();
    // Never waits on a FIFO or follows a link put in a file's place.
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW));
    struct stat st;
    if (!fd.valid() || ::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) return std::nullopt;  // a same-host mapping holds it shared
    locks.emplace_back(path, std::move(fd));
  }
  return locks;
}

absl::Status NodeCache::Reserve(const std::string& name, uint64_t bytes, std::vector<Victim>* victims) {
  if (options_.max_bytes != 0 && bytes > options_.max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("it has ", bytes, " bytes, over the cache budget of ", options_.max_bytes));
  }
  absl::MutexLock choosing(&evict_mu_);
  for (int attempt = 0;; ++attempt) {
    std::vector<std::pair<std::string, Cached>> candidates;  // least recently used first
    uint64_t over = 0, used = 0;
    {
      absl::MutexLock lock(&mu_);
      ForgetReplaced();
      used = cached_bytes_ + reserved_bytes_;
      if (options_.max_bytes == 0 || used + bytes <= options_.max_bytes) {
        reserved_bytes_ += bytes;
        return absl::OkStatus();
      }
      over = used + bytes - options_.max_bytes;
      for (const auto& [n, c] : ledger_) {
        if (n != name && !c.placing && !flights_.contains(n) && !stepping_.contains(n)) candidates.emplace_back(n, c);
      }
    }
    std::sort(candidates.begin(), candidates.end(),
              [](const auto& a, const auto& b) { return a.second.last_used_unix_ms < b.second.last_used_unix_ms; });
    std::vector<Victim> chosen;
    std::vector<std::string> busy;
    uint64_t freed = 0;
    for (auto& [n, c] : candidates) {
      if (freed >= over) break;
      std::optional<std::vector<std::pair<std::string, UniqueFd>>> locks = Claim(n, c);
      if (!locks.has_value()) {
        busy.push_back(n);
        continue;
      }
      freed += c.bytes;
      const bool ours = FileVersion((fs::path(models_dir_) / c.paths.back()).string()).value_or("") == c.file_version;
      chosen.push_back({n, std::move(c), *std::move(locks), ours});
    }
    if (freed < over && !busy.empty() && attempt < 2) {  // in use for a moment, perhaps (a request)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    if (freed < over) {  // evicting would not be enough: evict nothing
      return absl::ResourceExhaustedError(absl::StrCat(
          "it needs ", bytes, " bytes; the cache budget is ", options_.max_bytes, ", ", used, " in use or being pulled",
          busy.empty() ? "" : absl::StrCat(" (in use: ", absl::StrJoin(busy, ", "), ")")));
    }
    {
      absl::MutexLock lock(&mu_);
      // Committed only as chosen: none used (touched) or pulled since, and
      // still enough with what others reserved meanwhile.
      bool unchanged = true;
      for (const Victim& v : chosen) {
        auto it = ledger_.find(v.name);
        unchanged = unchanged && it != ledger_.end() && !it->second.placing && !flights_.contains(v.name) &&
                    !stepping_.contains(v.name) && it->second.last_used_unix_ms == v.cached.last_used_unix_ms &&
                    it->second.file_version == v.cached.file_version && it->second.bytes == v.cached.bytes;
      }
      if (unchanged && cached_bytes_ + reserved_bytes_ - freed + bytes <= options_.max_bytes) {
        for (const Victim& v : chosen) {
          cached_bytes_ -= v.cached.bytes;
          ledger_.erase(v.name);
        }
        reserved_bytes_ += bytes;
        *victims = std::move(chosen);
        return absl::OkStatus();
      }
    }
    if (attempt == 2) {
      return absl::UnavailableError("the node cache kept changing while room was made for it; retry");
    }
  }
}

void NodeCache::Evict(std::vector<Victim>* victims) {
  for (Victim& v : *victims) {
    if (!v.ours) continue;  // forgotten: someone else's files now
    // Only what was claimed: a version published since (a push, an upload)
    // stays served, and a file now at a claimed path that is not the one
    // claimed stays. A request that took the version since the probe keeps
    // its mapping: the files go, their bytes stay until it drops them.
    if (auto served = registry_->Get(v.name); served != nullptr && served->file_version() == v.cached.file_version) {
      (void)registry_->Unload(v.name);
    }
    for (auto& [path, fd] : v.locks) {
      struct stat now, claimed;
      if (::lstat(path.c_str(), &now) == 0 && ::fstat(fd.get(), &claimed) == 0 && now.st_dev == claimed.st_dev &&
          now.st_ino == claimed.st_ino) {
        ::unlink(path.c_str());
      }
    }
    v.locks.clear();
    // The configs beside go with it: its apart folder is the cache's own.
    for (const std::string& path : v.cached.beside) ::unlink((fs::path(models_dir_) / path).c_str());
    if (!v.cached.paths.empty() && node_cache_internal::IsApartPath(v.cached.paths.back())) {
      node_cache_internal::RemoveApartFolderIfEmpty((fs::path(models_dir_) / v.cached.paths.back()).parent_path());
    }
    evictions_.fetch_add(1);
  }
  // The follower stops following what went (its registry listener finds no
  // ledger entry by then, so says nothing).
  if (follower_ != nullptr && !victims->empty()) follower_->Refresh();
}

}  // namespace weightstore::origin

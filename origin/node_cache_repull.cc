// A follower's step from an origin without element patches (S3): the
// origin's new version of a held checkpoint, pulled whole beside the files
// held, checked, and renamed over them; the registry then serves it under
// the origin's id, with element patches from the version replaced for the
// node's own clients.
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <memory>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/checkpoint.h"
#include "core/mapped_file.h"
#include "core/status_macros.h"
#include "origin/node_cache.h"
#include "origin/node_cache_internal.h"

namespace weightstore::origin {

namespace fs = std::filesystem;

using node_cache_internal::Errno;
using node_cache_internal::FsyncFolder;
using node_cache_internal::Identity;
using node_cache_internal::NowMs;

absl::StatusOr<FollowedCache::Repulled> NodeCache::Repull(const std::string& name, const CheckpointVersion& base) {
  Cached held;
  {
    absl::MutexLock lock(&mu_);
    auto it = ledger_.find(name);
    if (it == ledger_.end() || it->second.placing || it->second.file_version != base.file_version()) {
      return absl::AbortedError(absl::StrCat("'", name, "' is no longer held as this node placed it"));
    }
    held = it->second;
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(OriginCheckpoint checkpoint, origin_->Find(name));
  Repulled out;
  if (checkpoint.version == held.version) return out;
  // What cannot be followed so stays so until the origin has another
  // version (FailedPrecondition: the follower's blocked step).
  if (!ValidVersionId(checkpoint.version)) {
    return absl::FailedPreconditionError(absl::StrCat("the origin's version id of '", name, "', '",
                                                      absl::CHexEscape(checkpoint.version.substr(0, 64)),
                                                      "', is not 1 to 64 bytes of [0-9A-Za-z._-]"));
  }
  if (checkpoint.files.size() != 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("it is ", checkpoint.files.size(),
                     " files there; only a single-file checkpoint is followed from an origin without element "
                     "patches (a sharded one is served as pulled)"));
  }
  const OriginFile& file = checkpoint.files.front();
  if (held.paths.size() != 1 || file.path != held.paths.front()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the origin's file of '", name, "' is now '", absl::CHexEscape(file.path.substr(0, 256)),
                     "', not '", held.paths.empty() ? "" : held.paths.front(), "' (another format)"));
  }
  if (file.size > options_.max_checkpoint_bytes) {
    return absl::FailedPreconditionError(absl::StrCat("the origin's new version of '", name, "' has ", file.size,
                                                      " bytes, over this node's limit of ",
                                                      options_.max_checkpoint_bytes));
  }
  // Room for the new version beside the one held, which stays served (and
  // counted) until the new one replaces it: a budget that cannot hold both
  // says so, evicting nothing in use.
  std::vector<Victim> victims;
  WEIGHTSTORE_RETURN_IF_ERROR(Reserve(name, file.size, &victims));
  absl::Cleanup release = [&] {
    absl::MutexLock lock(&mu_);
    reserved_bytes_ -= file.size;
  };
  if (!victims.empty()) {
    Evict(&victims);
    WEIGHTSTORE_RETURN_IF_ERROR(SaveLedger());
  }
  Staged staged;
  std::atomic<uint64_t> pulled{0};
  WEIGHTSTORE_RETURN_IF_ERROR(Download(name, checkpoint, &pulled, &staged));
  out.bytes = pulled.load();
  const fs::path target = fs::path(models_dir_) / file.path;
  std::error_code ec;

  // It must open as what it claims to be before it replaces anything; one
  // that does not is not fetched again until the origin has another version.
  {
    OpenOptions open = registry_->options().open;
    const int fd = staged.fds.front().get();
    open.open_file = [fd](const std::string& path) -> absl::StatusOr<std::shared_ptr<const MappedFile>> {
      const int copy = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
      if (copy < 0) return absl::InternalError(Errno("cannot read", path));
      return MappedFile::FromDescriptor(copy, path);
    };
    if (absl::Status opens = Checkpoint::Open(target.string(), open).status(); !opens.ok()) {
      staged.fds.clear();
      fs::remove_all(staged.folder, ec);
      return absl::FailedPreconditionError(absl::StrCat("the origin's version ", checkpoint.version, " of '", name,
                                                        "' does not open: ", opens.message()));
    }
  }

  // Recorded (durably) before the rename: the registry takes the origin's id
  // for the new file as it opens it, and a crash on either side of the rename
  // leaves files the next run can tell as this cache's.
  struct stat st;
  if (::fstat(staged.fds.front().get(), &st) != 0) return absl::InternalError(Errno("cannot stat", staged.paths[0]));
  {
    absl::MutexLock lock(&mu_);
    auto it = ledger_.find(name);
    if (it == ledger_.end() || it->second.placing || it->second.file_version != held.file_version) {
      return absl::AbortedError(absl::StrCat("'", name, "' was replaced on this node while it was pulled"));
    }
    Cached& c = it->second;
    c.replacing_version = c.version;
    c.replacing_file_version = c.file_version;
    c.version = checkpoint.version;
    c.placing = true;
    c.identities = {Identity(st)};
  }
  auto restore = [&] {  // the rename did not happen: the files held stay the cache's
    {
      absl::MutexLock lock(&mu_);
      auto it = ledger_.find(name);
      if (it != ledger_.end() && it->second.placing && it->second.replacing_file_version == held.file_version) {
        Cached& c = it->second;
        c.version = c.replacing_version;
        c.placing = false;
        c.identities.clear();
        c.replacing_version.clear();
        c.replacing_file_version.clear();
      }
    }
    (void)SaveLedger();
  };
  if (absl::Status saved = SaveLedger(); !saved.ok()) {
    restore();
    return saved;
  }
  staged.fds.clear();
  if (::rename(staged.paths.front().c_str(), target.c_str()) != 0) {
    const std::string error = Errno("cannot place", target.string());
    restore();
    return absl::InternalError(error);
  }
  if (absl::Status synced = FsyncFolder(target.parent_path().string()); !synced.ok()) {
    std::fprintf(stderr, "weightstored: follow: '%s': %s\n", name.c_str(), synced.ToString().c_str());
  }
  fs::remove_all(staged.folder, ec);
  // Published by a rescan, which diffs it against the version it replaces.
  (void)registry_->Rescan();
  std::shared_ptr<const CheckpointVersion> served = registry_->Get(name);
  bool published = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = ledger_.find(name);
    published = served != nullptr && served->version() == checkpoint.version;
    if (it != ledger_.end() && published) {
      Cached& c = it->second;
      c.placing = false;
      c.identities.clear();
      c.replacing_version.clear();
      c.replacing_file_version.clear();
      c.file_version = served->file_version();
      cached_bytes_ = cached_bytes_ - c.bytes + file.size;
      c.bytes = file.size;
      c.last_used_unix_ms = NowMs();
    } else if (it != ledger_.end()) {
      // Served otherwise (its file replaced again meanwhile): not the
      // cache's any more, as for any file replaced under it.
      cached_bytes_ -= it->second.bytes;
      ledger_.erase(it);
    }
  }
  WEIGHTSTORE_RETURN_IF_ERROR(SaveLedger());
  if (!published) {
    return absl::AbortedError(absl::StrCat("the origin's version ", checkpoint.version, " of '", name,
                                           "' was placed, but the registry serves another"));
  }
  out.version = std::move(served);
  return out;
}

}  // namespace weightstore::origin

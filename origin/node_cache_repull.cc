// A follower's step from an origin without element patches (S3): the
// origin's new version of a held checkpoint, pulled whole beside the file
// held, checked, and put in its place by the registry (ReplaceFile), which
// serves it under the origin's id, with element patches from the version
// replaced for the node's own clients.
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
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
  // What cannot be followed so stays so until the origin has another
  // version (FailedPrecondition: the follower's blocked step).
  if (held.paths.size() != 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("it is ", held.paths.size(),
                     " files here; only a single-file checkpoint is followed from an origin without element "
                     "patches (a sharded one is served as pulled)"));
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(OriginCheckpoint checkpoint, origin_->Find(name));
  Repulled out;
  if (checkpoint.version == held.version) return out;
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
  const fs::path target = fs::path(models_dir_) / file.path;
  if (file.path != held.paths.front() || target.string() != base.path()) {
    return absl::FailedPreconditionError(absl::StrCat("the origin's file of '", name, "' is now '",
                                                      absl::CHexEscape(file.path.substr(0, 256)), "', not '",
                                                      held.paths.front(), "' (another format)"));
  }
  if (file.size > options_.max_checkpoint_bytes || (options_.max_bytes != 0 && file.size > options_.max_bytes)) {
    return absl::FailedPreconditionError(absl::StrCat("the origin's version ", checkpoint.version, " of '", name,
                                                      "' has ", file.size, " bytes, over this node's limit of ",
                                                      options_.max_checkpoint_bytes, " or its cache budget of ",
                                                      options_.max_bytes));
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
  absl::Status downloaded = Download(name, checkpoint, &pulled, &staged);
  std::error_code ec;
  if (absl::IsDataLoss(downloaded)) {
    // Bytes unlike what the origin vouches for: fetched again only for its
    // next version, not on a timer (a whole object each time).
    fs::remove_all((fs::path(state_dir_) / "partial" / Sha256Hex(name)), ec);
    return absl::FailedPreconditionError(
        absl::StrCat(downloaded.message(), "; not fetched again until the origin has another version"));
  }
  WEIGHTSTORE_RETURN_IF_ERROR(downloaded);
  out.bytes = pulled.load();
  // The staged file is dropped on every way out but its rename.
  absl::Cleanup drop_staged = [&] { fs::remove_all(staged.folder, ec); };

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
      return absl::FailedPreconditionError(absl::StrCat("the origin's version ", checkpoint.version, " of '", name,
                                                        "' does not open: ", opens.message()));
    }
  }
  if (stopping_.load()) return absl::CancelledError("the daemon is stopping");

  // Recorded (durably) before the rename, so that a crash on either side of
  // it leaves files the next run can tell as this cache's, under the right id.
  struct stat st;
  if (::fstat(staged.fds.front().get(), &st) != 0) return absl::InternalError(Errno("cannot stat", staged.paths[0]));
  const std::array<uint64_t, 4> placed = Identity(st);
  staged.fds.clear();
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
    c.identities = {placed};
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
  // Renamed over the held file and published by the registry, which checks
  // under its scan lock that the file is still the one served (a client's
  // push or an operator's file since is never overwritten), and diffs the
  // new version against it for the node's own clients.
  absl::StatusOr<std::shared_ptr<const CheckpointVersion>> published =
      registry_->ReplaceFile(base, staged.paths.front(), checkpoint.version,
                             absl::StrCat("following '", name, "' from ", origin_->Describe()));
  struct stat now;
  const bool renamed = ::lstat(target.c_str(), &now) == 0 && Identity(now) == placed;
  if (!published.ok() && !renamed) {
    restore();
    return published.status();
  }
  std::move(drop_staged).Invoke();
  {
    absl::MutexLock lock(&mu_);
    auto it = ledger_.find(name);
    if (it != ledger_.end()) {
      Cached& c = it->second;
      c.placing = false;
      c.identities.clear();
      c.replacing_version.clear();
      c.replacing_file_version.clear();
      // Published: the file the registry opened. Renamed but not published
      // (it failed after the rename): what is on disk, which OriginVersion
      // then names by the origin's id when it is opened.
      c.file_version =
          published.ok() ? (*published)->file_version() : FileVersion(target.string()).value_or(std::string());
      cached_bytes_ = cached_bytes_ - c.bytes + file.size;
      c.bytes = file.size;
      c.last_used_unix_ms = NowMs();
    }
    reserved_bytes_ -= file.size;  // counted in cached_bytes_ from here
    std::move(release).Cancel();
  }
  WEIGHTSTORE_RETURN_IF_ERROR(SaveLedger());
  if (!published.ok()) return published.status();
  out.version = *std::move(published);
  return out;
}

}  // namespace weightstore::origin

// A follower's step from an origin without element patches (S3): the
// origin's new version of a held checkpoint, pulled whole beside the file
// held, checked, and put in its place by the registry (ReplaceFile), which
// serves it under the origin's id, with element patches from the version
// replaced for the node's own clients. Of a sharded checkpoint, only the
// files whose etag moved are pulled: shards, and a new index naming the same
// shards (ReplaceShards).
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "core/checked_math.h"
#include "core/checkpoint.h"
#include "core/crc32c.h"
#include "core/format.h"
#include "core/mapped_file.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"
#include "origin/node_cache.h"
#include "origin/node_cache_internal.h"

namespace weightstore::origin {

namespace fs = std::filesystem;

using node_cache_internal::Errno;
using node_cache_internal::FsyncFolder;
using node_cache_internal::Identity;
using node_cache_internal::LedgerPath;
using node_cache_internal::NowMs;
using node_cache_internal::ReadSmallFile;

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
  WEIGHTSTORE_ASSIGN_OR_RETURN(OriginCheckpoint checkpoint, origin_->Find(name));
  // The weights follow; the configs beside stay as pulled.
  std::erase_if(checkpoint.files, [](const OriginFile& f) { return f.beside; });
  // Held apart (a hub name): the origin's files are placed as the pull
  // placed them, in the name's folder.
  if (!held.paths.empty() && node_cache_internal::IsApartPath(held.paths.back())) {
    if (absl::Status placed = node_cache_internal::PlaceApart(name, &checkpoint); !placed.ok()) {
      return absl::FailedPreconditionError(placed.message());
    }
    for (const OriginFile& f : checkpoint.files) {
      if (!node_cache_internal::IsApartPath(f.path)) {
        return absl::FailedPreconditionError(
            absl::StrCat("the origin's file '", absl::CHexEscape(f.path.substr(0, 256)), "' cannot lie apart"));
      }
    }
  }
  Repulled out;
  if (checkpoint.version == held.version) return out;
  if (!ValidVersionId(checkpoint.version)) {
    return absl::FailedPreconditionError(absl::StrCat("the origin's version id of '", name, "', '",
                                                      absl::CHexEscape(checkpoint.version.substr(0, 64)),
                                                      "', is not 1 to 64 bytes of [0-9A-Za-z._-]"));
  }
  if (held.paths.size() > 1) return RepullShards(name, base, held, checkpoint);
  if (checkpoint.files.size() != 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("it is ", checkpoint.files.size(),
                     " files there, and one here: a checkpoint that became sharded is served as pulled"));
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
  // Only the changed ranges where the header says which tensors changed;
  // else, or where that fails but for the origin's own errors, the whole file.
  absl::StatusOr<bool> ranged = RangeStep(name, checkpoint, base, &pulled, &staged);
  if (!ranged.ok() && !absl::IsInvalidArgument(ranged.status()) && !absl::IsDataLoss(ranged.status())) {
    return ranged.status();
  }
  if (!ranged.ok()) {
    std::fprintf(stderr, "weightstored: node cache: '%s': %s; fetching the whole file\n", name.c_str(),
                 std::string(ranged.status().message()).c_str());
  }
  if (!ranged.ok() || !*ranged) WEIGHTSTORE_RETURN_IF_ERROR(DownloadStep(name, checkpoint, &pulled, &staged));
  out.ranged = ranged.ok() && *ranged;
  std::error_code ec;
  out.bytes = pulled.load();
  // The staged file is dropped on every way out but its rename.
  absl::Cleanup drop_staged = [&] { fs::remove_all(staged.folder, ec); };

  // It must open as what it claims to be before it replaces anything; one
  // that does not is not fetched again until the origin has another version.
  {
    OpenOptions open = registry_->options().open;
    open.open_file = [](const std::string& path) -> absl::StatusOr<std::shared_ptr<const MappedFile>> {
      return absl::InvalidArgumentError(absl::StrCat("it names another file, '", path, "'"));
    };
    if (absl::Status opens =
            OpenCheckpointWith(target.string(), open, {.descriptors = {{target.string(), staged.fds.front().get()}}})
                .status();
        !opens.ok()) {
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
  WEIGHTSTORE_RETURN_IF_ERROR(BeginReplacing(name, held, checkpoint.version, {placed}));
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
    UndoReplacing(name, held);
    return published.status();
  }
  std::move(drop_staged).Invoke();
  // Published: the file the registry opened. Renamed but not published (it
  // failed after the rename): what is on disk, which OriginVersion then names
  // by the origin's id when it is opened.
  EndReplacing(name, published.ok() ? (*published)->file_version() : FileVersion(target.string()).value_or(""),
               checkpoint, published.ok(), file.size);
  std::move(release).Cancel();
  WEIGHTSTORE_RETURN_IF_ERROR(SaveLedger());
  if (!published.ok()) return published.status();
  out.version = *std::move(published);
  return out;
}

absl::StatusOr<FollowedCache::Repulled> NodeCache::RepullShards(const std::string& name, const CheckpointVersion& base,
                                                                const Cached& held, const OriginCheckpoint& listed) {
  // The same files, by the same paths, the index last: shards added,
  // removed or renamed are refused. A new index may list them in another
  // order; from here they are in the order held.
  if (listed.files.size() != held.paths.size()) {
    return absl::FailedPreconditionError(absl::StrCat("the origin's version ", listed.version, " of '", name, "' is ",
                                                      listed.files.size(), " files; the one held is ",
                                                      held.paths.size(), " (shards added or removed)"));
  }
  absl::flat_hash_map<std::string, size_t> held_at;
  for (size_t i = 0; i < held.paths.size(); ++i) held_at.emplace(held.paths[i], i);
  OriginCheckpoint checkpoint = listed;
  for (size_t i = 0; i < listed.files.size(); ++i) {
    const OriginFile& f = listed.files[i];
    auto it = held_at.find(f.path);
    const bool is_index = i + 1 == listed.files.size();
    if (it == held_at.end() || (it->second + 1 == held.paths.size()) != is_index) {
      return absl::FailedPreconditionError(absl::StrCat("the origin's file '", absl::CHexEscape(f.path.substr(0, 256)),
                                                        "' of '", name, "' is none of the ",
                                                        is_index ? "index" : "shards", " held (shards renamed)"));
    }
    checkpoint.files[it->second] = f;
    held_at.erase(it);  // each held file once
  }
  if ((fs::path(models_dir_) / held.paths.back()).string() != base.path()) {
    return absl::FailedPreconditionError(absl::StrCat("'", name, "' is not served from the index this node placed"));
  }
  uint64_t total = 0;
  for (const OriginFile& f : checkpoint.files) total = CheckedAdd(total, f.size).value_or(UINT64_MAX);
  if (total > options_.max_checkpoint_bytes || (options_.max_bytes != 0 && total > options_.max_bytes)) {
    return absl::FailedPreconditionError(absl::StrCat("the origin's version ", checkpoint.version, " of '", name,
                                                      "' has ", total, " bytes, over this node's limit of ",
                                                      options_.max_checkpoint_bytes, " or its cache budget of ",
                                                      options_.max_bytes));
  }
  constexpr uint64_t kMaxIndexBytes = uint64_t{64} << 20;
  // What moved: the files whose etag is not the one placed, or whose size
  // is not the one on disk. An etag is trusted only as strong (a weak one,
  // "W/...", may stay while the bytes change); a ledger that kept none
  // (an older one, or a step a kill cut) fetches every file. A file whose
  // etag moved but whose CRC32C the listing gives (an upstream daemon's,
  // whose etags name its version) and matches the file held has not.
  const bool known = held.etags.size() == held.paths.size();
  auto same_crc = [&](size_t i, const OriginFile& f) {
    if (f.crc32c.empty()) return false;
    const std::string path = (fs::path(models_dir_) / held.paths[i]).string();
    std::optional<uint32_t> crc;
    for (const auto& shard : base.checkpoint()->files()) {
      if (shard->path() == path) crc = Crc32c(shard->bytes().view());
    }
    if (!crc.has_value() && path == base.path()) {
      if (absl::StatusOr<std::string> index = ReadSmallFile(path, kMaxIndexBytes); index.ok()) crc = Crc32c(*index);
    }
    return crc.has_value() && absl::StrFormat("%08x", *crc) == absl::AsciiStrToLower(f.crc32c);
  };
  std::vector<bool> moved_files(checkpoint.files.size());
  for (size_t i = 0; i < checkpoint.files.size(); ++i) {
    const OriginFile& f = checkpoint.files[i];
    std::error_code size_ec;
    const uint64_t on_disk = fs::file_size(fs::path(models_dir_) / held.paths[i], size_ec);
    const bool other_bytes = size_ec || on_disk != f.size;
    const bool same_etag = known && !f.etag.empty() && !absl::StartsWith(f.etag, "W/") && f.etag == held.etags[i];
    moved_files[i] = other_bytes || (!same_etag && !same_crc(i, f));
  }
  auto moved = [&](size_t i) { return moved_files[i]; };
  // What moved is pulled: the shards, and the index too when its etag or
  // size moved. A new index (tensors added, removed or moved between the
  // same shards) replaces the one held, renamed after the shards; one that
  // kept its bytes (uploaded again) is not replaced.
  const size_t index_at = checkpoint.files.size() - 1;
  if (moved(index_at) && checkpoint.files[index_at].size > kMaxIndexBytes) {
    return absl::FailedPreconditionError(absl::StrCat("the origin's index of '", name, "' is ",
                                                      checkpoint.files[index_at].size, " bytes; at most ",
                                                      kMaxIndexBytes, " are taken"));
  }
  Repulled out;
  std::error_code ec;
  OriginCheckpoint changed = checkpoint;
  changed.files.clear();
  std::vector<size_t> replaced;  // into checkpoint.files (and held.paths)
  uint64_t bytes = 0;
  for (size_t i = 0; i <= index_at; ++i) {
    if (!moved(i)) continue;
    changed.files.push_back(checkpoint.files[i]);
    replaced.push_back(i);
    bytes = CheckedAdd(bytes, checkpoint.files[i].size).value_or(UINT64_MAX);
  }
  // None moved, by etag or size, and the index kept its bytes: the origin's
  // new version is the files held (uploaded again; or an etag that is no MD5,
  // as SSE-KMS gives). It is published under the origin's id, replacing
  // nothing.
  // Room for the new shards beside those held (as a single file's step);
  // none asked when none moved (a cache over its budget evicts nothing for it).
  std::vector<Victim> victims;
  if (bytes > 0) WEIGHTSTORE_RETURN_IF_ERROR(Reserve(name, bytes, &victims));
  absl::Cleanup release = [&] {
    absl::MutexLock lock(&mu_);
    reserved_bytes_ -= bytes;
  };
  if (!victims.empty()) {
    Evict(&victims);
    WEIGHTSTORE_RETURN_IF_ERROR(SaveLedger());
  }
  Staged staged;
  std::atomic<uint64_t> pulled{0};
  if (!replaced.empty()) WEIGHTSTORE_RETURN_IF_ERROR(DownloadStep(name, changed, &pulled, &staged));
  out.bytes += pulled.load();
  absl::Cleanup drop_staged = [&] { fs::remove_all(staged.folder, ec); };
  // A listing taken while a trainer uploaded its shards one by one may mix
  // two of its steps; one that moved while the shards came is not taken.
  WEIGHTSTORE_ASSIGN_OR_RETURN(OriginCheckpoint again, origin_->Find(name));
  if (again.version != checkpoint.version) {
    return absl::AbortedError(absl::StrCat("'", name, "' changed at the origin while its shards were pulled"));
  }
  // An index pulled with its bytes unchanged stays as it is.
  if (!replaced.empty() && replaced.back() == index_at) {
    absl::StatusOr<std::string> theirs = ReadSmallFile(staged.paths.back(), kMaxIndexBytes);
    absl::StatusOr<std::string> ours = ReadSmallFile(base.path(), kMaxIndexBytes);
    WEIGHTSTORE_RETURN_IF_ERROR(theirs.status());
    if (ours.ok() && *theirs == *ours) {
      replaced.pop_back();
      staged.fds.pop_back();
      staged.paths.pop_back();
    }
  }
  std::vector<std::pair<std::string, std::string>> replacements;  // staged file, file it replaces
  FileOverrides staged_files;
  absl::flat_hash_map<std::string, int>& staged_fd = staged_files.descriptors;
  for (size_t k = 0; k < replaced.size(); ++k) {
    const std::string target = (fs::path(models_dir_) / checkpoint.files[replaced[k]].path).string();
    replacements.emplace_back(staged.paths[k], target);
    staged_fd[target] = staged.fds[k].get();
  }
  for (const auto& f : base.checkpoint()->files()) {  // the shards kept are the ones served
    if (!staged_fd.contains(f->path())) staged_files.mapped[f->path()] = f;
  }
  // It must open as what it claims to be (the new shards under the index,
  // held or new, and exactly the shards held) before anything is replaced.
  {
    const OpenOptions& options = registry_->options().open;
    OpenOptions open = options;
    open.open_file = [&](const std::string& path) -> absl::StatusOr<std::shared_ptr<const MappedFile>> {
      if (path == base.path()) return OpenCheckpointFile(path, options);  // the index held
      return absl::InvalidArgumentError(absl::StrCat("it names a file that is not one of its shards, '", path, "'"));
    };
    absl::StatusOr<std::shared_ptr<const Checkpoint>> opens = OpenCheckpointWith(base.path(), open, staged_files);
    if (opens.ok() && (*opens)->files().size() != index_at) {
      opens = absl::InvalidArgumentError(
          absl::StrCat("its index names ", (*opens)->files().size(), " of its ", index_at, " shards"));
    }
    if (!opens.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("the origin's version ", checkpoint.version, " of '", name,
                                                        "' does not open: ", opens.status().message()));
    }
  }
  if (stopping_.load()) return absl::CancelledError("the daemon is stopping");

  // Recorded (durably) before the renames: every file's identity as it will
  // be once placed (a rename keeps it), and the version held, so that a
  // crash at any point leaves files the next start tells as this cache's.
  std::vector<std::array<uint64_t, 4>> identities;
  for (size_t i = 0; i < held.paths.size(); ++i) {
    const std::string target = (fs::path(models_dir_) / held.paths[i]).string();
    struct stat st;
    auto it = staged_fd.find(target);
    const int status = it != staged_fd.end() ? ::fstat(it->second, &st) : ::lstat(target.c_str(), &st);
    if (status != 0) return absl::InternalError(Errno("cannot stat", target));
    identities.push_back(Identity(st));
  }
  staged.fds.clear();
  staged_fd.clear();
  WEIGHTSTORE_RETURN_IF_ERROR(BeginReplacing(name, held, checkpoint.version, identities));
  absl::StatusOr<std::shared_ptr<const CheckpointVersion>> published = registry_->ReplaceShards(
      base, replacements, checkpoint.version, absl::StrCat("following '", name, "' from ", origin_->Describe()));
  // Whether any shard was renamed: the files on disk then are no longer the
  // version held (the registry's record finishes the step).
  bool renamed = false;
  for (size_t i : replaced) {
    struct stat now;
    const std::string target = (fs::path(models_dir_) / held.paths[i]).string();
    renamed = renamed || (::lstat(target.c_str(), &now) == 0 && Identity(now) == identities[i]);
  }
  if (!published.ok() && !renamed) {
    UndoReplacing(name, held);
    return published.status();
  }
  std::move(drop_staged).Invoke();
  EndReplacing(name, published.ok() ? (*published)->file_version() : FileVersion(base.path()).value_or(""), checkpoint,
               published.ok(), bytes);
  std::move(release).Cancel();
  WEIGHTSTORE_RETURN_IF_ERROR(SaveLedger());
  if (!published.ok()) return published.status();
  out.version = *std::move(published);
  return out;
}

absl::Status NodeCache::DownloadStep(const std::string& name, const OriginCheckpoint& checkpoint,
                                     std::atomic<uint64_t>* pulled, Staged* staged) {
  absl::Status downloaded = Download(name, checkpoint, pulled, staged);
  if (!absl::IsDataLoss(downloaded)) return downloaded;
  // Bytes unlike what the origin vouches for: fetched again only for its
  // next version, not on a timer (a whole object each time).
  std::error_code ec;
  fs::remove_all((fs::path(state_dir_) / "partial" / Sha256Hex(name)), ec);
  return absl::FailedPreconditionError(
      absl::StrCat(downloaded.message(), "; not fetched again until the origin has another version"));
}

absl::Status NodeCache::BeginReplacing(const std::string& name, const Cached& held, const std::string& version,
                                       std::vector<std::array<uint64_t, 4>> identities) {
  {
    absl::MutexLock lock(&mu_);
    auto it = ledger_.find(name);
    if (it == ledger_.end() || it->second.placing || it->second.file_version != held.file_version) {
      return absl::AbortedError(absl::StrCat("'", name, "' was replaced on this node while it was pulled"));
    }
    Cached& c = it->second;
    c.replacing_version = c.version;
    c.replacing_file_version = c.file_version;
    c.version = version;
    c.placing = true;
    c.identities = std::move(identities);
    // Until the step ends, which files are whose is not known: a start
    // after a kill meanwhile fetches every file at the next step.
    c.etags.clear();
  }
  absl::Status saved = SaveLedger();
  if (!saved.ok()) UndoReplacing(name, held);
  return saved;
}

void NodeCache::UndoReplacing(const std::string& name, const Cached& held) {
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
      c.etags = held.etags;
    }
  }
  (void)SaveLedger();
}

void NodeCache::EndReplacing(const std::string& name, const std::string& file_version,
                             const OriginCheckpoint& checkpoint, bool published, uint64_t reserved) {
  absl::MutexLock lock(&mu_);
  reserved_bytes_ -= reserved;  // counted in cached_bytes_ from here
  auto it = ledger_.find(name);
  if (it == ledger_.end()) return;
  Cached& c = it->second;
  c.placing = false;
  c.identities.clear();
  c.replacing_version.clear();
  c.replacing_file_version.clear();
  c.file_version = file_version;
  c.etags.clear();
  if (published) {
    for (const OriginFile& f : checkpoint.files) c.etags.push_back(f.etag);
  }
  Recount(&c);
  c.last_used_unix_ms = NowMs();
}

void NodeCache::FinishInterruptedSteps() {
  auto text = ReadSmallFile((fs::path(state_dir_) / "ledger.json").string(), size_t{64} << 20);
  if (!text.ok()) return;
  nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return;
  for (const auto& [name, entry] : j.items()) {
    if (!entry.is_object() || !entry.value("placing", false) || !entry.contains("paths") ||
        !entry["paths"].is_array() || entry["paths"].empty() || !entry["paths"].back().is_string()) {
      continue;
    }
    const std::string main = entry["paths"].back().get<std::string>();
    if (!LedgerPath(main) || IndexFormatForPath(main) == nullptr) continue;
    std::string error;
    if (!registry_->FinishInterruptedPublish((fs::path(models_dir_) / main).string(), &error)) {
      std::fprintf(stderr, "weightstored: node cache: '%s': %s\n", name.c_str(), error.c_str());
    }
  }
}

}  // namespace weightstore::origin

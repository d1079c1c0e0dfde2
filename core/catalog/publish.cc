// CheckpointRegistry's publishing of new files over a version's: PublishOver
// (a push's end, ReplaceFile's and ReplaceShards'), and the record under
// which a sharded checkpoint's shards are renamed as one step, finished after
// a crash by RollForwardPublishing.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/atomic_file.h"
#include "core/catalog/registry.h"
#include "core/format.h"
#include "core/mapped_file.h"
#include "core/shm/unix_socket.h"
#include "core/status_macros.h"
#include "core/status_util.h"

namespace weightstore {
namespace fs = std::filesystem;

namespace {

// A file's inode, size and mtime (ns), which a rename keeps and a write in
// place or a replacement changes.
struct FileIdentity {
  uint64_t inode = 0, size = 0;
  int64_t mtime_ns = 0;
  bool operator==(const FileIdentity&) const = default;
};
FileIdentity IdentityOf(const struct stat& st) {
  return {static_cast<uint64_t>(st.st_ino), static_cast<uint64_t>(st.st_size),
          static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
}

// A follower's check of what it wrote against what its upstream published:
// DataLoss naming the first tensor that differs.
absl::Status CheckExpected(const std::string& name, const CheckpointManifest& written,
                           const std::vector<ManifestTensor>& expected) {
  absl::flat_hash_map<absl::string_view, const ManifestTensor*> by_name;
  for (const ManifestTensor& t : expected) by_name.emplace(t.name, &t);
  for (const ManifestTensor& t : written.tensors()) {
    auto it = by_name.find(t.name);
    if (it == by_name.end()) {
      return absl::DataLossError(absl::StrCat("push to '", name, "' wrote tensor '", t.name.substr(0, 256),
                                              "', which the version expected does not have; nothing was published"));
    }
    if (!it->second->SameContentAs(t)) {
      return absl::DataLossError(absl::StrCat("push to '", name, "' wrote tensor '", t.name.substr(0, 256),
                                              "' unlike the version expected (dtype, shape or digest); nothing was "
                                              "published"));
    }
    by_name.erase(it);
  }
  if (!by_name.empty()) {
    return absl::DataLossError(absl::StrCat("push to '", name, "' lacks tensor '",
                                            by_name.begin()->first.substr(0, 256),
                                            "' of the version expected; nothing was published"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string NewFilePathBeside(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t run = absl::Uniform<uint64_t>(absl::BitGen()) % 1000000000000ULL;
  const fs::path p(path);
  return (p.parent_path() /
          absl::StrCat(".", p.filename().string(), ".new.", ::getpid(), "-", run, "-", ++counter, ".tmp"))
      .string();
}

absl::StatusOr<std::shared_ptr<const CheckpointVersion>> CheckpointRegistry::ReplaceFile(const CheckpointVersion& base,
                                                                                         const std::string& path,
                                                                                         const std::string& version_id,
                                                                                         absl::string_view what) {
  const std::string& name = base.name();
  if (!version_id.empty() && !ValidVersionId(version_id)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": '", version_id.substr(0, 64), "' is no version id"));
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = served_.find(name);
    if (it == served_.end() || it->second.current.get() != &base) {
      return absl::AbortedError(absl::StrCat(what, ": version ", base.version(),
                                             " was replaced or unloaded meanwhile; nothing was published"));
    }
    if (it->second.outside_models || base.checkpoint()->files().size() != 1) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": '", name, "' is not served from one file of the models folder"));
    }
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return StatusFromErrno(errno, absl::StrCat(what, ": cannot open '", path, "'"));
  struct Closed {
    int fd;
    ~Closed() { ::close(fd); }
  } closed{fd};
  size_t renamed = 0;
  return PublishOver(base, {{{path, fd, base.path()}}, version_id, std::nullopt, {}, nullptr, std::string(what)},
                     &renamed);
}

absl::StatusOr<std::shared_ptr<const CheckpointVersion>> CheckpointRegistry::ReplaceShards(
    const CheckpointVersion& base, const std::vector<std::pair<std::string, std::string>>& replacements,
    const std::string& version_id, absl::string_view what) {
  const std::string& name = base.name();
  if (!version_id.empty() && !ValidVersionId(version_id)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": '", version_id.substr(0, 64), "' is no version id"));
  }
  const Checkpoint& checkpoint = *base.checkpoint();
  {
    absl::MutexLock lock(&mu_);
    auto it = served_.find(name);
    if (it == served_.end() || it->second.current.get() != &base) {
      return absl::AbortedError(absl::StrCat(what, ": version ", base.version(),
                                             " was replaced or unloaded meanwhile; nothing was published"));
    }
    if (it->second.outside_models || IndexFormatForPath(base.path()) == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": '", name, "' is not served from an index and its shards in the models folder"));
    }
  }
  if (replacements.empty() && (version_id.empty() || version_id == base.version())) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": nothing replaces a shard of '", name, "', and the version id is the same"));
  }
  absl::flat_hash_set<std::string> shards, replaced;
  for (const auto& f : checkpoint.files()) shards.insert(f->path());
  for (const auto& [from, to] : replacements) {
    if ((!shards.contains(to) && to != base.path()) || !replaced.insert(to).second) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": '", to, "' is not a file of '", name, "', or is replaced twice"));
    }
  }
  // The index is renamed last: until then the shards on disk are read
  // under the index they were replaced under (a scan waits for the step,
  // or, after a crash, for its record to be finished).
  std::vector<std::pair<std::string, std::string>> ordered = replacements;
  std::stable_partition(ordered.begin(), ordered.end(), [&](const auto& r) { return r.second != base.path(); });
  // The digests of the shards kept carry over: only the new ones are read.
  std::vector<ManifestTensor> known;
  if (base.manifest() != nullptr) {
    for (const auto& shard : checkpoint.files()) {
      if (replaced.contains(shard->path())) continue;
      WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const Checkpoint> held,
                                   checkpoint.format().open(shard, options_.open));
      for (const CheckpointEntry& e : held->entries()) {
        if (const ManifestTensor* t = base.manifest()->Find(e.spec.name)) known.push_back(*t);
      }
    }
  }
  // Each moved beside its shard under a push's temporary name (the record of
  // the renames names files there), locked as a push's.
  struct Moved {
    std::vector<NewFile> files;
    size_t renamed = 0;
    ~Moved() {
      for (size_t i = 0; i < files.size(); ++i) {
        if (i >= renamed) ::unlink(files[i].path.c_str());
        if (files[i].fd >= 0) ::close(files[i].fd);
      }
    }
  } moved;
  for (const auto& [from, to] : ordered) {
    const std::string beside = NewFilePathBeside(to);
    if (::rename(from.c_str(), beside.c_str()) != 0) {
      return StatusFromErrno(errno, absl::StrCat(what, ": cannot move '", from, "' beside '", to, "'"));
    }
    moved.files.push_back({beside, -1, to});
    NewFile& f = moved.files.back();
    f.fd = ::open(beside.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (f.fd < 0 || ::flock(f.fd, LOCK_SH) != 0) {
      return StatusFromErrno(errno, absl::StrCat(what, ": cannot open '", beside, "'"));
    }
  }
  return PublishOver(base, {moved.files, version_id, std::nullopt, std::move(known), nullptr, std::string(what)},
                     &moved.renamed);
}

bool CheckpointRegistry::FinishInterruptedPublish(const std::string& index_path, std::string* error) {
  const std::string record = PublishingRecordPath(index_path);
  absl::MutexLock scan_lock(&scan_mu_);
  struct stat st;
  if (::lstat(record.c_str(), &st) != 0) return true;
  ScanReport report;
  const bool finished = RollForwardPublishing(record, &report);
  if (!finished && !report.errors.empty()) *error = report.errors.back();
  return finished;
}

absl::StatusOr<std::shared_ptr<const CheckpointVersion>> CheckpointRegistry::PublishOver(const CheckpointVersion& base,
                                                                                         Replacement r,
                                                                                         size_t* renamed) {
  const std::string& name = base.name();
  // It must open as a checkpoint, and have the tensors expected, before it
  // replaces anything. The version is the files written (opened from their
  // descriptors, not by path again), so the digests carried over describe
  // their bytes; a sharded one's unchanged shards are the base's mappings.
  FileOverrides overrides;
  for (const NewFile& f : r.files) overrides.descriptors[f.replaces] = f.fd;
  for (const auto& f : base.checkpoint()->files()) {
    if (!overrides.descriptors.contains(f->path())) overrides.mapped[f->path()] = f;
  }
  std::vector<std::shared_ptr<const MappedFile>> opened_written;
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const Checkpoint> opened,
                               OpenCheckpointWith(base.path(), options_.open, overrides, &opened_written));
  // The same shards as the base's, none added or dropped, so that a record
  // of the renames (one line a shard, and the index) means the same under
  // either index, and no file another checkpoint owns joins this one.
  {
    absl::flat_hash_set<std::string> was, now;
    for (const auto& f : base.checkpoint()->files()) was.insert(f->path());
    for (const auto& f : opened->files()) now.insert(f->path());
    if (was != now) {
      return absl::FailedPreconditionError(absl::StrCat(r.what, ": the new version of '", name, "' is ", now.size(),
                                                        " files, not the ", was.size(),
                                                        " shards it replaces; nothing was published"));
    }
  }
  if (opened_written.size() != r.files.size()) {  // the index names other shards than the base's
    return absl::AbortedError(absl::StrCat(r.what, ": the files of '", name,
                                           "' changed outside weightstored meanwhile; nothing was published"));
  }
  // Named by its content when digests are kept (as a rescan would name it),
  // or as the push asks; else by its file.
  std::shared_ptr<const CheckpointManifest> manifest;
  if (options_.tensor_digests) {
    const CheckpointManifest known_manifest("", std::move(r.known));
    WEIGHTSTORE_ASSIGN_OR_RETURN(manifest, ComputeManifest(*opened, r.version_id, known_manifest));
  }
  if (r.expected.has_value()) WEIGHTSTORE_RETURN_IF_ERROR(CheckExpected(name, *manifest, *r.expected));

  // 2. Under the scan lock: the base must still be served, unchanged and its
  //    files at their paths; then the new files replace them and the version
  //    is published.
  NotifyOnExit notify(this);
  absl::MutexLock scan_lock(&scan_mu_);
  if (Get(name).get() != &base) {
    return absl::AbortedError(absl::StrCat(r.what, ": version ", base.version(),
                                           " was replaced or unloaded meanwhile; nothing was published"));
  }
  absl::StatusOr<std::string> on_disk = FileVersion(base.path());
  if (!base.CheckUnchanged().ok() || !on_disk.ok() || *on_disk != base.file_version()) {
    return absl::AbortedError(absl::StrCat(
        r.what, ": its file was written or replaced outside weightstored meanwhile; nothing was published"));
  }
  // Nothing wrote the new files since they were opened.
  for (const auto& f : opened_written) {
    if (f->ChangedOnDisk()) {
      return absl::AbortedError(absl::StrCat(r.what, ": '", f->path(),
                                             "' was written while it was checked; nothing "
                                             "was published"));
    }
  }
  const fs::path folder_path = fs::path(base.path()).parent_path();
  auto sync_folder = [&] {
    if (const int folder = ::open(folder_path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); folder >= 0) {
      ::fsync(folder);
      ::close(folder);
    }
  };
  // Several renames are one step: recorded first, with what each file is,
  // so that a crash between them is finished by the next scan
  // (RollForwardPublishing), and only over the files this step replaces.
  std::string record;
  if (r.files.size() > 1) {
    record = PublishingRecordPath(base.path());
    std::string lines;
    for (const NewFile& f : r.files) {
      struct stat from, to;
      if (::fstat(f.fd, &from) != 0 || ::lstat(f.replaces.c_str(), &to) != 0) {
        return StatusFromErrno(errno, absl::StrCat(r.what, ": cannot stat '", f.replaces, "'"));
      }
      const FileIdentity shard = IdentityOf(to);
      absl::StrAppend(&lines, fs::path(f.path).filename().string(), "\t", fs::path(f.replaces).filename().string(),
                      "\t", static_cast<uint64_t>(from.st_ino), "\t", shard.inode, "\t", shard.size, "\t",
                      shard.mtime_ns, "\n");
    }
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFile> file, AtomicFile::Create(record, /*overwrite=*/true));
    WEIGHTSTORE_RETURN_IF_ERROR(file->Append(lines));
    WEIGHTSTORE_RETURN_IF_ERROR(file->Commit());
  }
  for (const NewFile& f : r.files) {
    if (::rename(f.path.c_str(), f.replaces.c_str()) == 0) {
      ++*renamed;
      continue;
    }
    const int error = errno;
    if (*renamed == 0) {  // nothing changed; the record must not come back
      if (!record.empty()) {
        ::unlink(record.c_str());
        sync_folder();
      }
      return StatusFromErrno(error, absl::StrCat(r.what, ": cannot put the new version of '", name, "' in place"));
    }
    // Some shards are new and some old on disk (the base is still served
    // from its mappings): finished now if the record can finish it, else
    // left to the next scan or load.
    *renamed = r.files.size();
    ScanReport finished;
    if (!RollForwardPublishing(record, &finished) || !finished.errors.empty() || fs::exists(record)) {
      return StatusFromErrno(error, absl::StrCat(r.what, ": cannot put '", f.replaces, "' of the new version of '",
                                                 name, "' in place; the next scan finishes the step from ", record));
    }
    break;
  }
  sync_folder();
  if (!record.empty() && fs::exists(record)) {
    ::unlink(record.c_str());
    sync_folder();
  }
  // The renames moved the files' change times, and nothing else.
  for (const auto& f : opened_written) f->Renamed();
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::string file_version, FileVersion(base.path()));
  std::string id = manifest != nullptr ? manifest->version() : !r.version_id.empty() ? r.version_id : file_version;
  auto version = std::make_shared<CheckpointVersion>(name, base.path(), std::move(opened), file_version, std::move(id),
                                                     NowUnixSeconds());
  Prepare(version.get());
  if (manifest != nullptr) version->SetManifest(std::move(manifest));
  // Element patches from the base, for clients that hold it.
  std::shared_ptr<const VersionPatches> steps = PatchesBetween(&base, *version, r.patches);
  {
    absl::MutexLock lock(&mu_);
    (void)Watch(name, *version);  // best effort: the synchronous checks remain
    Published(name, version.get(), std::move(steps));
    served_[name].current = version;
  }
  notify.Add(name);
  return std::shared_ptr<const CheckpointVersion>(std::move(version));
}

std::string PublishingRecordPath(const std::string& index_path) {
  const fs::path p(index_path);
  return (p.parent_path() / absl::StrCat(".", p.filename().string(), kPublishingRecordSuffix)).string();
}

bool CheckpointRegistry::RollForwardPublishing(const std::string& record, ScanReport* report) {
  const bool finished = FinishPublishingRecord(record, report);
  const std::string name = fs::path(record).filename().string();
  if (name.size() > 1 + kPublishingRecordSuffix.size() && absl::EndsWith(name, kPublishingRecordSuffix)) {
    const std::string index =
        (fs::path(record).parent_path() / name.substr(1, name.size() - 1 - kPublishingRecordSuffix.size())).string();
    absl::MutexLock lock(&held_mu_);
    if (finished) {
      held_back_.erase(index);
    } else {
      held_back_.insert(index);
    }
  }
  return finished;
}

bool CheckpointRegistry::FinishPublishingRecord(const std::string& record, ScanReport* report) {
  const fs::path path(record);
  const std::string record_name = path.filename().string();
  if (record_name.size() <= 1 + kPublishingRecordSuffix.size() ||
      !absl::EndsWith(record_name, kPublishingRecordSuffix)) {
    report->errors.push_back(absl::StrCat(record, ": not a publishing record's name"));
    return false;
  }
  const std::string index =
      (path.parent_path() / record_name.substr(1, record_name.size() - 1 - kPublishingRecordSuffix.size())).string();
  auto refuse = [&](absl::string_view why) {
    report->errors.push_back(absl::StrCat(record, ": ", why, "; nothing was renamed, and '", index,
                                          "' is not reopened until the record is removed"));
    return false;
  };
  UniqueFd folder(::open(path.parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  UniqueFd fd(folder.valid() ? ::openat(folder.get(), record_name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC) : -1);
  struct stat st;
  if (!fd.valid() || ::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return refuse("cannot be read");
  // Only this daemon's own record, which nobody else could have written.
  if (st.st_uid != ::geteuid() || (st.st_mode & 022) != 0) {
    return refuse("is not this daemon's (another owner, or writable by others)");
  }
  // A line a shard of the index or the index itself (the same shards under
  // the old index and the new), each at most two file names and four numbers.
  const std::set<std::string> shards = FilesOfIndex(index);
  const uint64_t max_bytes = (shards.size() + 1) * (2 * 256 + 4 * 21);
  if (shards.empty()) return refuse("its index names no shards");
  if (static_cast<uint64_t>(st.st_size) > max_bytes) return refuse(absl::StrCat("is over ", max_bytes, " bytes"));
  std::string text(static_cast<size_t>(st.st_size), '\0');
  if (!PreadFully(fd.get(), 0, reinterpret_cast<std::byte*>(text.data()), text.size(), record).ok()) {
    return refuse("cannot be read");
  }
  // Every line is checked before anything is renamed: a new file named as a
  // push names it, for a shard of the index, each still what the record
  // says (the shard not yet replaced, or replaced by that very file).
  struct Rename {
    std::string from, to;
    bool done = false;
  };
  std::vector<Rename> renames;
  size_t pending = 0, done = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> parts = absl::StrSplit(line, '\t');
    uint64_t from_inode = 0;
    FileIdentity shard;
    if (parts.size() != 6 || !absl::SimpleAtoi(parts[2], &from_inode) || !absl::SimpleAtoi(parts[3], &shard.inode) ||
        !absl::SimpleAtoi(parts[4], &shard.size) || !absl::SimpleAtoi(parts[5], &shard.mtime_ns) ||
        (!shards.contains((path.parent_path() / std::string(parts[1])).string()) &&
         (path.parent_path() / std::string(parts[1])).string() != index) ||
        absl::StrContains(parts[0], '/') || !absl::StartsWith(parts[0], absl::StrCat(".", parts[1], ".new.")) ||
        !IsAtomicFileTemporary(parts[0])) {
      return refuse("is not a publishing record of weightstored's");
    }
    Rename r{std::string(parts[0]), std::string(parts[1])};
    // A new index must name the shards the old one names, as PublishOver
    // checked before it wrote the record.
    if ((path.parent_path() / r.to).string() == index && ::faccessat(folder.get(), r.from.c_str(), F_OK, 0) == 0) {
      const FormatSpec* format = IndexFormatForPath(index);
      std::vector<std::string> named = format != nullptr && format->index_files != nullptr
                                           ? format->index_files((path.parent_path() / r.from).string())
                                           : std::vector<std::string>{};
      if (std::set<std::string>(named.begin(), named.end()) != shards) {
        return refuse(absl::StrCat("its new index '", r.from, "' names other shards"));
      }
    }
    struct stat from, to;
    const bool has_from = ::fstatat(folder.get(), r.from.c_str(), &from, AT_SYMLINK_NOFOLLOW) == 0;
    if (::fstatat(folder.get(), r.to.c_str(), &to, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(to.st_mode)) {
      return refuse(absl::StrCat("its shard '", r.to, "' is missing or no regular file"));
    }
    if (has_from && S_ISREG(from.st_mode) && from.st_uid == ::geteuid() && from.st_nlink == 1 &&
        static_cast<uint64_t>(from.st_ino) == from_inode && IdentityOf(to) == shard) {
      ++pending;
    } else if (!has_from && static_cast<uint64_t>(to.st_ino) == from_inode) {
      r.done = true;
      ++done;
    } else {
      r.to.clear();  // neither the base's shard nor the new one
    }
    renames.push_back(std::move(r));
  }
  const size_t foreign = renames.size() - pending - done;
  if (done == 0 && foreign > 0) {
    // Nothing of the step reached the shards, which are no longer its base
    // (replaced since): the step is void, and its files are temporaries.
    ::unlinkat(folder.get(), record_name.c_str(), 0);
    ::fsync(folder.get());
    report->errors.push_back(
        absl::StrCat(record, ": a push's record over shards replaced since; dropped, nothing was renamed"));
    return true;
  }
  if (foreign > 0) return refuse("its shards are neither the push's base nor its new files");
  for (const Rename& r : renames) {
    if (r.done) continue;
    if (::renameat(folder.get(), r.from.c_str(), folder.get(), r.to.c_str()) != 0) {
      report->errors.push_back(absl::StrCat(record, ": cannot rename '", r.from, "' to '", r.to,
                                            "': ", std::strerror(errno), "; '", index,
                                            "' is not reopened until the record is finished"));
      return false;
    }
  }
  ::fsync(folder.get());
  ::unlinkat(folder.get(), record_name.c_str(), 0);
  ::fsync(folder.get());
  if (pending > 0) {
    report->rolled_forward.push_back(absl::StrCat(index, ": ", pending, " of ", renames.size(), " files"));
  }
  return true;
}

}  // namespace weightstore

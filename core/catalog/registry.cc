#include "core/catalog/registry.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <set>
#include <thread>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "core/catalog/hub_cache.h"
#include "core/crc32c.h"
#include "core/mapped_file.h"
#include "core/quant_config.h"
#include "core/shm/sealed_memfd.h"
#include "core/shm/unix_socket.h"
#include "core/status_macros.h"
#include "core/status_util.h"
#include "core/utf8.h"

namespace weightstore {
namespace fs = std::filesystem;

int64_t NowUnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

namespace {

uint64_t Mix(uint64_t h, uint64_t v) {  // FNV-1a over the value's bytes
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xFF;
    h *= 0x100000001b3ULL;
  }
  return h;
}

absl::StatusOr<uint64_t> HashFile(const std::string& path, uint64_t h) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return StatusFromErrno(errno, absl::StrCat("cannot stat '", path, "'"));
  h = Mix(h, st.st_dev);
  h = Mix(h, st.st_ino);
  h = Mix(h, static_cast<uint64_t>(st.st_size));
  h = Mix(h, static_cast<uint64_t>(st.st_mtim.tv_sec) * 1000000000ULL + st.st_mtim.tv_nsec);
  // ctime too: a rewrite that puts mtime back (touch -r, rsync -t) cannot put it back.
  h = Mix(h, static_cast<uint64_t>(st.st_ctim.tv_sec) * 1000000000ULL + st.st_ctim.tv_nsec);
  return h;
}

// Size of the file at `path`, or of every file in the folder of an index (an
// upper bound on what a sharded checkpoint reads).
absl::StatusOr<uint64_t> BytesOnDisk(const std::string& path) {
  std::error_code ec;
  fs::path folder = fs::is_directory(path, ec)            ? fs::path(path)
                    : IndexFormatForPath(path) != nullptr ? fs::path(path).parent_path()
                                                          : fs::path();
  if (folder.empty()) {
    uint64_t size = fs::file_size(path, ec);
    if (ec) return absl::NotFoundError(absl::StrCat("cannot stat '", path, "': ", ec.message()));
    return size;
  }
  uint64_t total = 0;
  for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code item_ec;
    if (it->is_regular_file(item_ec)) total += it->file_size(item_ec);
  }
  if (ec) return absl::NotFoundError(absl::StrCat("cannot list '", folder.string(), "': ", ec.message()));
  return total;
}

bool IsHiddenOrTemporary(const fs::path& p) {
  const std::string name = p.filename().string();
  return absl::StartsWith(name, ".") || absl::EndsWith(name, ".tmp");
}

}  // namespace

std::set<std::string> FilesOfIndex(const std::string& path) {
  const FormatSpec* format = IndexFormatForPath(path);
  if (format == nullptr || format->index_files == nullptr) return {};
  std::vector<std::string> files = format->index_files(path);
  return std::set<std::string>(files.begin(), files.end());
}

bool CheckpointVersion::stale() const {
  if (modified_.load(std::memory_order_acquire)) return true;
  for (const auto& file : checkpoint_->files()) {
    if (file->faulted()) return true;
  }
  return false;
}

bool CheckpointVersion::MarkModified() const { return !modified_.exchange(true); }

absl::Status CheckpointVersion::CheckUnchanged() const {
  for (const auto& file : checkpoint_->files()) {
    // Files read into memory are private copies: their bytes cannot change.
    if (!file->is_mapped()) continue;
    if (file->faulted() || file->ChangedOnDisk() || modified_.load(std::memory_order_acquire)) {
      if (MarkModified() && on_stale_) on_stale_();
      return absl::AbortedError(absl::StrCat("checkpoint '", name_, "' changed on disk while it was being served ('",
                                             file->path(), "' was written or truncated in place); version ", version_,
                                             " is gone, and the new contents will be served as a new version"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckCheckpointName(absl::string_view name, size_t max_bytes) {
  auto shown = [&] { return absl::StrCat("'", absl::CHexEscape(name.substr(0, 64)), name.size() > 64 ? "'..." : "'"); };
  if (name.empty()) return absl::InvalidArgumentError("the checkpoint name is empty");
  if (name.size() > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint name ", shown(), " is ", name.size(), " bytes; at most ", max_bytes, " are allowed"));
  }
  if (!IsValidUtf8(name)) return absl::InvalidArgumentError(absl::StrCat("checkpoint name ", shown(), " is not UTF-8"));
  for (size_t i = 0; i < name.size(); ++i) {
    const auto c = static_cast<unsigned char>(name[i]);
    const bool c1 = c == 0xC2 && i + 1 < name.size() && static_cast<unsigned char>(name[i + 1]) <= 0x9F;
    if (c < 0x20 || c == 0x7F || c1) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint name ", shown(), " contains a control character"));
    }
  }
  return absl::OkStatus();
}

std::optional<std::string> NameForPath(const std::string& relative_path) { return StripFormatExtension(relative_path); }

absl::StatusOr<std::string> FileVersion(const std::string& path) {
  uint64_t h = 0xcbf29ce484222325ULL;
  WEIGHTSTORE_ASSIGN_OR_RETURN(h, HashFile(path, h));
  {
    for (const std::string& shard : FilesOfIndex(path)) {
      WEIGHTSTORE_ASSIGN_OR_RETURN(h, HashFile(shard, h));
    }
  }
  return absl::StrFormat("%016x", h);
}

CheckpointRegistry::CheckpointRegistry(RegistryOptions options)
    : options_(std::move(options)),
      compositions_(std::make_shared<PatchCompositions>(options_.kept_patch_bytes)),
      reopen_generation_(absl::Uniform<uint64_t>(absl::BitGen())) {
  if (!options_.watch_files) return;
  auto watcher =
      FileWatcher::Start([this](const std::set<std::string>& names) { OnFilesModified(names); }, options_.watch_settle);
  if (watcher.ok()) {
    watcher_ = *std::move(watcher);
  } else {
    watch_error_ = absl::StrCat("files are not watched for changes in place: ", watcher.status().message());
  }
}

CheckpointRegistry::~CheckpointRegistry() {
  // Its thread may be in a Rescan, which uses watcher_: stop it first.
  if (watcher_ != nullptr) watcher_->Stop();
  watcher_.reset();
}

void CheckpointRegistry::OnFilesModified(const std::set<std::string>& names) {
  for (const std::string& name : names) {
    if (std::shared_ptr<const CheckpointVersion> current = Get(name)) current->MarkModified();
  }
  Rescan();  // reopens what is stale
}

std::string CheckpointRegistry::RelativePath(const std::string& path) const {
  std::error_code ec;
  const fs::path file = fs::absolute(path, ec).lexically_normal();
  std::vector<std::string> roots = {options_.models_dir};
  roots.insert(roots.end(), options_.load_roots.begin(), options_.load_roots.end());
  for (const std::string& root : roots) {
    const fs::path folder = fs::absolute(root, ec).lexically_normal();
    const fs::path relative = file.lexically_relative(folder);
    if (!relative.empty() && *relative.begin() != "..") return relative.string();
  }
  return file.filename().string();
}

std::string CheckpointRegistry::Watch(const std::string& name, const CheckpointVersion& version) {
  if (watcher_ == nullptr) return "";
  std::vector<std::string> paths;
  if (version.preloaded_bytes() == 0) {  // a preloaded copy cannot change
    for (const auto& file : version.checkpoint()->files()) paths.push_back(file->path());
  }
  absl::Status status = watcher_->Set(name, paths);
  return status.ok() ? "" : std::string(status.message());
}

absl::StatusOr<std::shared_ptr<const CheckpointVersion>> CheckpointRegistry::OpenVersion(
    const std::string& name, const std::string& path, const CheckpointVersion* previous) const {
  const auto start = std::chrono::steady_clock::now();
  auto version = OpenVersionUntimed(name, path, previous);
  if (options_.on_load) {
    options_.on_load(name, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                     version.status());
  }
  return version;
}

absl::StatusOr<std::shared_ptr<const CheckpointVersion>> CheckpointRegistry::OpenVersionUntimed(
    const std::string& name, const std::string& path, const CheckpointVersion* previous) const {
  const bool preload = options_.preload_all || options_.preload.contains(name);
  OpenOptions open = options_.open;
  SegmentCache::Reservation reservation;
  if (preload) {
    if (options_.shm == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("cannot preload '", name, "': no shared-memory budget"));
    }
    // Reserve before copying, so an oversized checkpoint is refused up front.
    WEIGHTSTORE_ASSIGN_OR_RETURN(uint64_t bytes, BytesOnDisk(path));
    WEIGHTSTORE_ASSIGN_OR_RETURN(reservation, options_.shm->Reserve(bytes, absl::StrCat("preloading '", name, "'")));
    open.open_file = PreloadFile;
  }
  // Hash before and after opening: a file replaced meanwhile is opened again.
  for (int attempt = 0; attempt < 3; ++attempt) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::string before, FileVersion(path));
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const Checkpoint> checkpoint, Checkpoint::Open(path, open));
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::string after, FileVersion(path));
    if (before != after) continue;
    // A rewrite in place within one timestamp tick can keep every stat field:
    // an id given for the files, or the files' own, would name two contents.
    const bool rewritten_in_tick = previous != nullptr && previous->stale() && previous->file_version() == after;
    // With digests, the id names the content (ContentVersion) unless the files
    // were given one (a node's copy of an origin's version).
    std::optional<std::string> taken = rewritten_in_tick ? std::nullopt : TakenId(name, after);
    std::shared_ptr<const CheckpointManifest> manifest;
    if (options_.tensor_digests) {
      WEIGHTSTORE_ASSIGN_OR_RETURN(manifest, ComputeManifest(*checkpoint, taken.value_or("")));
    }
    std::string id = manifest != nullptr ? manifest->version() : taken.value_or(after);
    if (manifest == nullptr && rewritten_in_tick) {
      id = absl::StrFormat(
          "%016x", Mix(std::hash<std::string>()(previous->version()), ++reopen_generation_ + 0x9e3779b97f4a7c15ULL));
    }
    auto version =
        std::make_shared<CheckpointVersion>(name, path, std::move(checkpoint), after, std::move(id), NowUnixSeconds());
    Prepare(version.get());
    if (manifest != nullptr) {
      // The digests vouch for the bytes as opened: a file written meanwhile is
      // opened again.
      if (!version->CheckUnchanged().ok()) continue;
      version->SetManifest(std::move(manifest));
    }
    if (preload) version->HoldReservation(std::move(reservation));
    return std::shared_ptr<const CheckpointVersion>(std::move(version));
  }
  return absl::UnavailableError(absl::StrCat("'", path, "' keeps changing while it is opened"));
}

void CheckpointRegistry::SetVersionIds(VersionIds ids) {
  absl::MutexLock lock(&ids_mu_);
  version_ids_ = std::move(ids);
}

std::optional<std::string> CheckpointRegistry::TakenId(const std::string& name, const std::string& file_version) const {
  absl::ReaderMutexLock lock(&ids_mu_);
  if (!version_ids_) return std::nullopt;
  std::optional<std::string> id = version_ids_(name, file_version);
  return id.has_value() && ValidVersionId(*id) ? id : std::nullopt;
}

bool ValidVersionId(absl::string_view id) {
  return !id.empty() && id.size() <= 64 && std::all_of(id.begin(), id.end(), [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  });
}

void CheckpointRegistry::Prepare(CheckpointVersion* version) const {
  version->SetRelativePath(RelativePath(version->path()));
  version->SetOnStale([watcher = std::weak_ptr<FileWatcher>(watcher_)] {
    if (auto w = watcher.lock()) w->Poke();  // a rescan soon reopens it
  });
}

ScanReport CheckpointRegistry::Rescan() {
  NotifyOnExit notify(this);
  absl::MutexLock scan_lock(&scan_mu_);
  ScanReport report;
  // Find candidates: (name, path), indexes first so their shards are excluded.
  std::map<std::string, std::string> found;
  std::vector<fs::path> files, temporaries, hub_repos, publishing;
  std::error_code ec;
  fs::recursive_directory_iterator it(options_.models_dir, fs::directory_options::skip_permission_denied, ec), end;
  // Only the error_code overloads: a symlink loop or a vanishing file must be a
  // line in the report, never an exception.
  for (; !ec && it != end; it.increment(ec)) {
    std::error_code item_ec;
    if (IsHiddenOrTemporary(it->path())) {
      if (it->is_directory(item_ec)) {
        it.disable_recursion_pending();
      } else if (IsAtomicFileTemporary(it->path().filename().string())) {
        temporaries.push_back(it->path());
      } else if (const std::string name = it->path().filename().string();
                 name.size() > 1 + kPublishingRecordSuffix.size() && absl::EndsWith(name, kPublishingRecordSuffix)) {
        publishing.push_back(it->path());
      }
      continue;
    }
    // A Hugging Face hub cache's repo folder is served by repo id
    // (core/catalog/hub_cache.h), not walked.
    if (it->is_directory(item_ec) && !it->is_symlink(item_ec)) {
      if (std::optional<std::string> kind = HubRepoKind(it->path().string())) {
        it.disable_recursion_pending();
        if (*kind == "models") hub_repos.push_back(it->path());
        continue;
      }
    }
    if (it->is_regular_file(item_ec)) {
      files.push_back(it->path());
    } else if (item_ec && NameForPath(it->path().filename().string())) {
      report.errors.push_back(absl::StrCat(it->path().string(), ": ", item_ec.message()));
    }
  }
  // A walk cut short (out of descriptors, a network error) saw only part of the
  // folder: this scan then adds and replaces, and removes nothing.
  const bool complete = !ec;
  if (ec) report.errors.push_back(absl::StrCat(options_.models_dir, ": ", ec.message(), "; nothing is removed"));
  // A push a crash interrupted between its renames is finished first, before
  // its new files could be taken for abandoned temporaries. (The walk listed
  // the shards by name: they are opened, as renamed, below.)
  // One it cannot finish holds its checkpoint as served (or unserved), and
  // the temporaries of its folder, until an operator has looked.
  std::set<std::string> held_back, held_folders;
  for (const fs::path& r : publishing) {
    if (RollForwardPublishing(r.string(), &report)) continue;
    const std::string name = r.filename().string();
    const std::string index =
        (r.parent_path() / name.substr(1, name.size() - 1 - kPublishingRecordSuffix.size())).string();
    held_back.insert(index);
    report.held_back.push_back(index);
    held_folders.insert(r.parent_path().string());
  }
  for (const fs::path& t : temporaries) {
    if (held_folders.contains(t.parent_path().string())) continue;
    UniqueFd folder(::open(t.parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    const std::string name = t.filename().string();
    if (folder.valid() && IsAbandonedTemporary(folder.get(), name, options_.abandoned_temporary_seconds) &&
        ::unlinkat(folder.get(), name.c_str(), 0) == 0) {
      report.cleaned.push_back(t.string());
    }
  }
  std::sort(files.begin(), files.end());
  std::set<std::string> shards;
  for (const fs::path& f : files) {
    std::set<std::string> s = FilesOfIndex(f.string());
    shards.insert(s.begin(), s.end());
  }
  for (const fs::path& f : files) {
    if (shards.contains(f.string())) continue;
    // Lexically: a symlinked file is named by where it sits, not where it points.
    std::optional<std::string> name = NameForPath(f.lexically_relative(options_.models_dir).string());
    if (!name) continue;
    if (absl::Status valid = CheckCheckpointName(*name, options_.max_name_bytes); !valid.ok()) {
      report.errors.push_back(absl::StrCat(absl::CHexEscape(f.string()), ": ", valid.message()));
      continue;
    }
    if (!found.emplace(*name, f.string()).second) {
      report.errors.push_back(absl::StrCat(f.string(), ": another file is already served as '", *name, "'"));
    }
  }
  std::sort(hub_repos.begin(), hub_repos.end());
  for (const fs::path& repo : hub_repos) {
    HubRepoScan hub = ScanHubRepo(repo.string());
    report.errors.insert(report.errors.end(), hub.errors.begin(), hub.errors.end());
    for (const HubCheckpoint& c : hub.checkpoints) {
      if (absl::Status valid = CheckCheckpointName(c.name, options_.max_name_bytes); !valid.ok()) {
        report.errors.push_back(absl::StrCat(absl::CHexEscape(c.path), ": ", valid.message()));
      } else if (!found.emplace(c.name, c.path).second) {
        report.errors.push_back(absl::StrCat(c.path, ": another file is already served as '", c.name, "'"));
      }
    }
  }

  // Open what is new or changed, outside the lock.
  std::map<std::string, std::shared_ptr<const CheckpointVersion>> opened;
  std::map<std::string, std::shared_ptr<const VersionPatches>> patches;  // from the version each replaces
  {
    std::map<std::string, std::string> to_open;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [name, path] : found) {
        if (held_back.contains(path)) continue;
        auto cur = served_.find(name);
        absl::StatusOr<std::string> version = FileVersion(path);
        if (cur != served_.end() && cur->second.current->path() == path && version.ok() &&
            *version == cur->second.current->file_version() && !cur->second.current->stale()) {
          continue;
        }
        to_open[name] = path;
      }
      // Checkpoints loaded from a load root are not in the folder: reopen them
      // where they were, once written in place.
      for (const auto& [name, entry] : served_) {
        if (entry.pinned && entry.current->stale()) to_open[name] = entry.current->path();
      }
    }
    for (const auto& [name, path] : to_open) {
      std::shared_ptr<const CheckpointVersion> previous = Get(name);
      auto version = OpenVersion(name, path, previous.get());
      if (version.ok()) {
        patches[name] = PatchesBetween(previous.get(), **version);
        opened[name] = *version;
      } else {
        report.errors.push_back(absl::StrCat(path, ": ", version.status().message()));
      }
    }
  }
  if (!watch_error_.empty()) report.errors.push_back(std::exchange(watch_error_, ""));
  {
    absl::MutexLock lock(&mu_);
    for (auto& [name, version] : opened) {
      auto [cur, inserted] = served_.try_emplace(name);
      (inserted ? report.added : report.replaced).push_back(name);
      if (std::string error = Watch(name, *version); !error.empty()) report.errors.push_back(error);
      const bool pinned = !inserted && cur->second.pinned && !found.contains(name);
      // Patches hold only from the version they were diffed against.
      std::shared_ptr<const VersionPatches>& step = patches[name];
      if (step != nullptr && (inserted || cur->second.current->version() != step->from)) step = nullptr;
      Published(name, version.get(), std::move(step));
      cur->second.current = std::move(version);
      cur->second.pinned = pinned;
      cur->second.outside_models = pinned && cur->second.outside_models;
      notify.Add(name);
    }
    for (auto cur = served_.begin(); cur != served_.end();) {
      if (complete && !cur->second.pinned && !found.contains(cur->first)) {
        if (watcher_ != nullptr) watcher_->Remove(cur->first);
        report.removed.push_back(cur->first);
        Published(cur->first, nullptr);
        notify.Add(cur->first);
        cur = served_.erase(cur);
      } else {
        ++cur;
      }
    }
  }
  last_errors_.store(report.errors.size(), std::memory_order_relaxed);
  {
    // Held back until finished, or until an operator removed the record.
    absl::MutexLock lock(&held_mu_);
    for (auto it = held_back_.begin(); it != held_back_.end();) {
      std::error_code exists_ec;
      it = fs::exists(PublishingRecordPath(*it), exists_ec) ? std::next(it) : held_back_.erase(it);
    }
  }
  return report;
}

ScanHealth CheckpointRegistry::LastScan() const {
  absl::MutexLock lock(&held_mu_);
  return {last_errors_.load(std::memory_order_relaxed), held_back_.size()};
}

std::shared_ptr<const VersionPatches> CheckpointRegistry::PatchesBetween(
    const CheckpointVersion* from, const CheckpointVersion& to,
    const absl::flat_hash_map<std::string, ElementPatch>* known) const {
  if (options_.kept_patch_bytes == 0 || from == nullptr || from->manifest() == nullptr || to.manifest() == nullptr ||
      from->version() == to.version() || !from->CheckUnchanged().ok()) {
    return nullptr;
  }
  const unsigned threads = std::min(4u, std::max(1u, std::thread::hardware_concurrency()));
  absl::StatusOr<std::shared_ptr<const VersionPatches>> patches =
      DiffVersions(*from->checkpoint(), *from->manifest(), *to.checkpoint(), *to.manifest(), options_.kept_patch_bytes,
                   threads, known);
  // The bytes read must have been the versions' own: neither was written in
  // place meanwhile.
  if (!patches.ok() || !from->CheckUnchanged().ok() || !to.CheckUnchanged().ok()) return nullptr;
  return *std::move(patches);
}

void CheckpointRegistry::Published(const std::string& name, const CheckpointVersion* version,
                                   std::shared_ptr<const VersionPatches> patches) {
  {
    // Compositions to an earlier version are asked for no more.
    compositions_->Forget(name, version != nullptr ? version->version() : "");
    auto& steps = patches_[name];
    // Drops every step when the chain ends: nothing is served, or the new
    // version does not follow the last step (it came without patches).
    const bool broken =
        version == nullptr ||
        (!steps.empty() && steps.back()->to != (patches != nullptr ? patches->from : version->version()));
    if (broken) {
      for (const auto& step : steps) patch_bytes_ -= step->memory_bytes;
      steps.clear();
    }
    if (version != nullptr && patches != nullptr) {
      patch_bytes_ += patches->memory_bytes;
      steps.push_back(std::move(patches));
    }
    while (steps.size() + 1 > std::max<size_t>(options_.kept_versions, 1) && !steps.empty()) {
      patch_bytes_ -= steps.front()->memory_bytes;
      steps.pop_front();
    }
    if (steps.empty()) patches_.erase(name);
    // Over the byte bound: the oldest step of each name first.
    for (bool dropped = true; patch_bytes_ > options_.kept_patch_bytes && dropped;) {
      dropped = false;
      for (auto it = patches_.begin(); it != patches_.end() && patch_bytes_ > options_.kept_patch_bytes;) {
        patch_bytes_ -= it->second.front()->memory_bytes;
        it->second.pop_front();
        dropped = true;
        it = it->second.empty() ? patches_.erase(it) : std::next(it);
      }
    }
  }
  if (version == nullptr) {  // no longer served: nothing to compare with
    auto it = kept_.find(name);
    if (it == kept_.end()) return;
    for (const auto& m : it->second) kept_bytes_ -= m->memory_bytes();
    kept_.erase(it);
    return;
  }
  if (version->manifest() == nullptr) return;
  auto& kept = kept_[name];
  if (!kept.empty() && kept.back()->version() == version->version()) return;  // loaded again, unchanged
  kept.push_back(version->manifest());
  kept_bytes_ += version->manifest()->memory_bytes();
  while (kept.size() > std::max<size_t>(options_.kept_versions, 1)) {
    kept_bytes_ -= kept.front()->memory_bytes();
    kept.pop_front();
  }
  // Over the byte bound: drop earlier versions' manifests, the oldest of each
  // name first, until it fits (each current one stays).
  for (bool dropped = true; kept_bytes_ > options_.kept_manifest_bytes && dropped;) {
    dropped = false;
    for (auto& [other, manifests] : kept_) {
      if (manifests.size() < 2 || kept_bytes_ <= options_.kept_manifest_bytes) continue;
      kept_bytes_ -= manifests.front()->memory_bytes();
      manifests.pop_front();
      dropped = true;
    }
  }
}

void CheckpointRegistry::Notify(const std::vector<std::string>& names) {
  if (names.empty()) return;
  std::vector<std::shared_ptr<const std::function<void(const std::string&)>>> listeners;
  {
    absl::MutexLock lock(&listeners_mu_);
    for (const auto& [id, listener] : listeners_) listeners.push_back(listener);
  }
  for (const auto& listener : listeners) {
    for (const std::string& name : names) (*listener)(name);
  }
}

uint64_t CheckpointRegistry::AddListener(std::function<void(const std::string& name)> listener) {
  absl::MutexLock lock(&listeners_mu_);
  const uint64_t id = next_listener_++;
  listeners_.emplace(id, std::make_shared<const std::function<void(const std::string&)>>(std::move(listener)));
  return id;
}

void CheckpointRegistry::RemoveListener(uint64_t id) {
  absl::MutexLock lock(&listeners_mu_);
  listeners_.erase(id);
}

std::shared_ptr<const CheckpointManifest> CheckpointRegistry::FindManifest(const std::string& name,
                                                                           const std::string& version) const {
  absl::MutexLock lock(&mu_);
  auto it = kept_.find(name);
  if (it == kept_.end()) return nullptr;
  for (const auto& m : it->second) {
    if (m->version() == version) return m;
  }
  return nullptr;
}

std::shared_ptr<const PatchChain> CheckpointRegistry::FindPatches(const std::string& name, const std::string& since,
                                                                  const std::string& to) const {
  absl::MutexLock lock(&mu_);
  auto it = patches_.find(name);
  if (it == patches_.end() || it->second.back()->to != to || since == to) return nullptr;
  std::vector<std::shared_ptr<const VersionPatches>> steps;
  for (auto step = it->second.rbegin(); step != it->second.rend(); ++step) {
    steps.push_back(*step);
    if ((*step)->from == since) {
      std::reverse(steps.begin(), steps.end());
      // Cheap: what it composes lives in compositions_, shared by every chain.
      return std::make_shared<const PatchChain>(std::move(steps), name, compositions_);
    }
  }
  return nullptr;
}

std::shared_ptr<const CheckpointVersion> CheckpointRegistry::Get(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = served_.find(name);
  return it == served_.end() ? nullptr : it->second.current;
}

absl::StatusOr<std::shared_ptr<const CheckpointVersion>> CheckpointRegistry::Find(
    const std::string& name, const std::string& pinned_version) const {
  WEIGHTSTORE_RETURN_IF_ERROR(CheckCheckpointName(name, options_.max_name_bytes));
  if (pinned_version.size() > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("version of ", pinned_version.size(), " bytes is not one this daemon issues"));
  }
  std::shared_ptr<const CheckpointVersion> current = Get(name);
  if (current == nullptr) return absl::NotFoundError(absl::StrCat("checkpoint '", name, "' is not served"));
  if (current->stale()) {
    return absl::UnavailableError(
        absl::StrCat("checkpoint '", name, "' was written in place and is being reopened; retry"));
  }
  if (!pinned_version.empty() && pinned_version != current->version()) {
    return absl::AbortedError(absl::StrCat("checkpoint '", name, "' was replaced: version ", pinned_version,
                                           " is gone, ", current->version(), " is current"));
  }
  return current;
}

std::vector<std::shared_ptr<const CheckpointVersion>> CheckpointRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<const CheckpointVersion>> out;
  for (const auto& [name, entry] : served_) out.push_back(entry.current);
  return out;
}

absl::StatusOr<std::shared_ptr<const CheckpointVersion>> CheckpointRegistry::Load(const std::string& path,
                                                                                  const std::string& name) {
  // One at a time with scans: a rescan that started before this load must not
  // undo it (remove an upload just committed, or put back an older version).
  NotifyOnExit notify(this);
  absl::MutexLock scan_lock(&scan_mu_);
  return LoadLocked(path, name, &notify);
}

absl::StatusOr<std::shared_ptr<const CheckpointVersion>> CheckpointRegistry::LoadIfAbsent(const std::string& path,
                                                                                          const std::string& name) {
  NotifyOnExit notify(this);
  absl::MutexLock scan_lock(&scan_mu_);
  if (Get(name) != nullptr) return absl::AlreadyExistsError(absl::StrCat("checkpoint '", name, "' is served already"));
  return LoadLocked(path, name, &notify);
}

absl::StatusOr<std::shared_ptr<const CheckpointVersion>> CheckpointRegistry::LoadLocked(const std::string& path,
                                                                                        const std::string& name,
                                                                                        NotifyOnExit* notify) {
  if (path.empty() || path.size() > 4096 || path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("path of ", path.size(), " bytes is not a path to load"));
  }
  // Only the models folder and the load roots: a caller may not make the daemon
  // read (and describe in errors) any file it can open. As for a rescan, what
  // counts is where the path lies, not where symlinks the operator placed there
  // point; ".." is resolved first, so it cannot climb out.
  fs::path p(path);
  if (p.is_relative()) p = fs::path(options_.models_dir) / p;
  std::error_code ec;
  const fs::path absolute = fs::absolute(p, ec).lexically_normal();
  if (ec) return absl::InvalidArgumentError(absl::StrCat("cannot resolve '", path, "'"));
  auto inside = [&](const std::string& root) {
    std::error_code root_ec;
    std::string folder = fs::absolute(root, root_ec).lexically_normal().string();
    if (root_ec || folder.empty()) return false;
    if (folder.back() != '/') folder += '/';
    return absl::StartsWith(absolute.string(), folder);
  };
  const bool in_models = inside(options_.models_dir);
  // Below the models folder, but where no scan looks (a hidden folder).
  bool hidden = false;
  if (in_models) {
    std::error_code models_ec;
    const fs::path models = fs::absolute(options_.models_dir, models_ec).lexically_normal();
    for (const fs::path& part : absolute.lexically_relative(models)) hidden = hidden || IsHiddenOrTemporary(part);
  }
  if (!in_models && std::none_of(options_.load_roots.begin(), options_.load_roots.end(), inside)) {
    return absl::PermissionDeniedError(absl::StrCat("'", path,
                                                    "' is outside the models folder and every load root "
                                                    "(weightstored --load-root)"));
  }
  const fs::path& canonical = absolute;
  if (hidden) {
    // No scan looks here (a node's folder apart): a push to a sharded
    // checkpoint that a crash interrupted is finished as it is loaded.
    const std::string record = PublishingRecordPath(canonical.string());
    std::error_code record_ec;
    if (fs::exists(fs::symlink_status(record, record_ec))) {
      ScanReport report;
      if (!RollForwardPublishing(record, &report)) return absl::FailedPreconditionError(report.errors.back());
    }
  }
  std::string served_name = name;
  if (served_name.empty()) {
    std::optional<std::string> derived = NameForPath(canonical.filename().string());
    served_name = derived.value_or(canonical.filename().string());
  }
  WEIGHTSTORE_RETURN_IF_ERROR(CheckCheckpointName(served_name, options_.max_name_bytes));
  if (!IsLoadableName(served_name, options_.max_name_bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid checkpoint name '", served_name,
                     "' (a relative path of letters, digits, '-', '_', '.' and '/', and at most one '@REVISION')"));
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto version, OpenVersion(served_name, canonical.string()));
  {
    absl::MutexLock lock(&mu_);
    (void)Watch(served_name, *version);  // best effort: the synchronous checks remain
    Entry& entry = served_[served_name];
    Published(served_name, version.get());
    entry.current = version;
    entry.pinned = !in_models || hidden;
    entry.outside_models = !in_models;
  }
  notify->Add(served_name);
  return version;
}

absl::Status CheckpointRegistry::Unload(const std::string& name) {
  WEIGHTSTORE_RETURN_IF_ERROR(CheckCheckpointName(name, options_.max_name_bytes));
  NotifyOnExit notify(this);
  absl::MutexLock scan_lock(&scan_mu_);  // a push or load in progress publishes first, or not at all
  absl::MutexLock lock(&mu_);
  if (served_.erase(name) == 0) return absl::NotFoundError(absl::StrCat("checkpoint '", name, "' is not served"));
  if (watcher_ != nullptr) watcher_->Remove(name);
  Published(name, nullptr);
  notify.Add(name);
  return absl::OkStatus();
}

absl::Status PutSession::Append(absl::string_view data) {
  if (bytes_ + data.size() > max_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat("upload of '", name_, "' exceeds ", max_bytes_, " bytes"));
  }
  if (expected_size_ != 0 && bytes_ + data.size() > expected_size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("upload of '", name_, "' is larger than its declared ", expected_size_, " bytes"));
  }
  bytes_ += data.size();
  crc32c_ = Crc32cExtend(crc32c_, data);
  return file_->Append(data);
}

absl::StatusOr<std::unique_ptr<PutSession>> CheckpointRegistry::BeginPut(const std::string& name,
                                                                         const std::string& extension, bool overwrite,
                                                                         uint64_t expected_size) {
  if (!IsPlaceableName(name, options_.max_name_bytes)) {
    WEIGHTSTORE_RETURN_IF_ERROR(CheckCheckpointName(name, options_.max_name_bytes));
    return absl::InvalidArgumentError(absl::StrCat("invalid checkpoint name '", name,
                                                   "' (a relative path of letters, digits, '-', '_', '.' and '/')"));
  }
  bool known = false;  // one of the scanned extensions, exactly
  for (const FormatSpec* format : Formats()) {
    for (absl::string_view ext : format->extensions) known |= ext.substr(1) == extension;
  }
  if (!known) {
    return absl::InvalidArgumentError(
        absl::StrCat("extension '", extension, "' is not one of ", FormatExtensions(), " (without the dot)"));
  }
  if (expected_size > options_.max_put_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("upload of ", expected_size, " bytes exceeds the limit of ", options_.max_put_bytes));
  }
  auto session = std::make_unique<PutSession>();
  session->name_ = name;
  session->path_ = (fs::path(options_.models_dir) / absl::StrCat(name, ".", extension)).string();
  session->expected_size_ = expected_size;
  session->max_bytes_ = options_.max_put_bytes;
  // Walk (and make) the folders one at a time without following symlinks, so a
  // link inside the models folder cannot steer the upload out of it.
  const std::vector<std::string> parts = absl::StrSplit(name, '/');
  UniqueFd folder(::open(options_.models_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!folder.valid()) return StatusFromErrno(errno, absl::StrCat("cannot open '", options_.models_dir, "'"));
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    if (::mkdirat(folder.get(), parts[i].c_str(), 0755) != 0 && errno != EEXIST) {
      return StatusFromErrno(errno, absl::StrCat("cannot create the folder for '", session->path_, "'"));
    }
    UniqueFd next(::openat(folder.get(), parts[i].c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!next.valid()) {
      if (errno == ELOOP || errno == ENOTDIR) {
        return absl::InvalidArgumentError(
            absl::StrCat("upload of '", name, "': '", parts[i], "' in the models folder is a symlink or not a folder"));
      }
      return StatusFromErrno(errno, absl::StrCat("cannot open the folder for '", session->path_, "'"));
    }
    folder = std::move(next);
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(
      session->file_,
      AtomicFile::CreateAt(folder.get(), absl::StrCat(parts.back(), ".", extension), session->path_, overwrite));
  return session;
}

absl::StatusOr<std::shared_ptr<const CheckpointVersion>> CheckpointRegistry::FinishPut(
    std::unique_ptr<PutSession> session) {
  if (session->expected_size_ != 0 && session->bytes_ != session->expected_size_) {
    return absl::InvalidArgumentError(absl::StrCat("upload of '", session->name_, "' ended after ", session->bytes_,
                                                   " of ", session->expected_size_, " bytes"));
  }
  // Validate before it becomes visible: a bad upload leaves nothing behind.
  // The temporary is read through its own descriptor, not its path.
  WEIGHTSTORE_RETURN_IF_ERROR(session->file_->Flush());
  OpenOptions open = options_.open;
  open.open_file = [](const std::string& path) -> absl::StatusOr<std::shared_ptr<const MappedFile>> {
    return absl::InvalidArgumentError(absl::StrCat("it names another file, '", path, "'"));
  };
  absl::StatusOr<std::shared_ptr<const Checkpoint>> check = OpenCheckpointWith(
      session->file_->temp_path(), open, {.descriptors = {{session->file_->temp_path(), session->file_->fd()}}});
  if (!check.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("upload of '", session->name_, "' is not a valid checkpoint: ", check.status().message()));
  }
  // Committed and served under the scan lock, so that a push or rescan sees
  // either the old file or the new one served.
  NotifyOnExit notify(this);
  absl::MutexLock scan_lock(&scan_mu_);
  WEIGHTSTORE_RETURN_IF_ERROR(session->file_->Commit());
  return LoadLocked(session->path_, session->name_, &notify);
}

bool IsPlaceableName(absl::string_view name, size_t max_bytes) {
  if (name.empty() || name.size() > max_bytes || name.front() == '/') return false;
  for (absl::string_view part : absl::StrSplit(name, '/')) {
    if (part.empty() || part == "." || part == ".." || part.front() == '.' || part.size() > 255) return false;
  }
  for (char c : name) {
    if (!(absl::ascii_isalnum(c) || c == '/' || c == '-' || c == '_' || c == '.')) return false;
  }
  return true;
}

bool IsLoadableName(absl::string_view name, size_t max_bytes) {
  if (name.size() > max_bytes) return false;
  const size_t at = name.find('@');
  if (at == absl::string_view::npos) return IsPlaceableName(name, max_bytes);
  return IsPlaceableName(name.substr(0, at), max_bytes) && IsPlaceableName(name.substr(at + 1), max_bytes);
}

absl::StatusOr<std::vector<StoredFile>> StoredFiles(const CheckpointVersion& version) {
  if (version.preloaded_bytes() > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint '", version.name(), "' is preloaded into memory; its files are not served as stored"));
  }
  const fs::path main(version.path());
  const std::string file_name = main.filename().string();
  const std::optional<std::string> stem = NameForPath(file_name);
  if (!stem) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint '", version.name(), "' is served from a file of no known extension"));
  }
  std::vector<StoredFile> files;
  if (NameForPath(version.relative_path()) != version.name()) {
    // A link is followed only as the hub cache follows a snapshot's: into
    // its repo folder (models--ORG--NAME/blobs/). What else the daemon can
    // read is not served.
    const fs::path snapshot = main.parent_path();
    std::error_code repo_ec;
    const fs::path repo = snapshot.parent_path().filename() == "snapshots"
                              ? fs::canonical(snapshot.parent_path().parent_path(), repo_ec)
                              : fs::path();
    for (absl::string_view config : QuantizationConfig::kFileNames) {
      const fs::path p = main.parent_path() / std::string(config);
      std::error_code ec;
      if (!fs::is_regular_file(p, ec)) continue;
      if (fs::is_symlink(fs::symlink_status(p, ec))) {
        const fs::path inside = fs::canonical(p, ec).lexically_relative(repo);
        if (ec || repo_ec || repo.empty() || inside.empty() || *inside.begin() == "..") continue;
      }
      const uintmax_t size = fs::file_size(p, ec);
      if (ec || size > QuantizationConfig::kMaxFileBytes) continue;  // not what the checkpoint was opened with
      files.push_back({std::string(config), p.string(), false, size, nullptr, /*beside=*/true});
    }
  }
  const MappedFile* main_mapping = nullptr;
  for (const auto& f : version.checkpoint()->files()) {
    const fs::path p(f->path());
    if (p == main) {
      main_mapping = f.get();
      continue;
    }
    if (p.parent_path() != main.parent_path()) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint '", version.name(), "' has a shard '",
                                                        p.filename().string(), "' outside its index's folder"));
    }
    files.push_back({p.filename().string(), f->path(), false, f->size(), f.get()});
  }
  StoredFile m{file_name.substr(stem->size()), version.path(), true, 0, main_mapping};
  if (main_mapping != nullptr) {
    m.size = main_mapping->size();
  } else {
    std::error_code ec;
    m.size = fs::file_size(main, ec);
    if (ec) return absl::NotFoundError(absl::StrCat("checkpoint '", version.name(), "': ", ec.message()));
  }
  files.push_back(std::move(m));
  return files;
}

}  // namespace weightstore

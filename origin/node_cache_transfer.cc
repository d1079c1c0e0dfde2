// A flight's transfer: reading a checkpoint's files from the origin into
// partial files (resuming what an earlier pull left), checking each whole,
// and placing them in the models folder; and, at Open, finishing a placement
// a crash interrupted.
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <deque>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <thread>

#include "absl/algorithm/container.h"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/catalog/registry.h"
#include "core/quant_config.h"
#include "core/shm/unix_socket.h"
#include "core/status_macros.h"
#include "origin/node_cache.h"
#include "origin/node_cache_internal.h"
#include "origin/node_cache_partial.h"

namespace weightstore::origin {

namespace fs = std::filesystem;

using node_cache_internal::ApartFolder;
using node_cache_internal::Errno;
using node_cache_internal::FsyncFolder;
using node_cache_internal::Identity;
using node_cache_internal::kApartNameFile;
using node_cache_internal::LedgerPath;
using node_cache_internal::NowMs;
using node_cache_internal::PlaceablePath;
using node_cache_internal::PlaceApart;
using node_cache_internal::Progress;
using node_cache_internal::ReadSmallFile;
using node_cache_internal::Remembered;
using node_cache_internal::RemoveApartFolderIfEmpty;
using node_cache_internal::WholeFileCheck;
using node_cache_internal::WriteAtomically;

namespace {

constexpr absl::Duration kProgressEvery = absl::Seconds(2);
// Bytes a pull writes between two starts of their writeback to disk.
constexpr uint64_t kWritebackBytes = uint64_t{8} << 20;

}  // namespace

absl::Status NodeCache::Download(const std::string& name, const OriginCheckpoint& checkpoint,
                                 std::atomic<uint64_t>* pulled, Staged* staged) {
  // Where this pull's partial files and progress live.
  const std::string folder = (fs::path(state_dir_) / "partial" / Sha256Hex(name)).string();
  const std::string state_path = (fs::path(folder) / "progress.json").string();
  std::error_code ec;
  fs::create_directories(folder, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create '", folder, "': ", ec.message()));
  Progress progress;
  // Of an earlier pull of another version (the origin moved on meanwhile):
  // the files it had begun that this one lists unchanged, by path, size and a
  // strong etag, and that can be checked whole (a CRC32C or an MD5 listed),
  // as (new index, old index).
  std::vector<std::pair<size_t, size_t>> carried;
  std::optional<Progress> saved;
  if (auto text = ReadSmallFile(state_path, size_t{64} << 20); text.ok()) {
    saved = Progress::FromJson(*text, options_.part_bytes);
    if (saved && saved->Matches(checkpoint)) {
      progress = *std::move(saved);
    } else if (saved && saved->name == name) {
      for (size_t i = 0; i < checkpoint.files.size(); ++i) {
        const OriginFile& f = checkpoint.files[i];
        if (f.etag.empty() || absl::StartsWith(f.etag, "W/") || (f.crc32c.empty() && f.md5.empty())) continue;
        for (size_t j = 0; j < saved->files.size(); ++j) {
          const OriginFile& was = saved->files[j];
          if (was.path == f.path && was.size == f.size && was.etag == f.etag) carried.emplace_back(i, j);
        }
      }
    }
  }
  if (progress.files.empty()) {  // nothing to resume as a whole: start clean, but for what carries over
    // The record goes first: a kill from here on leaves nothing that claims
    // any partial file. Then what an attempt killed here left, then the
    // files that carry over are set aside, and all else goes.
    fs::remove(state_path, ec);
    auto entries = [&](bool set_aside) {
      std::vector<fs::path> out;
      for (auto it = fs::directory_iterator(folder, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
        if (absl::StartsWith(it->path().filename().string(), "carried-") == set_aside) out.push_back(it->path());
      }
      return out;
    };
    for (const fs::path& p : entries(/*set_aside=*/true)) fs::remove_all(p, ec);
    std::vector<std::pair<size_t, size_t>> set_aside;
    for (const auto& [i, j] : carried) {
      if (::rename((fs::path(folder) / std::to_string(j)).c_str(),
                   (fs::path(folder) / absl::StrCat("carried-", i)).c_str()) == 0) {
        set_aside.emplace_back(i, j);
      }
    }
    for (const fs::path& p : entries(/*set_aside=*/false)) fs::remove_all(p, ec);
    progress.name = name;
    progress.version = checkpoint.version;
    progress.files = checkpoint.files;
    for (const OriginFile& f : checkpoint.files) {
      progress.done.emplace_back((f.size + options_.part_bytes - 1) / options_.part_bytes, 0);
    }
    for (const auto& [i, j] : set_aside) {
      if (::rename((fs::path(folder) / absl::StrCat("carried-", i)).c_str(),
                   (fs::path(folder) / std::to_string(i)).c_str()) == 0) {
        progress.done[i] = saved->done[j];
      }
    }
    if (!set_aside.empty()) (void)WriteAtomically(state_path, progress.ToJson());
  }
  for (size_t i = 0; i < checkpoint.files.size(); ++i) progress.files[i].crc32c = checkpoint.files[i].crc32c;

  // Room on the disk for what is still to come.
  uint64_t missing = 0;
  for (size_t i = 0; i < checkpoint.files.size(); ++i) {
    uint64_t have = 0;
    for (uint64_t d : progress.done[i]) have += d;
    missing += checkpoint.files[i].size - have;
  }
  struct statvfs disk;
  if (::statvfs(folder.c_str(), &disk) == 0 && uint64_t{disk.f_bavail} * disk.f_frsize < missing) {
    return absl::ResourceExhaustedError(absl::StrCat("it needs ", missing, " more bytes on disk and '", models_dir_,
                                                     "' has ", uint64_t{disk.f_bavail} * disk.f_frsize, " free"));
  }

  std::vector<UniqueFd> fds;
  std::vector<std::string> partial_paths;
  for (size_t i = 0; i < checkpoint.files.size(); ++i) {
    partial_paths.push_back((fs::path(folder) / std::to_string(i)).string());
    UniqueFd fd(::open(partial_paths[i].c_str(), O_RDWR | O_CLOEXEC));
    if (!fd.valid()) {  // nothing of it is kept, whatever the progress said
      std::fill(progress.done[i].begin(), progress.done[i].end(), 0);
      fd.reset(::open(partial_paths[i].c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    }
    if (!fd.valid()) return absl::InternalError(Errno("cannot create", partial_paths[i]));
    // The disk space is reserved up front, so a disk that fills meanwhile
    // fails the pull here rather than midway.
    const off_t size = static_cast<off_t>(checkpoint.files[i].size);
    if (size > 0 && ::fallocate(fd.get(), 0, 0, size) != 0 && errno != EOPNOTSUPP) {
      return absl::ResourceExhaustedError(Errno("cannot reserve disk space for", partial_paths[i]));
    }
    if (::ftruncate(fd.get(), size) != 0) {
      return absl::ResourceExhaustedError(Errno("cannot size", partial_paths[i]));
    }
    fds.push_back(std::move(fd));
  }

  // Every part not yet complete, read by a few threads at once.
  struct Part {
    size_t file;
    uint64_t index, begin, end;  // the part's bytes [begin, end)
  };
  std::deque<Part> parts;
  std::vector<bool> resumed(checkpoint.files.size());  // some bytes came in an earlier attempt
  for (size_t i = 0; i < checkpoint.files.size(); ++i) {
    for (uint64_t d : progress.done[i]) resumed[i] = resumed[i] || d > 0;
  }
  for (size_t i = 0; i < checkpoint.files.size(); ++i) {
    const uint64_t size = checkpoint.files[i].size;
    for (uint64_t k = 0; k < progress.done[i].size(); ++k) {
      const uint64_t begin = k * options_.part_bytes, end = std::min(size, begin + options_.part_bytes);
      if (progress.done[i][k] < end - begin) parts.push_back({i, k, begin, end});
    }
  }
  absl::Mutex work_mu;
  absl::Time last_save = absl::Now();
  absl::Status first_error;
  std::atomic<bool> failed{false};
  auto save = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(work_mu) { return WriteAtomically(state_path, progress.ToJson()); };
  auto worker = [&] {
    while (true) {
      Part part;
      {
        absl::MutexLock lock(&work_mu);
        if (parts.empty() || failed.load()) return;
        part = parts.front();
        parts.pop_front();
      }
      const OriginFile& file = checkpoint.files[part.file];
      const int fd = fds[part.file].get();
      uint64_t cursor;
      {
        absl::MutexLock lock(&work_mu);
        cursor = part.begin + progress.done[part.file][part.index];
      }
      const std::string what = absl::StrCat("'", file.path, "'");
      // Written bytes go to disk while the pull goes on (sync_file_range starts
      // the writeback, waiting for none of it), so the fsync before placing,
      // and each progress record's, wait for little: a fsync of 1 GiB left
      // dirty took 0.6 s here.
      uint64_t unsynced = cursor;
      auto start_writeback = [&](uint64_t min_bytes) {
        if (cursor - unsynced < min_bytes) return;
        (void)::sync_file_range(fd, static_cast<off_t>(unsynced), static_cast<off_t>(cursor - unsynced),
                                SYNC_FILE_RANGE_WRITE);
        unsynced = cursor;
      };
      absl::Status status = origin_->Read(file, cursor, part.end - cursor, [&](absl::string_view bytes) {
        if (failed.load()) return absl::CancelledError("another part of the pull failed");
        if (stopping_.load()) return absl::UnavailableError("the daemon is stopping");
        if (bytes.size() > part.end - cursor) return absl::DataLossError(absl::StrCat(what, ": more bytes than asked"));
        while (!bytes.empty()) {
          const ssize_t n = ::pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(cursor));
          if (n < 0 && errno == EINTR) continue;
          if (n <= 0) return absl::ResourceExhaustedError(Errno("cannot write", partial_paths[part.file]));
          bytes.remove_prefix(static_cast<size_t>(n));
          cursor += static_cast<uint64_t>(n);
          pulled->fetch_add(static_cast<uint64_t>(n));
          bytes_pulled_.fetch_add(static_cast<uint64_t>(n));
        }
        start_writeback(kWritebackBytes);
        return absl::OkStatus();
      });
      start_writeback(1);
      if (status.ok() && cursor != part.end) {
        status = absl::DataLossError(absl::StrCat(what, ": the origin sent ", cursor - part.begin, " of ",
                                                  part.end - part.begin, " bytes of a part"));
      }
      absl::MutexLock lock(&work_mu);
      progress.done[part.file][part.index] = cursor - part.begin;
      // What was written is recorded for the next attempt once it is durable:
      // at most every few seconds, and whenever a read fails.
      if (!status.ok() || absl::Now() - last_save >= kProgressEvery) {
        for (const UniqueFd& f : fds) {
          if (::fdatasync(f.get()) != 0 && status.ok()) status = absl::InternalError(Errno("cannot sync", folder));
        }
        if (status.ok()) status = save();
        last_save = absl::Now();
      }
      if (!status.ok()) {
        if (!failed.exchange(true) || absl::IsCancelled(first_error)) {
          if (first_error.ok() || absl::IsCancelled(first_error)) first_error = status;
        }
        for (const UniqueFd& f : fds) (void)::fdatasync(f.get());
        (void)save();
        return;
      }
    }
  };
  // Each file is checked whole before it is placed, unless the origin checked
  // every byte of it as it arrived in this pull. The checks follow the parts
  // as they complete, in file order, on a thread of their own, so most of the
  // hashing (MD5 runs at about 0.7 GB/s) overlaps the transfer.
  std::vector<std::unique_ptr<WholeFileCheck>> checks(checkpoint.files.size());
  for (size_t i = 0; i < checks.size(); ++i) {
    // A config beside is no file of the version its reads are pinned to: it
    // is checked whole against the CRC32C listed.
    if (origin_->verifies_reads() && !resumed[i] && !checkpoint.files[i].beside) continue;
    auto check = std::make_unique<WholeFileCheck>(checkpoint.files[i], fds[i].get());
    if (check->needed()) checks[i] = std::move(check);
  }
  // How far file i is complete from its start.
  auto frontier = [&](size_t i, uint64_t from) ABSL_EXCLUSIVE_LOCKS_REQUIRED(work_mu) {
    const uint64_t size = checkpoint.files[i].size;
    for (uint64_t k = from / options_.part_bytes; k < progress.done[i].size(); ++k) {
      const uint64_t begin = k * options_.part_bytes;
      if (progress.done[i][k] < std::min(options_.part_bytes, size - begin)) return begin + progress.done[i][k];
    }
    return size;
  };
  absl::Status check_error;
  auto checker = [&] {
    for (size_t i = 0; i < checks.size(); ++i) {
      while (checks[i] != nullptr && checks[i]->hashed() < checkpoint.files[i].size) {
        uint64_t upto;
        {
          absl::MutexLock lock(&work_mu);
          upto = frontier(i, checks[i]->hashed());
        }
        if (failed.load() || stopping_.load()) return;
        if (upto == checks[i]->hashed()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
          continue;
        }
        if (absl::Status s = checks[i]->Advance(upto); !s.ok()) {
          check_error = s;
          return;
        }
      }
    }
  };
  const int threads = std::max(1, options_.parallel_reads > 0 ? options_.parallel_reads : origin_->parallel_reads());
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(worker);
  std::thread checking(checker);
  for (std::thread& t : pool) t.join();
  if (!first_error.ok()) {
    checking.join();
    for (const UniqueFd& f : fds) (void)::fdatasync(f.get());
    absl::MutexLock lock(&work_mu);
    (void)save();  // parts finished after the first failure count too
    return first_error;
  }
  checking.join();  // every part is in: it has hashed every file, or stopped
  WEIGHTSTORE_RETURN_IF_ERROR(check_error);

  for (size_t i = 0; i < checkpoint.files.size(); ++i) {
    absl::Status verified = checks[i] != nullptr ? checks[i]->Finish() : absl::OkStatus();
    if (!verified.ok()) {
      std::fill(progress.done[i].begin(), progress.done[i].end(), 0);  // refetch this file in full next time
      (void)WriteAtomically(state_path, progress.ToJson());
      return verified;
    }
    if (::fsync(fds[i].get()) != 0) return absl::InternalError(Errno("cannot sync", partial_paths[i]));
  }
  staged->folder = folder;
  staged->paths = std::move(partial_paths);
  staged->fds = std::move(fds);
  return absl::OkStatus();
}

absl::Status NodeCache::Transfer(const std::string& name, std::atomic<uint64_t>* pulled) {
  if (registry_->Get(name) != nullptr) return absl::OkStatus();  // a flight that just ended placed it
  {
    absl::MutexLock lock(&mu_);
    if (stepping_.contains(name)) {  // its partial folder is the step's
      return absl::UnavailableError("a follower's step is replacing its files; retry");
    }
  }
  absl::StatusOr<OriginCheckpoint> found = origin_->Find(name);
  // What the origin holds refuses the pull (too many files): remembered for
  // a while, as a name it lacks is. A refusal of this node's own making (a
  // file in the way) is not.
  if (absl::IsFailedPrecondition(found.status())) return Remembered(found.status());
  WEIGHTSTORE_RETURN_IF_ERROR(found.status());
  OriginCheckpoint& checkpoint = *found;
  if (checkpoint.files.empty()) return absl::DataLossError("the origin lists no files");
  // Configs beside (at most two, as the origin checked) are not counted.
  const size_t listed = absl::c_count_if(checkpoint.files, [](const OriginFile& f) { return !f.beside; });
  if (listed > options_.max_files) {
    return Remembered(absl::FailedPreconditionError(
        absl::StrCat("the origin lists ", listed, " files (1 to ", options_.max_files, " accepted)")));
  }
  // A hub revision, or a hub snapshot's files: in a folder of their own.
  const bool apart = !PlaceablePath(name) || checkpoint.apart;
  // Configs beside are taken only into a folder of the checkpoint's own: in
  // the models folder they would be other checkpoints' too.
  if (!apart) std::erase_if(checkpoint.files, [](const OriginFile& f) { return f.beside; });
  for (const OriginFile& f : checkpoint.files) {
    if (f.beside && !absl::c_linear_search(QuantizationConfig::kFileNames, fs::path(f.path).filename().string())) {
      return absl::DataLossError(absl::StrCat("the origin lists '", absl::CHexEscape(f.path.substr(0, 256)),
                                              "' beside '", name, "', which is no quantization config"));
    }
  }
  for (const OriginFile& f : checkpoint.files) {
    if (!(apart ? IsLoadableName(f.path, 4096) : PlaceablePath(f.path))) {
      return absl::DataLossError(absl::StrCat("the origin names a file '", absl::CHexEscape(f.path.substr(0, 256)),
                                              "' this node will not create"));
    }
  }
  const OriginFile& main = checkpoint.files.back();
  if (NameForPath(main.path) != name) {
    return absl::DataLossError(absl::StrCat("the origin's file '", main.path, "' is not served as '", name, "'"));
  }
  if (apart) WEIGHTSTORE_RETURN_IF_ERROR(PlaceApart(name, &checkpoint));
  // Summed with a bound on every step: sizes come from the origin.
  uint64_t total = 0;
  for (const OriginFile& f : checkpoint.files) {
    if (f.size > options_.max_checkpoint_bytes - total) {
      return absl::ResourceExhaustedError(absl::StrCat("its files are over this node's limit of ",
                                                       options_.max_checkpoint_bytes, " bytes ('", f.path,
                                                       "': ", f.size, ")"));
    }
    total += f.size;
  }
  // A file in the way (an operator's, or this cache's unloaded) would refuse
  // the placement at the end: refused before any byte moves.
  for (const OriginFile& f : checkpoint.files) {
    const fs::path target = fs::path(models_dir_) / f.path;
    if (std::error_code exists_ec; fs::exists(fs::symlink_status(target, exists_ec))) {
      return absl::FailedPreconditionError(
          absl::StrCat("'", target.string(), "' exists and is not served; this node does not replace it"));
    }
  }
  std::vector<Victim> victims;
  WEIGHTSTORE_RETURN_IF_ERROR(Reserve(name, total, &victims));
  absl::Cleanup release = [&] {
    absl::MutexLock lock(&mu_);
    reserved_bytes_ -= total;
  };
  if (!victims.empty()) {
    Evict(&victims);
    WEIGHTSTORE_RETURN_IF_ERROR(SaveLedger());
  }

  Staged staged;
  WEIGHTSTORE_RETURN_IF_ERROR(Download(name, checkpoint, pulled, &staged));
  const std::string& folder = staged.folder;
  std::vector<std::string>& partial_paths = staged.paths;
  std::vector<UniqueFd>& fds = staged.fds;
  std::error_code ec;
  // Recorded (durably) before the first rename: a crash before the ledger
  // lists the checkpoint leaves files the next run can tell as this cache's.
  std::optional<Cached> previous;
  {
    Cached intent;
    intent.placing = true;
    intent.bytes = total;
    intent.last_used_unix_ms = NowMs();
    intent.version = checkpoint.version;
    for (size_t i = 0; i < checkpoint.files.size(); ++i) {
      if (checkpoint.files[i].beside) {  // in the apart folder, which is the cache's own
        intent.beside.push_back(checkpoint.files[i].path);
        continue;
      }
      struct stat st;
      if (::fstat(fds[i].get(), &st) != 0) return absl::InternalError(Errno("cannot stat", partial_paths[i]));
      intent.paths.push_back(checkpoint.files[i].path);
      intent.identities.push_back(Identity(st));
      intent.etags.push_back(checkpoint.files[i].etag);
    }
    absl::MutexLock lock(&mu_);
    auto [it, added] = ledger_.try_emplace(name);
    if (!added && !it->second.placing) {  // its files were removed by hand, or only unloaded
      cached_bytes_ -= it->second.bytes;
      previous = std::move(it->second);
    }
    it->second = std::move(intent);
  }
  std::vector<std::string> placed;
  auto unplace = [&] {
    for (const std::string& p : placed) ::unlink((fs::path(models_dir_) / p).c_str());
    if (apart) RemoveApartFolderIfEmpty((fs::path(models_dir_) / main.path).parent_path().string());
    // The entry this pull replaced comes back only for files still as it
    // recorded them (an only-unloaded checkpoint), never for files someone
    // put there since.
    const bool previous_intact =
        previous.has_value() && !previous->paths.empty() &&
        FileVersion((fs::path(models_dir_) / previous->paths.back()).string()).value_or("") == previous->file_version;
    {
      absl::MutexLock lock(&mu_);
      if (previous_intact) {  // as it was: its files are still there, as placed
        cached_bytes_ += previous->bytes;
        ledger_[name] = *std::move(previous);
      } else {
        ledger_.erase(name);
      }
    }
    (void)SaveLedger();
  };
  if (absl::Status saved = SaveLedger(); !saved.ok()) {
    unplace();
    return saved;
  }
  fds.clear();
  if (apart) {
    // The folder says whose it is, so that a start whose ledger lost it
    // serves it again (ServeApart) rather than guessing.
    const fs::path apart_folder = fs::path(models_dir_) / fs::path(main.path).parent_path();
    fs::create_directories(apart_folder, ec);
    if (absl::Status named = WriteAtomically((apart_folder / kApartNameFile).string(), name); !named.ok()) {
      unplace();
      return named;
    }
  }

  // Place the configs beside first, so that the checkpoint never opens
  // without them; then the file the name is served from: an index in place
  // before its shards keeps a rescan in between from serving a shard on its
  // own.
  std::vector<size_t> order;
  for (size_t i = 0; i + 1 < checkpoint.files.size(); ++i) {
    if (checkpoint.files[i].beside) order.push_back(i);
  }
  order.push_back(checkpoint.files.size() - 1);
  for (size_t i = 0; i + 1 < checkpoint.files.size(); ++i) {
    if (!checkpoint.files[i].beside) order.push_back(i);
  }
  for (size_t i : order) {
    const fs::path target = fs::path(models_dir_) / checkpoint.files[i].path;
    fs::create_directories(target.parent_path(), ec);
    if (::renameat2(AT_FDCWD, partial_paths[i].c_str(), AT_FDCWD, target.c_str(), RENAME_NOREPLACE) != 0) {
      const int e = errno;
      unplace();
      if (e == EEXIST) {
        return absl::FailedPreconditionError(
            absl::StrCat("'", target.string(), "' exists and is not served; this node does not replace it"));
      }
      errno = e;
      return absl::InternalError(Errno("cannot place", target.string()));
    }
    placed.push_back(checkpoint.files[i].path);
    if (absl::Status synced = FsyncFolder(target.parent_path().string()); !synced.ok()) {
      unplace();
      return synced;
    }
  }
  // The registry asks OriginVersion for the id while it opens the files (as
  // would a rescan that found them first).
  const std::string main_path = (fs::path(models_dir_) / main.path).string();
  // Apart, nothing else is in the way: a name served meanwhile (an upload, a
  // rescan) keeps what it serves.
  auto version = apart ? registry_->LoadIfAbsent(main_path, name) : registry_->Load(main_path, name);
  if (!version.ok()) {
    unplace();
    fs::remove_all(folder, ec);
    if (absl::IsAlreadyExists(version.status())) return absl::OkStatus();  // served meanwhile, not by this pull
    return absl::DataLossError(absl::StrCat("the pulled files do not open: ", version.status().message()));
  }
  fs::remove_all(folder, ec);
  {
    absl::MutexLock lock(&mu_);
    Cached& c = ledger_[name];
    c.placing = false;
    c.identities.clear();
    c.file_version = (*version)->file_version();
    c.last_used_unix_ms = NowMs();
    cached_bytes_ += c.bytes;
  }
  return SaveLedger();
}

bool NodeCache::FinishPlacing(const std::string& name, Cached* c) {
  if (c->paths.empty() || c->identities.size() != c->paths.size()) return false;
  std::vector<std::string> ours;
  for (size_t i = 0; i < c->paths.size(); ++i) {
    if (!LedgerPath(c->paths[i])) return false;
    const std::string path = (fs::path(models_dir_) / c->paths[i]).string();
    struct stat st;
    if (::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && Identity(st) == c->identities[i]) {
      ours.push_back(path);
    }
  }
  if (ours.size() == c->paths.size()) {  // all placed: it was loading
    absl::StatusOr<std::string> placed = FileVersion(ours.back());
    if (!placed.ok()) return false;
    std::error_code ec;
    fs::remove_all(fs::path(state_dir_) / "partial" / Sha256Hex(name), ec);
    c->file_version = *placed;
    c->placing = false;
    c->identities.clear();
    c->replacing_version.clear();
    c->replacing_file_version.clear();
    return true;
  }
  // A follower's replacement that never renamed its files (of a sharded
  // checkpoint, the shards it kept are its own as well): the files held
  // before are still in place, and still the cache's.
  if (!c->replacing_file_version.empty() &&
      FileVersion((fs::path(models_dir_) / c->paths.back()).string()).value_or("") == c->replacing_file_version) {
    c->version = std::move(c->replacing_version);
    c->file_version = std::move(c->replacing_file_version);
    c->placing = false;
    c->identities.clear();
    c->replacing_version.clear();
    c->replacing_file_version.clear();
    return true;
  }
  // A follower's replacement neither placed nor undone (the registry could
  // not finish its renames): the files stay, served as the operator's.
  if (!c->replacing_file_version.empty()) return false;
  // Half placed: this cache's files go, with the configs placed beside in
  // its apart folder. The partial pull stays, so the next pull resumes
  // (fetching again the files that had been moved out of it).
  for (const std::string& path : ours) ::unlink(path.c_str());
  for (const std::string& path : c->beside) ::unlink((fs::path(models_dir_) / path).c_str());
  return false;
}

}  // namespace weightstore::origin

#include "origin/node_cache.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/atomic_file.h"
#include "core/crc32c.h"
#include "core/shm/unix_socket.h"
#include "core/status_macros.h"
#include "core/status_util.h"
#include "nlohmann/json.hpp"

namespace weightstore::origin {

namespace fs = std::filesystem;

namespace {

constexpr char kStateFolder[] = ".weightstore-cache";
constexpr size_t kVerifyBlock = size_t{8} << 20;
constexpr absl::Duration kProgressEvery = absl::Seconds(2);
// Bytes a pull writes between two starts of their writeback to disk.
constexpr uint64_t kWritebackBytes = uint64_t{8} << 20;

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

// What identifies a file this cache placed: device, inode, size and mtime in
// nanoseconds, which a rename keeps.
std::array<uint64_t, 4> Identity(const struct stat& st) {
  return {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), static_cast<uint64_t>(st.st_size),
          static_cast<uint64_t>(st.st_mtim.tv_sec) * 1000000000u + static_cast<uint64_t>(st.st_mtim.tv_nsec)};
}

std::string Errno(const std::string& what, const std::string& path) {
  return absl::StrCat(what, " '", path, "': ", std::strerror(errno));
}

// A path the node may create under its models folder (core/registry.h).
bool PlaceablePath(absl::string_view path) { return IsPlaceableName(path, 4096); }

// Marks a refusal that comes from what the origin holds, so that it is
// remembered (NodeCacheOptions::not_found_ttl).
constexpr absl::string_view kRememberedRefusal = "weightstore.dev/remembered-refusal";
absl::Status Remembered(absl::Status status) {
  status.SetPayload(kRememberedRefusal, absl::Cord("1"));
  return status;
}

absl::Status WriteAtomically(const std::string& path, const std::string& content) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFile> file, AtomicFile::Create(path, /*overwrite=*/true));
  WEIGHTSTORE_RETURN_IF_ERROR(file->Append(content));
  return file->Commit();
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  std::string out(max_bytes + 1, '\0');
  in.read(out.data(), static_cast<std::streamsize>(out.size()));
  out.resize(static_cast<size_t>(in.gcount()));
  if (out.size() > max_bytes) return absl::DataLossError(absl::StrCat("'", path, "' is over ", max_bytes, " bytes"));
  return out;
}

absl::Status FsyncFolder(const std::string& folder) {
  UniqueFd fd(::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid() || ::fsync(fd.get()) != 0) return absl::InternalError(Errno("cannot fsync", folder));
  return absl::OkStatus();
}

// Checks a file whole against what the origin stated of it: its CRC32C and
// its MD5 (OriginFile::crc32c, ::md5). Fed in order (Advance), while the file is
// still being pulled, so most of the hashing overlaps the transfer.
class WholeFileCheck {
 public:
  WholeFileCheck(const OriginFile& file, int fd) : file_(file), fd_(fd), md5_(file.md5) {
    if (!md5_.empty()) {
      ctx_.reset(EVP_MD_CTX_new());
      if (ctx_ == nullptr || EVP_DigestInit_ex(ctx_.get(), EVP_md5(), nullptr) != 1) md5_failed_ = true;
    }
  }
  // False when the origin stated nothing to check against.
  bool needed() const { return !file_.crc32c.empty() || !md5_.empty(); }
  uint64_t hashed() const { return hashed_; }

  // Hashes the file's bytes [hashed(), upto), reading them back from disk.
  absl::Status Advance(uint64_t upto) {
    std::string block(std::min<uint64_t>(kVerifyBlock, upto > hashed_ ? upto - hashed_ : 0), '\0');
    while (hashed_ < upto) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(block.size(), upto - hashed_));
      const ssize_t got = ::pread(fd_, block.data(), n, static_cast<off_t>(hashed_));
      if (got <= 0) return absl::DataLossError(Errno("cannot read back", file_.path));
      const absl::string_view bytes(block.data(), static_cast<size_t>(got));
      if (!file_.crc32c.empty()) crc_ = Crc32cExtend(crc_, bytes);
      if (ctx_ != nullptr) EVP_DigestUpdate(ctx_.get(), bytes.data(), bytes.size());
      hashed_ += static_cast<uint64_t>(got);
    }
    return absl::OkStatus();
  }

  // Hashes what is left and compares. DataLoss naming the file on a mismatch.
  absl::Status Finish() {
    WEIGHTSTORE_RETURN_IF_ERROR(Advance(file_.size));
    const std::string what = absl::StrCat("'", file_.path, "'");
    if (!file_.crc32c.empty()) {
      const std::string got = absl::StrFormat("%08x", crc_);
      if (got != absl::AsciiStrToLower(file_.crc32c)) {
        return absl::DataLossError(absl::StrCat(what, ": CRC32C of the bytes received is ", got, ", the origin states ",
                                                absl::CHexEscape(file_.crc32c.substr(0, 16))));
      }
    }
    if (!md5_.empty()) {
      if (md5_failed_) return absl::InternalError("cannot compute an MD5 digest");
      unsigned char digest[EVP_MAX_MD_SIZE];
      unsigned int length = 0;
      EVP_DigestFinal_ex(ctx_.get(), digest, &length);
      const std::string got = absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(digest), length));
      if (got != md5_) {
        return absl::DataLossError(
            absl::StrCat(what, ": MD5 of the bytes received is ", got, ", the origin's ETag states ", md5_));
      }
    }
    return absl::OkStatus();
  }

 private:
  struct FreeContext {
    void operator()(EVP_MD_CTX* ctx) const { EVP_MD_CTX_free(ctx); }
  };
  const OriginFile& file_;
  const int fd_;
  const std::string md5_;
  std::unique_ptr<EVP_MD_CTX, FreeContext> ctx_;
  bool md5_failed_ = false;
  uint32_t crc_ = 0;
  uint64_t hashed_ = 0;
};

// How far a pull got: bytes written and verified from the start of each part
// of each file, persisted so a later pull of the same version resumes.
struct Progress {
  std::string name, version;
  std::vector<OriginFile> files;
  std::vector<std::vector<uint64_t>> done;  // [file][part]

  bool Matches(const OriginCheckpoint& c) const {
    if (name != c.name || version != c.version || files.size() != c.files.size()) return false;
    for (size_t i = 0; i < files.size(); ++i) {
      if (files[i].path != c.files[i].path || files[i].size != c.files[i].size || files[i].etag != c.files[i].etag) {
        return false;
      }
    }
    return true;
  }
  std::string ToJson() const {
    nlohmann::json j;
    j["name"] = name;
    j["version"] = version;
    for (size_t i = 0; i < files.size(); ++i) {
      j["files"].push_back(
          {{"path", files[i].path}, {"size", files[i].size}, {"etag", files[i].etag}, {"done", done[i]}});
    }
    return j.dump();
  }
  static std::optional<Progress> FromJson(const std::string& text, uint64_t part_bytes) {
    nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("files") || !j["files"].is_array()) return std::nullopt;
    Progress p;
    try {
      p.name = j.at("name").get<std::string>();
      p.version = j.at("version").get<std::string>();
      for (const auto& f : j["files"]) {
        OriginFile file;
        file.path = f.at("path").get<std::string>();
        file.size = f.at("size").get<uint64_t>();
        file.etag = f.at("etag").get<std::string>();
        std::vector<uint64_t> done = f.at("done").get<std::vector<uint64_t>>();
        const uint64_t parts = (file.size + part_bytes - 1) / part_bytes;
        if (done.size() != parts) return std::nullopt;
        for (uint64_t k = 0; k < parts; ++k) {
          if (done[k] > std::min(part_bytes, file.size - k * part_bytes)) return std::nullopt;
        }
        p.files.push_back(std::move(file));
        p.done.push_back(std::move(done));
      }
    } catch (const nlohmann::json::exception&) {
      return std::nullopt;
    }
    return p;
  }
};

}  // namespace

// One transfer, and who waits for its outcome (the caller that started it
// first). Its waiters are guarded by NodeCache::mu_.
struct NodeCache::Flight {
  struct Waiter {
    Done done;
    absl::Time start;
    uint64_t ticket = 0;
    bool started = false;  // its call started the transfer
  };
  std::map<uint64_t, Waiter> waiters;  // by ticket, in arrival order
  std::atomic<uint64_t> pulled{0};
};

struct NodeCache::Victim {
  std::string name;
  Cached cached;
  std::vector<std::pair<std::string, UniqueFd>> locks;  // its files, held until removed
  // False when its files are no longer as this cache placed them (replaced
  // while not served): forgotten, not removed.
  bool ours = true;
};

NodeCache::NodeCache(CheckpointRegistry* registry, std::unique_ptr<Origin> origin, NodeCacheOptions options)
    : registry_(registry),
      origin_(std::move(origin)),
      options_(std::move(options)),
      models_dir_(registry->options().models_dir),
      state_dir_((fs::path(registry->options().models_dir) / kStateFolder).string()) {
  origin_->set_max_files(options_.max_files);
}

NodeCache::~NodeCache() {
  registry_->SetVersionIds(nullptr);  // waits for a call in progress
  registry_->RemoveListener(listener_id_);
  {
    absl::MutexLock lock(&listener_target_->mu);
    listener_target_->cache = nullptr;
  }
  Shutdown();
  {
    absl::MutexLock lock(&running_->mu);
    running_->mu.Await(absl::Condition(
        +[](int* threads) { return *threads == 0; }, &running_->threads));
  }
  (void)SaveLedger();  // keeps the last uses for the next run's evictions
}

void NodeCache::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  origin_->Cancel();
}

absl::StatusOr<std::unique_ptr<NodeCache>> NodeCache::Open(CheckpointRegistry* registry, std::unique_ptr<Origin> origin,
                                                           NodeCacheOptions options) {
  if (options.part_bytes == 0 || options.max_concurrent_pulls < 1) {
    return absl::InvalidArgumentError("node cache: part_bytes and max_concurrent_pulls must be positive");
  }
  std::unique_ptr<NodeCache> cache(new NodeCache(registry, std::move(origin), std::move(options)));
  std::error_code ec;
  fs::create_directories(fs::path(cache->state_dir_) / "partial", ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create the node cache's folder '", cache->state_dir_,
                     "' (the models folder must be writable to pull): ", ec.message()));
  }
  // Partial pulls nobody resumed for a long time hold disk the budget does
  // not see: removed.
  const auto now = fs::file_time_type::clock::now();
  for (const auto& entry : fs::directory_iterator(fs::path(cache->state_dir_) / "partial", ec)) {
    std::error_code time_ec;
    const auto written = fs::last_write_time(entry.path(), time_ec);
    if (!time_ec && now - written > absl::ToChronoSeconds(cache->options_.abandoned_partial)) {
      fs::remove_all(entry.path(), time_ec);
    }
  }
  // What it pulled is served under the origin's version id, in this run and
  // the next (as long as the files are as placed).
  registry->SetVersionIds([cache = cache.get()](const std::string& name, const std::string& file_version) {
    return cache->OriginVersion(name, file_version);
  });
  {
    absl::MutexLock lock(&cache->listener_target_->mu);
    cache->listener_target_->cache = cache.get();
  }
  cache->listener_id_ = registry->AddListener([target = cache->listener_target_](const std::string& name) {
    absl::MutexLock lock(&target->mu);
    if (target->cache != nullptr) target->cache->OnServedChanged(name);
  });
  absl::MutexLock lock(&cache->mu_);
  auto text = ReadSmallFile((fs::path(cache->state_dir_) / "ledger.json").string(), size_t{64} << 20);
  if (!text.ok()) return cache;  // a first run
  nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return cache;  // unreadable: forget it (pulled files stay, as the operator's)
  for (const auto& [name, entry] : j.items()) {
    try {
      Cached c;
      c.paths = entry.at("paths").get<std::vector<std::string>>();
      c.last_used_unix_ms = entry.at("last_used_unix_ms").get<int64_t>();
      c.version = entry.value("version", "");
      c.file_version = entry.value("file_version", "");
      if (entry.value("placing", false)) {
        c.identities = entry.at("identities").get<std::vector<std::array<uint64_t, 4>>>();
        if (!cache->FinishPlacing(name, &c)) continue;
      }
      bool present = !c.paths.empty();
      for (const std::string& p : c.paths) {
        std::error_code size_ec;
        const uint64_t size = PlaceablePath(p) ? fs::file_size(fs::path(cache->models_dir_) / p, size_ec) : 0;
        present = present && PlaceablePath(p) && !size_ec;
        c.bytes += size;
      }
      // Files replaced since they were placed are no longer the cache's.
      if (!present ||
          FileVersion((fs::path(cache->models_dir_) / c.paths.back()).string()).value_or("") != c.file_version) {
        continue;
      }
      cache->cached_bytes_ += c.bytes;
      cache->ledger_[name] = std::move(c);
    } catch (const nlohmann::json::exception&) {
      continue;
    }
  }
  return cache;
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
      if (c.placing) {
        j[name]["placing"] = true;
        j[name]["identities"] = c.identities;
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

PullStats NodeCache::Stats() const {
  PullStats s;
  s.origin = origin_->Describe();
  s.bytes_pulled = bytes_pulled_.load();
  s.pulls = pulls_.load();
  s.pull_errors = pull_errors_.load();
  s.hits = hits_.load();
  s.misses = misses_.load();
  s.evictions = evictions_.load();
  s.cache_budget_bytes = options_.max_bytes;
  absl::MutexLock lock(&mu_);
  s.pulls_in_flight = flights_.size();
  s.cache_bytes = cached_bytes_;
  return s;
}

uint64_t NodeCache::PullAsync(const std::string& name, Done done) {
  const absl::Time start = absl::Now();
  if (absl::Status valid = CheckCheckpointName(name, registry_->options().max_name_bytes); !valid.ok()) {
    done(valid);
    return 0;
  }
  if (auto version = registry_->Get(name); version != nullptr) {
    Touch(name);
    hits_.fetch_add(1);
    PullResult result;
    result.already_present = true;
    result.bytes = version->checkpoint()->total_bytes();
    done(result);
    return 0;
  }
  misses_.fetch_add(1);
  if (!PlaceablePath(name)) {
    done(absl::NotFoundError(absl::StrCat("checkpoint '", name,
                                          "' is not served, and cannot be pulled: a pulled checkpoint's name is a "
                                          "relative path of letters, digits, '-', '_', '.' and '/'")));
    return 0;
  }
  absl::Status refused;
  {
    absl::MutexLock lock(&mu_);
    auto nf = not_found_.find(name);
    if (stopping_) {
      refused = absl::UnavailableError(absl::StrCat("checkpoint '", name, "' is not here, and the daemon is stopping"));
    } else if (nf != not_found_.end() && absl::Now() < nf->second.until) {
      refused =
          absl::IsNotFound(nf->second.status)
              ? absl::NotFoundError(absl::StrCat("checkpoint '", name, "' is not served, and ", origin_->Describe(),
                                                 " did not have it moments ago"))
              : absl::Status(nf->second.status.code(), absl::StrCat(nf->second.status.message(),
                                                                    " (refused moments ago; not asked again "
                                                                    "for ",
                                                                    absl::FormatDuration(options_.not_found_ttl), ")"));
    } else if (auto it = flights_.find(name); it != flights_.end()) {
      if (it->second->waiters.size() > options_.max_waiters) {
        refused = absl::ResourceExhaustedError(absl::StrCat("checkpoint '", name, "' is being pulled, and ",
                                                            it->second->waiters.size(),
                                                            " requests already wait for it; retry later"));
      } else {
        ++last_ticket_;  // joins the transfer under way
        it->second->waiters.emplace(last_ticket_, Flight::Waiter{std::move(done), start, last_ticket_});
        return last_ticket_;
      }
    } else if (flights_.size() >= static_cast<size_t>(options_.max_concurrent_pulls)) {
      refused = absl::ResourceExhaustedError(absl::StrCat("checkpoint '", name, "' is not here, and ", flights_.size(),
                                                          " pulls already run (the most at once); retry later"));
    } else {
      if (nf != not_found_.end()) not_found_.erase(nf);
      auto flight = std::make_shared<Flight>();
      ++last_ticket_;
      flight->waiters.emplace(last_ticket_, Flight::Waiter{std::move(done), start, last_ticket_, /*started=*/true});
      flights_[name] = flight;
      {
        absl::MutexLock running_lock(&running_->mu);
        ++running_->threads;
      }
      // The transfer has a thread of its own: callers (gRPC handlers) never
      // wait on it, and it ends when its outcome is delivered. It holds the
      // count it decrements last, so the destructor that waits on the count
      // never frees what the thread still touches.
      try {
        std::thread([this, name, flight, running = running_] {
          RunFlight(name, flight);
          absl::MutexLock running_lock(&running->mu);
          --running->threads;
        }).detach();
        return last_ticket_;
      } catch (const std::system_error& e) {  // no thread to be had: refuse, as when pulls are at their limit
        flights_.erase(name);
        done = std::move(flight->waiters.begin()->second.done);
        absl::MutexLock running_lock(&running_->mu);
        --running_->threads;
        refused = absl::ResourceExhaustedError(
            absl::StrCat("checkpoint '", name, "' is not here, and no thread could be started to pull it"));
      }
    }
  }
  done(refused);
  return 0;
}

void NodeCache::Abandon(const std::string& name, uint64_t ticket) {
  if (ticket == 0) return;
  Done done;
  {
    absl::MutexLock lock(&mu_);
    auto flight = flights_.find(name);
    if (flight == flights_.end()) return;  // delivered (or being delivered)
    auto it = flight->second->waiters.find(ticket);
    if (it == flight->second->waiters.end()) return;
    done = std::move(it->second.done);
    flight->second->waiters.erase(it);
  }
  done(absl::CancelledError(absl::StrCat("stopped waiting for checkpoint '", name, "' to be pulled")));
}

void NodeCache::RunFlight(const std::string& name, const std::shared_ptr<Flight>& flight) {
  pulls_.fetch_add(1);
  absl::Status status = Transfer(name, &flight->pulled);
  if (!status.ok()) {
    pull_errors_.fetch_add(1);
    absl::Status named(status.code(),
                       absl::StrCat("pulling '", name, "' from ", origin_->Describe(), ": ", status.message()));
    status.ForEachPayload(
        [&named](absl::string_view type, const absl::Cord& payload) { named.SetPayload(type, payload); });
    status = std::move(named);
  }
  std::map<uint64_t, Flight::Waiter> waiters;
  {
    absl::MutexLock lock(&mu_);
    flights_.erase(name);
    if (absl::IsNotFound(status) || status.GetPayload(kRememberedRefusal).has_value()) {
      if (not_found_.size() >= options_.max_not_found) not_found_.clear();
      not_found_[name] = {absl::Now() + options_.not_found_ttl, status};
    }
    waiters.swap(flight->waiters);  // no one joins a flight once it is erased
  }
  std::shared_ptr<const CheckpointVersion> version = status.ok() ? registry_->Get(name) : nullptr;
  if (status.ok() && version == nullptr) {
    status = absl::UnavailableError(absl::StrCat("checkpoint '", name, "' was pulled, then unloaded; retry"));
  }
  for (auto& [ticket, waiter] : waiters) {
    if (!status.ok()) {
      waiter.done(status);
      continue;
    }
    PullResult result;
    result.joined = !waiter.started;
    result.bytes_pulled = waiter.started ? flight->pulled.load() : 0;
    result.bytes = version->checkpoint()->total_bytes();
    result.seconds = absl::ToDoubleSeconds(absl::Now() - waiter.start);
    waiter.done(result);
  }
}

absl::Status NodeCache::Transfer(const std::string& name, std::atomic<uint64_t>* pulled) {
  if (registry_->Get(name) != nullptr) return absl::OkStatus();  // a flight that just ended placed it
  absl::StatusOr<OriginCheckpoint> found = origin_->Find(name);
  // What the origin holds refuses the pull (too many files): remembered for
  // a while, as a name it lacks is. A refusal of this node's own making (a
  // file in the way) is not.
  if (absl::IsFailedPrecondition(found.status())) return Remembered(found.status());
  WEIGHTSTORE_RETURN_IF_ERROR(found.status());
  OriginCheckpoint& checkpoint = *found;
  if (checkpoint.files.empty()) return absl::DataLossError("the origin lists no files");
  if (checkpoint.files.size() > options_.max_files) {
    return Remembered(absl::FailedPreconditionError(
        absl::StrCat("the origin lists ", checkpoint.files.size(), " files (1 to ", options_.max_files, " accepted)")));
  }
  for (const OriginFile& f : checkpoint.files) {
    if (!PlaceablePath(f.path)) {
      return absl::DataLossError(absl::StrCat("the origin names a file '", absl::CHexEscape(f.path.substr(0, 256)),
                                              "' this node will not create"));
    }
  }
  const OriginFile& main = checkpoint.files.back();
  if (NameForPath(main.path) != name) {
    return absl::DataLossError(absl::StrCat("the origin's file '", main.path, "' is not served as '", name, "'"));
  }
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

  // Where this pull's partial files and progress live.
  const std::string folder = (fs::path(state_dir_) / "partial" / Sha256Hex(name)).string();
  const std::string state_path = (fs::path(folder) / "progress.json").string();
  std::error_code ec;
  fs::create_directories(folder, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create '", folder, "': ", ec.message()));
  Progress progress;
  if (auto text = ReadSmallFile(state_path, size_t{64} << 20); text.ok()) {
    std::optional<Progress> saved = Progress::FromJson(*text, options_.part_bytes);
    if (saved && saved->Matches(checkpoint)) progress = std::move(*saved);
  }
  if (progress.files.empty()) {  // nothing to resume: start clean
    fs::remove_all(folder, ec);
    fs::create_directories(folder, ec);
    progress.name = name;
    progress.version = checkpoint.version;
    progress.files = checkpoint.files;
    for (const OriginFile& f : checkpoint.files) {
      progress.done.emplace_back((f.size + options_.part_bytes - 1) / options_.part_bytes, 0);
    }
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
    if (origin_->verifies_reads() && !resumed[i]) continue;
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
      struct stat st;
      if (::fstat(fds[i].get(), &st) != 0) return absl::InternalError(Errno("cannot stat", partial_paths[i]));
      intent.paths.push_back(checkpoint.files[i].path);
      intent.identities.push_back(Identity(st));
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

  // Place the file the name is served from first: an index in place before its
  // shards keeps a rescan in between from serving a shard on its own.
  std::vector<size_t> order;
  order.push_back(checkpoint.files.size() - 1);
  for (size_t i = 0; i + 1 < checkpoint.files.size(); ++i) order.push_back(i);
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
  auto version = registry_->Load(main_path, name);
  if (!version.ok()) {
    unplace();
    fs::remove_all(folder, ec);
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
    if (!PlaceablePath(c->paths[i])) return false;
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
    return true;
  }
  // Half placed: this cache's files go. The partial pull stays, so the next
  // pull resumes (fetching again the files that had been moved out of it).
  for (const std::string& path : ours) ::unlink(path.c_str());
  return false;
}

void NodeCache::OnServedChanged(const std::string& name) {
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

void NodeCache::ForgetReplaced() {
  for (auto it = ledger_.begin(); it != ledger_.end();) {
    auto served = it->second.placing ? nullptr : registry_->Get(it->first);
    if (served != nullptr && served->file_version() != it->second.file_version) {
      cached_bytes_ -= it->second.bytes;
      it = ledger_.erase(it);
    } else {
      ++it;
    }
  }
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
        if (n != name && !c.placing && !flights_.contains(n)) candidates.emplace_back(n, c);
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
                    it->second.last_used_unix_ms == v.cached.last_used_unix_ms &&
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
    evictions_.fetch_add(1);
  }
}

}  // namespace weightstore::origin

#include "origin/follower.h"

#include <fnmatch.h>

#include <algorithm>
#include <memory>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/updates.h"
#include "core/catalog/manifest.h"
#include "core/catalog/push.h"
#include "core/format.h"
#include "core/select/quantized_shard.h"
#include "core/status_macros.h"
#include "origin/node_cache_internal.h"

namespace weightstore::origin {

namespace {

void LogFollow(const std::string& line) { std::fprintf(stderr, "weightstored: follow: %s\n", line.c_str()); }

uint64_t SaturatingAdd(uint64_t a, uint64_t b) { return b > UINT64_MAX - a ? UINT64_MAX : a + b; }

// What an upstream sent (an id, a name, a message), fit for one log line.
std::string Said(absl::string_view text) { return absl::CHexEscape(text.substr(0, 1024)); }

// A step that fails so cannot succeed until something changes (the
// checkpoint, the upstream, the daemon's flags): not retried on a timer.
// (Not ResourceExhausted: a busy upstream says so, and is retried.)
bool Lasting(const absl::Status& status) {
  return absl::IsFailedPrecondition(status) || absl::IsInvalidArgument(status) || absl::IsUnimplemented(status);
}

// The tensors the upstream's listing says the version has, with their
// digests: what the step must write. FailedPrecondition when the upstream
// gives none (a daemon with --tensor-digests=false cannot be followed).
absl::StatusOr<std::vector<ManifestTensor>> ExpectedTensors(const std::string& name,
                                                            const std::vector<client::TensorDescription>& listed) {
  std::vector<ManifestTensor> expected;
  expected.reserve(listed.size());
  for (const client::TensorDescription& d : listed) {
    std::optional<TensorDigest> digest = TensorDigest::FromHex(d.digest);
    if (!digest.has_value()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the upstream lists tensor '", d.spec.name.substr(0, 256), "' of '", name,
                       "' without a digest; a daemon is followed only with --tensor-digests"));
    }
    expected.push_back({d.spec.name, d.spec.dtype, d.spec.shape, *digest});
  }
  return expected;
}

// Receives a step's changed tensors and element patches straight into the
// push session, one at a time: the step holds one tensor (or patch) in
// memory, whatever its size. Only what the listing said would come is
// taken, each once, with its listed dtype and shape (a patch smaller than
// its tensor), refused before anything is allocated for it; a tensor whose
// transfer restarted (a resumed stream) begins again. A patch of a tensor
// whose base digest is not known, or one the session refuses, marks the
// step's patches as failed: it is taken again with the tensors whole.
// Called by one thread at a time (the fetch's copier).
class StepSink : public client::TensorSink {
 public:
  struct Counts {
    size_t whole = 0, patches = 0;
    uint64_t whole_bytes = 0, patch_bytes = 0;
  };

  // `coming`: the specs the listing says will come, by name.
  StepSink(PushSession* session, const CheckpointManifest* base, absl::flat_hash_map<std::string, TensorSpec> coming,
           std::shared_ptr<const std::atomic<bool>> cancel)
      : session_(session), base_(base), coming_(std::move(coming)), cancel_(std::move(cancel)) {}

  absl::StatusOr<std::span<std::byte>> Begin(const TensorSpec& spec) override {
    WEIGHTSTORE_RETURN_IF_ERROR(Take(spec, spec.byte_size(), /*patch=*/false));
    patch_.reset();
    return std::span<std::byte>(buffer_.get(), spec.byte_size());
  }
  absl::Status End(const TensorSpec& spec) override {
    const absl::string_view bytes(reinterpret_cast<const char*>(buffer_.get()), spec.byte_size());
    // The fetch checked the tensor's CRC32C over its chunks as they came:
    // none again here.
    WEIGHTSTORE_RETURN_IF_ERROR(session_->BeginTensor(spec, std::nullopt));
    WEIGHTSTORE_RETURN_IF_ERROR(session_->Append(bytes));
    coming_.erase(spec.name);
    ++counts_.whole;
    counts_.whole_bytes += bytes.size();
    return absl::OkStatus();
  }
  absl::StatusOr<std::span<std::byte>> BeginPatch(const TensorSpec& spec, const ElementPatch& header, uint64_t bytes,
                                                  const std::string& digest) override {
    const ManifestTensor* b = base_ != nullptr ? base_->Find(spec.name) : nullptr;
    std::optional<TensorDigest> after = TensorDigest::FromHex(digest);
    if (b == nullptr || !after.has_value()) {
      patch_refused_ = true;
      return absl::DataLossError(absl::StrCat("the upstream sent a patch of '", spec.name.substr(0, 256),
                                              "', which the held version has no digest of, or without one"));
    }
    WEIGHTSTORE_RETURN_IF_ERROR(Take(spec, bytes, /*patch=*/true));
    patch_ = Patch{header, bytes, b->digest, *after};
    patch_->header.body = SharedBytes();
    return std::span<std::byte>(buffer_.get(), bytes);
  }
  absl::Status EndPatch(const TensorSpec& spec) override {
    if (!patch_.has_value()) return absl::InternalError("EndPatch without BeginPatch");
    const absl::string_view body(reinterpret_cast<const char*>(buffer_.get()), patch_->bytes);
    absl::Status s = session_->BeginPatchedTensor(spec, std::nullopt, patch_->header, patch_->bytes,
                                                  patch_->base_digest, patch_->digest);
    if (s.ok()) s = session_->Append(body);
    if (!s.ok()) {
      patch_refused_ = true;
      return s;
    }
    coming_.erase(spec.name);
    ++counts_.patches;
    counts_.patch_bytes += body.size();
    patch_.reset();
    return absl::OkStatus();
  }

  const Counts& counts() const { return counts_; }
  bool patch_refused() const { return patch_refused_; }

 private:
  struct Patch {
    ElementPatch header;
    uint64_t bytes = 0;
    TensorDigest base_digest, digest;
  };

  // Room for `bytes` of `spec` (or of its patch), which the listing must
  // say is coming and has not come yet. The buffer is reused; a larger one
  // replaces it (the old freed first), never initialised.
  absl::Status Take(const TensorSpec& spec, uint64_t bytes, bool patch) {
    if (cancel_ != nullptr && cancel_->load()) {
      return absl::CancelledError(absl::StrCat("the step was cancelled before tensor '", spec.name, "'"));
    }
    auto it = coming_.find(spec.name);
    if (it == coming_.end() || it->second.dtype != spec.dtype || it->second.shape != spec.shape ||
        (patch ? bytes >= spec.byte_size() : bytes != spec.byte_size())) {
      return absl::DataLossError(absl::StrCat("the upstream sent tensor '", spec.name.substr(0, 256),
                                              patch ? "' as a patch" : "'",
                                              ", which its listing does not say is coming so (unlisted, unchanged, "
                                              "sent already, or another dtype, shape or size)"));
    }
    if (capacity_ < bytes) {
      buffer_.reset();
      buffer_ = std::make_unique_for_overwrite<std::byte[]>(bytes);
      capacity_ = bytes;
    }
    return absl::OkStatus();
  }

  PushSession* session_;
  const CheckpointManifest* base_;
  absl::flat_hash_map<std::string, TensorSpec> coming_;  // erased as each ends
  std::shared_ptr<const std::atomic<bool>> cancel_;
  std::unique_ptr<std::byte[]> buffer_;
  uint64_t capacity_ = 0;
  std::optional<Patch> patch_;
  Counts counts_;
  bool patch_refused_ = false;
};

// How long a watch or a poll that finds nothing to follow waits before it
// asks the node cache again, should no pull wake it first: never forever.
// (A step's checkpoint once dropped out of NodeCache::Followed() while the
// step placed its files, and a poll that looked then stopped following for
// good; that is fixed, and this keeps any such moment from lasting.)
constexpr absl::Duration kLookAgain = absl::Seconds(1);

}  // namespace

Follower::Follower(CheckpointRegistry* registry, FollowedCache* cache, FollowUpstream upstream, FollowOptions options)
    : registry_(registry), cache_(cache), upstream_(std::move(upstream)), options_(options) {}

Follower::~Follower() {
  Stop();
  if (watcher_.joinable()) watcher_.join();
  if (stepper_.joinable()) stepper_.join();
}

void Follower::Start() {
  if (!upstream_.only.empty()) {
    LogFollow(absl::StrCat("following only the checkpoints named by --follow-only: ",
                           absl::StrJoin(upstream_.only, ", ", [](std::string* out, const std::string& p) {
                             absl::StrAppend(out, "'", absl::CHexEscape(p), "'");
                           })));
  }
  watcher_ = std::thread([this] {
    if (upstream_.watch != nullptr) {
      WatchLoop();
    } else if (upstream_.poll) {
      PollLoop();
    }
  });
  stepper_ = std::thread([this] { StepLoop(); });
}

void Follower::Refresh() {
  absl::MutexLock lock(&mu_);
  refresh_ = true;
  if (watch_cancel_) watch_cancel_->store(true);
}

void Follower::Stop() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  step_cancel_->store(true);
  if (watch_cancel_) watch_cancel_->store(true);
}

absl::Duration Follower::Backoff(int failures) const {
  absl::Duration d = options_.retry_min;
  for (int i = 1; i < failures && d < options_.retry_max; ++i) d *= 2;
  d = std::min(d, options_.retry_max);
  thread_local std::minstd_rand jitter(std::random_device{}());
  return d + d * (std::uniform_real_distribution<double>(0, 0.25)(jitter));
}

bool Follower::Sleep(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || refresh_; };
  mu_.AwaitWithTimeout(absl::Condition(&woken), d);
  return !stopping_;
}

void Follower::WatchLoop() {
  int failures = 0;
  while (true) {
    auto cancel = std::make_shared<std::atomic<bool>>(false);
    {
      // Before the snapshot: a Refresh from here on reopens the watch again.
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      refresh_ = false;
      watch_cancel_ = cancel;
    }
    std::map<std::string, std::string> known = Known();
    {
      absl::MutexLock lock(&mu_);
      Track(known);
    }
    if (known.empty()) {  // nothing to follow until a pull finishes, or a second from now
      absl::MutexLock lock(&mu_);
      auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || refresh_; };
      mu_.AwaitWithTimeout(absl::Condition(&woken), kLookAgain);
      continue;
    }
    client::WatchOptions watch;
    watch.known = known;
    watch.cancel = cancel;
    bool announced_connect = false;
    absl::Status status = upstream_.watch->Watch(watch, [&](const client::CheckpointEvent& e) {
      std::string line;
      bool go_on = true;
      {
        absl::MutexLock lock(&mu_);
        go_on = !stopping_;
        if (e.kind == client::CheckpointEvent::Kind::kSynced) {
          if (!connected_ && !announced_connect) {
            line = absl::StrCat("watching ", upstream_.name, " for ", known.size(), " checkpoints");
            announced_connect = true;
          }
          connected_ = true;
          failures = 0;
        } else if (auto it = followed_.find(e.name); it == followed_.end()) {
          // not one the node holds
        } else if (e.kind == client::CheckpointEvent::Kind::kRemoved) {
          line = absl::StrCat("'", e.name, "' was removed upstream; the node keeps serving what it holds");
        } else {
          Announce(it->second, e.new_version);
        }
      }
      if (!line.empty()) LogFollow(line);  // never under mu_: stderr may block
      return go_on;
    });
    bool refreshed = false;
    {
      absl::MutexLock lock(&mu_);
      connected_ = false;
      if (stopping_) return;
      refreshed = refresh_;
    }
    if (refreshed) continue;
    ++failures;
    if (failures == 1 || failures % 100 == 0) {
      LogFollow(absl::StrCat("the watch of ", upstream_.name, " ended (", Said(status.ToString()), "); retrying",
                             failures > 1 ? absl::StrCat(" (", failures, " tries)") : ""));
    }
    if (!Sleep(Backoff(failures))) return;
  }
}

absl::Status CheckFollowPatterns(const std::vector<std::string>& patterns) {
  constexpr size_t kMaxPatterns = 1024, kMaxPatternBytes = 1024, kMaxStars = 2;
  if (patterns.size() > kMaxPatterns) {
    return absl::InvalidArgumentError(absl::StrCat(patterns.size(), " patterns; at most ", kMaxPatterns));
  }
  for (const std::string& p : patterns) {
    if (p.empty() || p.size() > kMaxPatternBytes || p.find('\0') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("pattern '", absl::CHexEscape(p.substr(0, 64)), "': ", p.size(),
                                                     " bytes; 1 to ", kMaxPatternBytes, ", no NUL"));
    }
    if (std::count(p.begin(), p.end(), '*') > static_cast<std::ptrdiff_t>(kMaxStars)) {
      return absl::InvalidArgumentError(
          absl::StrCat("pattern '", absl::CHexEscape(p.substr(0, 64)), "': more than ", kMaxStars, " '*'"));
    }
  }
  return absl::OkStatus();
}

bool Follower::Follows(const std::string& name) const {
  if (upstream_.only.empty()) return true;
  for (const std::string& pattern : upstream_.only) {
    if (::fnmatch(pattern.c_str(), name.c_str(), 0) == 0) return true;
  }
  return false;
}

std::map<std::string, std::string> Follower::Known() {
  std::map<std::string, std::string> known = cache_->Followed();
  std::vector<std::string> left_out;
  std::erase_if(known, [&](const auto& held) {
    if (Follows(held.first)) return false;
    left_out.push_back(held.first);
    return true;
  });
  SayLeftOut(left_out);
  return known;
}

void Follower::SayLeftOut(const std::vector<std::string>& names) {
  std::vector<std::string> lines;
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& name : names) {
      if (left_out_said_.size() < kMaxLeftOutSaid && left_out_said_.insert(name).second) {
        lines.push_back(absl::StrCat("'", name, "' is held but not followed: --follow-only names it not"));
      }
    }
  }
  for (const std::string& line : lines) LogFollow(line);  // never under mu_: stderr may block
}

void Follower::Held(const std::string& name) {
  if (Follows(name)) {
    Refresh();
  } else {
    SayLeftOut({name});
  }
}

void Follower::Track(const std::map<std::string, std::string>& known) {
  // Checkpoints no longer held (evicted, replaced by an operator) are not
  // followed; those held are, from the version held. The one a step is
  // writing stays (its ledger entry is being brought up to date).
  for (auto it = followed_.begin(); it != followed_.end();) {
    it = known.contains(it->first) || it->first == stepping_ ? std::next(it) : followed_.erase(it);
  }
  for (const auto& [name, version] : known) followed_[name].stats.name = name;
}

void Follower::Announce(Followed& f, const std::string& version) {
  if (version != f.newest || f.announced == f.caught_up) {
    if (f.announced == f.caught_up) f.behind_since = absl::Now();
    f.newest = version;
    ++f.announced;
    f.retry_at = absl::InfinitePast();
    f.blocked.clear();  // another version: worth a try
  }
}

void Follower::PollLoop() {
  int failures = 0;            // polls in a row that some checkpoint's failed
  std::set<std::string> gone;  // said to be missing at the origin (logged once)
  thread_local std::minstd_rand jitter(std::random_device{}());
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      refresh_ = false;
    }
    std::map<std::string, std::string> known = Known();
    {
      absl::MutexLock lock(&mu_);
      Track(known);
      if (known.empty()) {  // nothing to follow until a pull finishes, or the next poll
        auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || refresh_; };
        mu_.AwaitWithTimeout(absl::Condition(&woken), std::min(upstream_.poll_interval, kLookAgain));
        continue;
      }
    }
    // One listing per checkpoint held, one checkpoint at a time.
    absl::Status failed;
    for (const auto& [name, held] : known) {
      absl::StatusOr<std::string> version = upstream_.poll(name);
      std::string line;
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) return;
        auto it = followed_.find(name);
        if (version.ok()) {
          if (gone.erase(name) > 0) line = absl::StrCat("'", name, "' is at ", upstream_.name, " again");
          if (it != followed_.end() && *version != held) Announce(it->second, *version);
        } else if (absl::IsNotFound(version.status())) {
          if (gone.insert(name).second) {
            line =
                absl::StrCat("'", name, "' is no longer at ", upstream_.name, "; the node keeps serving what it holds");
          }
        } else if (failed.ok()) {
          failed = version.status();
        }
      }
      if (!line.empty()) LogFollow(line);
    }
    {
      absl::MutexLock lock(&mu_);
      connected_ = failed.ok();
    }
    failures = failed.ok() ? 0 : failures + 1;
    if (failures == 1 || (failures > 0 && failures % 100 == 0)) {
      LogFollow(absl::StrCat("polling ", upstream_.name, " failed (", Said(failed.ToString()), "); retrying",
                             failures > 1 ? absl::StrCat(" (", failures, " tries)") : ""));
    }
    const double spread = std::uniform_real_distribution<double>(0.8, 1.2)(jitter);
    if (!Sleep(upstream_.poll_interval * spread)) return;
  }
}

void Follower::StepLoop() {
  while (true) {
    std::string name;
    uint64_t announced_before = 0;
    {
      absl::MutexLock lock(&mu_);
      // The next checkpoint behind its upstream whose retry is due.
      absl::Time next = absl::InfiniteFuture();
      auto due = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (stopping_) return true;
        next = absl::InfiniteFuture();
        const absl::Time now = absl::Now();
        for (auto& [n, f] : followed_) {
          if (f.announced == f.caught_up || !f.blocked.empty()) continue;
          if (f.retry_at <= now) {
            name = n;
            return true;
          }
          next = std::min(next, f.retry_at);
        }
        return false;
      };
      while (!due()) {
        if (next == absl::InfiniteFuture()) {
          mu_.Await(absl::Condition(&due));
          break;
        }
        mu_.AwaitWithDeadline(absl::Condition(&due), next);
      }
      if (stopping_) return;
      if (name.empty()) continue;
      stepping_ = name;
      announced_before = followed_[name].announced;
    }
    absl::Status status = Step(name);
    std::string line;
    {
      absl::MutexLock lock(&mu_);
      stepping_.clear();
      if (stopping_) return;
      auto it = followed_.find(name);
      if (it == followed_.end()) continue;
      Followed& f = it->second;
      if (status.ok()) {
        f.failures_in_a_row = 0;
        continue;
      }
      ++f.stats.failures;
      ++f.failures_in_a_row;
      const bool lasting = Lasting(status);
      if (lasting && f.announced == announced_before) {
        f.blocked = std::string(status.message());
      } else if (lasting) {
        // Another version was announced while it ran: worth a try now.
      } else {
        f.retry_at = absl::Now() + Backoff(f.failures_in_a_row);
      }
      // Once per kind of failure in a row, then every 100th.
      if (f.failures_in_a_row == 1 || f.failures_in_a_row % 100 == 0 || lasting) {
        line = absl::StrCat("'", name, "' stays at its version", lasting ? " until the upstream has another" : "", ": ",
                            Said(status.ToString()));
      }
    }
    if (!line.empty()) LogFollow(line);
  }
}

absl::Status Follower::Step(const std::string& name) {
  bool patch_failed = false;
  absl::Status status = StepOnce(name, /*patches=*/true, &patch_failed);
  if (patch_failed) {
    LogFollow(absl::StrCat("'", name, "': the element patches failed (", Said(status.message()),
                           "); fetching the changed tensors whole"));
    {
      absl::MutexLock lock(&mu_);
      if (auto it = followed_.find(name); it != followed_.end()) ++it->second.stats.fallbacks["patch_failed"];
    }
    status = StepOnce(name, /*patches=*/false, &patch_failed);
  }
  return status;
}

absl::Status Follower::StepOnce(const std::string& name, bool patches, bool* patch_failed) {
  *patch_failed = false;
  std::shared_ptr<const CheckpointVersion> base = registry_->Get(name);
  if (base == nullptr || !cache_->BeginStep(name, *base)) {
    // Unloaded, evicted, or its files replaced here: not the cache's, and no
    // longer followed (a later pull of it is, from then).
    {
      absl::MutexLock lock(&mu_);
      followed_.erase(name);
    }
    LogFollow(absl::StrCat("'", name,
                           "' is no longer the node cache's (unloaded, evicted, or its files replaced "
                           "here); it is not followed"));
    return absl::OkStatus();
  }
  // EndStep on every way out, with the version published if there is one.
  std::shared_ptr<const CheckpointVersion> published;
  struct EndStep {
    FollowedCache* cache;
    const std::string& name;
    const std::shared_ptr<const CheckpointVersion>& published;
    ~EndStep() { cache->EndStep(name, published.get()); }
  } end_step{cache_, name, published};
  uint64_t announced = 0;  // before the listing: what it catches up with
  {
    absl::MutexLock lock(&mu_);
    if (auto it = followed_.find(name); it != followed_.end()) announced = it->second.announced;
  }
  // Held now: the upstream's version as listed after every announcement up
  // to `announced`.
  auto caught_up = [&] {
    absl::MutexLock lock(&mu_);
    auto it = followed_.find(name);
    if (it == followed_.end()) return;
    Followed& f = it->second;
    f.caught_up = std::max(f.caught_up, announced);
    // Announced while the step ran: behind again, from now.
    if (f.announced > f.caught_up) f.behind_since = absl::Now();
  };
  const absl::Time start = absl::Now();
  // The origin's new version as its files (FollowedCache::Repull): from an
  // origin without patches, or as the fallback `reason` names.
  auto pull_files = [&](const std::string& reason) -> absl::Status {
    absl::StatusOr<FollowedCache::Repulled> repulled = cache_->Repull(name, *base);
    if (!repulled.ok()) {
      return absl::Status(repulled.status().code(), absl::StrCat("step of '", name, "' from ", upstream_.name, ": ",
                                                                 repulled.status().message()));
    }
    if (repulled->version != nullptr) {
      published = repulled->version;
      absl::MutexLock lock(&mu_);
      if (auto it = followed_.find(name); it != followed_.end()) {
        it->second.stats.whole_bytes += repulled->bytes;
        ++(repulled->ranged ? it->second.stats.steps_ranged : it->second.stats.steps_whole);
        if (!reason.empty()) ++it->second.stats.fallbacks[reason];
      }
    }
    caught_up();
    if (published != nullptr) {
      LogFollow(absl::StrFormat(
          "'%s' is at version %s: pulled as files (%d bytes%s)%s in %.3f s", name, published->version(),
          repulled->bytes, repulled->ranged ? ", only the changed tensors" : "",
          reason.empty() ? "" : absl::StrCat(", ", reason), absl::ToDoubleSeconds(absl::Now() - start)));
    }
    return absl::OkStatus();
  };
  if (upstream_.steps == nullptr) return pull_files("");
  // What keeps any step from succeeding is found before anything is fetched:
  // digests off here, or a checkpoint the push cannot write (sharded, a
  // format without a writer, preloaded, reached through a symlink).
  if (!registry_->options().tensor_digests || base->manifest() == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("'", name, "' has no tensor digests here; a node follows only with --tensor-digests"));
  }
  WEIGHTSTORE_RETURN_IF_ERROR(registry_->BeginPush(name, {.base_version = base->version()}).status());

  client::Query query;
  query.since_version = base->version();
  query.patches = patches;
  query.cancel = step_cancel_;
  // The listing first (no bytes): what blocks the step is found before
  // anything is fetched, and the fetch is pinned to the version listed.
  WEIGHTSTORE_ASSIGN_OR_RETURN(client::TensorListing listing, upstream_.steps->ListTensors(name, query));
  if (listing.version == base->version()) {
    caught_up();
    return absl::OkStatus();
  }
  if (!ValidVersionId(listing.version)) {
    return absl::InvalidArgumentError(absl::StrCat("the upstream's version id of '", name, "', '",
                                                   Said(listing.version), "', is not 1 to 64 bytes of [0-9A-Za-z._-]"));
  }
  // The node keeps the quantization config it pulled beside a checkpoint
  // held apart (a hub snapshot): a version the upstream describes by another
  // config would be served here with the old one, and is not taken, however
  // it would come (as patches, or as its files).
  const bool config_pulled =
      base->checkpoint()->quantization() != nullptr && node_cache_internal::IsApartPath(base->relative_path());
  for (size_t i = 0; config_pulled && i < listing.tensors.size(); ++i) {
    const client::TensorDescription& d = listing.tensors[i];
    std::string ours;
    if (const CheckpointEntry* held = base->checkpoint()->Find(d.spec.name)) {
      ours = DescribeQuantizationOf(*base->checkpoint(), *held);
    } else if (d.quantization.empty()) {
      continue;  // a new tensor the upstream leaves alone
    } else if (const QuantScheme* scheme = base->checkpoint()->quantization()->SchemeOf(d.spec.name)) {
      ours = absl::StrCat(DescribeQuantScheme(*scheme), " (", base->checkpoint()->quantization()->source(), ")");
    }
    if (ours != d.quantization) {
      return absl::FailedPreconditionError(
          absl::StrCat("the upstream's version ", Said(listing.version), " of '", name, "' quantizes tensor '",
                       Said(d.spec.name), "' as '", Said(d.quantization), "', and this node's config beside it as '",
                       ours, "': a node keeps the configs it pulled; remove its folder to pull the checkpoint anew"));
    }
  }
  // A push to a sharded checkpoint keeps each shard's tensors, in order, with
  // their dtypes and shapes, and the index's metadata: a version that adds,
  // drops, reorders or redefines tensors, or has other metadata (another
  // index over the same shards), comes as its files. One that only moves
  // tensors between shards, keeping their order, is written under the
  // shards held: the same tensors, laid out as this node's.
  if (base->checkpoint()->files().size() > 1 || IndexFormatForPath(base->path()) != nullptr) {
    const Checkpoint& held = *base->checkpoint();
    bool same_layout = listing.tensors.size() == held.size();
    for (size_t i = 0; same_layout && i < held.size(); ++i) {
      const TensorSpec& theirs = listing.tensors[i].spec;
      const TensorSpec& ours = held.entries()[i].spec;
      same_layout = theirs.name == ours.name && theirs.dtype == ours.dtype && theirs.shape == ours.shape;
    }
    if (same_layout) {
      WEIGHTSTORE_ASSIGN_OR_RETURN(client::CheckpointSummary now, upstream_.steps->GetCheckpoint(name, step_cancel_));
      same_layout = now.version != listing.version || now.metadata == held.metadata();
    }
    if (!same_layout) return pull_files("index_changed");
  }
  uint64_t to_receive = 0;
  const bool delta = listing.delta.has_value() && listing.delta->delta;
  for (const client::TensorDescription& d : listing.tensors) {
    if (TensorDigest::FromHex(d.digest) == std::nullopt) {
      return absl::FailedPreconditionError(
          absl::StrCat("the upstream lists tensor '", Said(d.spec.name), "' of '", name,
                       "' without a digest; a daemon is followed only with --tensor-digests"));
    }
    if (!delta || !d.unchanged) to_receive = SaturatingAdd(to_receive, d.spec.byte_size());
  }
  if (to_receive > options_.max_step_bytes) {
    return absl::FailedPreconditionError(absl::StrCat("a step of '", name, "' to version ", Said(listing.version),
                                                      " brings ", to_receive, " bytes of tensors; at most ",
                                                      options_.max_step_bytes, " (--max-put-bytes) are taken"));
  }
  // Room on disk for the new file, written beside the one held: the
  // tensors listed, and their header (at most 64 KiB, and 256 bytes a
  // tensor, allowed for).
  uint64_t new_file_bytes = 64 << 10;
  for (const client::TensorDescription& d : listing.tensors) {
    new_file_bytes = SaturatingAdd(new_file_bytes, SaturatingAdd(d.spec.byte_size(), 256));
  }
  WEIGHTSTORE_RETURN_IF_ERROR(cache_->ReserveStep(name, new_file_bytes));
  // The same id must never name two contents here: an upstream that reuses
  // the id of a version this node keeps, for other tensors, is refused.
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<ManifestTensor> expected, ExpectedTensors(name, listing.tensors));
  if (std::shared_ptr<const CheckpointManifest> kept = registry_->FindManifest(name, listing.version)) {
    bool same = kept->tensors().size() == expected.size();
    for (size_t i = 0; same && i < expected.size(); ++i) {
      const ManifestTensor* k = kept->Find(expected[i].name);
      same = k != nullptr && k->SameContentAs(expected[i]);
    }
    if (!same) {
      // Blocked until the upstream has another version: retrying would
      // fetch the same lie again.
      return absl::FailedPreconditionError(absl::StrCat("the upstream names other tensors '", Said(listing.version),
                                                        "', a version id of '", name, "' this node keeps"));
    }
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(client::CheckpointSummary summary, upstream_.steps->GetCheckpoint(name, step_cancel_));
  if (summary.version != listing.version) {
    return absl::AbortedError(absl::StrCat("'", name, "' changed upstream while it was listed; listing again"));
  }
  if (step_cancel_->load()) return absl::CancelledError("the daemon is stopping");

  // The push: tensors the base lacks, or holds with another dtype or shape,
  // are (re)defined; tensors the upstream no longer has are removed.
  const Checkpoint& held = *base->checkpoint();
  PushOptions push;
  push.base_version = base->version();
  push.version_id = listing.version;
  push.metadata = summary.metadata;
  absl::flat_hash_set<std::string> listed;
  for (const client::TensorDescription& d : listing.tensors) {
    listed.insert(d.spec.name);
    const CheckpointEntry* e = held.Find(d.spec.name);
    if (e == nullptr) {
      push.allow_new_tensors = true;
    } else if (e->spec.dtype != d.spec.dtype || e->spec.shape != d.spec.shape) {
      push.allow_new_tensors = true;
      push.remove.push_back(d.spec.name);
    }
  }
  for (const CheckpointEntry& e : held.entries()) {
    if (!listed.contains(e.spec.name)) push.remove.push_back(e.spec.name);
  }
  push.expected = std::move(expected);

  // The changed tensors and patches go into the push as they arrive, one at
  // a time (StepSink): a step holds one tensor in memory, not all of them.
  // The fetch is pinned to the version listed (else Aborted).
  query.version = listing.version;
  if (!delta) query.since_version.clear();
  StepSink::Counts counts;
  absl::Time fetched = absl::Now();
  absl::Status status = [&]() -> absl::Status {
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::unique_ptr<PushSession> session, registry_->BeginPush(name, push));
    if (!delta || listing.delta->changed_tensors > 0) {
      absl::flat_hash_map<std::string, TensorSpec> coming;
      for (const client::TensorDescription& d : listing.tensors) {
        if (!delta || !d.unchanged) coming.emplace(d.spec.name, d.spec);
      }
      StepSink sink(session.get(), base->manifest().get(), std::move(coming), step_cancel_);
      absl::Status streamed = upstream_.steps->FetchTensors(name, query, &sink);
      counts = sink.counts();
      {  // counted as received, before the version they make is served (and whether or not it is)
        absl::MutexLock lock(&mu_);
        if (auto it = followed_.find(name); it != followed_.end()) {
          it->second.stats.patch_bytes += counts.patch_bytes;
          it->second.stats.whole_bytes += counts.whole_bytes;
        }
      }
      if (!streamed.ok()) {
        *patch_failed = sink.patch_refused();
        return streamed;
      }
    }
    fetched = absl::Now();
    absl::StatusOr<std::shared_ptr<const CheckpointVersion>> finished = registry_->FinishPush(std::move(session));
    if (!finished.ok()) {
      // A patch whose result is unlike its digest fails here (DataLoss).
      *patch_failed = counts.patches > 0 && absl::IsDataLoss(finished.status());
      return finished.status();
    }
    published = *std::move(finished);
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    return absl::Status(status.code(), absl::StrCat("step of '", name, "' to version ", listing.version, " from ",
                                                    upstream_.name, ": ", status.message()));
  }
  const uint64_t patch_bytes = counts.patch_bytes, whole_bytes = counts.whole_bytes;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = followed_.find(name); it != followed_.end()) {
      FollowedStats& s = it->second.stats;
      if (counts.whole == 0) {
        ++s.steps_patched;
      } else {
        ++s.steps_whole;
        if (!delta) {
          ++s.fallbacks["not_delta"];
        } else if (patches && !listing.delta->patch_reason.empty()) {
          ++s.fallbacks["not_kept"];
        }
      }
    }
  }
  caught_up();
  LogFollow(absl::StrFormat(
      "'%s' is at version %s: %d patches (%d bytes), %d tensors whole (%d bytes); fetched into the push in %.3f s, "
      "written and published in %.3f s",
      name, listing.version, counts.patches, patch_bytes, counts.whole, whole_bytes,
      absl::ToDoubleSeconds(fetched - start), absl::ToDoubleSeconds(absl::Now() - fetched)));
  return absl::OkStatus();
}

FollowStats Follower::Stats() const { return StatsFor(nullptr); }

std::set<std::string> Follower::FollowedNames() const {
  std::set<std::string> names;
  absl::MutexLock lock(&mu_);
  for (const auto& [name, f] : followed_) names.insert(name);
  return names;
}

FollowStats Follower::StatsOf(const std::string& name) const { return StatsFor(&name); }

FollowStats Follower::StatsFor(const std::string* only) const {
  FollowStats s;
  s.following = true;
  absl::MutexLock lock(&mu_);
  s.upstream_connected = connected_;
  const absl::Time now = absl::Now();
  auto add = [&](const Followed& f) {
    FollowedStats c = f.stats;
    c.blocked = !f.blocked.empty();
    c.blocked_reason = f.blocked;
    c.newest = f.newest;
    c.lag_versions = f.announced - f.caught_up;
    c.lag_seconds = c.lag_versions == 0 ? 0 : absl::ToDoubleSeconds(now - f.behind_since);
    s.checkpoints.push_back(std::move(c));
  };
  if (only != nullptr) {
    if (auto it = followed_.find(*only); it != followed_.end()) add(it->second);
    return s;
  }
  for (const auto& [name, f] : followed_) add(f);
  return s;
}

}  // namespace weightstore::origin

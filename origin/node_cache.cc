// The node cache's construction, its flights (one transfer per checkpoint,
// and who waits for it) and its counters. The transfer and placement are in
// node_cache_transfer.cc, the ledger in node_cache_ledger.cc, the budget and
// eviction in node_cache_eviction.cc.
#include "origin/node_cache.h"

#include <filesystem>
#include <map>
#include <system_error>
#include <thread>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "origin/node_cache_internal.h"

namespace weightstore::origin {

namespace fs = std::filesystem;

using node_cache_internal::kRememberedRefusal;
using node_cache_internal::PlaceablePath;

namespace {

constexpr char kStateFolder[] = ".weightstore-cache";

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

NodeCache::NodeCache(CheckpointRegistry* registry, std::unique_ptr<Origin> origin, NodeCacheOptions options)
    : registry_(registry),
      origin_(std::move(origin)),
      options_(std::move(options)),
      // Absolute: the registry resolves a relative path against the models
      // folder, so a relative --models would be taken twice.
      models_dir_(fs::absolute(registry->options().models_dir).lexically_normal().string()),
      state_dir_((fs::path(models_dir_) / kStateFolder).string()) {
  origin_->set_max_files(options_.max_files);
}

NodeCache::~NodeCache() {
  // First what reaches follower_ (the listener, the flights), then the
  // follower, whose steps call the cache.
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
  follower_.reset();
  registry_->SetVersionIds(nullptr);  // waits for a call in progress
  (void)SaveLedger();                 // keeps the last uses for the next run's evictions
}

void NodeCache::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (follower_ != nullptr) follower_->Stop();
  origin_->Cancel();
}

absl::StatusOr<std::unique_ptr<NodeCache>> NodeCache::Open(CheckpointRegistry* registry, std::unique_ptr<Origin> origin,
                                                           NodeCacheOptions options, FollowUpstream follow) {
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
  cache->FinishInterruptedSteps();
  {
    absl::MutexLock lock(&cache->mu_);
    cache->ReadLedger();
  }
  cache->ServeApart();
  if ((follow.watch != nullptr && follow.steps != nullptr) || follow.poll) {
    if (follow.name.empty()) follow.name = cache->origin_->Describe();
    FollowOptions follow_options;
    follow_options.max_step_bytes = registry->options().max_put_bytes;
    cache->follower_ = std::make_unique<Follower>(registry, cache.get(), std::move(follow), follow_options);
    cache->follower_->Start();
  }
  return cache;
}

PullStats NodeCache::Stats() const { return StatsFor(nullptr); }

PullStats NodeCache::StatsOf(const std::string& name) const { return StatsFor(&name); }

PullStats NodeCache::StatsFor(const std::string* only) const {
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
  if (follower_ != nullptr) s.follow = only != nullptr ? follower_->StatsOf(*only) : follower_->Stats();
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
  if (!IsLoadableName(name, 4096)) {
    done(absl::NotFoundError(absl::StrCat("checkpoint '", name,
                                          "' is not served, and cannot be pulled: a pulled checkpoint's name is a "
                                          "relative path of letters, digits, '-', '_', '.' and '/', with at most "
                                          "one '@REVISION'")));
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
  if (version != nullptr && follower_ != nullptr) follower_->Held(name);  // followed from now, or said not to be
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

}  // namespace weightstore::origin

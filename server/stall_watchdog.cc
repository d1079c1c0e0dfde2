#include "server/stall_watchdog.h"

#include <algorithm>
#include <utility>

#include "server/log.h"

namespace weightstore::server {

StallWatchdog::StallWatchdog() {
  thread_ = std::thread([this] { Run(); });
}

StallWatchdog::~StallWatchdog() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

StallWatchdog::Watched StallWatchdog::Watch(std::string peer, const StreamLimits& limits,
                                            std::function<void()> cancel) {
  absl::MutexLock lock(&mu_);
  const uint64_t id = next_id_++;
  streams_.emplace(id, Stream{PeerAddress(peer), &limits, std::move(cancel), Clock::now()});
  if (Tick(limits) < tick_) {  // wake the thread to check this one in time
    tick_ = Tick(limits);
    retick_ = true;
  }
  return Watched(this, id);
}

uint64_t StallWatchdog::cancelled(const StreamLimits& limits) const {
  absl::MutexLock lock(&mu_);
  auto it = cancelled_.find(&limits);
  return it == cancelled_.end() ? 0 : it->second;
}

StallWatchdog::Watched& StallWatchdog::Watched::operator=(Watched&& other) noexcept {
  if (this != &other) {
    Unwatch();
    watchdog_ = std::exchange(other.watchdog_, nullptr);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

void StallWatchdog::Watched::Progress(uint64_t bytes) {
  if (watchdog_ == nullptr) return;
  absl::MutexLock lock(&watchdog_->mu_);
  if (auto it = watchdog_->streams_.find(id_); it != watchdog_->streams_.end()) it->second.period_bytes += bytes;
}

void StallWatchdog::Watched::Busy() {
  if (watchdog_ == nullptr) return;
  absl::MutexLock lock(&watchdog_->mu_);
  if (auto it = watchdog_->streams_.find(id_); it != watchdog_->streams_.end()) it->second.busy = true;
}

void StallWatchdog::Watched::Resume() {
  if (watchdog_ == nullptr) return;
  absl::MutexLock lock(&watchdog_->mu_);
  if (auto it = watchdog_->streams_.find(id_); it != watchdog_->streams_.end()) {
    it->second.busy = false;
    it->second.period_start = Clock::now();
    it->second.period_bytes = 0;
  }
}

void StallWatchdog::Watched::Unwatch() {
  StallWatchdog* watchdog = std::exchange(watchdog_, nullptr);
  if (watchdog == nullptr) return;
  absl::MutexLock lock(&watchdog->mu_);  // a cancel in progress holds it
  watchdog->streams_.erase(id_);
}

std::chrono::milliseconds StallWatchdog::Tick(const StreamLimits& limits) {
  return std::clamp(limits.idle / 4, std::chrono::milliseconds(10), std::chrono::milliseconds(1000));
}

void StallWatchdog::Run() {
  // Each stream is checked a few times per its idle period: the thread wakes
  // for the shortest one watched (at most once a second, at least every 10 ms).
  absl::MutexLock lock(&mu_);
  const auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || retick_; };
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&woken), absl::FromChrono(tick_));
    retick_ = false;
    const Clock::time_point now = Clock::now();
    tick_ = std::chrono::milliseconds(1000);
    for (auto& [id, stream] : streams_) {
      const StreamLimits& limits = *stream.limits;
      tick_ = std::min(tick_, Tick(limits));
      if (stream.cancelling || stream.busy || now - stream.period_start < limits.idle) continue;
      if (stream.period_bytes >= limits.min_bytes) {  // moving: a new period
        stream.period_start = now;
        stream.period_bytes = 0;
        continue;
      }
      stream.cancelling = true;  // unwatched when the stream ends
      ++cancelled_[&limits];
      Log(LogLevel::kWarning, "stalled stream cancelled",
          {{"what", limits.what},
           {"peer", stream.peer},
           {"bytes", stream.period_bytes},
           {"period_ms", std::chrono::duration_cast<std::chrono::milliseconds>(now - stream.period_start).count()}});
      stream.cancel();
    }
  }
}

}  // namespace weightstore::server

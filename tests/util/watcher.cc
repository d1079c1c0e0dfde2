#include "tests/util/watcher.h"

#include "tests/util/wait.h"

namespace weightstore::testing {

using client::CheckpointEvent;

Watcher::Watcher(client::Store* store, client::WatchOptions options) {
  options.cancel = cancel_;
  thread_ = std::thread([this, store, options] {
    absl::Status status = store->Watch(options, [this](const CheckpointEvent& e) {
      absl::MutexLock lock(&mu_);
      events_.push_back(e);
      last_event_at_ = std::chrono::steady_clock::now();
      return true;
    });
    absl::MutexLock lock(&mu_);
    status_ = status;
    done_ = true;
  });
}

absl::Status Watcher::Stop() {
  *cancel_ = true;
  if (thread_.joinable()) thread_.join();
  absl::MutexLock lock(&mu_);
  return status_;
}

std::vector<CheckpointEvent> Watcher::events() {
  absl::MutexLock lock(&mu_);
  return events_;
}

std::chrono::steady_clock::time_point Watcher::last_event_at() {
  absl::MutexLock lock(&mu_);
  return last_event_at_;
}

std::optional<CheckpointEvent> Watcher::WaitFor(const std::function<bool(const CheckpointEvent&)>& match) {
  absl::MutexLock lock(&mu_);
  auto found = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (; seen_ < events_.size(); ++seen_) {
      if (match(events_[seen_])) return true;
    }
    return done_;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&found), absl::Seconds(10)) || seen_ >= events_.size()) {
    return std::nullopt;
  }
  return events_[seen_++];
}

bool Watcher::WaitForReplacement(const std::string& version) {
  return WaitUntil([&] {
    for (const CheckpointEvent& e : events()) {
      if (e.kind == CheckpointEvent::Kind::kReplaced && e.new_version == version) return true;
    }
    return false;
  });
}

}  // namespace weightstore::testing

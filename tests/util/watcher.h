// Watcher: a client's watch (Store::Watch) collecting its events on a thread
// of its own, for tests that wait on what a daemon announces.
#ifndef WEIGHTSTORE_TESTS_UTIL_WATCHER_H_
#define WEIGHTSTORE_TESTS_UTIL_WATCHER_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "client/store.h"

namespace weightstore::testing {

class Watcher {
 public:
  // Watches `store` (which must outlive it) with `options`, until Stop().
  Watcher(client::Store* store, client::WatchOptions options);
  ~Watcher() { (void)Stop(); }
  // Ends the watch; returns how it ended (Cancelled when by this call).
  absl::Status Stop();
  // Every event so far.
  std::vector<client::CheckpointEvent> events();
  // When the last event arrived.
  std::chrono::steady_clock::time_point last_event_at();
  // Waits up to 10 s for an event after the last one returned that `match`
  // accepts, and returns it.
  std::optional<client::CheckpointEvent> WaitFor(const std::function<bool(const client::CheckpointEvent&)>& match);
  // Waits (WaitUntil's deadline) until a replacement by `version` has come.
  bool WaitForReplacement(const std::string& version);

 private:
  std::shared_ptr<std::atomic<bool>> cancel_ = std::make_shared<std::atomic<bool>>(false);
  absl::Mutex mu_;
  std::vector<client::CheckpointEvent> events_ ABSL_GUARDED_BY(mu_);
  size_t seen_ ABSL_GUARDED_BY(mu_) = 0;
  std::chrono::steady_clock::time_point last_event_at_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace weightstore::testing

#endif  // WEIGHTSTORE_TESTS_UTIL_WATCHER_H_

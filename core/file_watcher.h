// FileWatcher: tells when watched files are written in place (inotify
// IN_MODIFY: a write or a truncation), so the registry can stop serving what
// changed under it and open the new contents as a new version. Replacing a
// file by rename does not modify the old one and is not reported.
//
// Files are watched under keys (a served checkpoint's name); several keys may
// share a file, and a key may cover several files (shards). Reports come on
// the watcher's own thread, `settle` after the last modification of a burst,
// so a writer that is still writing is reported once it pauses. A report
// names only keys whose files were modified while watched under them.
// Thread-safe.
#ifndef WEIGHTSTORE_CORE_FILE_WATCHER_H_
#define WEIGHTSTORE_CORE_FILE_WATCHER_H_

#include <chrono>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace weightstore {

class FileWatcher {
 public:
  using Callback = std::function<void(const std::set<std::string>& keys)>;

  // Starts the watcher thread. Internal if inotify is unavailable.
  static absl::StatusOr<std::unique_ptr<FileWatcher>> Start(Callback on_modified, std::chrono::milliseconds settle);
  ~FileWatcher();  // Stop()s

  // Stops the thread, waiting for a report in progress; none runs after it
  // returns. Idempotent. REQUIRES: not called from a report.
  void Stop();

  // Watches exactly `paths` (following symlinks) under `key`, replacing what
  // `key` watched before. Returns ResourceExhausted when the kernel's watch
  // limit (fs.inotify.max_user_watches) is reached; `key` then watches nothing.
  absl::Status Set(const std::string& key, const std::vector<std::string>& paths);
  // Stops watching for `key`.
  void Remove(const std::string& key);
  // Calls on_modified once more (after `settle`), with no keys: a reader saw a
  // change the kernel has not reported yet.
  void Poke();

 private:
  FileWatcher() = default;
  void Run();
  void RemoveLocked(const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Callback on_modified_;
  std::chrono::milliseconds settle_{0};
  int inotify_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: stop, or a poke
  std::thread thread_;
  absl::Mutex mu_;
  absl::flat_hash_map<int, std::set<std::string>> keys_of_watch_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::vector<int>> watches_of_key_ ABSL_GUARDED_BY(mu_);
  bool poked_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_FILE_WATCHER_H_

#include "core/file_watcher.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/status_util.h"

namespace weightstore {

absl::StatusOr<std::unique_ptr<FileWatcher>> FileWatcher::Start(Callback on_modified,
                                                                std::chrono::milliseconds settle) {
  std::unique_ptr<FileWatcher> w(new FileWatcher());
  w->on_modified_ = std::move(on_modified);
  w->settle_ = settle;
  w->inotify_fd_ = ::inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  if (w->inotify_fd_ < 0) return StatusFromErrno(errno, "inotify_init1");
  w->wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (w->wake_fd_ < 0) return StatusFromErrno(errno, "eventfd");
  w->thread_ = std::thread([p = w.get()] { p->Run(); });
  return w;
}

FileWatcher::~FileWatcher() {
  Stop();
  if (inotify_fd_ >= 0) ::close(inotify_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void FileWatcher::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof one);
  }
  if (thread_.joinable()) thread_.join();
}

absl::Status FileWatcher::Set(const std::string& key, const std::vector<std::string>& paths) {
  absl::MutexLock lock(&mu_);
  RemoveLocked(key);
  std::vector<int>& mine = watches_of_key_[key];
  for (const std::string& path : paths) {
    // The same inode watched twice gets the same descriptor.
    const int wd = ::inotify_add_watch(inotify_fd_, path.c_str(), IN_MODIFY);
    if (wd < 0) {
      const int error = errno;
      RemoveLocked(key);
      if (error == ENOSPC) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "cannot watch '", path, "' for changes: the inotify watch limit is reached (fs.inotify.max_user_watches)"));
      }
      return StatusFromErrno(error, absl::StrCat("cannot watch '", path, "' for changes"));
    }
    mine.push_back(wd);
    keys_of_watch_[wd].insert(key);
  }
  return absl::OkStatus();
}

void FileWatcher::Remove(const std::string& key) {
  absl::MutexLock lock(&mu_);
  RemoveLocked(key);
}

void FileWatcher::RemoveLocked(const std::string& key) {
  auto it = watches_of_key_.find(key);
  if (it == watches_of_key_.end()) return;
  for (int wd : it->second) {
    auto w = keys_of_watch_.find(wd);
    if (w == keys_of_watch_.end()) continue;
    w->second.erase(key);
    if (w->second.empty()) {
      // Events already queued for it find no keys and are dropped.
      ::inotify_rm_watch(inotify_fd_, wd);
      keys_of_watch_.erase(w);
    }
  }
  watches_of_key_.erase(it);
}

void FileWatcher::Poke() {
  {
    absl::MutexLock lock(&mu_);
    poked_ = true;
  }
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof one);
}

void FileWatcher::Run() {
  using Clock = std::chrono::steady_clock;
  std::set<std::string> pending;
  bool report = false;
  Clock::time_point report_at;
  alignas(struct inotify_event) char buffer[16 * 1024];
  while (true) {
    int timeout = -1;
    if (report) {
      timeout = static_cast<int>(std::max<int64_t>(
          0, std::chrono::duration_cast<std::chrono::milliseconds>(report_at - Clock::now()).count()));
    }
    pollfd fds[2] = {{inotify_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    const int ready = ::poll(fds, 2, timeout);
    if (ready < 0 && errno != EINTR) return;
    bool burst = false;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      if (fds[1].revents & POLLIN) {
        uint64_t n;
        (void)!::read(wake_fd_, &n, sizeof n);
      }
      if (poked_) {
        poked_ = false;
        burst = true;
      }
      while (fds[0].revents & POLLIN) {
        const ssize_t n = ::read(inotify_fd_, buffer, sizeof buffer);
        if (n <= 0) break;
        for (ssize_t at = 0; at < n;) {
          const auto* event = reinterpret_cast<const struct inotify_event*>(buffer + at);
          at += static_cast<ssize_t>(sizeof(struct inotify_event) + event->len);
          if (event->mask & IN_Q_OVERFLOW) {  // events were lost: assume every file changed
            for (const auto& [key, watches] : watches_of_key_) pending.insert(key);
            burst = true;
          } else if (event->mask & IN_MODIFY) {
            auto it = keys_of_watch_.find(event->wd);
            if (it != keys_of_watch_.end()) {
              pending.insert(it->second.begin(), it->second.end());
              burst = true;
            }
          }
        }
      }
    }
    if (burst) {
      report = true;
      report_at = Clock::now() + settle_;
    }
    if (report && Clock::now() >= report_at) {
      on_modified_(pending);
      pending.clear();
      report = false;
    }
  }
}

}  // namespace weightstore

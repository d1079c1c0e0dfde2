#include "server/worker_pool.h"

#include <algorithm>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"

namespace weightstore::server {

WorkerPool::WorkerPool(int threads, size_t max_queued, std::string what)
    : max_queued_(max_queued), what_(std::move(what)) {
  for (int i = 0; i < std::max(threads, 1); ++i) {
    try {
      threads_.emplace_back([this] { Work(); });
    } catch (const std::system_error&) {  // out of threads: serve with those started
      break;
    }
  }
  if (threads_.empty()) {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
}

WorkerPool::~WorkerPool() { Stop(); }

absl::Status WorkerPool::Post(Job job) {
  absl::MutexLock lock(&mu_);
  if (threads_.empty()) return absl::UnavailableError(absl::StrCat(what_, ": no worker thread could be started"));
  if (stopping_) return absl::UnavailableError(absl::StrCat(what_, ": the daemon is shutting down"));
  if (queue_.size() >= max_queued_) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what_, ": ", max_queued_, " requests are already waiting for a worker; try again later"));
  }
  queue_.push_back(std::move(job));
  return absl::OkStatus();
}

void WorkerPool::Stop() {
  std::deque<Job> dropped;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    stopped_ = true;
    dropped.swap(queue_);
  }
  for (Job& job : dropped) job(absl::UnavailableError(absl::StrCat(what_, ": the daemon is shutting down")));
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
}

size_t WorkerPool::queued() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

bool WorkerPool::HasWork() const { return stopping_ || !queue_.empty(); }

void WorkerPool::Work() {
  for (;;) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &WorkerPool::HasWork));
      if (queue_.empty()) return;  // stopping, and Stop() took the rest
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job(absl::OkStatus());
  }
}

}  // namespace weightstore::server

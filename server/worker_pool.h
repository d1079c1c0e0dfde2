// WorkerPool: a few threads for request work too long for gRPC's callback
// threads (a checksum over whole files), fed by a bounded queue.
//
// A job is called once: with OK on a worker when its turn comes, or with
// Unavailable when the queue stops before it ran (on the thread that stops
// it). Either way it must finish its call: a gRPC reactor left unfinished
// keeps the server from shutting down. Thread-safe.
#ifndef WEIGHTSTORE_SERVER_WORKER_POOL_H_
#define WEIGHTSTORE_SERVER_WORKER_POOL_H_

#include <atomic>
#include <cstddef>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace weightstore::server {

class WorkerPool {
 public:
  using Job = std::function<void(absl::Status runnable)>;

  // `threads` workers (at least 1); at most `max_queued` jobs wait. `what`
  // names the work in errors. If no thread can be started, every Post is
  // Unavailable (fewer than asked: those that started serve).
  WorkerPool(int threads, size_t max_queued, std::string what);
  ~WorkerPool();  // Stop()
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues `job`. ResourceExhausted when max_queued wait already, Unavailable
  // once stopped: `job` is then not called.
  absl::Status Post(Job job) ABSL_LOCKS_EXCLUDED(mu_);
  // Refuses new jobs, calls those still queued with Unavailable, and waits for
  // those running. Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  // Marks the pool stopping (stopping() is true from now on) without waiting:
  // the long jobs of several pools can be told to end before any is joined.
  void BeginStop() { stopped_.store(true, std::memory_order_relaxed); }

  size_t queued() const ABSL_LOCKS_EXCLUDED(mu_);
  // True once Stop() began: long jobs ask it to end early.
  bool stopping() const { return stopped_.load(std::memory_order_relaxed); }

 private:
  void Work() ABSL_LOCKS_EXCLUDED(mu_);
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t max_queued_;
  const std::string what_;
  mutable absl::Mutex mu_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> stopped_{false};
  std::vector<std::thread> threads_;
};

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_WORKER_POOL_H_

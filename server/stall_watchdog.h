// StallWatchdog: cancels streams that stop moving. One thread, for every kind
// of stream that can stall, checks each watched stream a few times per its
// `idle` period; a stream that moved less than its `min_bytes` in a whole
// period (its client stopped reading or writing, or trickles) has its cancel
// callback called, once. Admission is not its job (server/admission_gate.h).
// Thread-safe.
#ifndef WEIGHTSTORE_SERVER_STALL_WATCHDOG_H_
#define WEIGHTSTORE_SERVER_STALL_WATCHDOG_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "server/admission_gate.h"

namespace weightstore::server {

class StallWatchdog {
 public:
  StallWatchdog();
  ~StallWatchdog();  // stops the thread; every Watched must be gone by then
  StallWatchdog(const StallWatchdog&) = delete;
  StallWatchdog& operator=(const StallWatchdog&) = delete;

  // One watched stream: unwatched by Unwatch() or its destructor, after which
  // its cancel callback is never called (nor running). Move-only; empty when
  // default-constructed or moved from (every call then does nothing).
  class Watched {
   public:
    Watched() = default;
    Watched(Watched&& other) noexcept { *this = std::move(other); }
    Watched& operator=(Watched&& other) noexcept;
    Watched(const Watched&) = delete;
    Watched& operator=(const Watched&) = delete;
    ~Watched() { Unwatch(); }

    // `bytes` of the stream moved (a write or a read completed).
    void Progress(uint64_t bytes);
    // The stream is busy on the server's side (a push being written, a pull
    // or a selection it waits on): never taken for stalled until Resume.
    void Busy();
    // The stream moves again: watched from now, a fresh period.
    void Resume();
    void Unwatch();
    explicit operator bool() const { return watchdog_ != nullptr; }

   private:
    friend class StallWatchdog;
    Watched(StallWatchdog* watchdog, uint64_t id) : watchdog_(watchdog), id_(id) {}
    StallWatchdog* watchdog_ = nullptr;
    uint64_t id_ = 0;
  };

  // Watches a stream of `peer` from now, by `limits`' idle and min_bytes
  // (`limits.what` names it in the log; `limits` must outlive the watch).
  // `cancel` is called on the watchdog's thread, under its lock, if the
  // stream stalls: it must not call back into the watchdog.
  Watched Watch(std::string peer, const StreamLimits& limits, std::function<void()> cancel);

  // Streams watched by `limits` cancelled for stalling, since start.
  uint64_t cancelled(const StreamLimits& limits) const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Stream {
    std::string peer;
    const StreamLimits* limits;
    std::function<void()> cancel;
    Clock::time_point period_start;  // of the current `idle` period
    uint64_t period_bytes = 0;
    bool cancelling = false;
    bool busy = false;  // not checked for stalling
  };
  void Run();
  // How often a stream of `limits` is checked.
  static std::chrono::milliseconds Tick(const StreamLimits& limits);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Stream> streams_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<const StreamLimits*, uint64_t> cancelled_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::chrono::milliseconds tick_ ABSL_GUARDED_BY(mu_){1000};  // the thread's wait between checks
  bool retick_ ABSL_GUARDED_BY(mu_) = false;                   // a stream needs an earlier check
  std::thread thread_;
};

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_STALL_WATCHDOG_H_

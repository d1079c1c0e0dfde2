// StreamGovernor: admits FetchTensors streams and reclaims the stalled ones.
//
// At most `total` streams at once, and at most `per_peer` from one client
// address, so one client cannot lock the others out; a stream whose last write
// completed more than `idle` ago (its client stopped reading) is cancelled,
// which frees its slot. Thread-safe.
#ifndef WEIGHTSTORE_SERVER_STREAM_GOVERNOR_H_
#define WEIGHTSTORE_SERVER_STREAM_GOVERNOR_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace weightstore::server {

struct StreamLimits {
  // Streams served at once. Default: 64.
  int total = 64;
  // Streams served at once to one client address. Default: 32.
  int per_peer = 32;
  // A stream with no write completed for this long is cancelled. Default: 30 s.
  std::chrono::milliseconds idle{30 * 1000};
};

class StreamGovernor {
 public:
  explicit StreamGovernor(StreamLimits limits);
  ~StreamGovernor();  // stops the watchdog

  // Admits a stream from `peer` (gRPC's peer string; its port is ignored).
  // `cancel` is called, under the governor's lock, if the stream stalls; it
  // must not call back into the governor. Returns a ticket for Progress and
  // Release, or ResourceExhausted naming the limit that was reached.
  absl::StatusOr<uint64_t> Admit(absl::string_view peer, std::function<void()> cancel);
  // A write of the stream completed.
  void Progress(uint64_t ticket);
  // The stream is over; `cancel` is never called after this returns.
  void Release(uint64_t ticket);

  int active() const;
  // Streams cancelled for stalling, since start.
  uint64_t cancelled() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Stream {
    std::string peer;
    std::function<void()> cancel;
    Clock::time_point last_progress;
    bool cancelling = false;
  };
  void Watch();

  const StreamLimits limits_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Stream> streams_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int> per_peer_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t cancelled_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread watchdog_;
};

// The address part of a gRPC peer string ("ipv4:10.0.0.1:5000" -> "ipv4:10.0.0.1",
// "ipv6:[::1]:5000" -> "ipv6:[::1]").
std::string PeerAddress(absl::string_view peer);

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_STREAM_GOVERNOR_H_

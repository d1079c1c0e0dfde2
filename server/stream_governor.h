// StreamGovernor: admits FetchTensors streams and reclaims the stalled ones.
//
// At most `total` streams at once, and at most `per_peer` from one client
// address (an IPv6 client's /64), so one client cannot lock the others out; a
// stream that moves less than `min_bytes` in any `idle` period (its client
// stopped reading or writing, or trickles) is cancelled, which frees its slot.
// Thread-safe.
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
  // Streams served at once to one client address. Default: 16.
  int per_peer = 16;
  // A stream that moves less than `min_bytes` in any period this long is
  // cancelled. Default: 30 s and 1 MiB (~35 KB/s).
  std::chrono::milliseconds idle{30 * 1000};
  uint64_t min_bytes = 1 << 20;
  // For messages: what the streams are, and the flags that set the limits.
  std::string what = "FetchTensors streams";
  std::string total_flag = "--max-concurrent-fetches", per_peer_flag = "--max-fetches-per-peer";
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
  // `bytes` of the stream moved (a write or a read completed).
  void Progress(uint64_t ticket, uint64_t bytes);
  // The stream is busy on the server's side (a push being written, a pull it
  // waits on) and must not be taken for stalled: it keeps its slot, and is
  // not cancelled until Resume.
  void Busy(uint64_t ticket);
  // The stream moves again: it is watched from now, a fresh period.
  void Resume(uint64_t ticket);
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
    Clock::time_point period_start;  // of the current `idle` period
    uint64_t period_bytes = 0;
    bool cancelling = false;
    bool busy = false;  // not checked for stalling
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

// Whom a gRPC peer string counts as: its address without the port
// ("ipv4:10.0.0.1:5000" -> "ipv4:10.0.0.1"), an IPv6 address's /64, since one
// client may hold a whole one ("ipv6:[2001:db8::1]:5000" -> "ipv6:[2001:db8::]/64"),
// and an IPv4-mapped IPv6 address as IPv4.
std::string PeerAddress(absl::string_view peer);

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_STREAM_GOVERNOR_H_

// AdmissionGate: how many calls of one kind run at once, in all and per client
// address, so one client cannot lock the others out. It owns no thread: a
// stream that may stall is also watched by a StallWatchdog
// (server/stall_watchdog.h).
//
// A slot is a GateTicket: move-only, released exactly once, by Release() or by
// its destructor, however the call ends. Thread-safe.
#ifndef WEIGHTSTORE_SERVER_ADMISSION_GATE_H_
#define WEIGHTSTORE_SERVER_ADMISSION_GATE_H_

#include <chrono>
#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace weightstore::server {

struct StreamLimits {
  // Calls served at once. Default: 64.
  int total = 64;
  // Calls served at once to one client address. Default: 16.
  int per_peer = 16;
  // Where a StallWatchdog watches the calls: one that moves less than
  // `min_bytes` in any period this long is cancelled. Default: 30 s and 1 MiB
  // (~35 KB/s).
  std::chrono::milliseconds idle{30 * 1000};
  uint64_t min_bytes = 1 << 20;
  // For messages: what the calls are, and the flags that set the limits.
  std::string what = "FetchTensors streams";
  std::string total_flag = "--max-concurrent-fetches", per_peer_flag = "--max-fetches-per-peer";
};

class AdmissionGate;

// One admitted call's slot. Empty when default-constructed or moved from.
class GateTicket {
 public:
  GateTicket() = default;
  GateTicket(GateTicket&& other) noexcept { *this = std::move(other); }
  GateTicket& operator=(GateTicket&& other) noexcept;
  GateTicket(const GateTicket&) = delete;
  GateTicket& operator=(const GateTicket&) = delete;
  ~GateTicket() { Release(); }

  // Frees the slot; later calls do nothing.
  void Release();
  explicit operator bool() const { return gate_ != nullptr; }

 private:
  friend class AdmissionGate;
  GateTicket(AdmissionGate* gate, std::string peer) : gate_(gate), peer_(std::move(peer)) {}
  AdmissionGate* gate_ = nullptr;
  std::string peer_;  // PeerAddress()
};

class AdmissionGate {
 public:
  explicit AdmissionGate(StreamLimits limits) : limits_(std::move(limits)) {}
  AdmissionGate(const AdmissionGate&) = delete;
  AdmissionGate& operator=(const AdmissionGate&) = delete;

  // A slot for a call from `peer` (gRPC's peer string; its port is ignored),
  // or ResourceExhausted naming the limit reached and its flag. The gate must
  // outlive the ticket.
  absl::StatusOr<GateTicket> Admit(absl::string_view peer);
  int active() const;
  const StreamLimits& limits() const { return limits_; }

 private:
  friend class GateTicket;
  void Release(const std::string& peer);

  const StreamLimits limits_;
  mutable absl::Mutex mu_;
  int active_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, int> per_peer_ ABSL_GUARDED_BY(mu_);
};

// Whom a gRPC peer string counts as: its address without the port
// ("ipv4:10.0.0.1:5000" -> "ipv4:10.0.0.1"), an IPv6 address's /64, since one
// client may hold a whole one ("ipv6:[2001:db8::1]:5000" -> "ipv6:[2001:db8::]/64"),
// and an IPv4-mapped IPv6 address as IPv4.
std::string PeerAddress(absl::string_view peer);

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_ADMISSION_GATE_H_

#include "server/stream_governor.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "server/log.h"

namespace weightstore::server {

std::string PeerAddress(absl::string_view peer) {
  if (!absl::StartsWith(peer, "ipv4:") && !absl::StartsWith(peer, "ipv6:")) return std::string(peer);
  const size_t colon = peer.rfind(':');
  absl::string_view address = colon > 5 ? peer.substr(0, colon) : peer;
  if (!absl::ConsumePrefix(&address, "ipv6:[") || !absl::ConsumeSuffix(&address, "]")) return std::string(address);
  in6_addr ip;
  if (::inet_pton(AF_INET6, std::string(address).c_str(), &ip) != 1) return absl::StrCat("ipv6:[", address, "]");
  char text[INET6_ADDRSTRLEN];
  if (IN6_IS_ADDR_V4MAPPED(&ip)) {
    ::inet_ntop(AF_INET, ip.s6_addr + 12, text, sizeof text);
    return absl::StrCat("ipv4:", text);
  }
  std::memset(ip.s6_addr + 8, 0, 8);
  ::inet_ntop(AF_INET6, &ip, text, sizeof text);
  return absl::StrCat("ipv6:[", text, "]/64");
}

StreamGovernor::StreamGovernor(StreamLimits limits) : limits_(limits) {
  watchdog_ = std::thread([this] { Watch(); });
}

StreamGovernor::~StreamGovernor() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  watchdog_.join();
}

absl::StatusOr<uint64_t> StreamGovernor::Admit(absl::string_view peer, std::function<void()> cancel) {
  std::string address = PeerAddress(peer);
  absl::MutexLock lock(&mu_);
  if (static_cast<int>(streams_.size()) >= limits_.total) {
    return absl::ResourceExhaustedError(
        absl::StrCat(limits_.total, " ", limits_.what, " are being served; retry later (", limits_.total_flag, ")"));
  }
  int& mine = per_peer_[address];
  if (mine >= limits_.per_peer) {
    return absl::ResourceExhaustedError(
        absl::StrCat(address, " has ", mine, " ", limits_.what, " open; retry later (", limits_.per_peer_flag, ")"));
  }
  ++mine;
  const uint64_t ticket = next_ticket_++;
  streams_.emplace(ticket, Stream{std::move(address), std::move(cancel), Clock::now()});
  return ticket;
}

void StreamGovernor::Progress(uint64_t ticket, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (auto it = streams_.find(ticket); it != streams_.end()) it->second.period_bytes += bytes;
}

void StreamGovernor::Busy(uint64_t ticket) {
  absl::MutexLock lock(&mu_);
  if (auto it = streams_.find(ticket); it != streams_.end()) it->second.busy = true;
}

void StreamGovernor::Resume(uint64_t ticket) {
  absl::MutexLock lock(&mu_);
  if (auto it = streams_.find(ticket); it != streams_.end()) {
    it->second.busy = false;
    it->second.period_start = Clock::now();
    it->second.period_bytes = 0;
  }
}

void StreamGovernor::Release(uint64_t ticket) {
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(ticket);
  if (it == streams_.end()) return;
  if (auto peer = per_peer_.find(it->second.peer); peer != per_peer_.end() && --peer->second <= 0) {
    per_peer_.erase(peer);
  }
  streams_.erase(it);
}

int StreamGovernor::active() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(streams_.size());
}

uint64_t StreamGovernor::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

void StreamGovernor::Watch() {
  const auto period = std::clamp(limits_.idle / 4, std::chrono::milliseconds(10), std::chrono::milliseconds(1000));
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::FromChrono(period));
    const Clock::time_point now = Clock::now();
    for (auto& [ticket, stream] : streams_) {
      if (stream.cancelling || stream.busy || now - stream.period_start < limits_.idle) continue;
      if (stream.period_bytes >= limits_.min_bytes) {  // moving: a new period
        stream.period_start = now;
        stream.period_bytes = 0;
        continue;
      }
      stream.cancelling = true;  // its slot is freed when the stream ends
      ++cancelled_;
      Log(LogLevel::kWarning, "stalled stream cancelled",
          {{"what", limits_.what},
           {"peer", stream.peer},
           {"bytes", stream.period_bytes},
           {"period_ms", std::chrono::duration_cast<std::chrono::milliseconds>(now - stream.period_start).count()}});
      stream.cancel();
    }
  }
}

}  // namespace weightstore::server

#include "server/admission_gate.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

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

GateTicket& GateTicket::operator=(GateTicket&& other) noexcept {
  if (this != &other) {
    Release();
    gate_ = std::exchange(other.gate_, nullptr);
    peer_ = std::move(other.peer_);
  }
  return *this;
}

void GateTicket::Release() {
  if (AdmissionGate* gate = std::exchange(gate_, nullptr)) gate->Release(peer_);
}

absl::StatusOr<GateTicket> AdmissionGate::Admit(absl::string_view peer) {
  std::string address = PeerAddress(peer);
  absl::MutexLock lock(&mu_);
  if (active_ >= limits_.total) {
    return absl::ResourceExhaustedError(
        absl::StrCat(limits_.total, " ", limits_.what, " are being served; retry later (", limits_.total_flag, ")"));
  }
  auto it = per_peer_.find(address);
  const int mine = it == per_peer_.end() ? 0 : it->second;
  if (mine >= limits_.per_peer) {
    return absl::ResourceExhaustedError(
        absl::StrCat(address, " has ", mine, " ", limits_.what, " open; retry later (", limits_.per_peer_flag, ")"));
  }
  ++per_peer_[address];
  ++active_;
  return GateTicket(this, std::move(address));
}

void AdmissionGate::Release(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  --active_;
  if (auto it = per_peer_.find(peer); it != per_peer_.end() && --it->second <= 0) per_peer_.erase(it);
}

int AdmissionGate::active() const {
  absl::MutexLock lock(&mu_);
  return active_;
}

}  // namespace weightstore::server

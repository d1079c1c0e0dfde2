#include "server/data_lane.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "proto/codec/data_lane.h"

namespace weightstore::server {

namespace {

constexpr size_t kHandshakeBytes = wire::kLaneHello.size() + wire::kLaneTicketBytes;

// What the per-address bound counts by: an IPv6 address's /64 (one host's
// share of a network, as the gRPC port's gates count), else the address.
std::string AddressGroup(const std::string& ip) {
  in6_addr v6;
  if (::inet_pton(AF_INET6, ip.c_str(), &v6) != 1) return ip;
  std::memset(v6.s6_addr + 8, 0, 8);
  char text[INET6_ADDRSTRLEN];
  ::inet_ntop(AF_INET6, &v6, text, sizeof text);
  return absl::StrCat(text, "/64");
}

std::optional<std::string> SocketPeerIp(int fd) {
  sockaddr_storage peer{};
  socklen_t length = sizeof peer;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &length) != 0) return std::nullopt;
  char text[INET6_ADDRSTRLEN];
  if (peer.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&peer)->sin_addr, text, sizeof text);
  } else if (peer.ss_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&peer)->sin6_addr, text, sizeof text);
  } else {
    return std::nullopt;
  }
  return wire::NormalizedIp(text);
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataLane>> DataLane::Start(DataLaneOptions options) {
  const size_t colon = options.listen.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(options.listen.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--data-listen '", options.listen, "' is not host:port (port 0 picks one)"));
  }
  std::string host = options.listen.substr(0, colon);
  if (absl::StartsWith(host, "[") && absl::EndsWith(host, "]")) host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--data-listen '", options.listen, "': cannot resolve '", host, "': ", ::gai_strerror(rc)));
  }
  UniqueFd listener;
  std::string why = "no address";
  for (addrinfo* a = found; a != nullptr && !listener.valid(); a = a->ai_next) {
    UniqueFd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
    if (!fd.valid()) continue;
    const int one = 1;
    (void)::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);  // not SO_REUSEPORT: one owner
    if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd.get(), 128) != 0) {
      why = std::strerror(errno);
      continue;
    }
    listener = std::move(fd);
  }
  ::freeaddrinfo(found);
  if (!listener.valid()) {
    return absl::UnavailableError(absl::StrCat("cannot listen for the data lane on ", options.listen, ": ", why));
  }
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  ::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&bound), &length);
  const int bound_port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                           : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  std::unique_ptr<DataLane> lane(new DataLane(std::move(listener), bound_port, std::move(wake), options));
  lane->thread_ = std::thread([l = lane.get()] { l->Run(); });
  return lane;
}

DataLane::DataLane(UniqueFd listener, int port, UniqueFd wake, DataLaneOptions options)
    : options_(std::move(options)), listener_(std::move(listener)), wake_(std::move(wake)), port_(port) {}

DataLane::~DataLane() { Stop(); }

absl::StatusOr<std::string> DataLane::Offer(const std::string& peer_ip,
                                            std::function<void(absl::StatusOr<UniqueFd>)> attach) {
  absl::StatusOr<std::string> ticket = wire::RandomLaneSecret();
  if (!ticket.ok()) return ticket.status();
  absl::MutexLock lock(&mu_);
  if (stopped_) return absl::UnavailableError("the data lane has stopped");
  offers_[*ticket] = Offered{peer_ip, std::chrono::steady_clock::now() + options_.ticket_life, std::move(attach)};
  return ticket;
}

void DataLane::Withdraw(const std::string& ticket) {
  {
    absl::MutexLock lock(&mu_);
    auto it = offers_.find(ticket);
    if (it == offers_.end()) return;
    it->second.withdrawn = true;
  }
  Wake();
}

void DataLane::Stop() {
  stopping_ = true;
  Wake();
  absl::MutexLock lock(&stop_mu_);
  if (thread_.joinable()) thread_.join();
}

DataLaneCounts DataLane::counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

void DataLane::Wake() {
  const uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
}

void DataLane::Accept(std::vector<Handshake>* handshakes, Calls* calls) {
  // At most 64 a pass: a flood must not keep the thread from the tickets.
  for (int accepted = 0; accepted < 64 && !stopping_; ++accepted) {
    UniqueFd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!fd.valid()) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // Out of descriptors: the listener stays readable, so rest a while
        // instead of spinning on it.
        listener_rests_until_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
      }
      return;  // EAGAIN, or a connection that went away
    }
    std::optional<std::string> ip = SocketPeerIp(fd.get());
    const std::string group = ip ? AddressGroup(*ip) : "";
    const auto same_group = [&](const Handshake& h) { return h.group == group; };
    // The per-address bound holds once half the slots are taken: a burst of
    // one host's clients is let in while nobody else waits.
    const int waiting = static_cast<int>(handshakes->size());
    if (!ip || waiting >= options_.max_handshakes ||
        (waiting >= options_.max_handshakes / 2 &&
         std::count_if(handshakes->begin(), handshakes->end(), same_group) >= options_.max_handshakes_per_address)) {
      absl::MutexLock lock(&mu_);
      ++(ip ? counts_.overflowed : counts_.refused);
      continue;  // closed
    }
    Handshake h{std::move(fd), *std::move(ip), group, std::chrono::steady_clock::now() + options_.handshake_time, {}};
    // A client sends its ticket as it connects: most are done here, and never
    // hold a slot.
    if (!Read(&h, calls)) handshakes->push_back(std::move(h));
  }
}

bool DataLane::Read(Handshake* h, Calls* calls) {
  char buffer[kHandshakeBytes];
  const ssize_t n = ::recv(h->fd.get(), buffer, kHandshakeBytes - h->received.size(), MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
  absl::MutexLock lock(&mu_);
  if (n <= 0) {  // gone before its ticket
    ++counts_.refused;
    return true;
  }
  h->received.append(buffer, static_cast<size_t>(n));
  if (h->received.size() < kHandshakeBytes) return false;
  const bool hello = std::memcmp(h->received.data(), wire::kLaneHello.data(), wire::kLaneHello.size()) == 0;
  auto it = hello ? offers_.find(h->received.substr(wire::kLaneHello.size())) : offers_.end();
  // Another address keeps the ticket for its own client: a ticket seen on the
  // network is no use from elsewhere, and cannot be spent to deny its stream.
  if (it == offers_.end() || it->second.withdrawn || it->second.peer_ip != h->peer_ip) {
    ++counts_.refused;
    return true;
  }
  UniqueFd fd = std::move(h->fd);
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0 || !wire::PrepareLaneSocket(fd.get()).ok()) {
    calls->emplace_back(
        std::move(it->second.attach),
        absl::InternalError(absl::StrCat("cannot set up the data lane's connection: ", std::strerror(errno))));
  } else {
    calls->emplace_back(std::move(it->second.attach), std::move(fd));
    ++counts_.attached;
  }
  offers_.erase(it);
  return true;
}

void DataLane::Run() {
  std::vector<Handshake> handshakes;
  while (!stopping_) {
    const bool resting = std::chrono::steady_clock::now() < listener_rests_until_;
    std::vector<pollfd> polled = {{resting ? -1 : listener_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    for (const Handshake& h : handshakes) polled.push_back({h.fd.get(), POLLIN, 0});
    (void)::poll(polled.data(), polled.size(), 100);
    uint64_t drained;
    (void)!::read(wake_.get(), &drained, sizeof drained);
    if (stopping_) break;
    Calls calls;
    // Handshakes first: one accepted below has nothing to read yet.
    const auto now = std::chrono::steady_clock::now();
    std::vector<Handshake> kept;
    for (size_t i = 0; i < handshakes.size(); ++i) {
      Handshake& h = handshakes[i];
      if ((polled[i + 2].revents != 0 && Read(&h, &calls))) continue;
      if (now >= h.expires) {
        absl::MutexLock lock(&mu_);
        ++counts_.timed_out;
        continue;
      }
      kept.push_back(std::move(h));
    }
    handshakes = std::move(kept);
    if (polled[0].revents != 0) Accept(&handshakes, &calls);
    {
      absl::MutexLock lock(&mu_);
      for (auto it = offers_.begin(); it != offers_.end();) {
        if (it->second.withdrawn) {
          calls.emplace_back(std::move(it->second.attach), absl::CancelledError("the stream gave up its data lane"));
        } else if (now >= it->second.expires) {
          ++counts_.unclaimed;
          calls.emplace_back(std::move(it->second.attach),
                             absl::DeadlineExceededError(absl::StrCat("the client did not open the data lane within ",
                                                                      options_.ticket_life.count(), " ms (is port ",
                                                                      port_, " reachable from it?)")));
        } else {
          ++it;
          continue;
        }
        it = offers_.erase(it);
      }
    }
    for (auto& [attach, fd] : calls) attach(std::move(fd));
  }
  handshakes.clear();
  Calls calls;
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    for (auto& [ticket, offered] : offers_) {
      calls.emplace_back(std::move(offered.attach), absl::UnavailableError("the daemon is stopping its data lane"));
    }
    offers_.clear();
  }
  for (auto& [attach, fd] : calls) attach(std::move(fd));
}

}  // namespace weightstore::server

#include "proto/codec/data_lane.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace weightstore::wire {

static_assert(std::endian::native == std::endian::little, "lane frames are little-endian, as is every host served");

namespace {

constexpr uint32_t kFrameMagic = 0x464c5357;  // "WSLF" in little-endian bytes

// Why a blocked lane call stops waiting, if it does: asked between calls that
// each return within 20 ms.
absl::Status Waited(const LaneWait& wait, std::chrono::steady_clock::time_point last_progress) {
  const auto now = std::chrono::steady_clock::now();
  if ((wait.cancel != nullptr && wait.cancel->load()) || (wait.stop && wait.stop())) {
    return absl::CancelledError("the data lane was cancelled");
  }
  if (now >= wait.deadline) return absl::DeadlineExceededError("the data lane passed its deadline");
  if (now - last_progress >= wait.idle) {
    return absl::DeadlineExceededError(
        absl::StrCat("the data lane moved nothing for ",
                     std::chrono::duration_cast<std::chrono::milliseconds>(now - last_progress).count(), " ms"));
  }
  return absl::OkStatus();
}

bool WouldBlock(int err) { return err == EAGAIN || err == EWOULDBLOCK || err == EINTR; }

}  // namespace

std::array<std::byte, kLaneFrameHeaderBytes> EncodeLaneFrameHeader(const LaneFrameHeader& header) {
  std::array<std::byte, kLaneFrameHeaderBytes> out;
  std::memcpy(out.data(), &kFrameMagic, 4);
  std::memcpy(out.data() + 4, &header.meta_bytes, 4);
  std::memcpy(out.data() + 8, &header.data_bytes, 8);
  return out;
}

absl::StatusOr<LaneFrameHeader> DecodeLaneFrameHeader(std::span<const std::byte, kLaneFrameHeaderBytes> bytes) {
  uint32_t magic;
  LaneFrameHeader header;
  std::memcpy(&magic, bytes.data(), 4);
  std::memcpy(&header.meta_bytes, bytes.data() + 4, 4);
  std::memcpy(&header.data_bytes, bytes.data() + 8, 8);
  if (magic != kFrameMagic) return absl::DataLossError("the data lane sent a frame without its magic");
  if (header.meta_bytes > kMaxLaneMetaBytes || header.data_bytes > kMaxLaneDataBytes) {
    return absl::DataLossError(absl::StrCat("the data lane sent a frame of ", header.meta_bytes, " + ",
                                            header.data_bytes, " bytes, over its bounds (", kMaxLaneMetaBytes, " + ",
                                            kMaxLaneDataBytes, ")"));
  }
  return header;
}

std::optional<std::string> NormalizedIp(absl::string_view address) {
  char text[INET6_ADDRSTRLEN];
  in_addr v4;
  if (::inet_pton(AF_INET, std::string(address).c_str(), &v4) == 1) {
    ::inet_ntop(AF_INET, &v4, text, sizeof text);
    return std::string(text);
  }
  in6_addr v6;
  if (::inet_pton(AF_INET6, std::string(address).c_str(), &v6) != 1) return std::nullopt;
  if (IN6_IS_ADDR_V4MAPPED(&v6)) {
    ::inet_ntop(AF_INET, v6.s6_addr + 12, text, sizeof text);
  } else {
    ::inet_ntop(AF_INET6, &v6, text, sizeof text);
  }
  return std::string(text);
}

std::optional<std::string> GrpcPeerIp(absl::string_view peer) {
  absl::string_view address = peer;
  if (absl::ConsumePrefix(&address, "ipv4:")) {
    const size_t colon = address.rfind(':');
    if (colon == absl::string_view::npos) return std::nullopt;
    return NormalizedIp(address.substr(0, colon));
  }
  if (!absl::ConsumePrefix(&address, "ipv6:")) return std::nullopt;
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos) return std::nullopt;
  address = address.substr(0, colon);
  // "[::1]", or URL-escaped "%5B::1%5D"; a zone ("%25eth0") is not an address.
  if (!(absl::ConsumePrefix(&address, "[") && absl::ConsumeSuffix(&address, "]")) &&
      !(absl::ConsumePrefix(&address, "%5B") && absl::ConsumeSuffix(&address, "%5D"))) {
    return std::nullopt;
  }
  return NormalizedIp(address);
}

absl::StatusOr<std::string> RandomLaneSecret() {
  std::string secret(kLaneTicketBytes, '\0');
  size_t got = 0;
  while (got < secret.size()) {
    const ssize_t n = ::getrandom(secret.data() + got, secret.size() - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::InternalError(absl::StrCat("getrandom: ", std::strerror(errno)));
    got += static_cast<size_t>(n);
  }
  return secret;
}

absl::Status PrepareLaneSocket(int fd) {
  const timeval step{.tv_sec = 0, .tv_usec = 20 * 1000};
  const int one = 1;
  if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &step, sizeof(step)) != 0 ||
      setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &step, sizeof(step)) != 0 ||
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) {
    return absl::InternalError(absl::StrCat("cannot set up the data lane's socket: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status LaneWriteAll(int fd, std::span<const std::span<const std::byte>> parts, const LaneWait& wait,
                          const std::function<void(uint64_t)>& progress) {
  std::vector<iovec> iov;
  for (std::span<const std::byte> p : parts) {
    if (!p.empty()) iov.push_back({const_cast<std::byte*>(p.data()), p.size()});
  }
  size_t first = 0;
  auto last_progress = std::chrono::steady_clock::now();
  while (first < iov.size()) {
    msghdr msg{};
    msg.msg_iov = iov.data() + first;
    msg.msg_iovlen = std::min<size_t>(iov.size() - first, 64);
    const ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EFAULT) {  // a mapping whose file shrank under it
        return absl::DataLossError("the bytes being sent became unreadable (their file shrank?)");
      }
      if (!WouldBlock(errno))
        return absl::UnavailableError(absl::StrCat("the data lane broke: ", std::strerror(errno)));
      if (absl::Status s = Waited(wait, last_progress); !s.ok()) return s;
      continue;
    }
    last_progress = std::chrono::steady_clock::now();
    if (progress) progress(static_cast<uint64_t>(n));
    size_t left = static_cast<size_t>(n);
    while (left > 0) {
      iovec& v = iov[first];
      const size_t used = std::min(left, v.iov_len);
      v.iov_base = static_cast<std::byte*>(v.iov_base) + used;
      v.iov_len -= used;
      left -= used;
      if (v.iov_len == 0) ++first;
    }
    if (absl::Status s = Waited(wait, last_progress); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status LaneReadExactly(int fd, std::span<std::byte> out, const LaneWait& wait) {
  size_t got = 0;
  auto last_progress = std::chrono::steady_clock::now();
  while (got < out.size()) {
    const ssize_t n = recv(fd, out.data() + got, out.size() - got, MSG_WAITALL);
    if (n == 0) {
      return absl::UnavailableError(
          absl::StrCat("the data lane ended after ", got, " of the ", out.size(), " bytes due"));
    }
    if (n < 0) {
      if (!WouldBlock(errno))
        return absl::UnavailableError(absl::StrCat("the data lane broke: ", std::strerror(errno)));
    } else {
      got += static_cast<size_t>(n);
      last_progress = std::chrono::steady_clock::now();
      if (got == out.size()) break;
    }
    if (absl::Status s = Waited(wait, last_progress); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace weightstore::wire

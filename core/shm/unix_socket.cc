#include "core/shm/unix_socket.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "core/status_util.h"

namespace weightstore {
namespace {

absl::Status SocketError(int err, absl::string_view what) {
  if (err == EAGAIN || err == EWOULDBLOCK) return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
  if (err == EPIPE || err == ECONNRESET) return absl::UnavailableError(absl::StrCat(what, ": the peer went away"));
  return StatusFromErrno(err, what);
}

// Moves the descriptors of every SCM_RIGHTS message in `msg` into `fds`.
void TakeFds(msghdr* msg, std::vector<UniqueFd>* fds) {
  for (cmsghdr* c = CMSG_FIRSTHDR(msg); c != nullptr; c = CMSG_NXTHDR(msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const unsigned char* data = CMSG_DATA(c);
    for (size_t i = 0; i < n; ++i) {
      int fd;
      std::memcpy(&fd, data + i * sizeof(int), sizeof(int));
      fds->emplace_back(fd);
    }
  }
}

// Waits until `socket` is readable (or closed, or failed: the read says
// which), asking `wait.cancelled` (may be null) every 20 ms, until
// `wait.deadline`. Cancelled and DeadlineExceeded say `what` was waited for.
absl::Status PollReadable(int socket, const FrameWait& wait, absl::string_view what) {
  const bool bounded = wait.deadline != std::chrono::steady_clock::time_point::max();
  while (true) {
    if (wait.cancelled != nullptr && wait.cancelled->load()) {
      return absl::CancelledError(absl::StrCat("cancelled while ", what));
    }
    int step = 20;
    if (bounded) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(wait.deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
      step = static_cast<int>(std::min<int64_t>(left.count(), step));
    }
    pollfd p{socket, POLLIN, 0};
    const int ready = ::poll(&p, 1, step);
    if (ready > 0) return absl::OkStatus();
    if (ready < 0 && errno != EINTR) return StatusFromErrno(errno, "poll");
  }
}

// PollReadable for a frame's next bytes; nothing to wait for without a
// deadline or a cancel (the socket's own timeouts bound each read).
absl::Status AwaitBytes(int socket, const FrameWait& wait) {
  if (wait.deadline == std::chrono::steady_clock::time_point::max() && wait.cancelled == nullptr) {
    return absl::OkStatus();
  }
  return PollReadable(socket, wait, "receiving a frame");
}

// Reads exactly `n` bytes into `out`, collecting the descriptors that come
// with a frame's first bytes. `*got_any` is set once a byte has arrived.
absl::Status RecvExactly(int socket, char* out, size_t n, std::vector<UniqueFd>* fds, bool* got_any,
                         const FrameWait& wait) {
  alignas(cmsghdr) static thread_local char control[CMSG_SPACE(kMaxFdsPerFrame * sizeof(int))];
  size_t done = 0;
  while (done < n) {
    WEIGHTSTORE_RETURN_IF_ERROR(AwaitBytes(socket, wait));
    iovec iov{out + done, n - done};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t r = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC);
    if (r < 0) {
      if (errno == EINTR) continue;
      return SocketError(errno, "receiving a frame");
    }
    std::vector<UniqueFd> came;  // closed unless they are the frame's
    TakeFds(&msg, &came);
    if (msg.msg_flags & MSG_CTRUNC) {
      return absl::DataLossError("descriptors were dropped by the kernel (control buffer too small)");
    }
    if (!came.empty() && *got_any) {  // a peer piling them up would run this process out of descriptors
      return absl::DataLossError(absl::StrCat(came.size(), " descriptors came after the frame's first bytes"));
    }
    std::move(came.begin(), came.end(), std::back_inserter(*fds));
    if (r == 0) {
      if (!*got_any) return absl::OutOfRangeError("end of stream");
      return absl::DataLossError(absl::StrCat("the stream ended inside a frame (", done, " of ", n, " bytes)"));
    }
    *got_any = true;
    done += static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

}  // namespace

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

absl::Status SendFrame(int socket, absl::string_view payload, std::span<const int> fds) {
  if (fds.size() > kMaxFdsPerFrame) {
    return absl::InvalidArgumentError(absl::StrCat(fds.size(), " descriptors in one frame; at most ", kMaxFdsPerFrame));
  }
  if (payload.size() > UINT32_MAX) return absl::InvalidArgumentError("frame over 4 GiB");
  const uint32_t n = static_cast<uint32_t>(payload.size());
  unsigned char header[4] = {static_cast<unsigned char>(n), static_cast<unsigned char>(n >> 8),
                             static_cast<unsigned char>(n >> 16), static_cast<unsigned char>(n >> 24)};
  std::vector<char> control(fds.empty() ? 0 : CMSG_SPACE(fds.size() * sizeof(int)));
  size_t sent = 0;
  const size_t total = sizeof(header) + payload.size();
  while (sent < total) {
    iovec iov[2];
    int count = 0;
    if (sent < sizeof(header)) iov[count++] = {header + sent, sizeof(header) - sent};
    size_t body_sent = sent > sizeof(header) ? sent - sizeof(header) : 0;
    if (body_sent < payload.size()) {
      iov[count++] = {const_cast<char*>(payload.data()) + body_sent, payload.size() - body_sent};
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = count;
    if (sent == 0 && !fds.empty()) {  // descriptors ride with the first bytes
      msg.msg_control = control.data();
      msg.msg_controllen = control.size();
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
      std::memcpy(CMSG_DATA(c), fds.data(), fds.size() * sizeof(int));
    }
    ssize_t r = ::sendmsg(socket, &msg, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR) continue;
      return SocketError(errno, "sending a frame");
    }
    sent += static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

absl::Status RecvFrame(int socket, uint32_t max_bytes, std::string* payload, std::vector<UniqueFd>* fds,
                       const FrameWait& wait) {
  unsigned char header[4];
  bool got_any = false;
  absl::Status status = RecvExactly(socket, reinterpret_cast<char*>(header), sizeof(header), fds, &got_any, wait);
  if (!status.ok()) return status;
  const uint32_t n = header[0] | (header[1] << 8) | (header[2] << 16) | (uint32_t{header[3]} << 24);
  if (n > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("frame of ", n, " bytes; the limit is ", max_bytes));
  }
  payload->resize(n);
  return RecvExactly(socket, payload->data(), n, fds, &got_any, wait);
}

absl::Status SetSocketTimeouts(int socket, std::chrono::milliseconds timeout) {
  timeval tv{static_cast<time_t>(timeout.count() / 1000), static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
  if (::setsockopt(socket, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0 ||
      ::setsockopt(socket, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) != 0) {
    return StatusFromErrno(errno, "setsockopt(SO_RCVTIMEO, SO_SNDTIMEO)");
  }
  return absl::OkStatus();
}

absl::Status WaitReadable(int socket, const std::atomic<bool>& cancelled, std::chrono::milliseconds timeout) {
  FrameWait wait{.cancelled = &cancelled};
  if (timeout.count() > 0) wait.deadline = std::chrono::steady_clock::now() + timeout;  // 0: none, as SO_RCVTIMEO's
  return PollReadable(socket, wait, "waiting for an answer");
}

absl::StatusOr<UniqueFd> ConnectUnixSocket(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("socket path '", path, "' is longer than ", sizeof(addr.sun_path) - 1, " bytes"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return StatusFromErrno(errno, "socket(AF_UNIX)");
  while (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (errno == EINTR) continue;
    if (errno == ECONNREFUSED) return absl::UnavailableError(absl::StrCat("nothing listens on '", path, "'"));
    return StatusFromErrno(errno, absl::StrCat("cannot connect to '", path, "'"));
  }
  return fd;
}

}  // namespace weightstore

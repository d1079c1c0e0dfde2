// Length-prefixed frames over a Unix domain stream socket, with file
// descriptors passed alongside (SCM_RIGHTS). Used by weightstored's same-host
// socket and its clients.
//
// A frame is a 4-byte little-endian length followed by the payload. Descriptors
// travel with the frame's first bytes; at most kMaxFdsPerFrame per frame.
#ifndef WEIGHTSTORE_CORE_SHM_UNIX_SOCKET_H_
#define WEIGHTSTORE_CORE_SHM_UNIX_SOCKET_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightstore {

// unix(7): SCM_MAX_FD.
inline constexpr size_t kMaxFdsPerFrame = 253;

// Owns a file descriptor; closes it on destruction. Move-only.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    reset(other.release());
    return *this;
  }
  ~UniqueFd() { reset(); }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// Sends one frame holding `payload` and `fds` (not closed). Retries partial
// writes. Returns InvalidArgument for more than kMaxFdsPerFrame descriptors,
// Unavailable if the peer went away, DeadlineExceeded on a send timeout.
absl::Status SendFrame(int socket, absl::string_view payload, std::span<const int> fds = {});

// How long a whole frame may take to arrive, and what calls the wait off:
// a peer that sends a byte now and then stays within each receive's timeout.
struct FrameWait {
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  const std::atomic<bool>* cancelled = nullptr;  // asked every 20 ms; may be null
};

// Receives one frame: its payload and any descriptors that came with its
// first bytes (close-on-exec). Returns OutOfRange on a clean end of stream
// before the frame began, DataLoss for a stream that ends mid-frame,
// descriptors the kernel had to drop (MSG_CTRUNC) or descriptors after the
// frame's first bytes, ResourceExhausted for a declared length over
// `max_bytes`, DeadlineExceeded on a receive timeout or past
// `wait.deadline`, Cancelled once `wait.cancelled` says so.
absl::Status RecvFrame(int socket, uint32_t max_bytes, std::string* payload, std::vector<UniqueFd>* fds,
                       const FrameWait& wait = {});

// Sets the send and receive timeouts of `socket` (SO_SNDTIMEO, SO_RCVTIMEO):
// a blocked SendFrame/RecvFrame then fails with DeadlineExceeded.
absl::Status SetSocketTimeouts(int socket, std::chrono::milliseconds timeout);

// Waits until `socket` has something to read (or the peer closed it), asking
// `cancelled` every 20 ms. Returns Cancelled once it says so, DeadlineExceeded
// after `timeout` (none when it is 0, as for SetSocketTimeouts). A caller that gives up must close the socket: the
// answer it was waiting for may still come.
absl::Status WaitReadable(int socket, const std::atomic<bool>& cancelled, std::chrono::milliseconds timeout);

// Connects to the Unix socket at `path`. NotFound if nothing is there,
// Unavailable if nobody listens, PermissionDenied if the socket's mode refuses.
absl::StatusOr<UniqueFd> ConnectUnixSocket(const std::string& path);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_SHM_UNIX_SOCKET_H_

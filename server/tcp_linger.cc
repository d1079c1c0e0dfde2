#include "server/tcp_linger.h"

#include <arpa/inet.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <charconv>
#include <filesystem>
#include <string>
#include <thread>

namespace weightstore::server {
namespace {

// The local port of TCP socket `fd`, or -1 for anything else.
int LocalTcpPort(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return -1;
  int protocol = 0;
  socklen_t len = sizeof(protocol);
  if (getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &protocol, &len) != 0 || protocol != IPPROTO_TCP) return -1;
  sockaddr_storage local{};
  len = sizeof(local);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) return -1;
  if (local.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&local)->sin_port);
  if (local.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&local)->sin6_port);
  return -1;
}

}  // namespace

size_t UnacknowledgedTcpBytes(int local_port) {
  size_t total = 0;
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/proc/self/fd", ec), end; !ec && it != end; it.increment(ec)) {
    int fd = -1;
    const std::string name = it->path().filename().string();
    if (std::from_chars(name.data(), name.data() + name.size(), fd).ec != std::errc()) continue;
    // Another thread may close or reuse `fd` meanwhile; every call below only reads.
    if (LocalTcpPort(fd) != local_port) continue;
    int queued = 0;  // 0 on a listener
    if (ioctl(fd, SIOCOUTQ, &queued) == 0 && queued > 0) total += static_cast<size_t>(queued);
  }
  return total;
}

bool WaitForPeersToAcknowledge(int local_port, std::chrono::system_clock::time_point deadline) {
  while (UnacknowledgedTcpBytes(local_port) > 0) {
    if (std::chrono::system_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

}  // namespace weightstore::server

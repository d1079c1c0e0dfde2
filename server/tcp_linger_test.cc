#include "server/tcp_linger.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>
#include <vector>

#include "core/shm/unix_socket.h"

namespace weightstore::server {
namespace {

using Clock = std::chrono::system_clock;

// A loopback connection whose reading end has a small receive buffer; the
// writer is the accepted end, on `port`.
struct TcpPair {
  UniqueFd writer, reader;
  int port = 0;
};

TcpPair Connect() {
  UniqueFd listener(::socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  EXPECT_EQ(::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr), &len), 0);
  EXPECT_EQ(::listen(listener.get(), 1), 0);
  TcpPair pair;
  pair.port = ntohs(addr.sin_port);
  pair.reader.reset(::socket(AF_INET, SOCK_STREAM, 0));
  int small = 4096;
  ::setsockopt(pair.reader.get(), SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  EXPECT_EQ(::connect(pair.reader.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  pair.writer.reset(::accept(listener.get(), nullptr, nullptr));
  ::setsockopt(pair.writer.get(), SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
  return pair;
}

TEST(TcpLingerTest, WaitsUntilAPeerThatStoppedReadingHasReadEverything) {
  TcpPair pair = Connect();
  ASSERT_TRUE(pair.writer.valid() && pair.reader.valid());
  EXPECT_TRUE(WaitForPeersToAcknowledge(pair.port, Clock::now())) << "idle connections have nothing queued";

  // Write until the kernel takes no more: the peer is not reading.
  ASSERT_EQ(::fcntl(pair.writer.get(), F_SETFL, O_NONBLOCK), 0);
  std::vector<char> block(64 << 10, 'w');
  size_t written = 0;
  while (true) {
    ssize_t n = ::write(pair.writer.get(), block.data(), block.size());
    if (n <= 0) break;
    written += static_cast<size_t>(n);
  }
  ASSERT_GT(written, 0u);
  EXPECT_GT(UnacknowledgedTcpBytes(pair.port), 0u);
  EXPECT_EQ(UnacknowledgedTcpBytes(pair.port + 1), 0u) << "other ports do not count";
  EXPECT_FALSE(WaitForPeersToAcknowledge(pair.port, Clock::now() + std::chrono::milliseconds(50)));

  size_t read = 0;
  std::thread reader([&] {
    std::vector<char> buf(64 << 10);
    while (read < written) {
      ssize_t n = ::read(pair.reader.get(), buf.data(), buf.size());
      if (n <= 0) break;
      read += static_cast<size_t>(n);
    }
  });
  EXPECT_TRUE(WaitForPeersToAcknowledge(pair.port, Clock::now() + std::chrono::seconds(10)));
  reader.join();
  EXPECT_EQ(read, written);
  EXPECT_EQ(UnacknowledgedTcpBytes(pair.port), 0u);
}

}  // namespace
}  // namespace weightstore::server

// A TCP connection to 127.0.0.1, for tests that speak to a port raw.
#ifndef WEIGHTSTORE_TESTS_UTIL_LOOPBACK_H_
#define WEIGHTSTORE_TESTS_UTIL_LOOPBACK_H_

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "core/shm/unix_socket.h"

namespace weightstore::testing {

// Connected to 127.0.0.1:`port` (a failure is a test failure).
inline UniqueFd ConnectLoopback(int port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&address), sizeof address), 0) << "port " << port;
  return fd;
}

}  // namespace weightstore::testing

#endif  // WEIGHTSTORE_TESTS_UTIL_LOOPBACK_H_

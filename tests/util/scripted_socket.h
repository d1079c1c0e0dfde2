// A scripted stand-in for weightstored's same-host socket, for the answers
// a real daemon never gives (tests of the socket store's checks).
#ifndef WEIGHTSTORE_TESTS_UTIL_SCRIPTED_SOCKET_H_
#define WEIGHTSTORE_TESTS_UTIL_SCRIPTED_SOCKET_H_

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/mapped_file.h"
#include "core/shm/sealed_memfd.h"
#include "core/shm/unix_socket.h"
#include "tests/util/test_env.h"
#include "weightstore/v1/shm.pb.h"

namespace weightstore::testing {

// A socket "daemon" that answers the requests of one connection in turn, as
// weightstored's socket would, each with its segment in a sealed memfd (none
// when empty): for the answers a real daemon never gives.
class ScriptedSocket {
 public:
  struct Answer {
    ::weightstore::v1::ShmResponse response;
    std::string segment;
  };
  explicit ScriptedSocket(std::vector<Answer> answers) : path_(MakeScratchDir("fake-shm") + "/s.sock") {
    listener_ = UniqueFd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path_.c_str(), sizeof(addr.sun_path) - 1);
    EXPECT_EQ(::bind(listener_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(::listen(listener_.get(), 1), 0);
    thread_ = std::thread([this, answers = std::move(answers)] {
      UniqueFd connection(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      std::string frame;
      std::vector<UniqueFd> fds;
      for (const Answer& a : answers) {
        if (!RecvFrame(connection.get(), 1 << 20, &frame, &fds).ok()) return;
        std::vector<int> sent;
        absl::StatusOr<std::shared_ptr<const MappedFile>> memfd;
        if (!a.segment.empty()) {
          memfd = CreateSealedMemfd("fake", a.segment.size(), [&](std::span<std::byte> out) {
            std::memcpy(out.data(), a.segment.data(), a.segment.size());
            return absl::OkStatus();
          });
          if (!memfd.ok()) return;
          sent.push_back((*memfd)->fd());
        }
        (void)SendFrame(connection.get(), a.response.SerializeAsString(), sent);
      }
      (void)RecvFrame(connection.get(), 1 << 20, &frame, &fds);  // until the client leaves
    });
  }
  ~ScriptedSocket() {
    ::shutdown(listener_.get(), SHUT_RDWR);
    thread_.join();
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  UniqueFd listener_;
  std::thread thread_;
};

}  // namespace weightstore::testing

#endif  // WEIGHTSTORE_TESTS_UTIL_SCRIPTED_SOCKET_H_

#include "core/shm/unix_socket.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/shm/sealed_memfd.h"
#include "core/shm/unix_socket.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

TEST(UnixSocketTest, FramesCarryPayloadAndDescriptors) {
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  UniqueFd a(pair[0]), b(pair[1]);
  int passed = ::open("/dev/null", O_RDONLY);
  ASSERT_OK(SendFrame(a.get(), "hello", std::span<const int>(&passed, 1)));
  ASSERT_OK(SendFrame(a.get(), std::string(100000, 'q')));
  ::close(passed);
  std::string payload;
  std::vector<UniqueFd> fds;
  ASSERT_OK(RecvFrame(b.get(), 1 << 20, &payload, &fds));
  EXPECT_EQ(payload, "hello");
  ASSERT_EQ(fds.size(), 1u);
  EXPECT_NE(::fcntl(fds[0].get(), F_GETFD) & FD_CLOEXEC, 0);
  fds.clear();
  ASSERT_OK(RecvFrame(b.get(), 1 << 20, &payload, &fds));
  EXPECT_EQ(payload.size(), 100000u);
  EXPECT_TRUE(fds.empty());
}

TEST(UnixSocketTest, WaitingForAnAnswerEndsOnDataOnACancelOrAtTheTimeout) {
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  UniqueFd a(pair[0]), b(pair[1]);
  std::atomic<bool> cancelled{false};
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(WaitReadable(b.get(), cancelled, std::chrono::milliseconds(60)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("timed out")));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(60));
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    cancelled = true;
  });
  EXPECT_THAT(WaitReadable(b.get(), cancelled, std::chrono::minutes(1)), StatusIs(absl::StatusCode::kCancelled));
  canceller.join();
  cancelled = false;
  ASSERT_OK(SendFrame(a.get(), "answer"));
  EXPECT_OK(WaitReadable(b.get(), cancelled, std::chrono::minutes(1)));
  a.reset();  // a closed peer ends the wait too; the read then says what happened
  std::string payload;
  std::vector<UniqueFd> fds;
  ASSERT_OK(RecvFrame(b.get(), 1000, &payload, &fds));
  EXPECT_OK(WaitReadable(b.get(), cancelled, std::chrono::minutes(1)));
  EXPECT_THAT(RecvFrame(b.get(), 1000, &payload, &fds), StatusIs(absl::StatusCode::kOutOfRange));
}

TEST(UnixSocketTest, BadFramesAreNamedErrors) {
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  UniqueFd a(pair[0]), b(pair[1]);
  std::string payload;
  std::vector<UniqueFd> fds;
  ASSERT_EQ(::write(a.get(), "\xff\xff\xff\x7f", 4), 4);
  EXPECT_THAT(RecvFrame(b.get(), 1000, &payload, &fds),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("2147483647")));
  const char truncated[] = {10, 0, 0, 0, 'a', 'b', 'c'};  // declares 10 bytes, sends 3
  ASSERT_EQ(::write(a.get(), truncated, sizeof(truncated)), 7);
  a.reset();
  EXPECT_THAT(RecvFrame(b.get(), 1000, &payload, &fds), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("3 of 10")));
  EXPECT_THAT(RecvFrame(b.get(), 1000, &payload, &fds), StatusIs(absl::StatusCode::kOutOfRange));
  std::vector<int> many(kMaxFdsPerFrame + 1, 0);
  EXPECT_THAT(SendFrame(b.get(), "x", many), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ConnectUnixSocket("/nonexistent/socket"), StatusIs(absl::StatusCode::kNotFound));
}

}  // namespace
}  // namespace weightstore

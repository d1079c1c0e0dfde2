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

// A peer that sends a frame a byte now and then stays inside each read's
// timeout: the frame as a whole has a deadline, and a cancel ends it.
TEST(UnixSocketTest, AFrameTrickledInEndsAtItsDeadlineOrOnACancel) {
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  UniqueFd a(pair[0]), b(pair[1]);
  ASSERT_OK(SetSocketTimeouts(b.get(), std::chrono::minutes(1)));
  const unsigned char header[4] = {100, 0, 0, 0};  // 100 bytes announced, 3 sent
  ASSERT_EQ(::send(a.get(), header, sizeof(header), 0), 4);
  ASSERT_EQ(::send(a.get(), "abc", 3, 0), 3);
  std::string payload;
  std::vector<UniqueFd> fds;
  EXPECT_THAT(RecvFrame(b.get(), 1000, &payload, &fds,
                        {.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(50)}),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("receiving a frame: timed out")));
  std::atomic<bool> cancelled{false};
  std::thread canceller([&] { cancelled = true; });  // while the frame is awaited, or before
  EXPECT_THAT(RecvFrame(b.get(), 1000, &payload, &fds, {.cancelled = &cancelled}),
              StatusIs(absl::StatusCode::kCancelled));
  canceller.join();
}

// Descriptors ride with a frame's first bytes; a peer sending more later
// (piling them up in this process) gets DataLoss, and they are closed.
TEST(UnixSocketTest, DescriptorsAfterAFramesFirstBytesAreRefusedAndClosed) {
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  UniqueFd a(pair[0]), b(pair[1]);
  const unsigned char header[4] = {1, 0, 0, 0};
  ASSERT_EQ(::send(a.get(), header, sizeof(header), 0), 4);
  int extra[2];
  ASSERT_EQ(::pipe2(extra, O_NONBLOCK), 0);  // a read that would wait fails the test instead
  UniqueFd read_end(extra[0]), write_end(extra[1]);
  {
    char byte = 'x';
    iovec iov{&byte, 1};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &extra[1], sizeof(int));
    ASSERT_EQ(::sendmsg(a.get(), &msg, 0), 1);
  }
  write_end.reset();  // the only writer left is the copy in flight
  std::string payload;
  std::vector<UniqueFd> fds;
  EXPECT_THAT(RecvFrame(b.get(), 1000, &payload, &fds),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("descriptors came after the frame's first bytes")));
  EXPECT_TRUE(fds.empty());
  char got;
  EXPECT_EQ(::read(read_end.get(), &got, 1), 0) << "the descriptor received was closed";
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

#include "proto/codec/data_lane.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "core/shm/unix_socket.h"
#include "tests/util/status_matchers.h"

namespace weightstore::wire {
namespace {

using ::weightstore::testing::StatusIs;

TEST(LaneFrameHeaderTest, RoundTripsAndTheEndFrameHasNeitherPart) {
  const auto bytes = EncodeLaneFrameHeader({.meta_bytes = 123, .data_bytes = kMaxLaneDataBytes});
  ASSERT_OK_AND_ASSIGN(LaneFrameHeader header, DecodeLaneFrameHeader(bytes));
  EXPECT_EQ(header.meta_bytes, 123u);
  EXPECT_EQ(header.data_bytes, kMaxLaneDataBytes);
  EXPECT_FALSE(header.end());
  ASSERT_OK_AND_ASSIGN(LaneFrameHeader end, DecodeLaneFrameHeader(EncodeLaneFrameHeader({})));
  EXPECT_TRUE(end.end());
}

TEST(LaneFrameHeaderTest, AWrongMagicOrAPartOverItsBoundIsDataLoss) {
  auto bytes = EncodeLaneFrameHeader({.meta_bytes = 1, .data_bytes = 1});
  bytes[0] = std::byte{'X'};
  EXPECT_THAT(DecodeLaneFrameHeader(bytes).status(), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(DecodeLaneFrameHeader(EncodeLaneFrameHeader({.meta_bytes = kMaxLaneMetaBytes + 1})).status(),
              StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(DecodeLaneFrameHeader(EncodeLaneFrameHeader({.data_bytes = kMaxLaneDataBytes + 1})).status(),
              StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(DecodeLaneFrameHeader(EncodeLaneFrameHeader({.data_bytes = ~uint64_t{0}})).status(),
              StatusIs(absl::StatusCode::kDataLoss));
}

TEST(GrpcPeerIpTest, NamesTheAddressOfATcpPeerAndNothingElse) {
  EXPECT_EQ(GrpcPeerIp("ipv4:127.0.0.1:50051"), "127.0.0.1");
  EXPECT_EQ(GrpcPeerIp("ipv4:10.1.2.3:1"), "10.1.2.3");
  EXPECT_EQ(GrpcPeerIp("ipv6:[::1]:50051"), "::1");
  EXPECT_EQ(GrpcPeerIp("ipv6:%5B::1%5D:50051"), "::1");
  EXPECT_EQ(GrpcPeerIp("ipv6:[0:0:0:0:0:0:0:1]:7"), "::1");             // as inet_ntop writes it
  EXPECT_EQ(GrpcPeerIp("ipv6:[::ffff:127.0.0.1]:50051"), "127.0.0.1");  // v4-mapped: the IPv4 address
  for (const char* other : {"unix:/tmp/ws.sock", "unix-abstract:x", "", "ipv4:", "ipv4:127.0.0.1", "ipv6:::1:5",
                            "ipv4:not-an-ip:5", "ipv6:[fe80::1%25eth0]:5", "inproc"}) {
    EXPECT_EQ(GrpcPeerIp(other), std::nullopt) << other;
  }
}

class LaneSocketTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int fds[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
    a_ = UniqueFd(fds[0]);
    b_ = UniqueFd(fds[1]);
    // PrepareLaneSocket's timeouts (its TCP_NODELAY does not apply here).
    const timeval step{.tv_sec = 0, .tv_usec = 20 * 1000};
    for (int fd : {a_.get(), b_.get()}) {
      ASSERT_EQ(setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &step, sizeof step), 0);
      ASSERT_EQ(setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &step, sizeof step), 0);
    }
  }
  UniqueFd a_, b_;
};

TEST_F(LaneSocketTest, WritesEveryPartInOrderAndReadsExactlyWhatIsAskedFor) {
  std::string big(3 << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7);
  const std::string small = "head";
  uint64_t told = 0;
  std::thread writer([&] {
    const std::span<const std::byte> parts[] = {std::as_bytes(std::span(small)), {}, std::as_bytes(std::span(big))};
    EXPECT_OK(LaneWriteAll(a_.get(), parts, {}, [&](uint64_t n) { told += n; }));
  });
  std::string got(small.size() + big.size(), '\0');
  EXPECT_OK(LaneReadExactly(b_.get(), std::as_writable_bytes(std::span(got)), {}));
  writer.join();
  EXPECT_EQ(got, small + big);
  EXPECT_EQ(told, got.size());
}

TEST_F(LaneSocketTest, AStreamThatEndsEarlyIsUnavailableNamingWhatArrived) {
  ASSERT_EQ(write(a_.get(), "abc", 3), 3);
  a_.reset();
  std::string got(10, '\0');
  EXPECT_THAT(LaneReadExactly(b_.get(), std::as_writable_bytes(std::span(got)), {}),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::HasSubstr("after 3 of the 10 bytes")));
}

TEST_F(LaneSocketTest, AReadOrWriteBlockedOnAQuietPeerStopsWhenCancelledOrIdle) {
  std::atomic<bool> cancel{false};
  std::thread canceller([&] { cancel = true; });  // whenever it runs: the read waits for it
  std::string got(10, '\0');
  EXPECT_THAT(LaneReadExactly(b_.get(), std::as_writable_bytes(std::span(got)), {.cancel = &cancel}),
              StatusIs(absl::StatusCode::kCancelled));
  canceller.join();
  EXPECT_THAT(
      LaneReadExactly(b_.get(), std::as_writable_bytes(std::span(got)), {.idle = std::chrono::milliseconds(50)}),
      StatusIs(absl::StatusCode::kDeadlineExceeded));
  // A peer that reads nothing: the writer fills the socket's buffer, then waits.
  std::string big(64 << 20, 'x');
  const std::span<const std::byte> parts[] = {std::as_bytes(std::span(big))};
  bool asked = false;
  EXPECT_THAT(LaneWriteAll(a_.get(), parts, {.stop = [&] { return std::exchange(asked, true); }}),
              StatusIs(absl::StatusCode::kCancelled));
}

TEST_F(LaneSocketTest, AWriteToAPeerThatWentAwayIsUnavailable) {
  b_.reset();
  const std::string bytes = "abc";
  const std::span<const std::byte> parts[] = {std::as_bytes(std::span(bytes))};
  EXPECT_THAT(LaneWriteAll(a_.get(), parts, {}), StatusIs(absl::StatusCode::kUnavailable));
}

}  // namespace
}  // namespace weightstore::wire

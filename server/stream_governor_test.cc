#include "server/stream_governor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "tests/util/status_matchers.h"

namespace weightstore::server {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

TEST(StreamGovernorTest, BoundsStreamsInAllAndPerClientAddress) {
  StreamGovernor governor({.total = 3, .per_peer = 2, .idle = std::chrono::hours(1)});
  ASSERT_OK_AND_ASSIGN(uint64_t a, governor.Admit("ipv4:10.0.0.1:5000", [] {}));
  ASSERT_OK(governor.Admit("ipv4:10.0.0.1:5001", [] {}));
  EXPECT_THAT(governor.Admit("ipv4:10.0.0.1:5002", [] {}),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("ipv4:10.0.0.1 has 2")));
  ASSERT_OK(governor.Admit("ipv4:10.0.0.2:5000", [] {}));
  EXPECT_THAT(governor.Admit("ipv4:10.0.0.3:5000", [] {}),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("--max-concurrent-fetches")));
  governor.Release(a);
  EXPECT_OK(governor.Admit("ipv4:10.0.0.1:5003", [] {}));
  EXPECT_EQ(governor.active(), 3);
}

TEST(StreamGovernorTest, CancelsAStreamThatStopsMakingProgressAndOnlyThatOne) {
  StreamGovernor governor({.total = 8, .per_peer = 8, .idle = std::chrono::milliseconds(200), .min_bytes = 1000});
  std::atomic<int> stalled_cancels{0}, busy_cancels{0}, trickle_cancels{0};
  ASSERT_OK_AND_ASSIGN(uint64_t stalled, governor.Admit("ipv4:1.1.1.1:1", [&] { ++stalled_cancels; }));
  ASSERT_OK_AND_ASSIGN(uint64_t busy, governor.Admit("ipv4:1.1.1.1:2", [&] { ++busy_cancels; }));
  ASSERT_OK_AND_ASSIGN(uint64_t trickle, governor.Admit("ipv4:1.1.1.1:3", [&] { ++trickle_cancels; }));
  for (int i = 0; i < 20; ++i) {
    governor.Progress(busy, 500);
    governor.Progress(trickle, 10);  // a slow loris: always some progress, never enough
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  }
  EXPECT_EQ(stalled_cancels.load(), 1) << "cancelled once";
  EXPECT_EQ(trickle_cancels.load(), 1);
  EXPECT_EQ(busy_cancels.load(), 0);
  EXPECT_EQ(governor.cancelled(), 2u);
  governor.Release(stalled);
  governor.Release(busy);
  governor.Release(trickle);
  EXPECT_EQ(governor.active(), 0);
}

TEST(StreamGovernorTest, AStreamBusyOnTheServersSideIsNeverTakenForStalled) {
  StreamGovernor governor({.total = 1, .per_peer = 1, .idle = std::chrono::milliseconds(50), .min_bytes = 1000});
  std::atomic<int> cancels{0};
  ASSERT_OK_AND_ASSIGN(uint64_t committing, governor.Admit("ipv4:1.1.1.1:1", [&] { ++cancels; }));
  governor.Busy(committing);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(cancels.load(), 0);
  EXPECT_FALSE(governor.Admit("ipv4:1.1.1.1:2", [] {}).ok()) << "it keeps its slot";
  governor.Release(committing);
}

TEST(StreamGovernorTest, AResumedStreamIsWatchedAgainFromAFreshPeriod) {
  StreamGovernor governor({.total = 1, .per_peer = 1, .idle = std::chrono::milliseconds(100), .min_bytes = 1000});
  std::atomic<int> cancels{0};
  ASSERT_OK_AND_ASSIGN(uint64_t waiting, governor.Admit("ipv4:1.1.1.1:1", [&] { ++cancels; }));
  governor.Busy(waiting);  // a pull it waits on
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  governor.Resume(waiting);
  std::this_thread::sleep_for(std::chrono::milliseconds(40));
  EXPECT_EQ(cancels.load(), 0) << "not judged on the time it was busy";
  for (int i = 0; i < 200 && cancels.load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(cancels.load(), 1) << "then stalled again, and cancelled";
  governor.Release(waiting);
}

TEST(StreamGovernorTest, PeerAddressDropsThePort) {
  EXPECT_EQ(PeerAddress("ipv4:127.0.0.1:54321"), "ipv4:127.0.0.1");
  EXPECT_EQ(PeerAddress("ipv6:[::1]:443"), "ipv6:[::]/64");
  EXPECT_EQ(PeerAddress("ipv6:[2001:db8:1:2:3:4:5:6]:443"), "ipv6:[2001:db8:1:2::]/64");
  EXPECT_EQ(PeerAddress("ipv6:[2001:db8:1:2:ffff::9]:80"), "ipv6:[2001:db8:1:2::]/64") << "one /64, one share";
  EXPECT_EQ(PeerAddress("ipv6:[::ffff:10.0.0.7]:80"), "ipv4:10.0.0.7");
  EXPECT_EQ(PeerAddress("unix:/run/ws.sock"), "unix:/run/ws.sock");
  EXPECT_EQ(PeerAddress("ipv4:"), "ipv4:");
}

}  // namespace
}  // namespace weightstore::server

#include "server/stream_governor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <iostream>
#include <thread>

#include "absl/synchronization/notification.h"
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
  auto step = [&] {
    governor.Progress(busy, 1 << 20);  // enough for a period in any one call
    governor.Progress(trickle, 10);    // a slow loris: always some progress, never enough
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  };
  // Until both are cancelled (30 s only catches a watchdog that never runs),
  // then two periods more, in which neither may be cancelled again.
  const auto start = std::chrono::steady_clock::now();
  while ((stalled_cancels.load() == 0 || trickle_cancels.load() == 0) &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(30)) {
    step();
  }
  const auto cancelled = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - cancelled < std::chrono::milliseconds(400)) step();
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
  absl::Notification cancelled;
  std::chrono::steady_clock::time_point cancelled_at;
  auto on_cancel = [&] {
    if (++cancels == 1) {
      cancelled_at = std::chrono::steady_clock::now();
      cancelled.Notify();
    }
  };
  ASSERT_OK_AND_ASSIGN(uint64_t waiting, governor.Admit("ipv4:1.1.1.1:1", on_cancel));
  governor.Busy(waiting);  // a pull it waits on
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  EXPECT_EQ(cancels.load(), 0) << "not while busy";
  const auto resumed = std::chrono::steady_clock::now();
  governor.Resume(waiting);
  const bool stalled_again = cancelled.WaitForNotificationWithTimeout(absl::Seconds(30));
  governor.Release(waiting);
  ASSERT_TRUE(stalled_again) << "then stalled again, and cancelled";
  // A whole idle period after the resume at the earliest, however late the
  // watchdog ran: judged on the time it was busy, it would go at once.
  std::cout << "cancelled " << std::chrono::duration_cast<std::chrono::milliseconds>(cancelled_at - resumed).count()
            << " ms after the resume (idle: 100 ms)\n";
  EXPECT_GE(cancelled_at - resumed, std::chrono::milliseconds(100)) << "not judged on the time it was busy";
  EXPECT_EQ(cancels.load(), 1);
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

#include "server/stall_watchdog.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <iostream>
#include <thread>

#include "absl/synchronization/notification.h"

namespace weightstore::server {
namespace {

TEST(StallWatchdogTest, CancelsAStreamThatStopsMakingProgressAndOnlyThatOne) {
  StallWatchdog watchdog;
  // Periods long enough that a busy machine never keeps this thread off the
  // CPU for one (the busy stream's progress comes from it).
  const StreamLimits limits{.idle = std::chrono::seconds(2), .min_bytes = 1000};
  std::atomic<int> stalled_cancels{0}, busy_cancels{0}, trickle_cancels{0};
  StallWatchdog::Watched stalled = watchdog.Watch("ipv4:1.1.1.1:1", limits, [&] { ++stalled_cancels; });
  StallWatchdog::Watched busy = watchdog.Watch("ipv4:1.1.1.1:2", limits, [&] { ++busy_cancels; });
  StallWatchdog::Watched trickle = watchdog.Watch("ipv4:1.1.1.1:3", limits, [&] { ++trickle_cancels; });
  auto step = [&] {
    busy.Progress(1 << 20);  // enough for a period in any one call
    trickle.Progress(10);    // a slow loris: always some progress, never enough
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
  while (std::chrono::steady_clock::now() - cancelled < std::chrono::seconds(4)) step();
  EXPECT_EQ(stalled_cancels.load(), 1) << "cancelled once";
  EXPECT_EQ(trickle_cancels.load(), 1);
  EXPECT_EQ(busy_cancels.load(), 0);
  EXPECT_EQ(watchdog.cancelled(limits), 2u);
}

TEST(StallWatchdogTest, AStreamBusyOnTheServersSideIsNeverTakenForStalled) {
  StallWatchdog watchdog;
  // A period long enough that nothing comes between Watch and Busy.
  const StreamLimits limits{.idle = std::chrono::seconds(1), .min_bytes = 1000};
  std::atomic<int> cancels{0};
  StallWatchdog::Watched committing = watchdog.Watch("ipv4:1.1.1.1:1", limits, [&] { ++cancels; });
  committing.Busy();
  std::this_thread::sleep_for(std::chrono::milliseconds(3000));
  EXPECT_EQ(cancels.load(), 0);
  EXPECT_EQ(watchdog.cancelled(limits), 0u);
}

TEST(StallWatchdogTest, AnUnwatchedStreamIsNeverCancelled) {
  StallWatchdog watchdog;
  // A period long enough that nothing comes between Watch and Unwatch.
  const StreamLimits limits{.idle = std::chrono::seconds(1), .min_bytes = 1000};
  std::atomic<int> cancels{0};
  StallWatchdog::Watched first = watchdog.Watch("ipv4:1.1.1.1:1", limits, [&] { ++cancels; });
  StallWatchdog::Watched moved = std::move(first);  // the watch moves with it
  EXPECT_FALSE(first);
  moved.Unwatch();
  moved.Unwatch();  // once is enough; again does nothing
  // A stream that stalls beside it is cancelled: the watchdog ran, and left
  // the unwatched one alone.
  absl::Notification other_cancelled;
  StallWatchdog::Watched other = watchdog.Watch("ipv4:1.1.1.1:2", limits, [&] { other_cancelled.Notify(); });
  ASSERT_TRUE(other_cancelled.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(cancels.load(), 0);
  EXPECT_EQ(watchdog.cancelled(limits), 1u);
}

TEST(StallWatchdogTest, AResumedStreamIsWatchedAgainFromAFreshPeriod) {
  StallWatchdog watchdog;
  const StreamLimits limits{.idle = std::chrono::seconds(1), .min_bytes = 1000};
  std::atomic<int> cancels{0};
  absl::Notification cancelled;
  std::chrono::steady_clock::time_point cancelled_at;
  auto on_cancel = [&] {
    if (++cancels == 1) {
      cancelled_at = std::chrono::steady_clock::now();
      cancelled.Notify();
    }
  };
  StallWatchdog::Watched waiting = watchdog.Watch("ipv4:1.1.1.1:1", limits, on_cancel);
  waiting.Busy();  // a pull it waits on
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  EXPECT_EQ(cancels.load(), 0) << "not while busy";
  const auto resumed = std::chrono::steady_clock::now();
  waiting.Resume();
  const bool stalled_again = cancelled.WaitForNotificationWithTimeout(absl::Seconds(30));
  waiting.Unwatch();
  ASSERT_TRUE(stalled_again) << "then stalled again, and cancelled";
  // A whole idle period after the resume at the earliest, however late the
  // watchdog ran: judged on the time it was busy, it would go at once.
  std::cout << "cancelled " << std::chrono::duration_cast<std::chrono::milliseconds>(cancelled_at - resumed).count()
            << " ms after the resume (idle: 1000 ms)\n";
  EXPECT_GE(cancelled_at - resumed, std::chrono::seconds(1)) << "not judged on the time it was busy";
  EXPECT_EQ(cancels.load(), 1);
}

}  // namespace
}  // namespace weightstore::server

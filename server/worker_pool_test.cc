#include "server/worker_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"

namespace weightstore::server {
namespace {

TEST(WorkerPoolTest, JobsRunOnTheWorkersWithOkStatus) {
  WorkerPool background(2, 16, "test work");
  std::atomic<int> ran{0};
  absl::Notification all;
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(background
                    .Post([&](absl::Status runnable) {
                      EXPECT_TRUE(runnable.ok());
                      if (++ran == 10) all.Notify();
                    })
                    .ok());
  }
  all.WaitForNotification();
  EXPECT_EQ(ran.load(), 10);
}

// Gives `background`'s one worker a job that runs until `release`, and waits
// until it has started.
void OccupyTheWorker(WorkerPool& background, absl::Notification& release) {
  auto started = std::make_shared<absl::Notification>();  // outlives this call, for the job
  ASSERT_TRUE(background
                  .Post([started, &release](absl::Status) {
                    started->Notify();
                    release.WaitForNotification();
                  })
                  .ok());
  started->WaitForNotification();
}

TEST(WorkerPoolTest, AFullQueueRefusesAJobWithoutCallingIt) {
  WorkerPool background(1, 2, "checksum work");
  absl::Notification release;
  ASSERT_NO_FATAL_FAILURE(OccupyTheWorker(background, release));
  std::atomic<int> ran{0}, called{0};
  auto job = [&](absl::Status runnable) {
    ++called;
    if (runnable.ok()) ++ran;
  };
  ASSERT_TRUE(background.Post(job).ok());
  ASSERT_TRUE(background.Post(job).ok());
  const absl::Status refused = background.Post(job);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("checksum work"), absl::string_view::npos) << refused;
  EXPECT_FALSE(background.stopping());
  release.Notify();
  while (background.queued() != 0) std::this_thread::yield();
  background.Stop();
  EXPECT_TRUE(background.stopping());
  EXPECT_EQ(called.load(), 2);  // the refused one never
  EXPECT_EQ(ran.load(), 2);
}

TEST(WorkerPoolTest, StopEndsQueuedJobsUnavailableAndRefusesNewOnes) {
  WorkerPool background(1, 8, "test work");
  absl::Notification release;
  ASSERT_NO_FATAL_FAILURE(OccupyTheWorker(background, release));
  std::vector<absl::StatusCode> codes;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(background.Post([&](absl::Status runnable) { codes.push_back(runnable.code()); }).ok());
  }
  std::thread stopper([&] { background.Stop(); });
  // Stop() ends the queued jobs at once, then waits for the running one.
  while (background.queued() != 0) std::this_thread::yield();
  release.Notify();
  stopper.join();
  EXPECT_EQ(codes, std::vector<absl::StatusCode>(3, absl::StatusCode::kUnavailable));
  EXPECT_EQ(background.Post([](absl::Status) { ADD_FAILURE() << "ran after Stop"; }).code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace weightstore::server

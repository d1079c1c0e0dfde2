#include "core/file_watcher.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "absl/synchronization/notification.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using ::testing::ElementsAre;

class Reports {
 public:
  void Add(const std::set<std::string>& keys) {
    absl::MutexLock lock(&mu_);
    reports_.push_back(keys);
  }
  // Waits up to `ms` for a report; returns all so far.
  std::vector<std::set<std::string>> Await(int ms) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(
                             +[](std::vector<std::set<std::string>>* r) { return !r->empty(); }, &reports_),
                         absl::Milliseconds(ms));
    return reports_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::set<std::string>> reports_ ABSL_GUARDED_BY(mu_);
};

void AppendTo(const std::string& path, const std::string& data) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, data.data(), data.size()), static_cast<ssize_t>(data.size()));
  ::close(fd);
}

TEST(FileWatcherTest, ReportsAWriteInPlaceOnceItsWriterPauses) {
  const std::string dir = testing::MakeScratchDir("watch");
  testing::WriteFileOrDie(dir + "/a", "1");
  testing::WriteFileOrDie(dir + "/b", "1");
  Reports reports;
  ASSERT_OK_AND_ASSIGN(auto watcher,
                       FileWatcher::Start([&](const auto& keys) { reports.Add(keys); }, std::chrono::milliseconds(50)));
  ASSERT_OK(watcher->Set("ka", {dir + "/a"}));
  ASSERT_OK(watcher->Set("kb", {dir + "/b"}));
  for (int i = 0; i < 5; ++i) AppendTo(dir + "/a", "more");
  EXPECT_THAT(reports.Await(5000), ElementsAre(std::set<std::string>{"ka"})) << "one report for the burst";
}

TEST(FileWatcherTest, AReplacementByRenameOrAnUnwatchedKeyIsNotReported) {
  const std::string dir = testing::MakeScratchDir("watch");
  testing::WriteFileOrDie(dir + "/a", "1");
  testing::WriteFileOrDie(dir + "/b", "1");
  Reports reports;
  ASSERT_OK_AND_ASSIGN(auto watcher,
                       FileWatcher::Start([&](const auto& keys) { reports.Add(keys); }, std::chrono::milliseconds(20)));
  ASSERT_OK(watcher->Set("ka", {dir + "/a"}));
  ASSERT_OK(watcher->Set("kb", {dir + "/b"}));
  testing::WriteFileOrDie(dir + "/a.new", "2");
  std::filesystem::rename(dir + "/a.new", dir + "/a");
  watcher->Remove("kb");
  AppendTo(dir + "/b", "more");
  EXPECT_TRUE(reports.Await(300).empty());
  watcher->Poke();
  EXPECT_THAT(reports.Await(5000), ElementsAre(std::set<std::string>{})) << "a poke reports no keys";
}

}  // namespace
}  // namespace weightstore

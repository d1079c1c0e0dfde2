#include "client/usable_cores.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <thread>

namespace weightstore::client {
namespace {

TEST(UsableCoresTest, ParsesCgroupV2CpuMax) {
  EXPECT_EQ(ParseCpuMax("200000 100000\n"), 2.0);
  EXPECT_EQ(ParseCpuMax("50000 100000"), 0.5);
  EXPECT_EQ(ParseCpuMax("max 100000\n"), std::nullopt);
  EXPECT_EQ(ParseCpuMax(""), std::nullopt);
  EXPECT_EQ(ParseCpuMax("garbage"), std::nullopt);
  EXPECT_EQ(ParseCpuMax("0 100000"), std::nullopt);
}

TEST(UsableCoresTest, ParsesCgroupV1Quota) {
  EXPECT_EQ(ParseCfsQuota("150000\n", "100000\n"), 1.5);
  EXPECT_EQ(ParseCfsQuota("-1\n", "100000\n"), std::nullopt);
  EXPECT_EQ(ParseCfsQuota("x", "100000"), std::nullopt);
}

TEST(UsableCoresTest, FollowsTheThreadsCpuAffinity) {
  const int all = UsableCores();
  EXPECT_GE(all, 1);
  EXPECT_LE(all, static_cast<int>(std::thread::hardware_concurrency()));
  int on_one = 0;
  std::thread pinned([&] {
    cpu_set_t set;
    ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
    int first = 0;
    while (!CPU_ISSET(first, &set)) ++first;
    CPU_ZERO(&set);
    CPU_SET(first, &set);
    ASSERT_EQ(sched_setaffinity(0, sizeof(set), &set), 0);  // this thread only
    on_one = UsableCores();
  });
  pinned.join();
  EXPECT_EQ(on_one, 1);
}

}  // namespace
}  // namespace weightstore::client

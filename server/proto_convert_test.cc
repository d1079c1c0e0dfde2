#include "server/proto_convert.h"

#include <gtest/gtest.h>

#include <string>

namespace weightstore {
namespace {

PullStats Following(std::initializer_list<const char*> names) {
  PullStats stats;
  stats.origin = "grpc://regional:7070";
  stats.follow.following = true;
  stats.follow.upstream_connected = true;
  for (const char* name : names) {  // sorted by name, as Follower::Stats lists them
    FollowedStats c;
    c.name = name;
    c.lag_versions = 2;
    c.newest = std::string("v-") + name;
    stats.follow.checkpoints.push_back(c);
  }
  return stats;
}

TEST(FollowInfoTest, EachListedCheckpointGetsItsOwnFollowStatsAndOnlyAFollowedOneGetsAny) {
  const PullStats stats = Following({"acme/a", "acme/a@v1", "b", "m"});
  for (const char* name : {"acme/a", "acme/a@v1", "b", "m"}) {
    pb::CheckpointInfo info;
    info.set_name(name);
    info.set_version("held");
    AddFollowing(stats, &info);
    ASSERT_TRUE(info.has_follow()) << name;
    EXPECT_EQ(info.follow().upstream_version(), std::string("v-") + name);
    EXPECT_EQ(info.follow().upstream(), "grpc://regional:7070");
    EXPECT_EQ(info.follow().lag_versions(), 2u);
  }
  for (const char* name : {"", "a", "acme", "acme/b", "c", "z"}) {
    pb::CheckpointInfo info;
    info.set_name(name);
    AddFollowing(stats, &info);
    EXPECT_FALSE(info.has_follow()) << name;
  }
  // A daemon that follows nothing adds nothing.
  pb::CheckpointInfo info;
  info.set_name("m");
  AddFollowing(PullStats{}, &info);
  EXPECT_FALSE(info.has_follow());
}

}  // namespace
}  // namespace weightstore

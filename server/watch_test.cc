#include "server/watch.h"

#include <gtest/gtest.h>

#include <string>

namespace weightstore::server {
namespace {

CheckpointUpdate Replacement(size_t changed_names, size_t name_bytes) {
  CheckpointUpdate u;
  u.kind = CheckpointUpdate::Kind::kReplaced;
  u.name = "m";
  u.old_version = "v1";
  u.new_version = "v2";
  u.diff.emplace();
  for (size_t i = 0; i < changed_names; ++i) u.diff->changed.push_back(std::string(name_bytes, 'a' + i % 26));
  u.diff->added = {"new"};
  u.diff->removed = {"old"};
  u.diff->unchanged = 7;
  return u;
}

TEST(WatchEventTest, AReplacementListsTheTensorsThatChangedWithTheirCounts) {
  v1::CheckpointEvent e;
  ToProto(Replacement(2, 8), &e);
  EXPECT_EQ(e.kind(), v1::CheckpointEvent::REPLACED);
  EXPECT_TRUE(e.delta());
  EXPECT_EQ(e.changed_tensors_size(), 2);
  EXPECT_EQ(e.added_tensors(0), "new");
  EXPECT_EQ(e.removed_tensors(0), "old");
  EXPECT_EQ(e.changed_count(), 2u);
  EXPECT_EQ(e.unchanged_count(), 7u);
  EXPECT_FALSE(e.tensor_names_omitted());
}

TEST(WatchEventTest, NamesPastTheBoundAreLeftOutAndTheCountsStay) {
  // 100,000 names of 4 KiB would make a 400 MB event: past 1 MiB of names
  // only the counts go out.
  v1::CheckpointEvent e;
  ToProto(Replacement(300, 4096), &e);
  EXPECT_TRUE(e.tensor_names_omitted());
  EXPECT_EQ(e.changed_tensors_size(), 0);
  EXPECT_EQ(e.added_tensors_size(), 0);
  EXPECT_EQ(e.changed_count(), 300u);
  EXPECT_EQ(e.added_count(), 1u);
  EXPECT_LT(e.ByteSizeLong(), 1024u);
}

TEST(WatchEventTest, AFullReplacementSaysWhyAndListsNothing) {
  CheckpointUpdate u = Replacement(0, 0);
  u.diff.reset();
  u.full_reason = "version v1 is not kept";
  v1::CheckpointEvent e;
  ToProto(u, &e);
  EXPECT_FALSE(e.delta());
  EXPECT_EQ(e.full_reason(), "version v1 is not kept");
  EXPECT_EQ(e.changed_count(), 0u);
}

}  // namespace
}  // namespace weightstore::server

#include "server/watch.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>

namespace weightstore::server {
namespace {

CheckpointUpdate Replacement(size_t changed_names, size_t name_bytes) {
  CheckpointUpdate u;
  u.kind = CheckpointUpdate::Kind::kReplaced;
  u.name = "m";
  u.old_version = "v1";
  u.new_version = "v2";
  auto diff = std::make_shared<ManifestDiff>();
  for (size_t i = 0; i < changed_names; ++i) diff->changed.push_back(std::string(name_bytes, 'a' + i % 26));
  diff->added = {"new"};
  diff->removed = {"old"};
  diff->unchanged = 7;
  u.diff = diff;
  return u;
}

// Issue 26, findings 1 and 5: every watcher of one step is sent the same
// serialized event (a reference to one buffer, not a copy per watcher), and
// the hub keeps a bounded number of them.
TEST(WatchHubTest, OneStepIsSerializedOnceAndSharedByItsWatchers) {
  const std::string models = ::testing::TempDir() + "/watch-hub-models";
  std::filesystem::create_directories(models);
  CheckpointRegistry registry({.models_dir = models});
  Authenticator auth;
  WatchHub hub(&registry, &auth, WatchLimits{}, [](const absl::Status&) { return grpc::Status::OK; });
  const CheckpointUpdate step = Replacement(1000, 64);
  std::shared_ptr<const grpc::ByteBuffer> a = hub.Event(step);
  std::shared_ptr<const grpc::ByteBuffer> b = hub.Event(step);
  EXPECT_EQ(a, b);
  EXPECT_GT(a->Length(), 64000u);
  CheckpointUpdate other = step;
  other.new_version = "v3";
  EXPECT_NE(hub.Event(other), a);
  for (int i = 0; i < 300; ++i) {  // more steps than are kept
    other.new_version = "w" + std::to_string(i);
    hub.Event(other);
  }
  EXPECT_NE(hub.Event(step), a);  // made again: the old one was let go
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
  u.diff = nullptr;
  u.full_reason = "version v1 is not kept";
  v1::CheckpointEvent e;
  ToProto(u, &e);
  EXPECT_FALSE(e.delta());
  EXPECT_EQ(e.full_reason(), "version v1 is not kept");
  EXPECT_EQ(e.changed_count(), 0u);
}

}  // namespace
}  // namespace weightstore::server

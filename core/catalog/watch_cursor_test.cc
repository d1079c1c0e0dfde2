#include "core/catalog/watch_cursor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Kind = CheckpointUpdate::Kind;

SharedTensor F32(const std::string& name, float value) {
  std::string bytes(reinterpret_cast<const char*>(&value), sizeof value);
  return SharedTensor{{name, DType::kF32, {1}}, SharedBytes::Copy(bytes)};
}

// Writes a checkpoint as a trainer would publish one: a temporary, renamed
// over the file (a new version).
void Publish(const std::string& path, const std::vector<SharedTensor>& tensors) {
  // Timestamps are coarse (a few ms) and a freed inode number is soon reused:
  // a pause keeps two publications of one size from looking like one file.
  std::this_thread::sleep_for(std::chrono::milliseconds(15));
  const std::string temporary = path + ".tmp-publish";
  testing::WriteFileOrDie(temporary, *SerializeCheckpoint(kSafeTensorsFormat, tensors, {}));
  ASSERT_EQ(std::rename(temporary.c_str(), path.c_str()), 0);
}

std::vector<CheckpointUpdate> Drain(WatchCursor& cursor) {
  std::vector<CheckpointUpdate> updates;
  while (std::optional<CheckpointUpdate> u = cursor.Next()) updates.push_back(*std::move(u));
  return updates;
}

class WatchCursorTest : public ::testing::Test {
 protected:
  WatchCursorTest()
      : models_(testing::MakeScratchDir("watch")),
        registry_({.models_dir = models_, .tensor_digests = true, .kept_versions = 3}) {}
  std::string models_;
  CheckpointRegistry registry_;
};

TEST_F(WatchCursorTest, ANewWatcherIsToldWhatIsServedThenThatItIsSynced) {
  Publish(models_ + "/a.safetensors", {F32("w", 1)});
  Publish(models_ + "/b.safetensors", {F32("w", 1)});
  registry_.Rescan();
  WatchCursor cursor(&registry_, {}, {});
  cursor.Start();
  std::vector<CheckpointUpdate> updates = Drain(cursor);
  ASSERT_EQ(updates.size(), 3u);
  EXPECT_EQ(updates[0].kind, Kind::kAdded);
  EXPECT_EQ(updates[0].name, "a");
  EXPECT_EQ(updates[0].new_version, registry_.Get("a")->version());
  EXPECT_EQ(updates[1].name, "b");
  EXPECT_EQ(updates[2].kind, Kind::kSynced);
  EXPECT_FALSE(cursor.Next().has_value());
}

TEST_F(WatchCursorTest, AReplacementNamesTheTensorsThatChanged) {
  const std::string path = models_ + "/m.safetensors";
  Publish(path, {F32("a", 1), F32("b", 2), F32("c", 3)});
  registry_.Rescan();
  const std::string v1 = registry_.Get("m")->version();
  WatchCursor cursor(&registry_, {.name = "m"}, {{"m", v1}});
  cursor.Start();
  EXPECT_EQ(Drain(cursor).size(), 1u);  // synced: it holds the current version
  Publish(path, {F32("a", 1), F32("b", 2.5f), F32("d", 4)});
  registry_.Rescan();
  EXPECT_TRUE(cursor.MarkChanged("m"));
  std::vector<CheckpointUpdate> updates = Drain(cursor);
  ASSERT_EQ(updates.size(), 1u);
  const CheckpointUpdate& u = updates[0];
  EXPECT_EQ(u.kind, Kind::kReplaced);
  EXPECT_EQ(u.old_version, v1);
  EXPECT_EQ(u.new_version, registry_.Get("m")->version());
  ASSERT_NE(u.diff, nullptr) << u.full_reason;
  EXPECT_THAT(u.diff->changed, ElementsAre("b"));
  EXPECT_THAT(u.diff->added, ElementsAre("d"));
  EXPECT_THAT(u.diff->removed, ElementsAre("c"));
}

// Issue 26, finding 5: a publish with many watchers diffed once per watcher.
TEST_F(WatchCursorTest, CursorsSharingADiffCacheShareOneDiffPerStep) {
  const std::string path = models_ + "/m.safetensors";
  Publish(path, {F32("a", 1), F32("b", 2)});
  registry_.Rescan();
  const std::string v1 = registry_.Get("m")->version();
  DiffCache diffs(2);
  std::vector<std::unique_ptr<WatchCursor>> cursors;
  for (int i = 0; i < 8; ++i) {
    cursors.push_back(std::make_unique<WatchCursor>(&registry_, WatchScope{.name = "m"},
                                                    std::map<std::string, std::string>{{"m", v1}}, &diffs));
    cursors.back()->Start();
    Drain(*cursors.back());
  }
  Publish(path, {F32("a", 1), F32("b", 3)});
  registry_.Rescan();
  std::shared_ptr<const ManifestDiff> first;
  for (auto& cursor : cursors) {
    cursor->MarkChanged("m");
    std::vector<CheckpointUpdate> updates = Drain(*cursor);
    ASSERT_EQ(updates.size(), 1u);
    ASSERT_NE(updates[0].diff, nullptr);
    if (first == nullptr) first = updates[0].diff;
    EXPECT_EQ(updates[0].diff, first);  // the same object, made once
  }
  EXPECT_THAT(first->changed, ElementsAre("b"));
}

TEST_F(WatchCursorTest, TheDiffCacheKeepsAtMostItsBytesAndTheNewestStep) {
  const std::string path = models_ + "/m.safetensors";
  std::vector<std::string> versions;
  for (int step = 0; step < 3; ++step) {
    std::vector<SharedTensor> tensors;
    for (int i = 0; i < 100; ++i) tensors.push_back(F32(std::string(200, 'a' + i % 26) + std::to_string(i), step));
    Publish(path, tensors);
    registry_.Rescan();
    versions.push_back(registry_.Get("m")->version());
  }
  DiffCache diffs(64, /*max_bytes=*/100 * 200 + 1000);  // about one step's names
  std::shared_ptr<const CheckpointManifest> manifests[3];
  for (int i = 0; i < 3; ++i) {
    manifests[i] = registry_.FindManifest("m", versions[i]);
    ASSERT_NE(manifests[i], nullptr) << "version " << i << " is not kept";
  }
  auto first = diffs.Get("m", *manifests[0], *manifests[1]);
  ASSERT_EQ(first->changed.size(), 100u);
  EXPECT_GT(diffs.bytes(), 100u * 200);
  diffs.Get("m", *manifests[1], *manifests[2]);
  EXPECT_LE(diffs.bytes(), 100u * 200 + 1000 + 100 * sizeof(std::string) + sizeof(ManifestDiff));
  EXPECT_NE(diffs.Get("m", *manifests[0], *manifests[1]), first);  // let go, made again
  diffs.Clear();
  EXPECT_EQ(diffs.bytes(), 0u);
  EXPECT_EQ(first->changed.size(), 100u);  // a holder keeps its diff
}

TEST_F(WatchCursorTest, AWatcherThatMissedVersionsGetsOneStepFromWhatItHolds) {
  const std::string path = models_ + "/m.safetensors";
  Publish(path, {F32("a", 1), F32("b", 2), F32("c", 3)});
  registry_.Rescan();
  const std::string v1 = registry_.Get("m")->version();
  Publish(path, {F32("a", 10), F32("b", 2), F32("c", 3)});
  registry_.Rescan();
  Publish(path, {F32("a", 10), F32("b", 20), F32("c", 3)});
  registry_.Rescan();
  WatchCursor cursor(&registry_, {.prefix = "m"}, {{"m", v1}, {"other", "x"}});
  cursor.Start();
  std::vector<CheckpointUpdate> updates = Drain(cursor);
  ASSERT_EQ(updates.size(), 2u);  // "other" is out of scope
  ASSERT_NE(updates[0].diff, nullptr);
  EXPECT_EQ(updates[0].old_version, v1);
  EXPECT_THAT(updates[0].diff->changed, ElementsAre("a", "b"));
  EXPECT_EQ(updates[1].kind, Kind::kSynced);
}

TEST_F(WatchCursorTest, AVersionNoLongerKeptIsAFullUpdateThatSaysWhy) {
  const std::string path = models_ + "/m.safetensors";
  Publish(path, {F32("a", 0)});
  registry_.Rescan();
  const std::string v1 = registry_.Get("m")->version();
  for (int i = 1; i <= 3; ++i) {  // three more versions: kept_versions is 3
    Publish(path, {F32("a", static_cast<float>(i))});
    registry_.Rescan();
  }
  EXPECT_EQ(registry_.FindManifest("m", v1), nullptr);
  EXPECT_NE(registry_.FindManifest("m", registry_.Get("m")->version()), nullptr);
  WatchCursor cursor(&registry_, {.name = "m"}, {{"m", v1}});
  cursor.Start();
  std::vector<CheckpointUpdate> updates = Drain(cursor);
  ASSERT_EQ(updates.size(), 2u);
  EXPECT_EQ(updates[0].kind, Kind::kReplaced);
  EXPECT_EQ(updates[0].diff, nullptr);
  EXPECT_THAT(updates[0].full_reason, HasSubstr(v1));
  // A version no daemon issued reads the same way.
  WatchCursor forged(&registry_, {.name = "m"}, {{"m", "not-a-version"}});
  forged.Start();
  std::optional<CheckpointUpdate> update = forged.Next();
  ASSERT_TRUE(update.has_value());
  EXPECT_THAT(update->full_reason, HasSubstr("not-a-version"));
}

TEST_F(WatchCursorTest, ARemovedCheckpointIsReportedOnceAndForgotten) {
  Publish(models_ + "/m.safetensors", {F32("a", 0)});
  registry_.Rescan();
  WatchCursor cursor(&registry_, {}, {});
  cursor.Start();
  EXPECT_EQ(Drain(cursor).size(), 2u);
  std::filesystem::remove(models_ + "/m.safetensors");
  registry_.Rescan();
  cursor.MarkChanged("m");
  cursor.MarkChanged("m");  // coalesced
  std::vector<CheckpointUpdate> updates = Drain(cursor);
  ASSERT_EQ(updates.size(), 1u);
  EXPECT_EQ(updates[0].kind, Kind::kRemoved);
  EXPECT_EQ(registry_.FindManifest("m", updates[0].old_version), nullptr);
  cursor.MarkChanged("m");
  EXPECT_FALSE(cursor.Next().has_value());
}

TEST_F(WatchCursorTest, ListenersHearEveryPublishedChangeOutsideTheRegistryLock) {
  std::vector<std::string> heard;
  const uint64_t id = registry_.AddListener([&](const std::string& name) {
    heard.push_back(name);
    (void)registry_.Get(name);  // calling back in must not deadlock
    (void)registry_.List();
  });
  Publish(models_ + "/m.safetensors", {F32("a", 0)});
  registry_.Rescan();
  Publish(models_ + "/m.safetensors", {F32("a", 1)});
  registry_.Rescan();
  ASSERT_OK(registry_.Unload("m"));
  registry_.RemoveListener(id);
  registry_.Rescan();  // back, unheard
  EXPECT_THAT(heard, ElementsAre("m", "m", "m"));
}

TEST(RegistryManifestTest, KeptManifestsStayWithinTheirByteBound) {
  const std::string models = testing::MakeScratchDir("kept");
  CheckpointRegistry registry({.models_dir = models,
                               .tensor_digests = true,
                               .kept_versions = 100,
                               .kept_manifest_bytes = 1});  // only the current ones
  std::vector<std::string> versions;
  for (int i = 0; i < 4; ++i) {
    Publish(models + "/m.safetensors", {F32("a", static_cast<float>(i))});
    Publish(models + "/n.safetensors", {F32("a", static_cast<float>(i))});
    registry.Rescan();
    versions.push_back(registry.Get("m")->version());
  }
  EXPECT_EQ(registry.FindManifest("m", versions[0]), nullptr);
  EXPECT_EQ(registry.FindManifest("m", versions[2]), nullptr);
  EXPECT_NE(registry.FindManifest("m", versions[3]), nullptr);
  EXPECT_NE(registry.FindManifest("n", registry.Get("n")->version()), nullptr);
}

TEST(RegistryManifestTest, WithoutDigestsNoManifestIsComputed) {
  const std::string models = testing::MakeScratchDir("nodigest");
  Publish(models + "/m.safetensors", {F32("a", 0)});
  CheckpointRegistry registry({.models_dir = models});
  registry.Rescan();
  EXPECT_EQ(registry.Get("m")->manifest(), nullptr);
  WatchCursor cursor(&registry, {}, {{"m", "old"}});
  cursor.Start();
  std::optional<CheckpointUpdate> update = cursor.Next();
  ASSERT_TRUE(update.has_value());
  EXPECT_THAT(update->full_reason, HasSubstr("--tensor-digests"));
}

}  // namespace
}  // namespace weightstore

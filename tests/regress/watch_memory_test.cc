// What the daemon keeps for watchers (each step's event and diff) is given
// back, and the heap trimmed, once the last watch ends: it stayed after they
// left.
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "tests/util/daemon.h"
#include "tests/util/metrics.h"
#include "tests/util/serving.h"
#include "tests/util/test_env.h"
#include "tests/util/wait.h"

namespace weightstore {
namespace {

namespace pb = ::weightstore::v1;

TEST(WatchMemoryTest, WhatWatchesKeepIsGivenBackOnceTheLastWatchEnds) {
  const std::string models = testing::MakeScratchDir("models");
  auto checkpoint = [](int seed) {
    std::vector<SharedTensor> tensors;
    for (int i = 0; i < 2000; ++i) {
      tensors.push_back({{absl::StrCat("model.layers.", i, ".weight"), DType::kF32, {1}},
                         SharedBytes::Copy(std::string(4, static_cast<char>(i % 2 == 0 ? 1 : seed)))});
    }
    return *SerializeCheckpoint(kSafeTensorsFormat, tensors, {});
  };
  testing::WriteFileOrDie(models + "/m.safetensors", checkpoint(1));
  testing::Daemon daemon(models, {"--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto gauge = [&](absl::string_view name) { return testing::MetricValue(daemon.metrics_port(), name); };
  auto stub = testing::NewStub(daemon.address());
  constexpr int kWatchers = 4;
  std::vector<grpc::ClientContext> contexts(kWatchers);
  std::vector<std::unique_ptr<grpc::ClientReader<pb::CheckpointEvent>>> watches;
  pb::WatchCheckpointsRequest request;
  request.set_name("m");
  for (grpc::ClientContext& ctx : contexts) {
    watches.push_back(stub->WatchCheckpoints(&ctx, request));
    pb::CheckpointEvent event;
    do {
      ASSERT_TRUE(watches.back()->Read(&event));
    } while (event.kind() != pb::CheckpointEvent::SYNCED);
  }
  // A replacement: half the tensors change, and every watcher reads its event.
  testing::WriteFileOrDie(models + "/m.safetensors.tmp", checkpoint(7));
  std::filesystem::rename(models + "/m.safetensors.tmp", models + "/m.safetensors");
  grpc::ClientContext rescan_ctx;
  pb::RescanResponse rescanned;
  ASSERT_TRUE(stub->Rescan(&rescan_ctx, pb::RescanRequest(), &rescanned).ok());
  for (auto& watch : watches) {
    pb::CheckpointEvent event;
    ASSERT_TRUE(watch->Read(&event));
    EXPECT_EQ(event.kind(), pb::CheckpointEvent::REPLACED);
    EXPECT_TRUE(event.delta());
    EXPECT_EQ(event.changed_tensors().size(), 1000);
  }
  EXPECT_GT(gauge("weightstore_watch_cached_bytes"), 1000 * 20);
  EXPECT_EQ(gauge("weightstore_watches_active"), kWatchers);
  for (grpc::ClientContext& ctx : contexts) ctx.TryCancel();
  for (auto& watch : watches) (void)watch->Finish();
  // The daemon sees them go and lets go of what it kept.
  EXPECT_TRUE(testing::WaitUntil([&] {
    return gauge("weightstore_watches_active") == 0 && gauge("weightstore_watch_cached_bytes") == 0;
  })) << "active: "
      << gauge("weightstore_watches_active") << ", cached: " << gauge("weightstore_watch_cached_bytes");
}

}  // namespace
}  // namespace weightstore

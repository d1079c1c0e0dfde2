// Delta updates (client::UpdateTensors) keep a held tensor only when the new
// request selects it the same way: held tensors of another selection (here
// another shard rank, with the same names, dtypes and shapes) were kept as
// unchanged.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>

#include "client/store.h"
#include "client/updates.h"
#include "tests/util/checkpoints.h"
#include "tests/util/serving.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

TEST(DeltaUpdatesTest, UpdateTensorsRefetchesWhatAnotherShardRankSelects) {
  const std::string models = testing::MakeScratchDir("models");
  testing::WriteFileOrDie(models + "/m.safetensors", testing::OneTensorFile({1, 2, 3, 4}));
  server::ServerOptions options;
  options.registry.tensor_digests = true;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<server::WeightStoreServer> daemon,
                       testing::StartInProcessServer(models, options));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Store> store, client::ConnectRemoteStore(testing::AddressOf(*daemon)));
  auto rank = [](uint32_t r) {
    client::Query q;
    q.selection.shard = {.rank = r, .world_size = 2, .rules = {{"w", ShardSplit{.dim = 0}}}};
    return q;
  };
  client::HeldTensors held;
  ASSERT_OK(client::UpdateTensors(*store, "m", rank(0), &held).status());
  ASSERT_OK_AND_ASSIGN(client::UpdateResult same, client::UpdateTensors(*store, "m", rank(0), &held));
  EXPECT_TRUE(same.delta) << same.full_reason;
  EXPECT_EQ(same.fetched_bytes, 0u);
  ASSERT_OK_AND_ASSIGN(client::UpdateResult other, client::UpdateTensors(*store, "m", rank(1), &held));
  EXPECT_FALSE(other.delta);
  EXPECT_THAT(other.full_reason, ::testing::HasSubstr("selected otherwise"));
  ASSERT_EQ(held.tensors.size(), 1u);
  float second_half[2];
  std::memcpy(second_half, held.tensors[0].bytes.view().data(), 8);
  EXPECT_EQ(second_half[0], 3);
  EXPECT_EQ(second_half[1], 4);
}

}  // namespace
}  // namespace weightstore

// Quantized checkpoints (narrow float dtypes, scales that follow their
// weights' shards): a gathered F6 slice is served over gRPC as locally, and
// scale following refuses, naming the tensors, what it could only guess.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "client/store.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "tests/util/serving.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

// A tensor of `dtype` and `shape` whose bytes count 0, 1, 2, ... (mod 251).
SharedTensor Counting(const std::string& name, DType dtype, std::vector<uint64_t> shape) {
  TensorSpec spec{name, dtype, std::move(shape)};
  std::string bytes(spec.byte_size(), '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i % 251);
  return {spec, SharedBytes::Copy(bytes)};
}

// An F6 tensor is stored in units of 3 bytes, and a gRPC chunk is a multiple
// of 64: a gathered slice larger than a chunk was refused at its first chunk
// ("not a range of F6_E2M3 elements"), where the socket and files served it.
TEST(QuantizedShardsTest, AGatheredF6SliceLargerThanAChunkIsServedOverGrpcAsLocally) {
  const std::string models = testing::MakeScratchDir("models");
  testing::WriteFileOrDie(models + "/f6.safetensors",
                          *SerializeCheckpoint(kSafeTensorsFormat, {Counting("w", DType::kF6E2M3, {4, 1 << 20})}, {}));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<server::WeightStoreServer> daemon, testing::StartInProcessServer(models));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Store> local, client::OpenLocalStore(models));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Store> remote, client::ConnectRemoteStore(testing::AddressOf(*daemon)));
  for (uint32_t rank : {0u, 1u}) {
    client::Query query;  // columns: every row's half, 1.5 MiB in all, gathered
    query.selection.shard = {rank, 2, {{"^w$", ShardSplit{1}}}};
    ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> want, local->FetchAll("f6", query));
    ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> got, remote->FetchAll("f6", query));
    ASSERT_EQ(got.size(), 1u);
    EXPECT_EQ(got[0].spec, want[0].spec);
    EXPECT_EQ(got[0].bytes.size(), 3u << 19);
    EXPECT_TRUE(got[0].bytes.view() == want[0].bytes.view()) << "rank " << rank;
  }
}

// Scale following: what a review found ambiguous or silently ignored is
// refused naming the tensors.
TEST(QuantizedShardsTest, ScaleFollowingRefusesWhatItCouldOnlyGuess) {
  const std::string models = testing::MakeScratchDir("models");
  testing::WriteFileOrDie(
      models + "/q.safetensors",
      *SerializeCheckpoint(
          kSafeTensorsFormat,
          {Counting("c.weight", DType::kF8E4M3, {8, 4}), Counting("c.weight_scale", DType::kF32, {8, 1}),
           Counting("c.weight_scale2", DType::kF32, {8, 1}), Counting("qkv.weight", DType::kF8E4M3, {12, 4}),
           Counting("qkv.weight_scale_inv", DType::kF32, {2, 1}),
           Counting("e.experts.18446744073709551615.w", DType::kU8, {2})},
          {}));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Store> store, client::OpenLocalStore(models));
  auto refused = [&](ShardSpec shard, std::vector<NamedSlice> slices = {}) {
    client::Query query;
    query.selection.shard = std::move(shard);
    query.selection.slices = std::move(slices);
    return store->ListTensors("q", query).status();
  };
  // A scale of a scale: the cut depended on the order of the file.
  EXPECT_THAT(refused({1, 2, {{"^c\\.weight$", ShardSplit{0}}}, {{"weight_scale2$", "weight_scale", {}}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("itself a scale")));
  // A cycle: both were served whole, the weight's shard rule ignored.
  EXPECT_THAT(refused({1, 2, {{"^c\\.weight$", ShardSplit{0}}}, {{"^c\\.weight$", "c.weight_scale", {}}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("itself a scale")));
  // An explicit slice of a followed scale was ignored.
  EXPECT_THAT(refused({1, 2, {{"^c\\.weight$", ShardSplit{0}}}}, {{"c.weight_scale", {{0, 1}}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has an explicit slice")));
  // A block of 8 rows spanning two fused parts of rank 0's [0:3] + [6:9].
  EXPECT_THAT(refused({0, 2, {{"^qkv\\.weight$", ShardSplit{0, 2}}}, {{"weight_scale_inv$", "weight", {8, 4}}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("spans two pieces")));
  // An expert index of 2^64 - 1 was dropped on every rank.
  EXPECT_THAT(refused({0, 2, {}, {}, true, {"experts\\.(\\d+)\\."}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("out of range")));
}

}  // namespace
}  // namespace weightstore

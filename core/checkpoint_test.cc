#include "core/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>

#include "tests/util/status_matchers.h"

namespace weightstore {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

CheckpointEntry Entry(const std::string& name, std::vector<uint64_t> shape, std::shared_ptr<const LazyStorage> storage,
                      uint64_t offset = 0, std::vector<uint64_t> strides = {}) {
  CheckpointEntry e;
  e.spec = {name, DType::kF32, std::move(shape)};
  e.layout.storage = std::move(storage);
  e.layout.offset = offset;
  e.layout.strides = std::move(strides);
  return e;
}

TEST(CheckpointTest, ReadOfAContiguousTensorPointsIntoItsStorage) {
  SharedBytes bytes = SharedBytes::Copy(std::string(32, 'x'));
  auto storage = LazyStorage::Ready(bytes);
  ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Create(Format::kSafeTensors, "mem", {}, {Entry("w", {2, 2}, storage, 8)}));
  ASSERT_OK_AND_ASSIGN(SharedTensor t, c->Read("w"));
  EXPECT_EQ(t.bytes.data(), bytes.data() + 8);
  EXPECT_EQ(t.bytes.size(), 16u);
}

TEST(CheckpointTest, TreatsSizeOneDimensionStridesAsContiguous) {
  // conv weight [8, 1, 3, 3] with stride (9, 9, 3, 1): contiguous once size-1 dims are ignored.
  auto storage = LazyStorage::Ready(SharedBytes::Copy(std::string(8 * 9 * 4, 'x')));
  ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Create(Format::kPyTorch, "mem", {},
                                                  {Entry("w", {8, 1, 3, 3}, storage, 0, {9, 9, 3, 1})}));
  EXPECT_TRUE(Checkpoint::IsZeroCopy(c->entries()[0]));
}

TEST(CheckpointTest, RejectsDuplicateNamesAndTensorsOutsideTheirStorage) {
  auto storage = LazyStorage::Ready(SharedBytes::Copy(std::string(16, 'x')));
  EXPECT_THAT(Checkpoint::Create(Format::kSafeTensors, "f", {}, {Entry("a", {1}, storage), Entry("a", {1}, storage)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("two tensors named 'a'")));
  EXPECT_THAT(Checkpoint::Create(Format::kSafeTensors, "f", {}, {Entry("a", {4}, storage, 4)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor 'a' in 'f'")));
  EXPECT_THAT(Checkpoint::Create(Format::kSafeTensors, "f", {}, {Entry("a", {2, 2}, storage, 0, {4, 1})}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("past its storage")));
  EXPECT_THAT(Checkpoint::Create(Format::kSafeTensors, "f", {}, {Entry("\xff", {1}, storage)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not UTF-8")));
}

TEST(CheckpointTest, ReadReportsTheTensorWhoseStorageFails) {
  auto storage = LazyStorage::Deferred(4, [] { return absl::StatusOr<SharedBytes>(absl::DataLossError("disk")); });
  ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Create(Format::kPyTorch, "f", {}, {Entry("w", {1}, storage)}));
  EXPECT_THAT(c->Read("w"), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tensor 'w'")));
  EXPECT_THAT(c->Read("nope"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("tensor 'nope'")));
}

TEST(GatherStridedTest, PermutesAThreeDimensionalTensor) {
  // arange(24) as (2, 3, 4), permuted to (4, 2, 3): strides (1, 12, 4).
  std::vector<uint32_t> src(24);
  std::iota(src.begin(), src.end(), 0);
  std::vector<uint64_t> shape = {4, 2, 3}, strides = {1, 12, 4};
  std::vector<uint32_t> out(24);
  GatherStrided(reinterpret_cast<const std::byte*>(src.data()), 4, shape, strides,
                reinterpret_cast<std::byte*>(out.data()));
  std::vector<uint32_t> expected;
  for (uint64_t i = 0; i < 4; ++i)
    for (uint64_t j = 0; j < 2; ++j)
      for (uint64_t k = 0; k < 3; ++k) expected.push_back(static_cast<uint32_t>(i * 1 + j * 12 + k * 4));
  EXPECT_EQ(out, expected);
}

}  // namespace
}  // namespace weightstore

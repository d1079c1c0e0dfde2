#include "core/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "core/formats/pytorch.h"
#include "core/formats/safetensors.h"
#include "core/host_buffer.h"
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
  ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Create(kSafeTensorsFormat, "mem", {}, {Entry("w", {2, 2}, storage, 8)}));
  ASSERT_OK_AND_ASSIGN(SharedTensor t, c->Read("w"));
  EXPECT_EQ(t.bytes.data(), bytes.data() + 8);
  EXPECT_EQ(t.bytes.size(), 16u);
}

TEST(CheckpointTest, TreatsSizeOneDimensionStridesAsContiguous) {
  // conv weight [8, 1, 3, 3] with stride (9, 9, 3, 1): contiguous once size-1 dims are ignored.
  auto storage = LazyStorage::Ready(SharedBytes::Copy(std::string(8 * 9 * 4, 'x')));
  ASSERT_OK_AND_ASSIGN(
      auto c, Checkpoint::Create(kPyTorchFormat, "mem", {}, {Entry("w", {8, 1, 3, 3}, storage, 0, {9, 9, 3, 1})}));
  EXPECT_TRUE(Checkpoint::IsZeroCopy(c->entries()[0]));
}

TEST(CheckpointTest, RejectsDuplicateNamesAndTensorsOutsideTheirStorage) {
  auto storage = LazyStorage::Ready(SharedBytes::Copy(std::string(16, 'x')));
  EXPECT_THAT(Checkpoint::Create(kSafeTensorsFormat, "f", {}, {Entry("a", {1}, storage), Entry("a", {1}, storage)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("two tensors named 'a'")));
  EXPECT_THAT(Checkpoint::Create(kSafeTensorsFormat, "f", {}, {Entry("a", {4}, storage, 4)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor 'a' in 'f'")));
  EXPECT_THAT(Checkpoint::Create(kSafeTensorsFormat, "f", {}, {Entry("a", {2, 2}, storage, 0, {4, 1})}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("past its storage")));
  EXPECT_THAT(Checkpoint::Create(kSafeTensorsFormat, "f", {}, {Entry("\xff", {1}, storage)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not UTF-8")));
}

TEST(CheckpointTest, ReadReportsTheTensorWhoseStorageFails) {
  auto storage = LazyStorage::Deferred(4, [] { return absl::StatusOr<SharedBytes>(absl::DataLossError("disk")); });
  ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Create(kPyTorchFormat, "f", {}, {Entry("w", {1}, storage)}));
  EXPECT_THAT(c->Read("w"), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tensor 'w'")));
  EXPECT_THAT(c->Read("nope"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("tensor 'nope'")));
}

TEST(CheckpointTest, ReadIntoAndReadCopyFillOwnedMemory) {
  std::string data(12 * 4, '\0');
  for (int i = 0; i < 12; ++i) data[i * 4] = static_cast<char>(i);
  SharedBytes bytes = SharedBytes::Copy(data);
  auto storage = LazyStorage::Ready(bytes);
  ASSERT_OK_AND_ASSIGN(auto c,
                       Checkpoint::Create(kPyTorchFormat, "mem", {},
                                          {Entry("flat", {12}, storage), Entry("t", {4, 3}, storage, 0, {1, 4})}));
  std::vector<std::byte> out(48);
  ASSERT_OK(c->ReadInto(*c->Find("flat"), out));
  EXPECT_EQ(std::memcmp(out.data(), data.data(), 48), 0);
  ASSERT_OK(c->ReadInto(*c->Find("t"), out));
  EXPECT_EQ(static_cast<int>(out[4]), 4);  // t[0][1] = storage[4]
  EXPECT_THAT(c->ReadInto(*c->Find("t"), std::span<std::byte>(out).first(8)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("destination holds 8")));
  ASSERT_OK_AND_ASSIGN(SharedTensor copy, c->ReadCopy(*c->Find("flat")));
  EXPECT_NE(copy.bytes.data(), bytes.data());
  EXPECT_EQ(copy.bytes.view(), data);
}

TEST(HostBufferTest, LargeBuffersAreHugePageAlignedAndFreezeWithoutCopying) {
  ASSERT_OK_AND_ASSIGN(HostBuffer big, HostBuffer::Allocate((size_t{5} << 20) + 3));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big.data()) % (2 << 20), 0u);
  big.data()[big.size() - 1] = std::byte{42};
  std::byte* p = big.data();
  SharedBytes frozen = std::move(big).Freeze();
  EXPECT_EQ(frozen.data(), p);
  EXPECT_EQ(frozen.size(), (size_t{5} << 20) + 3);
  EXPECT_EQ(static_cast<int>(frozen.data()[frozen.size() - 1]), 42);
  ASSERT_OK_AND_ASSIGN(HostBuffer small, HostBuffer::Allocate(10));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small.data()) % 64, 0u);
}

// A size a peer sent (a tensor's listed bytes) near 2^64 would wrap the
// rounding to huge pages into a small mapping under a huge span.
TEST(HostBufferTest, ASizeNoAddressSpaceHoldsIsRefusedNotWrapped) {
  for (size_t size : {~size_t{0} - 3, ~size_t{0} - (size_t{1} << 20), (size_t{1} << 56) + 1}) {
    EXPECT_THAT(HostBuffer::Allocate(size), StatusIs(absl::StatusCode::kResourceExhausted)) << size;
  }
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

#include "core/checkpoint.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <numeric>

#include "core/formats/checkpoint_writer.h"
#include "core/formats/pytorch.h"
#include "core/formats/safetensors.h"
#include "core/host_buffer.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

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

SharedTensor Filled(const std::string& name, float value) {
  const std::vector<float> values(16, value);
  return {{name, DType::kF32, {16}}, SharedBytes::Copy({reinterpret_cast<const char*>(values.data()), 64})};
}

// A new shard is read from its descriptor (not from its path, which still
// holds the old one), a kept shard is the mapping given, and the caller learns
// which descriptors the checkpoint named.
TEST(OpenCheckpointWithTest, ReadsNewFilesFromTheirDescriptorsAndKeptOnesFromTheirMappings) {
  const std::string dir = testing::MakeScratchDir("open-with");
  const auto shard = [&](const std::string& file, const std::string& tensor, float value) {
    testing::WriteFileOrDie(dir + "/" + file, *SerializeCheckpoint(kSafeTensorsFormat, {Filled(tensor, value)}, {}));
  };
  shard("s1.safetensors", "a", 1);
  shard("s2.safetensors", "b", 2);
  shard("s2.new", "b", 20);
  shard("unnamed.new", "z", 9);
  const std::string index = dir + "/model.safetensors.index.json";
  testing::WriteFileOrDie(index, R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})");
  ASSERT_OK_AND_ASSIGN(auto base, Checkpoint::Open(index));

  const int fresh = ::open((dir + "/s2.new").c_str(), O_RDONLY | O_CLOEXEC);
  const int stray = ::open((dir + "/unnamed.new").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fresh, 0);
  ASSERT_GE(stray, 0);
  FileOverrides overrides;
  overrides.descriptors[dir + "/s2.safetensors"] = fresh;
  overrides.descriptors[dir + "/unnamed.safetensors"] = stray;  // a path the index does not name
  for (const auto& f : base->files()) {
    if (f->path() == dir + "/s1.safetensors") overrides.mapped[f->path()] = f;
  }
  ASSERT_EQ(overrides.mapped.size(), 1u);
  std::vector<std::shared_ptr<const MappedFile>> from_descriptors;
  ASSERT_OK_AND_ASSIGN(auto opened, OpenCheckpointWith(index, {}, overrides, &from_descriptors));
  EXPECT_EQ(::close(fresh), 0) << "the caller keeps its descriptors";
  EXPECT_EQ(::close(stray), 0);

  ASSERT_EQ(from_descriptors.size(), 1u) << "only the descriptors the checkpoint named are opened";
  EXPECT_EQ(from_descriptors[0]->path(), dir + "/s2.safetensors");
  ASSERT_OK_AND_ASSIGN(SharedTensor b, opened->Read(*opened->Find("b")));
  EXPECT_EQ(reinterpret_cast<const float*>(b.bytes.view().data())[0], 20.0f) << "the new shard, not the path's";
  bool shares_kept = false;
  for (const auto& f : opened->files()) shares_kept |= f == overrides.mapped.begin()->second;
  EXPECT_TRUE(shares_kept) << "the kept shard is the base's own mapping";

  // A descriptor that cannot be duplicated is an error naming the file.
  overrides.descriptors[dir + "/s2.safetensors"] = -1;
  const absl::Status bad = OpenCheckpointWith(index, {}, overrides).status();
  EXPECT_FALSE(bad.ok());
  EXPECT_THAT(bad.message(), HasSubstr("s2.safetensors"));
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

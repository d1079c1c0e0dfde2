// CheckpointWriter's clone source: a new version that keeps most of its base's
// bytes is the base's file copied (shared extents, or a copy in the kernel)
// with only the other tensors written over it, and is the very bytes a whole
// write gives. Anything the plan does not lay out as the source is written
// whole.
#include "core/formats/checkpoint_writer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/formats/burnpack.h"
#include "core/formats/safetensors.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using CloneResult = AtomicFile::CloneResult;

SharedTensor Filled(const std::string& name, size_t n, float value) {
  const std::vector<float> values(n, value);
  return {{name, DType::kF32, {n}},
          SharedBytes::Copy({reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float)})};
}

BytesProducer Of(SharedBytes bytes) {
  return [bytes]() -> absl::StatusOr<SharedBytes> { return bytes; };
}

class CloneSourceTest : public ::testing::TestWithParam<const FormatSpec*> {
 protected:
  // A base of three tensors (a of 1 MiB, b of 64 KiB, c small), mapped, and
  // each tensor's view of it.
  void SetUp() override {
    dir_ = testing::MakeScratchDir("clone-source");
    base_tensors_ = {Filled("a", 1 << 18, 1), Filled("b", 1 << 14, 2), Filled("c", 100, 3)};
    ASSERT_OK_AND_ASSIGN(std::string bytes, SerializeCheckpoint(format(), base_tensors_, {{"k", "v"}}));
    testing::WriteFileOrDie(dir_ + "/base", bytes);
    ASSERT_OK_AND_ASSIGN(base_, MappedFile::Open(dir_ + "/base"));
    ASSERT_OK_AND_ASSIGN(std::shared_ptr<const Checkpoint> opened, format().open(base_, {}));
    for (const SharedTensor& t : base_tensors_) {
      ASSERT_OK_AND_ASSIGN(SharedTensor read, opened->Read(t.spec.name));
      uint64_t at = 0;
      ASSERT_TRUE(base_->Contains(read.bytes, &at)) << t.spec.name;
      views_.push_back(read.bytes);
    }
  }
  const FormatSpec& format() const { return *GetParam(); }

  // Writes `tensors` with the base as the clone source, those marked in
  // `unchanged` given as `views`; returns how, and checks the file is what a
  // whole write of the same tensors gives.
  CloneResult WriteAndCheck(const std::vector<SharedTensor>& tensors, const std::vector<bool>& unchanged,
                            const Metadata& metadata, const std::vector<SharedBytes>& views) {
    const std::string out = dir_ + "/out" + std::to_string(++written_);
    auto writer = *CheckpointWriter::Create(out, format(), {.keep_order = true});
    writer->SetMetadata(metadata);
    writer->SetCloneSource(base_);
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (unchanged[i]) {
        EXPECT_OK(writer->AddUnchanged(tensors[i].spec, views[i]));
      } else {
        EXPECT_OK(writer->Add(tensors[i].spec, Of(tensors[i].bytes)));
      }
    }
    EXPECT_OK(writer->Finish());
    absl::StatusOr<std::string> whole = SerializeCheckpoint(format(), tensors, metadata);
    EXPECT_OK(whole.status());
    EXPECT_TRUE(testing::ReadFileOrEmpty(out) == *whole) << "the same bytes as a whole write";
    return writer->clone_result();
  }

  std::string dir_;
  std::vector<SharedTensor> base_tensors_;
  std::shared_ptr<const MappedFile> base_;
  std::vector<SharedBytes> views_;  // of each base tensor, in the mapped base
  int written_ = 0;
};

TEST_P(CloneSourceTest, ANewVersionKeepingMostOfItsBaseIsItsBaseCopiedWithTheChangedTensorsWrittenOver) {
  const std::vector<SharedTensor> next = {base_tensors_[0], Filled("b", 1 << 14, 20), base_tensors_[2]};
  const CloneResult how = WriteAndCheck(next, {true, false, true}, {{"k", "v"}}, views_);
  // A copy in the kernel on ext4 and tmpfs (16 times more kept than written),
  // shared extents on XFS and btrfs.
  EXPECT_NE(how, CloneResult::kUnsupported);
}

TEST_P(CloneSourceTest, WhatThePlanDoesNotLayOutAsTheSourceIsWrittenWhole) {
  const std::vector<SharedTensor> next = {base_tensors_[0], Filled("b", 1 << 14, 20), base_tensors_[2]};
  // Other metadata: another header.
  EXPECT_EQ(WriteAndCheck(next, {true, false, true}, {{"k", "w"}}, views_), CloneResult::kUnsupported);
  // Kept bytes given as views of another file: nothing lies in the source.
  std::vector<SharedBytes> copies;
  for (const SharedBytes& v : views_) copies.push_back(SharedBytes::Copy(v.view()));
  EXPECT_EQ(WriteAndCheck(next, {true, false, true}, {{"k", "v"}}, copies), CloneResult::kUnsupported);
  // A view of the source that is not where the plan puts its tensor: the
  // bytes of `a` given for `c`, which the new version holds.
  std::vector<SharedTensor> moved = next;
  moved[2] = {base_tensors_[2].spec, views_[0].Subspan(0, base_tensors_[2].spec.byte_size())};
  std::vector<SharedBytes> moved_views = views_;
  moved_views[2] = moved[2].bytes;
  EXPECT_EQ(WriteAndCheck(moved, {true, false, true}, {{"k", "v"}}, moved_views), CloneResult::kUnsupported);
  // Most bytes changed: a copy would be written over almost whole.
  const std::vector<SharedTensor> most = {Filled("a", 1 << 18, 10), base_tensors_[1], base_tensors_[2]};
  EXPECT_EQ(WriteAndCheck(most, {false, true, true}, {{"k", "v"}}, views_), CloneResult::kUnsupported);
  // A tensor of another size moves the ones after it.
  const std::vector<SharedTensor> resized = {base_tensors_[0], Filled("b", (1 << 14) - 1, 2), base_tensors_[2]};
  EXPECT_EQ(WriteAndCheck(resized, {true, false, true}, {{"k", "v"}}, views_), CloneResult::kUnsupported);
  // Nothing unchanged: nothing to copy.
  EXPECT_EQ(WriteAndCheck(base_tensors_, {false, false, false}, {{"k", "v"}}, views_), CloneResult::kUnsupported);
}

INSTANTIATE_TEST_SUITE_P(Formats, CloneSourceTest, ::testing::Values(&kSafeTensorsFormat, &kBurnpackFormat),
                         [](const ::testing::TestParamInfo<const FormatSpec*>& info) {
                           return std::string(info.param->name);
                         });

}  // namespace
}  // namespace weightstore

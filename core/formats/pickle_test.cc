#include "core/formats/pickle.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/util/pickle_builder.h"
#include "tests/util/status_matchers.h"

namespace weightstore {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::PickleBuilder;
using ::weightstore::testing::StatusIs;
using Kind = PickleValue::Kind;

absl::StatusOr<std::unique_ptr<PickleResult>> Unpickled(const std::string& bytes) {
  return Unpickle(bytes, "'test.pkl'");
}

TEST(PickleTest, BuildsAProtocol2DictOfTensors) {
  PickleBuilder p;
  p.Proto(2).EmptyDict().Mark().Str("w").Tensor("FloatStorage", "0", 6, 0, {2, 3}, {3, 1}).SetItems().Stop();
  ASSERT_OK_AND_ASSIGN(auto result, Unpickled(p.str()));
  const PickleValue* root = result->root();
  ASSERT_EQ(root->kind, Kind::kDict);
  ASSERT_EQ(root->dict.size(), 1u);
  const PickleValue* t = root->dict[0].second;
  ASSERT_EQ(t->kind, Kind::kTensor);
  EXPECT_THAT(t->tensor.shape, ::testing::ElementsAre(2, 3));
  EXPECT_THAT(t->tensor.strides, ::testing::ElementsAre(3, 1));
  EXPECT_EQ(t->tensor.storage->storage.dtype, DType::kF32);
  EXPECT_EQ(t->tensor.storage->storage.numel, 6u);
}

TEST(PickleTest, RefusesOsSystemNamingTheGlobal) {
  // The classic payload: posix.system('touch pwned') via REDUCE.
  PickleBuilder p;
  p.Proto(2).Global("posix", "system").Mark().Str("touch pwned").Tuple().Reduce().Stop();
  EXPECT_THAT(Unpickled(p.str()), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("global 'posix.system' is not on the allow-list")));
}

TEST(PickleTest, RefusesStackGlobalOutsideTheAllowList) {
  const std::string p("\x80\x04\x8c\x02os\x8c\x06system\x93.", 16);
  EXPECT_THAT(Unpickled(p), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'os.system'")));
}

TEST(PickleTest, RefusesInstOfAnUnlistedClass) {
  EXPECT_THAT(Unpickled("(S'ls'\nios\nsystem\n."),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'os.system'")));
}

TEST(PickleTest, RefusesSetItemOnAList) {
  PickleBuilder p;
  p.Proto(2).EmptyList().Str("k").Str("v").SetItem().Stop();
  EXPECT_THAT(Unpickled(p.str()), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a dict")));
}

TEST(PickleTest, RefusesAppendOnADict) {
  PickleBuilder p;
  p.Proto(2).EmptyDict().Str("v").Append().Stop();
  EXPECT_THAT(Unpickled(p.str()), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a list")));
}

TEST(PickleTest, RefusesMemoIndexNeverStored) {
  PickleBuilder p;
  p.Proto(2).Get(7).Stop();
  EXPECT_THAT(Unpickled(p.str()), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("memo index 7")));
}

TEST(PickleTest, RefusesTruncationAndStackUnderflow) {
  PickleBuilder p;
  p.Proto(2).EmptyDict();
  EXPECT_THAT(Unpickled(p.str()), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("without STOP")));
  EXPECT_THAT(Unpickled("\x80\x02s."), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("underflow")));
  EXPECT_THAT(Unpickled(std::string("\x80\x02X\x00\x10\x00\x00"
                                    "abc",
                                    10)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("truncated")));
}

TEST(PickleTest, RefusesHugeDeclaredLengthsBeforeAllocating) {
  EXPECT_THAT(Unpickled(std::string("\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\x7f", 11)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds the limit")));
}

TEST(PickleTest, RefusesExtensionCodesAndOutOfBandBuffers) {
  EXPECT_THAT(Unpickled("\x80\x02\x82\x01."), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("EXT")));
  EXPECT_THAT(Unpickled("\x80\x05\x97."), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("out-of-band")));
}

TEST(PickleTest, ReadsProtocol0TextOpcodes) {
  ASSERT_OK_AND_ASSIGN(auto result, Unpickled("(dp0\nVname\np1\nI42\nsS'k'\nL7L\ns."));
  const PickleValue* root = result->root();
  ASSERT_EQ(root->kind, Kind::kDict);
  ASSERT_EQ(root->dict.size(), 2u);
  EXPECT_EQ(root->dict[0].first->s, "name");
  EXPECT_EQ(root->dict[0].second->i, 42);
  EXPECT_EQ(root->dict[1].second->i, 7);
}

TEST(PickleTest, ReadsNegativeLong1AndBinFloat) {
  // LONG1 of -2 (0xfe), BINFLOAT 1.5 big-endian.
  ASSERT_OK_AND_ASSIGN(auto result, Unpickled(std::string("\x80\x02(\x8a\x01\xfeG\x3f\xf8\0\0\0\0\0\0t.", 17)));
  ASSERT_EQ(result->root()->items.size(), 2u);
  EXPECT_EQ(result->root()->items[0]->i, -2);
  EXPECT_EQ(result->root()->items[1]->f, 1.5);
}

TEST(PickleTest, MemoRecallSharesInsteadOfCopying) {
  // A list recalled from the memo 100,000 times costs one value per recall, not a
  // copy of the list: no memo bomb.
  PickleBuilder p;
  p.Proto(2).EmptyList().Put(0).Mark();
  for (int i = 0; i < 1000; ++i) p.Str("x");
  p.Raw("e").Mark();
  for (int i = 0; i < 100000; ++i) p.Get(0);
  p.Raw("l").Raw("\x86").Stop();
  ASSERT_OK_AND_ASSIGN(auto result, Unpickled(p.str()));
  EXPECT_LT(result->values().size(), 2000u);
}

TEST(PickleTest, EnforcesTheValueLimit) {
  PickleBuilder p;
  p.Proto(2).Mark();
  for (int i = 0; i < 100; ++i) p.None();
  p.Tuple().Stop();
  PickleLimits limits;
  limits.max_values = 50;
  EXPECT_THAT(Unpickle(p.str(), "'t'", limits), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("too many")));
}

}  // namespace
}  // namespace weightstore

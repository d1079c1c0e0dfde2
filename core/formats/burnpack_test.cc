#include "core/formats/burnpack.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "core/formats/byte_reader.h"
#include "core/formats/checkpoint_writer.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

std::string MnistPath() { return testing::FixturesDir() + "/burn/burnpack/mnist.bpk"; }

// Minimal CBOR encoder for hand-made (often hostile) metadata.
struct Cbor {
  std::string out;
  Cbor& Head(int major, uint64_t v) {
    if (v < 24) {
      out.push_back(static_cast<char>(major << 5 | v));
    } else if (v <= 0xFF) {
      out.push_back(static_cast<char>(major << 5 | 24));
      out.push_back(static_cast<char>(v));
    } else {
      out.push_back(static_cast<char>(major << 5 | 27));
      for (int i = 7; i >= 0; --i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
    }
    return *this;
  }
  Cbor& U(uint64_t v) { return Head(0, v); }
  Cbor& T(const std::string& s) {
    Head(3, s.size());
    out += s;
    return *this;
  }
  Cbor& M(uint64_t n) { return Head(5, n); }
  Cbor& A(uint64_t n) { return Head(4, n); }
  Cbor& Tensor(const std::string& name, const std::string& dtype, std::vector<uint64_t> shape, uint64_t b, uint64_t e) {
    T(name).M(3).T("dtype").T(dtype).T("shape").A(shape.size());
    for (uint64_t d : shape) U(d);
    return T("data_offsets").A(2).U(b).U(e);
  }
};

std::string Pack(const std::string& cbor, const std::string& data, uint16_t version = 1) {
  std::string out = "NRUB";
  out.push_back(static_cast<char>(version & 0xFF));
  out.push_back(static_cast<char>(version >> 8));
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((cbor.size() >> (8 * i)) & 0xFF));
  out += cbor;
  out.resize((out.size() + 255) / 256 * 256, '\0');
  return out + data;
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> Parse(const std::string& bytes) {
  return ParseBurnpack(SharedBytes::Copy(bytes), "t.bpk", {});
}

TEST(BurnpackTest, ReadsBurnsMnistFixtureWithParamIdsInDataOrder) {
  ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Open(MnistPath()));
  EXPECT_EQ(c->format(), kBurnpackFormat);
  ASSERT_EQ(c->size(), 18u);
  EXPECT_EQ(c->entries()[0].spec.name, "conv1.conv.weight");  // data order, not name order
  EXPECT_EQ(c->entries()[1].spec.name, "conv1.conv.bias");
  EXPECT_EQ(c->total_bytes(), 1043240u);
  for (const auto& e : c->entries()) {
    EXPECT_EQ(e.spec.dtype, DType::kF32) << e.spec.name;
    EXPECT_TRUE(e.spec.param_id.has_value()) << e.spec.name;
  }
}

TEST(BurnpackTest, RewritesBurnsMnistFixtureByteForByte) {
  ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Open(MnistPath()));
  std::vector<SharedTensor> tensors;
  for (const auto& e : c->entries()) {
    ASSERT_OK_AND_ASSIGN(SharedTensor t, c->Read(e));
    tensors.push_back(t);
  }
  ASSERT_OK_AND_ASSIGN(std::string bytes, SerializeCheckpoint(kBurnpackFormat, tensors, c->metadata()));
  EXPECT_TRUE(bytes == testing::ReadFileOrEmpty(MnistPath())) << "our writer differs from Burn's";
}

TEST(BurnpackWriterTest, AlignsTensorsTo256AndSortsDescriptorsByName) {
  std::vector<SharedTensor> tensors = {
      {{"zeta", DType::kF32, {3}}, SharedBytes::Copy(std::string(12, '\1'))},
      {{"alpha", DType::kBool, {2}}, SharedBytes::Copy(std::string("\1\0", 2))},
  };
  ASSERT_OK_AND_ASSIGN(std::string bytes, SerializeCheckpoint(kBurnpackFormat, tensors, {{"producer", "test"}}));
  const uint64_t metadata_size = LoadU32(bytes.data() + 6);
  const uint64_t data_start = (10 + metadata_size + 255) / 256 * 256;
  EXPECT_EQ(bytes.size(), data_start + 256 + 2);  // zeta at 0, alpha at 256, no trailing padding
  EXPECT_LT(bytes.find("alpha"), bytes.find("zeta"));
  EXPECT_NE(bytes.find("\xa1\x64"
                       "Bool\x66Native"),
            std::string::npos);
  ASSERT_OK_AND_ASSIGN(auto c, Parse(bytes));
  EXPECT_EQ(c->entries()[0].spec.name, "zeta");
  EXPECT_EQ(c->metadata().at("producer"), "test");
  EXPECT_EQ(c->Find("alpha")->spec.dtype, DType::kBool);
}

TEST(BurnpackWriterTest, OutputIsDeterministic) {
  std::vector<SharedTensor> tensors = {{{"w", DType::kF16, {2, 2}}, SharedBytes::Copy(std::string(8, '\7'))}};
  Metadata metadata = {{"b", "2"}, {"a", "1"}};
  EXPECT_EQ(*SerializeCheckpoint(kBurnpackFormat, tensors, metadata),
            *SerializeCheckpoint(kBurnpackFormat, tensors, metadata));
}

TEST(BurnpackWriterTest, RefusesDTypesBurnCannotStore) {
  std::vector<SharedTensor> tensors = {{{"f8", DType::kF8E4M3, {1}}, SharedBytes::Copy("x")}};
  EXPECT_THAT(SerializeCheckpoint(kBurnpackFormat, tensors, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor 'f8'")));
}

TEST(BurnpackTest, AcceptsTheLegacyBoolTextTag) {
  ASSERT_OK_AND_ASSIGN(
      auto c, Parse(Pack(Cbor().M(1).T("tensors").M(1).Tensor("b", "Bool", {2}, 0, 2).out, std::string("\1\0", 2))));
  EXPECT_EQ(c->Find("b")->spec.dtype, DType::kBool);
}

TEST(BurnpackTest, RejectsBadMagic) {
  std::string bytes = Pack(Cbor().M(1).T("tensors").M(0).out, "");
  bytes[0] = 'X';
  EXPECT_THAT(ParseBurnpack(SharedBytes::Copy(bytes), "t.bpk", {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad magic")));
}

TEST(BurnpackTest, RejectsNewerVersions) {
  EXPECT_THAT(Parse(Pack(Cbor().M(1).T("tensors").M(0).out, "", 2)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("version 2")));
}

TEST(BurnpackTest, RejectsMetadataSizeOverTheLimitBeforeAllocating) {
  std::string bytes = std::string("NRUB\x01\x00", 6) + std::string("\xff\xff\xff\x7f", 4);
  EXPECT_THAT(Parse(bytes), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds 100 MiB")));
}

TEST(BurnpackTest, RejectsTruncatedHeaderAndMetadata) {
  EXPECT_THAT(Parse("NRUB\x01"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("10-byte")));
  std::string bytes = Pack(Cbor().M(1).T("tensors").M(0).out, "");
  EXPECT_THAT(Parse(bytes.substr(0, 12)), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("past the end")));
}

TEST(BurnpackTest, RejectsTensorsPastTheEndOfTheFile) {
  EXPECT_THAT(Parse(Pack(Cbor().M(1).T("tensors").M(1).Tensor("w", "U8", {4}, 0, 4).out, "ab")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor 'w' ends at data offset 4")));
}

TEST(BurnpackTest, RejectsByteLengthThatDisagreesWithShape) {
  EXPECT_THAT(Parse(Pack(Cbor().M(1).T("tensors").M(1).Tensor("w", "F32", {4}, 0, 4).out, "abcd")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs 16")));
}

TEST(BurnpackTest, RejectsOverlappingTensors) {
  Cbor cbor;
  cbor.M(1).T("tensors").M(2).Tensor("a", "U8", {4}, 0, 4).Tensor("b", "U8", {4}, 2, 6);
  EXPECT_THAT(Parse(Pack(cbor.out, "abcdef")), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlaps")));
}

TEST(BurnpackTest, RejectsTrailingBytes) {
  EXPECT_THAT(Parse(Pack(Cbor().M(1).T("tensors").M(1).Tensor("w", "U8", {2}, 0, 2).out, "abXYZ")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("trailing")));
}

TEST(BurnpackTest, RejectsCborNestedDeeperThan128) {
  Cbor cbor;
  cbor.M(2).T("tensors").M(0).T("junk");
  for (int i = 0; i < 200; ++i) cbor.A(1);
  cbor.U(0);
  EXPECT_THAT(Parse(Pack(cbor.out, "")), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("deeper than 128")));
}

TEST(BurnpackTest, RejectsIndefiniteLengthCbor) {
  std::string cbor = Cbor().M(1).T("tensors").out + "\xbf\xff";
  EXPECT_THAT(Parse(Pack(cbor, "")), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("indefinite")));
}

TEST(BurnpackTest, RejectsQuantizedTensorsWithAClearMessage) {
  Cbor cbor;
  cbor.M(1).T("tensors").M(1).T("q").M(3).T("dtype").M(1).T("QFloat").M(0);
  cbor.T("shape").A(1).U(1).T("data_offsets").A(2).U(0).U(1);
  EXPECT_THAT(Parse(Pack(cbor.out, "x")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 'q' quantized (QFloat) tensors are not supported")));
}

TEST(BurnpackTest, RejectsMissingTensorsMapAndMalformedCbor) {
  EXPECT_THAT(Parse(Pack(Cbor().M(0).out, "")), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'tensors'")));
  EXPECT_FALSE(Parse(Pack("\x1c", "")).ok());
  EXPECT_FALSE(Parse(Pack(Cbor().M(1).T("tensors").out, "")).ok());
}

}  // namespace
}  // namespace weightstore

#include "core/formats/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/formats/byte_reader.h"
#include "core/formats/checkpoint_writer.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

std::string File(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xFF);
  return out + header + data;
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> Parse(const std::string& bytes, OpenOptions options = {}) {
  return ParseSafeTensors(SharedBytes::Copy(bytes), "t.safetensors", options);
}

const char kTwo[] = R"({"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                    R"("a":{"dtype":"U8","shape":[],"data_offsets":[8,9]}})";

TEST(SafeTensorsTest, ReadsTensorsInHeaderOrderWithMetadata) {
  ASSERT_OK_AND_ASSIGN(auto c, Parse(File(kTwo, std::string("\0\0\x80?\0\0\0@\x07", 9))));
  ASSERT_EQ(c->size(), 2u);
  EXPECT_EQ(c->entries()[0].spec.name, "b");
  EXPECT_EQ(c->entries()[1].spec.name, "a");
  EXPECT_EQ(c->metadata().at("format"), "pt");
  ASSERT_OK_AND_ASSIGN(SharedTensor b, c->Read("b"));
  float values[2];
  std::memcpy(values, b.bytes.data(), 8);
  EXPECT_EQ(values[0], 1.0f);
  EXPECT_EQ(values[1], 2.0f);
  ASSERT_OK_AND_ASSIGN(SharedTensor a, c->Read("a"));
  EXPECT_TRUE(a.spec.shape.empty());
  EXPECT_EQ(static_cast<int>(a.bytes.data()[0]), 7);
}

TEST(SafeTensorsTest, AHeaderParsesFromTheFilesFirstBytesWithTheWholeFilesChecks) {
  const std::string file = File(kTwo, std::string("\0\0\x80?\0\0\0@\x07", 9));
  const std::string prefix = file.substr(0, 8 + std::string(kTwo).size());
  ASSERT_OK_AND_ASSIGN(SafeTensorsHeader header, ParseSafeTensorsHeader(prefix, file.size(), "t.safetensors", {}));
  EXPECT_EQ(header.data_start, prefix.size());
  ASSERT_EQ(header.tensors.size(), 2u);
  EXPECT_EQ(header.tensors[0].spec.name, "b");
  EXPECT_EQ(header.tensors[0].offset, 0u);
  EXPECT_EQ(header.tensors[1].spec.name, "a");
  EXPECT_EQ(header.tensors[1].offset, 8u);
  EXPECT_EQ(header.metadata.at("format"), "pt");
  // What the data section's size says is checked against the file's size.
  EXPECT_THAT(ParseSafeTensorsHeader(prefix, file.size() + 1, "t.safetensors", {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("trailing bytes")));
  EXPECT_THAT(ParseSafeTensorsHeader(prefix, file.size() - 1, "t.safetensors", {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("truncated")));
  // A prefix cut inside the header.
  EXPECT_THAT(ParseSafeTensorsHeader(prefix.substr(0, 20), file.size(), "t.safetensors", {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("runs past the 20 bytes read")));
  EXPECT_THAT(ParseSafeTensorsHeader("", file.size(), "t.safetensors", {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("8-byte header length")));
}

TEST(SafeTensorsTest, ReadIsZeroCopyIntoTheFileBytes) {
  SharedBytes file = SharedBytes::Copy(File(kTwo, std::string(9, 'x')));
  ASSERT_OK_AND_ASSIGN(auto c, ParseSafeTensors(file, "t.safetensors", {}));
  ASSERT_OK_AND_ASSIGN(SharedTensor b, c->Read("b"));
  EXPECT_EQ(b.bytes.data(), file.data() + 8 + std::string(kTwo).size());
}

TEST(SafeTensorsTest, AcceptsJsonWhitespaceAroundTheHeaderObject) {
  std::string header = std::string("  \n") + R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})" + "    ";
  EXPECT_OK(Parse(File(header, "z")));
}

TEST(SafeTensorsTest, AcceptsZeroSizedTensorsAndScalars) {
  EXPECT_OK(Parse(File(
      R"({"e":{"dtype":"F32","shape":[0,3],"data_offsets":[0,0]},"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]}})",
      std::string(8, '\0'))));
}

TEST(SafeTensorsTest, IgnoresUnknownTensorFields) {
  EXPECT_OK(Parse(File(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":{"x":[1,2]}}})", "z")));
}

TEST(SafeTensorsTest, RejectsFileShorterThanLengthPrefix) {
  EXPECT_THAT(Parse("abc"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("8-byte")));
}

TEST(SafeTensorsTest, RejectsHeaderOverTheSizeLimit) {
  std::string bytes(8, '\0');
  const uint64_t n = 100000001;
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  EXPECT_THAT(Parse(bytes + "{}"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds the limit")));
}

TEST(SafeTensorsTest, RejectsHeaderRunningPastTheEnd) {
  std::string bytes = File("{}", "");
  bytes[0] = 100;
  EXPECT_THAT(Parse(bytes), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("past the end")));
}

TEST(SafeTensorsTest, RejectsDuplicateTensorKeys) {
  // Same 4 bytes seen as U8[4] by one parser and F32[1] by another.
  EXPECT_THAT(
      Parse(File(
          R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
          "abcd")),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("duplicate key 'w'")));
}

TEST(SafeTensorsTest, RejectsDuplicateMetadataKeys) {
  EXPECT_THAT(Parse(File(R"({"__metadata__":{"k":"1","k":"2"}})", "")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("duplicate __metadata__ key 'k'")));
}

TEST(SafeTensorsTest, RejectsDuplicateFieldsInATensor) {
  EXPECT_THAT(Parse(File(R"({"a":{"dtype":"U8","dtype":"F32","shape":[1],"data_offsets":[0,1]}})", "z")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("duplicate field 'dtype'")));
}

TEST(SafeTensorsTest, RejectsNonStringMetadataValues) {
  EXPECT_THAT(Parse(File(R"({"__metadata__":{"k":1}})", "")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("__metadata__ value for 'k'")));
}

TEST(SafeTensorsTest, RejectsUnknownDTypeNamingTheTensor) {
  EXPECT_THAT(Parse(File(R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", "z")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor 'a' has unsupported dtype 'Q4'")));
}

TEST(SafeTensorsTest, RejectsByteSizeThatDisagreesWithShape) {
  EXPECT_THAT(Parse(File(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "abcd")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs 8")));
}

TEST(SafeTensorsTest, RejectsShapeWhoseSizeOverflows) {
  // The safetensors-cpp overflow report: this product wraps to 4 in 64 bits.
  EXPECT_THAT(
      Parse(File(R"({"a":{"dtype":"U8","shape":[4194305,4194305,211106198978564],"data_offsets":[0,4]}})", "abcd")),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows")));
}

TEST(SafeTensorsTest, RejectsGapsBetweenTensors) {
  EXPECT_THAT(Parse(File(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", "zz")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(gap)")));
}

TEST(SafeTensorsTest, RejectsOverlappingTensors) {
  EXPECT_THAT(
      Parse(File(
          R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})",
          "zzz")),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(overlap)")));
}

TEST(SafeTensorsTest, RejectsTrailingBytesSoPolyglotsCannotHide) {
  EXPECT_THAT(Parse(File(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "z<script>")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("trailing bytes")));
}

TEST(SafeTensorsTest, RejectsTruncatedData) {
  EXPECT_THAT(Parse(File(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", "zz")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("truncated")));
}

TEST(SafeTensorsTest, RejectsOffsetsThatEndBeforeTheyBegin) {
  EXPECT_THAT(Parse(File(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[1,0]}})", "z")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("end before they begin")));
}

TEST(SafeTensorsTest, RejectsNegativeDimensions) {
  EXPECT_THAT(Parse(File(R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", "z")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("non-negative integer")));
}

TEST(SafeTensorsTest, RejectsDeepNesting) {
  std::string deep = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":)" + std::string(50, '[') +
                     std::string(50, ']') + "}}";
  EXPECT_THAT(Parse(File(deep, "z")), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("too deep")));
}

TEST(SafeTensorsTest, RejectsMoreTensorsThanTheLimit) {
  OpenOptions options;
  options.max_tensors = 1;
  EXPECT_THAT(Parse(File(kTwo, std::string(9, 'x')), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more than 1 tensors")));
}

TEST(SafeTensorsTest, RejectsInvalidJsonAndNonObjects) {
  EXPECT_THAT(Parse(File("{\"a\":", "")), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("invalid JSON")));
  EXPECT_FALSE(Parse(File("[1,2]", "")).ok());
  EXPECT_FALSE(Parse(File("{\"a\":1}", "")).ok());
}

TEST(SafeTensorsTest, RejectsInvalidUtf8InNames) {
  EXPECT_FALSE(Parse(File("{\"\xff\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", "z")).ok());
}

TEST(SafeTensorsWriterTest, OrdersByDTypeDescendingThenNameAndPadsTheHeader) {
  std::vector<SharedTensor> tensors = {
      {{"z", DType::kF32, {1}}, SharedBytes::Copy(std::string(4, '\1'))},
      {{"b", DType::kI64, {}}, SharedBytes::Copy(std::string(8, '\2'))},
      {{"a", DType::kF32, {1}}, SharedBytes::Copy(std::string(4, '\3'))},
      {{"m", DType::kBool, {2}}, SharedBytes::Copy(std::string(2, '\1'))},
  };
  ASSERT_OK_AND_ASSIGN(std::string bytes, SerializeCheckpoint(kSafeTensorsFormat, tensors, {{"k", "v"}}));
  const uint64_t n = LoadU64(bytes.data());
  EXPECT_EQ(n % 8, 0u);
  std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.rfind(R"({"__metadata__":{"k":"v"},"b":{"dtype":"I64","shape":[],"data_offsets":[0,8]},)"
                         R"("a":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},)",
                         0),
            0u)
      << header;
  ASSERT_OK_AND_ASSIGN(auto c, Parse(bytes));
  std::vector<std::string> names;
  for (const auto& e : c->entries()) names.push_back(e.spec.name);
  EXPECT_THAT(names, ::testing::ElementsAre("b", "a", "z", "m"));
  ASSERT_OK_AND_ASSIGN(SharedTensor m, c->Read("m"));
  EXPECT_EQ(m.bytes.view(), std::string(2, '\1'));
}

TEST(SafeTensorsWriterTest, RewritesTheHuggingFaceFixtureByteForByte) {
  const std::string path = testing::FixturesDir() + "/burn/safetensors/multi_layer.safetensors";
  ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Open(path));
  std::vector<SharedTensor> tensors;
  for (const auto& e : c->entries()) {
    ASSERT_OK_AND_ASSIGN(SharedTensor t, c->Read(e));
    tensors.push_back(t);
  }
  ASSERT_OK_AND_ASSIGN(std::string bytes, SerializeCheckpoint(kSafeTensorsFormat, tensors, c->metadata()));
  EXPECT_TRUE(bytes == testing::ReadFileOrEmpty(path)) << "our writer differs from safetensors' own";
}

}  // namespace
}  // namespace weightstore

#include "core/select/narrow_float.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/formats/safetensors.h"
#include "core/select/dtype_cast.h"
#include "core/select/selection.h"
#include "core/select/snapshot.h"
#include "tests/util/status_matchers.h"

namespace weightstore {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

TEST(DTypeTest, EverySafeTensorsDTypeIsKnownWithItsBits) {
  const std::vector<std::pair<const char*, uint32_t>> reference = {
      {"BOOL", 8},    {"F4", 4},      {"F6_E2M3", 6}, {"F6_E3M2", 6},     {"U8", 8},          {"I8", 8},
      {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8}, {"I16", 16},
      {"U16", 16},    {"F16", 16},    {"BF16", 16},   {"I32", 32},        {"U32", 32},        {"F32", 32},
      {"C64", 64},    {"F64", 64},    {"I64", 64},    {"U64", 64}};
  ASSERT_EQ(reference.size(), std::size(kAllDTypes));
  for (const auto& [name, bits] : reference) {
    std::optional<DType> dtype = ParseDType(name);
    ASSERT_TRUE(dtype.has_value()) << name;
    EXPECT_EQ(DTypeName(*dtype), name);
    EXPECT_EQ(DTypeBits(*dtype), bits) << name;
  }
}

TEST(DTypeTest, SubByteTypesAreCountedInBitsAndMustFillWholeBytes) {
  EXPECT_EQ(DTypeBytes(DType::kF4, 4), 2u);
  EXPECT_EQ(DTypeBytes(DType::kF4, 3), std::nullopt);  // 12 bits
  EXPECT_EQ(DTypeBytes(DType::kF6E2M3, 4), 3u);
  EXPECT_EQ(DTypeBytes(DType::kF6E3M2, 8), 6u);
  EXPECT_EQ(DTypeBytes(DType::kF6E3M2, 6), std::nullopt);  // 36 bits
  EXPECT_EQ(DTypeBytes(DType::kC64, 3), 24u);
  EXPECT_EQ(DTypeBytes(DType::kC64, UINT64_MAX / 4), std::nullopt);  // no overflow either
  EXPECT_EQ((TensorSpec{"w", DType::kF4, {4096, 4096}}.byte_size()), 8u << 20);
}

// The OCP MX spec v1.0's tables (section 5.3): every F4 value, and the
// extremes of F6 and the F8 types.
TEST(NarrowFloatTest, CodesDecodeToTheValuesOfTheSpecs) {
  const double f4[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};
  for (uint32_t c = 0; c < 16; ++c) EXPECT_EQ(DecodeNarrow(DType::kF4, c), f4[c]) << c;
  EXPECT_TRUE(std::signbit(DecodeNarrow(DType::kF4, 8)));
  EXPECT_EQ(DecodeNarrow(DType::kF6E2M3, 0x1F), 7.5);    // largest
  EXPECT_EQ(DecodeNarrow(DType::kF6E2M3, 0x01), 0.125);  // smallest subnormal
  EXPECT_EQ(DecodeNarrow(DType::kF6E3M2, 0x1F), 28.0);
  EXPECT_EQ(DecodeNarrow(DType::kF6E3M2, 0x01), 0.0625);
  EXPECT_EQ(DecodeNarrow(DType::kF6E3M2, 0x3F), -28.0);
  EXPECT_EQ(DecodeNarrow(DType::kF8E8M0, 127), 1.0);
  EXPECT_EQ(DecodeNarrow(DType::kF8E8M0, 0), std::ldexp(1.0, -127));
  EXPECT_EQ(DecodeNarrow(DType::kF8E8M0, 254), std::ldexp(1.0, 127));
  EXPECT_TRUE(std::isnan(DecodeNarrow(DType::kF8E8M0, 255)));
  EXPECT_EQ(DecodeNarrow(DType::kF8E4M3, 0x7E), 448.0);
  EXPECT_TRUE(std::isnan(DecodeNarrow(DType::kF8E4M3, 0x7F)));
  EXPECT_EQ(DecodeNarrow(DType::kF8E4M3, 0x01), std::ldexp(1.0, -9));
  EXPECT_EQ(DecodeNarrow(DType::kF8E5M2, 0x7B), 57344.0);
  EXPECT_TRUE(std::isinf(DecodeNarrow(DType::kF8E5M2, 0x7C)));
  EXPECT_EQ(DecodeNarrow(DType::kF8E4M3FNUZ, 0x7F), 240.0);
  EXPECT_EQ(DecodeNarrow(DType::kF8E4M3FNUZ, 0x01), std::ldexp(1.0, -10));
  EXPECT_TRUE(std::isnan(DecodeNarrow(DType::kF8E4M3FNUZ, 0x80)));
  EXPECT_EQ(DecodeNarrow(DType::kF8E5M2FNUZ, 0x7F), 57344.0);
  EXPECT_EQ(DecodeNarrow(DType::kF8E5M2FNUZ, 0x01), std::ldexp(1.0, -17));
}

TEST(NarrowFloatTest, EveryF8CodeEncodesBackToItself) {
  for (DType dtype : {DType::kF8E4M3, DType::kF8E5M2, DType::kF8E4M3FNUZ, DType::kF8E5M2FNUZ}) {
    for (uint32_t c = 0; c < 256; ++c) {
      const double v = DecodeNarrow(dtype, c);
      if (std::isnan(v)) continue;
      const float f = static_cast<float>(v);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      EXPECT_EQ(EncodeF8(dtype, bits), c) << DTypeName(dtype) << " code " << c;
    }
  }
}

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// What torch 2.13's .to() gives at the edges (tests/python/test_dtypes.py
// checks every value against torch itself).
TEST(NarrowFloatTest, NarrowingSaturatesOverflowsOrTurnsToNaNAsTorchDoes) {
  EXPECT_EQ(EncodeF8(DType::kF8E4M3, Bits(464.0f)), 0x7E);  // a tie: to even, 448
  EXPECT_EQ(EncodeF8(DType::kF8E4M3, Bits(479.0f)), 0x7E);  // saturated
  EXPECT_EQ(EncodeF8(DType::kF8E4M3, Bits(INFINITY)), 0x7E);
  EXPECT_EQ(EncodeF8(DType::kF8E4M3, Bits(-1e9f)), 0xFE);
  EXPECT_EQ(EncodeF8(DType::kF8E4M3, Bits(-NAN)), 0xFF);
  EXPECT_EQ(EncodeF8(DType::kF8E4M3, Bits(std::ldexp(1.0f, -10))), 0x00);        // a tie with zero
  EXPECT_EQ(EncodeF8(DType::kF8E4M3, Bits(1.5f * std::ldexp(1.0f, -9))), 0x02);  // a tie: to even
  EXPECT_EQ(EncodeF8(DType::kF8E5M2, Bits(61439.0f)), 0x7B);
  EXPECT_EQ(EncodeF8(DType::kF8E5M2, Bits(61440.0f)), 0x7C);  // a tie past the largest: infinity
  EXPECT_EQ(EncodeF8(DType::kF8E5M2, Bits(-INFINITY)), 0xFC);
  EXPECT_EQ(EncodeF8(DType::kF8E5M2, Bits(NAN)), 0x7F);
  EXPECT_EQ(EncodeF8(DType::kF8E4M3FNUZ, Bits(247.0f)), 0x7F);
  EXPECT_EQ(EncodeF8(DType::kF8E4M3FNUZ, Bits(248.0f)), 0x80);  // rounds past 240: NaN
  EXPECT_EQ(EncodeF8(DType::kF8E4M3FNUZ, Bits(-1e-9f)), 0x00);  // no negative zero
  EXPECT_EQ(EncodeF8(DType::kF8E5M2FNUZ, Bits(-INFINITY)), 0x80);
}

// The table-driven fast paths against one element at a time through double.
TEST(NarrowFloatTest, FastDecodingMatchesTheReferenceForEveryCodeAndTarget) {
  std::mt19937 rng(5);
  std::vector<std::byte> src(3 * 256 * 4);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>(i < 256 ? i : rng() & 0xFF);
  for (DType from : {DType::kF8E4M3, DType::kF8E5M2, DType::kF8E4M3FNUZ, DType::kF8E5M2FNUZ, DType::kF8E8M0, DType::kF4,
                     DType::kF6E2M3, DType::kF6E3M2}) {
    const size_t count = src.size() * 8 / DTypeBits(from);
    for (DType to : {DType::kF32, DType::kF16, DType::kBF16, DType::kF64}) {
      std::vector<std::byte> fast(count * DTypeSize(to) + 1), slow(count * DTypeSize(to) + 1);
      // +1: an unaligned destination, as a slice of a mapping can be.
      CastElements(from, src.data(), to, fast.data() + 1, count);
      CastElementsReference(from, src.data(), to, slow.data() + 1, count);
      EXPECT_EQ(fast, slow) << DTypeName(from) << " -> " << DTypeName(to);
    }
  }
}

TEST(NarrowFloatTest, F4AndF6AreReadLowBitsFirst) {
  const std::byte f4[1] = {std::byte{0x72}};  // low nibble 2 (1.0), high 7 (6.0)
  float out[2];
  CastElements(DType::kF4, f4, DType::kF32, reinterpret_cast<std::byte*>(out), 2);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], 6.0f);
  // Four F6_E2M3 codes 0x08 (1.0), 0x1F (7.5), 0x21 (-0.125), 0x10 (2.0) in
  // 24 bits: 0x10 << 18 | 0x21 << 12 | 0x1F << 6 | 0x08.
  const uint32_t word = (0x10u << 18) | (0x21u << 12) | (0x1Fu << 6) | 0x08u;
  const std::byte f6[3] = {std::byte(word & 0xFF), std::byte((word >> 8) & 0xFF), std::byte(word >> 16)};
  float four[4];
  CastElements(DType::kF6E2M3, f6, DType::kF32, reinterpret_cast<std::byte*>(four), 4);
  EXPECT_THAT(four, ::testing::ElementsAre(1.0f, 7.5f, -0.125f, 2.0f));
}

TEST(NarrowFloatTest, CastsIntoScalesOrSubByteTypesAndFromComplexAreRefusedNamingBoth) {
  EXPECT_OK(CheckCast(DType::kF8E8M0, DType::kF32));
  EXPECT_OK(CheckCast(DType::kF4, DType::kBF16));
  EXPECT_OK(CheckCast(DType::kF32, DType::kF8E4M3FNUZ));
  EXPECT_OK(CheckCast(DType::kBF16, DType::kF8E5M2));
  EXPECT_THAT(CheckCast(DType::kF32, DType::kF8E8M0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cannot cast F32 to F8_E8M0")));
  EXPECT_THAT(CheckCast(DType::kBF16, DType::kF4), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CheckCast(DType::kF4, DType::kF8E4M3), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CheckCast(DType::kC64, DType::kF32),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cannot cast C64 to F32")));
  EXPECT_THAT(CheckCast(DType::kU8, DType::kF8E4M3), StatusIs(absl::StatusCode::kInvalidArgument));
}

// A SafeTensors file of one [rows, cols] F4 tensor "w" whose element i is F4
// code i % 16, parsed from memory.
std::shared_ptr<const Checkpoint> F4Matrix(uint64_t rows, uint64_t cols) {
  const uint64_t n = rows * cols;
  std::string data(n / 2, '\0');
  for (uint64_t i = 0; i < n; ++i) data[i / 2] |= static_cast<char>((i % 16) << (4 * (i % 2)));
  std::string header =
      absl::StrCat(R"({"w":{"dtype":"F4","shape":[)", rows, ",", cols, R"(],"data_offsets":[0,)", data.size(), "]}}");
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string file(8, '\0');
  const uint64_t size = header.size();
  std::memcpy(file.data(), &size, 8);
  file += header + data;
  auto parsed = ParseSafeTensors(SharedBytes::Copy(file), "f4.safetensors", {});
  EXPECT_OK(parsed.status());
  return *parsed;
}

TEST(SubByteSliceTest, ShardsOfF4RowsAndWholeByteColumnsAreServedAndCastExactly) {
  auto checkpoint = F4Matrix(4, 8);  // 16 bytes
  for (uint32_t dim : {0u, 1u}) {
    SelectionOptions options;
    options.shard = {1, 2, {{"w", ShardSplit{dim, 1, false}}}};
    options.dtype = DType::kF32;
    ASSERT_OK_AND_ASSIGN(auto selection, Selection::Compile(options));
    ASSERT_OK_AND_ASSIGN(auto snapshot, Snapshot::Select(checkpoint, *selection));
    const SnapshotTensor& t = snapshot->tensors()[0];
    ASSERT_EQ(t.spec.shape, (dim == 0 ? std::vector<uint64_t>{2, 8} : std::vector<uint64_t>{4, 4}));
    std::vector<float> got(16);
    ASSERT_OK(snapshot->ReadInto(t, std::as_writable_bytes(std::span(got))));
    for (uint64_t r = 0; r < t.spec.shape[0]; ++r) {
      for (uint64_t c = 0; c < t.spec.shape[1]; ++c) {
        const uint64_t source = dim == 0 ? (r + 2) * 8 + c : r * 8 + c + 4;
        EXPECT_EQ(got[r * t.spec.shape[1] + c], DecodeNarrow(DType::kF4, source % 16)) << dim << " " << r << "," << c;
      }
    }
  }
  // Uncast, a row shard is a byte range of the file.
  SelectionOptions rows;
  rows.shard = {1, 2, {{"w", ShardSplit{0, 1, false}}}};
  ASSERT_OK_AND_ASSIGN(auto selection, Selection::Compile(rows));
  ASSERT_OK_AND_ASSIGN(auto snapshot, Snapshot::Select(checkpoint, *selection));
  EXPECT_EQ(snapshot->tensors()[0].ByteRangeStart(), 8u);
  EXPECT_EQ(snapshot->tensors()[0].spec.byte_size(), 8u);
}

TEST(SubByteSliceTest, ASliceThatWouldSplitAByteIsRefusedNamingTheTensor) {
  auto checkpoint = F4Matrix(4, 6);
  SelectionOptions options;
  options.shard = {0, 2, {{"w", ShardSplit{1, 1, false}}}};  // 3 columns: a byte and a half
  ASSERT_OK_AND_ASSIGN(auto selection, Selection::Compile(options));
  EXPECT_THAT(Snapshot::Select(checkpoint, *selection),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor 'w' (F4 [4, 6]): the slice [0:3]")));
  auto odd_rows = F4Matrix(2, 3);  // rows of 12 bits: served whole only
  SelectionOptions by_row;
  by_row.shard = {0, 2, {{"w", ShardSplit{0, 1, false}}}};
  ASSERT_OK_AND_ASSIGN(auto row_selection, Selection::Compile(by_row));
  EXPECT_THAT(Snapshot::Select(odd_rows, *row_selection),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rows are not whole bytes")));
  ASSERT_OK_AND_ASSIGN(auto whole, Selection::Compile({}));
  ASSERT_OK_AND_ASSIGN(auto snapshot, Snapshot::Select(odd_rows, *whole));
  EXPECT_EQ(snapshot->tensors()[0].spec.byte_size(), 3u);
}

TEST(SubByteSliceTest, AnF4TensorOfAnOddCountIsAnInvalidFile) {
  std::string header = R"({"w":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string file(8, '\0');
  const uint64_t size = header.size();
  std::memcpy(file.data(), &size, 8);
  file += header + std::string(2, '\0');
  EXPECT_THAT(ParseSafeTensors(SharedBytes::Copy(file), "odd.safetensors", {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a whole number of bytes")));
}

}  // namespace
}  // namespace weightstore

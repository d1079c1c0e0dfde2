#include "core/select/dtype_cast.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "tests/util/status_matchers.h"

namespace weightstore {
namespace {

uint16_t F16(double v) { return static_cast<uint16_t>(EncodeFloat(v, 5, 10)); }
uint16_t BF16(double v) { return static_cast<uint16_t>(EncodeFloat(v, 8, 7)); }

TEST(EncodeFloatTest, F16BoundariesRoundToNearestEven) {
  EXPECT_EQ(F16(1.0), 0x3C00);
  EXPECT_EQ(F16(-2.0), 0xC000);
  EXPECT_EQ(F16(65504.0), 0x7BFF);               // largest finite
  EXPECT_EQ(F16(65519.99), 0x7BFF);              // rounds down below the halfway point
  EXPECT_EQ(F16(65520.0), 0x7C00);               // halfway to 2^16: ties to even = infinity
  EXPECT_EQ(F16(std::ldexp(1.0, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(F16(std::ldexp(1.0, -25)), 0x0000);  // half of it: ties to even = 0
  EXPECT_EQ(F16(std::ldexp(1.5, -25)), 0x0001);
  EXPECT_EQ(F16(1.0 + std::ldexp(1.0, -11)), 0x3C00);                             // tie, even stays
  EXPECT_EQ(F16(1.0 + 3 * std::ldexp(1.0, -11)), 0x3C02);                         // tie, odd rounds up
  EXPECT_EQ(F16(std::ldexp(1023.0 / 1024, -14) + std::ldexp(1.0, -25)), 0x0400);  // carries into the first normal
  EXPECT_EQ(F16(-0.0), 0x8000);
}

TEST(EncodeFloatTest, KeepsInfinitiesAndNaNs) {
  EXPECT_EQ(F16(std::numeric_limits<double>::infinity()), 0x7C00);
  EXPECT_EQ(BF16(-std::numeric_limits<double>::infinity()), 0xFF80);
  EXPECT_EQ(F16(std::numeric_limits<double>::quiet_NaN()) & 0x7E00, 0x7E00);
  EXPECT_TRUE(std::isnan(DecodeFloat(BF16(std::nan("")), 8, 7)));
  EXPECT_EQ(BF16(1e39), 0x7F80);  // past BF16's range
}

TEST(EncodeFloatTest, RoundsOnceFromDouble) {
  // 1 + 2^-8 + 2^-30 is just above the BF16 halfway point; rounding through F32
  // first would land exactly on the tie and round down to even.
  EXPECT_EQ(BF16(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30)), 0x3F81);
  EXPECT_EQ(BF16(1.0 + std::ldexp(1.0, -8)), 0x3F80);
}

TEST(EncodeFloatTest, DecodeInvertsEveryF16) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    double v = DecodeFloat(b, 5, 10);
    if (std::isnan(v)) continue;
    ASSERT_EQ(F16(v), b) << b;
  }
}

TEST(CastTest, WidensIntegersAndRefusesNarrowing) {
  const int8_t src[] = {-128, -1, 0, 127};
  int64_t dst[4];
  ASSERT_OK(CheckCast(DType::kI8, DType::kI64));
  CastElements(DType::kI8, reinterpret_cast<const std::byte*>(src), DType::kI64, reinterpret_cast<std::byte*>(dst), 4);
  EXPECT_THAT(dst, ::testing::ElementsAre(-128, -1, 0, 127));
  const uint8_t u[] = {255, 1};
  int32_t w[2];
  CastElements(DType::kU8, reinterpret_cast<const std::byte*>(u), DType::kI32, reinterpret_cast<std::byte*>(w), 2);
  EXPECT_THAT(w, ::testing::ElementsAre(255, 1));
  EXPECT_FALSE(CheckCast(DType::kI64, DType::kI32).ok());
  EXPECT_FALSE(CheckCast(DType::kI8, DType::kU16).ok());
  EXPECT_FALSE(CheckCast(DType::kF32, DType::kI32).ok());
  EXPECT_FALSE(CheckCast(DType::kU64, DType::kI64).ok());
}

TEST(CastTest, TransposeCastFusesBothInOnePass) {
  const float src[6] = {1, 2, 3, 4, 5, 6};  // [2, 3]
  double dst[6];
  TransposeCast(DType::kF32, reinterpret_cast<const std::byte*>(src), DType::kF64, reinterpret_cast<std::byte*>(dst), 2,
                3);
  EXPECT_THAT(dst, ::testing::ElementsAre(1, 4, 2, 5, 3, 6));
}

// Every 16-bit input, and F32 inputs around every rounding boundary: each
// combination of the upper 16 bits with low bits at and around the halfway
// points, plus pseudo-random ones.
std::vector<uint32_t> F32Patterns() {
  std::vector<uint32_t> out;
  uint64_t state = 0x9E3779B97F4A7C15ull;
  for (uint32_t hi = 0; hi < 0x10000; ++hi) {
    // F16's halfway points in the low 13 bits (0x1000 with an even kept bit,
    // 0x3000 with an odd one), BF16's in the low 16 (0x8000), and neighbours.
    for (uint32_t lo : {0x0000u, 0x0001u, 0x0FFFu, 0x1000u, 0x1001u, 0x1FFFu, 0x2000u, 0x2FFFu, 0x3000u, 0x3001u,
                        0x5000u, 0x6000u, 0x7FFFu, 0x8000u, 0x8001u, 0xA000u, 0xC000u, 0xFFFFu}) {
      out.push_back(hi << 16 | lo);
    }
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    out.push_back(static_cast<uint32_t>(state >> 32));
  }
  return out;
}

template <typename From, typename To>
void ExpectFastEqualsReference(DType from, DType to, const std::vector<From>& inputs) {
  std::vector<To> fast(inputs.size()), reference(inputs.size());
  const auto* src = reinterpret_cast<const std::byte*>(inputs.data());
  CastElements(from, src, to, reinterpret_cast<std::byte*>(fast.data()), inputs.size());
  CastElementsReference(from, src, to, reinterpret_cast<std::byte*>(reference.data()), inputs.size());
  size_t mismatches = 0;
  for (size_t i = 0; i < inputs.size() && mismatches < 5; ++i) {
    if (fast[i] != reference[i]) {
      ++mismatches;
      ADD_FAILURE() << DTypeName(from) << " -> " << DTypeName(to) << " of 0x" << std::hex << inputs[i] << ": fast 0x"
                    << fast[i] << ", reference 0x" << reference[i];
    }
  }
}

TEST(CastTest, FastFloatPathsEqualTheReferenceBitForBit) {
  const std::vector<uint32_t> f32 = F32Patterns();
  ExpectFastEqualsReference<uint32_t, uint16_t>(DType::kF32, DType::kF16, f32);
  ExpectFastEqualsReference<uint32_t, uint16_t>(DType::kF32, DType::kBF16, f32);
  std::vector<uint16_t> all16(0x10000);
  for (uint32_t i = 0; i < all16.size(); ++i) all16[i] = static_cast<uint16_t>(i);
  ExpectFastEqualsReference<uint16_t, uint32_t>(DType::kF16, DType::kF32, all16);
  ExpectFastEqualsReference<uint16_t, uint32_t>(DType::kBF16, DType::kF32, all16);
  // The element-at-a-time converters (strided reads, and the tails and NaN
  // lanes of the vector path) on every other pattern.
  std::vector<uint16_t> strided(f32.size() / 2), reference(f32.size() / 2);
  for (DType to : {DType::kF16, DType::kBF16}) {
    for (size_t start : {0, 1}) {  // the even patterns, then the odd ones
      const auto* src = reinterpret_cast<const std::byte*>(f32.data() + start);
      CastStrided(DType::kF32, src, 2, to, reinterpret_cast<std::byte*>(strided.data()), strided.size());
      for (size_t i = 0; i < reference.size(); ++i) {
        CastElementsReference(DType::kF32, src + 8 * i, to, reinterpret_cast<std::byte*>(&reference[i]), 1);
      }
      EXPECT_EQ(strided, reference) << DTypeName(to) << " from " << start;
    }
  }
  // Runs whose length is not a multiple of the vector width.
  for (size_t n : {1, 7, 9, 15, 17}) {
    std::vector<uint32_t> few(f32.begin() + 1000, f32.begin() + 1000 + n);
    ExpectFastEqualsReference<uint32_t, uint16_t>(DType::kF32, DType::kF16, few);
  }
}

TEST(CastTest, StridedAndTransposedFastPathsEqualTheReference) {
  std::vector<float> matrix(6 * 7);
  for (size_t i = 0; i < matrix.size(); ++i) matrix[i] = 0.1f * static_cast<float>(i) - 1.7f;
  const auto* src = reinterpret_cast<const std::byte*>(matrix.data());
  std::vector<uint16_t> column(6), want(6);
  CastStrided(DType::kF32, src + 4 * 3, 7, DType::kBF16, reinterpret_cast<std::byte*>(column.data()), 6);
  for (size_t r = 0; r < 6; ++r) {
    CastElementsReference(DType::kF32, src + 4 * (r * 7 + 3), DType::kBF16, reinterpret_cast<std::byte*>(&want[r]), 1);
  }
  EXPECT_EQ(column, want);
  std::vector<uint16_t> transposed(42), expected(42);
  TransposeCast(DType::kF32, src, DType::kF16, reinterpret_cast<std::byte*>(transposed.data()), 6, 7);
  for (size_t r = 0; r < 6; ++r) {
    for (size_t c = 0; c < 7; ++c) {
      CastElementsReference(DType::kF32, src + 4 * (r * 7 + c), DType::kF16,
                            reinterpret_cast<std::byte*>(&expected[c * 6 + r]), 1);
    }
  }
  EXPECT_EQ(transposed, expected);
}

TEST(CastTest, TransposeCastRowsIsABandOfTheWholeTranspose) {
  std::vector<float> matrix(37 * 45);
  for (size_t i = 0; i < matrix.size(); ++i) matrix[i] = static_cast<float>(i) * 0.25f;
  const auto* src = reinterpret_cast<const std::byte*>(matrix.data());
  std::vector<uint16_t> whole(matrix.size());
  TransposeCast(DType::kF32, src, DType::kBF16, reinterpret_cast<std::byte*>(whole.data()), 37, 45);
  for (auto [first, end] : {std::pair<size_t, size_t>{0, 45}, {3, 4}, {10, 42}, {44, 45}}) {
    std::vector<uint16_t> band((end - first) * 37);
    TransposeCastRows(DType::kF32, src, DType::kBF16, reinterpret_cast<std::byte*>(band.data()), 37, 45, first, end);
    EXPECT_TRUE(std::equal(band.begin(), band.end(), whole.begin() + first * 37)) << first << ".." << end;
  }
}

TEST(CastTest, TransposesOfEverySizeShapeAndBandEqualTheElementByElementReference) {
  // Random bits (NaNs with payloads included) through every kernel: the SSE
  // blocks (2 and 4-byte elements), the scalar ones, and the tile-then-cast
  // path, on shapes with and without whole blocks, as bands of a wider matrix.
  std::mt19937_64 rng(7);
  const std::pair<DType, DType> pairs[] = {
      {DType::kU8, DType::kU8},   {DType::kBF16, DType::kBF16}, {DType::kF16, DType::kF16},  {DType::kF32, DType::kF32},
      {DType::kF64, DType::kF64}, {DType::kF32, DType::kBF16},  {DType::kBF16, DType::kF32}, {DType::kF16, DType::kF32},
      {DType::kF32, DType::kF16}, {DType::kF32, DType::kF64},   {DType::kI32, DType::kF32},  {DType::kU8, DType::kF32}};
  // Tiles are 128 rows by 2 KiB: 130 rows, and 300 to 2100 columns, cross them.
  const std::pair<size_t, size_t> shapes[] = {{1, 1},    {8, 8},   {4, 4},   {9, 17},   {64, 64},  {65, 130},
                                              {130, 67}, {3, 200}, {9, 300}, {10, 600}, {5, 1100}, {3, 2100}};
  for (auto [from, to] : pairs) {
    const size_t fs = DTypeSize(from), ts = DTypeSize(to);
    for (auto [rows, cols] : shapes) {
      const size_t stride = cols + 5;  // the matrix is a block of a wider one
      std::vector<std::byte> src(rows * stride * fs);
      for (auto& b : src) b = static_cast<std::byte>(rng());
      for (auto [first, end] : {std::pair<size_t, size_t>{0, cols}, {cols / 3, cols - cols / 4}, {cols - 1, cols}}) {
        if (first >= end) continue;
        std::vector<std::byte> got((end - first) * rows * ts), want(got.size());
        TransposeCastRows(from, src.data(), to, got.data(), rows, cols, first, end, stride);
        for (size_t c = first; c < end; ++c) {
          for (size_t r = 0; r < rows; ++r) {
            const std::byte* in = src.data() + (r * stride + c) * fs;
            std::byte* out = want.data() + ((c - first) * rows + r) * ts;
            // The same dtype is a copy of the bits (the reference would make NaNs canonical).
            if (from == to) {
              std::memcpy(out, in, fs);
            } else {
              CastElementsReference(from, in, to, out, 1);
            }
          }
        }
        EXPECT_TRUE(got == want) << DTypeName(from) << " -> " << DTypeName(to) << " [" << rows << ", " << cols
                                 << "] columns " << first << ".." << end;
      }
    }
  }
}

}  // namespace
}  // namespace weightstore

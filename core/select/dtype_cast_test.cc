#include "core/select/dtype_cast.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

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

}  // namespace
}  // namespace weightstore

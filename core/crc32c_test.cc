#include "core/crc32c.h"

#include <gtest/gtest.h>

#include <random>
#include <string>

namespace weightstore {
namespace {

TEST(Crc32cTest, MatchesRfc3720Vectors) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  std::string ascending(32, '\0');
  for (int i = 0; i < 32; ++i) ascending[i] = static_cast<char>(i);
  EXPECT_EQ(Crc32c(ascending), 0x46DD794Eu);
  EXPECT_EQ(Crc32c(""), 0u);
}

TEST(Crc32cTest, HardwareAndTableAgreeAndExtendComposes) {
  std::mt19937 rng(5);
  std::string data(100003, '\0');
  for (char& c : data) c = static_cast<char>(rng());
  for (size_t len : {0, 1, 7, 8, 9, 4096, 100003}) {
    absl::string_view piece(data.data(), len);
    EXPECT_EQ(Crc32c(piece), Crc32cExtendPortable(0, piece)) << len;
  }
  uint32_t split = Crc32cExtend(Crc32c(absl::string_view(data).substr(0, 333)), absl::string_view(data).substr(333));
  EXPECT_EQ(split, Crc32c(data));
}

}  // namespace
}  // namespace weightstore

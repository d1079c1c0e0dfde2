#include "core/crc32c.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

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

TEST(Crc32cTest, ConcatGivesTheCrcOfTheWholeFromItsPieces) {
  std::mt19937 rng(9);
  std::string data(70001, '\0');
  for (char& c : data) c = static_cast<char>(rng());
  const absl::string_view all(data);
  for (size_t cut : {size_t{0}, size_t{1}, size_t{7}, size_t{4096}, size_t{69999}, all.size()}) {
    const absl::string_view a = all.substr(0, cut), b = all.substr(cut);
    EXPECT_EQ(Crc32cConcat(Crc32c(a), Crc32c(b), b.size()), Crc32c(all)) << cut;
  }
  // Three pieces, folded left to right.
  const uint32_t ab = Crc32cConcat(Crc32c(all.substr(0, 100)), Crc32c(all.substr(100, 5000)), 5000);
  EXPECT_EQ(Crc32cConcat(ab, Crc32c(all.substr(5100)), all.size() - 5100), Crc32c(all));
}

TEST(Crc32cTest, DataOverOneGibibyteIsTakenInPieces) {
  // ISA-L takes an int length. 1 GiB + 3 zero bytes, mapped from the zero
  // page (nothing allocated); the value is the table implementation's.
  const size_t size = (size_t{1} << 30) + 3;
  void* zeros = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(zeros, MAP_FAILED);
  const absl::string_view all(static_cast<const char*>(zeros), size);
  EXPECT_EQ(Crc32c(all), 0xA72390E4u);
  // And a gibibyte moved past, for Crc32cConcat.
  EXPECT_EQ(Crc32cConcat(Crc32c("123456789"), 0xA72390E4u, size), Crc32cExtend(Crc32c("123456789"), all));
  ::munmap(zeros, size);
}

}  // namespace
}  // namespace weightstore

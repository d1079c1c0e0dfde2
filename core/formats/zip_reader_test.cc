#include "core/formats/zip_reader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <zlib.h>

#include "tests/util/status_matchers.h"
#include "tests/util/zip_builder.h"

namespace weightstore {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::BuildZip;
using ::weightstore::testing::Deflate;
using ::weightstore::testing::StatusIs;
using ::weightstore::testing::ZipBuildOptions;

absl::StatusOr<ZipArchive> Open(const std::string& bytes) {
  return ZipArchive::Open(SharedBytes::Copy(bytes), "t.zip");
}

TEST(ZipReaderTest, ReadsStoredEntriesWithoutCopying) {
  SharedBytes bytes = SharedBytes::Copy(BuildZip({{"a/data.pkl", "hello"}, {"a/data/0", "world!"}}));
  ASSERT_OK_AND_ASSIGN(ZipArchive zip, ZipArchive::Open(bytes, "t.zip"));
  ASSERT_EQ(zip.entries().size(), 2u);
  const ZipEntry* e = zip.Find("a/data/0");
  ASSERT_NE(e, nullptr);
  ASSERT_OK_AND_ASSIGN(SharedBytes data, zip.Read(*e, /*verify_crc=*/true));
  EXPECT_EQ(data.view(), "world!");
  EXPECT_GE(data.data(), bytes.data());
  EXPECT_LT(data.data(), bytes.data() + bytes.size());
}

TEST(ZipReaderTest, ReadsZip64Records) {
  ZipBuildOptions options;
  options.zip64 = true;
  ASSERT_OK_AND_ASSIGN(ZipArchive zip, Open(BuildZip({{"x", "12345"}}, options)));
  ASSERT_OK_AND_ASSIGN(SharedBytes data, zip.Read(zip.entries()[0], true));
  EXPECT_EQ(data.view(), "12345");
}

TEST(ZipReaderTest, InflatesDeflatedEntriesAndChecksTheirCrc) {
  const std::string plain(10000, 'q');
  const std::string packed = Deflate(plain);
  // Build a stored archive, then patch in the method and sizes of a deflated one.
  ZipBuildOptions options;
  options.method = 8;
  std::string zip_bytes = BuildZip({{"d", packed}}, options);
  auto patch32 = [&](size_t at, uint32_t v) {
    for (int i = 0; i < 4; ++i) zip_bytes[at + i] = static_cast<char>((v >> (8 * i)) & 0xFF);
  };
  const uint32_t crc = Crc32(plain);
  const size_t central = zip_bytes.find("PK\x01\x02");
  patch32(14, crc);
  patch32(22, plain.size());
  patch32(central + 16, crc);
  patch32(central + 24, plain.size());
  ASSERT_OK_AND_ASSIGN(ZipArchive zip, Open(zip_bytes));
  ASSERT_OK_AND_ASSIGN(SharedBytes data, zip.Read(zip.entries()[0], false));
  EXPECT_EQ(data.view(), plain);

  patch32(central + 16, crc ^ 1);  // wrong CRC in the directory
  ASSERT_OK_AND_ASSIGN(ZipArchive bad, Open(zip_bytes));
  EXPECT_THAT(bad.Read(bad.entries()[0], false), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("CRC-32")));
}

TEST(ZipReaderTest, AZipBombIsRefusedBeforeAnyMemoryIsSpentOnIt) {
  // Issue 11: a ZIP64 entry declaring 8 GiB was allocated and zero-filled
  // before inflating. Deflate cannot expand more than 1032:1.
  ZipBuildOptions options;
  options.zip64 = true;
  options.method = 8;
  options.declared_size = uint64_t{8} << 30;
  ASSERT_OK_AND_ASSIGN(ZipArchive zip, Open(BuildZip({{"data.pkl", Deflate("tiny")}}, options)));
  EXPECT_THAT(zip.Read(zip.entries()[0], true),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("more than deflate can expand")));
}

TEST(ZipReaderTest, AnEntryThatInflatesToLessThanItDeclaresIsDataLossWithoutAllocatingTheClaim) {
  // 1 MiB of zeros deflates to ~1 KiB, so a 1 GiB claim passes the ratio check:
  // the output must grow with what inflates, not with the claim.
  const std::string packed = Deflate(std::string(1 << 20, '\0'));
  ZipBuildOptions options;
  options.zip64 = true;
  options.method = 8;
  options.declared_size = packed.size() * 1000;
  ASSERT_OK_AND_ASSIGN(ZipArchive zip, Open(BuildZip({{"d", packed}}, options)));
  EXPECT_THAT(zip.Read(zip.entries()[0], true),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("does not match its declared size")));
}

TEST(ZipReaderTest, RejectsNamesThatEscapeTheArchive) {
  EXPECT_THAT(Open(BuildZip({{"a/../../etc/passwd", "x"}})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("escapes the archive")));
  EXPECT_THAT(Open(BuildZip({{"/etc/passwd", "x"}})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("absolute")));
  EXPECT_THAT(Open(BuildZip({{"a\\b", "x"}})), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("backslash")));
}

TEST(ZipReaderTest, RejectsDuplicateNames) {
  EXPECT_THAT(Open(BuildZip({{"a", "1"}, {"a", "2"}})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("duplicate entry name 'a'")));
}

TEST(ZipReaderTest, RejectsOverlappingEntries) {
  ZipBuildOptions options;
  options.overlap_entry = 1;
  EXPECT_THAT(Open(BuildZip({{"a", "same"}, {"a", "same"}}, options)), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(
      Open(BuildZip({{"a", "same"}, {"b", "same"}}, options)),
      StatusIs(absl::StatusCode::kInvalidArgument, ::testing::AnyOf(HasSubstr("overlap"), HasSubstr("disagree"))));
}

TEST(ZipReaderTest, RejectsUnsupportedCompressionMethods) {
  ZipBuildOptions options;
  options.method = 12;  // bzip2
  EXPECT_THAT(Open(BuildZip({{"a", "x"}}, options)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("compression method 12")));
}

TEST(ZipReaderTest, DetectsCrcMismatchWhenAskedToVerify) {
  ZipBuildOptions options;
  options.bad_crc_entry = 0;
  ASSERT_OK_AND_ASSIGN(ZipArchive zip, Open(BuildZip({{"a", "payload"}}, options)));
  EXPECT_OK(zip.Read(zip.entries()[0], false));
  EXPECT_THAT(zip.Read(zip.entries()[0], true), StatusIs(absl::StatusCode::kDataLoss));
}

TEST(ZipReaderTest, RejectsTruncatedAndRandomBytes) {
  std::string bytes = BuildZip({{"a", "payload"}});
  EXPECT_FALSE(Open(bytes.substr(0, bytes.size() - 5)).ok());
  EXPECT_FALSE(Open(bytes.substr(0, 30)).ok());
  EXPECT_THAT(Open(std::string(100, '\x37')),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("end-of-central")));
}

TEST(ZipReaderTest, RejectsCentralDirectoryPointingOutsideTheFile) {
  std::string bytes = BuildZip({{"a", "payload"}});
  bytes[bytes.size() - 6] = '\x7f';  // cd offset high byte
  EXPECT_THAT(Open(bytes), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("central directory")));
}

}  // namespace
}  // namespace weightstore

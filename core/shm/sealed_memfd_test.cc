#include "core/shm/sealed_memfd.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/shm/sealed_memfd.h"
#include "core/shm/unix_socket.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

TEST(SealedMemfdTest, SegmentIsSealedReadOnlyAndHoldsWhatWasFilled) {
  ASSERT_OK_AND_ASSIGN(auto segment, CreateSealedMemfd("test", 10000, [](std::span<std::byte> out) {
                         std::memset(out.data(), 'z', out.size());
                         return absl::OkStatus();
                       }));
  EXPECT_EQ(segment->size(), 10000u);
  EXPECT_EQ(segment->bytes().view(), std::string(10000, 'z'));
  EXPECT_OK(CheckSealed(segment->fd(), "test"));
  EXPECT_EQ(::fcntl(segment->fd(), F_GETFL) & O_ACCMODE, O_RDONLY);
  EXPECT_LT(::pwrite(segment->fd(), "a", 1, 0), 0);
  EXPECT_EQ(::mmap(nullptr, 4096, PROT_WRITE, MAP_SHARED, segment->fd(), 0), MAP_FAILED);
}

TEST(SealedMemfdTest, AFailingFillLeavesNoSegment) {
  EXPECT_THAT(CreateSealedMemfd("test", 100, [](std::span<std::byte>) { return absl::DataLossError("tensor 'x'"); }),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tensor 'x'")));
}

TEST(SealedMemfdTest, OrdinaryFilesAreNotSealed) {
  const std::string path = testing::MakeScratchDir("seal") + "/f";
  testing::WriteFileOrDie(path, "abc");
  ASSERT_OK_AND_ASSIGN(auto file, MappedFile::Open(path));
  EXPECT_THAT(CheckSealed(file->fd(), "f"), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("f is not")));
}

TEST(SealedMemfdTest, PreloadCopiesTheFileAndKeepsItsPathForMessages) {
  const std::string path = testing::MakeScratchDir("seal") + "/model.bin";
  std::string data(300000, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7);
  testing::WriteFileOrDie(path, data);
  ASSERT_OK_AND_ASSIGN(auto preloaded, PreloadFile(path));
  EXPECT_EQ(preloaded->path(), path);
  EXPECT_EQ(preloaded->bytes().view(), data);
  EXPECT_OK(CheckSealed(preloaded->fd(), path));
}

TEST(SealedMemfdTest, AWriterFillsBySegmentsAndRefusesWritesPastTheEnd) {
  ASSERT_OK_AND_ASSIGN(auto segment, CreateSealedMemfd("test", 10, [](SegmentWriter& out) -> absl::Status {
                         const std::string a = "01234", b = "56789";
                         if (absl::Status s = out.Write(5, std::as_bytes(std::span(b))); !s.ok()) return s;
                         return out.Write(0, std::as_bytes(std::span(a)));
                       }));
  EXPECT_EQ(segment->bytes().view(), "0123456789");
  EXPECT_OK(CheckSealed(segment->fd(), "test"));
  EXPECT_THAT(CreateSealedMemfd("test", 4,
                                [](SegmentWriter& out) {
                                  const std::string five = "12345";
                                  return out.Write(0, std::as_bytes(std::span(five)));
                                }),
              ::weightstore::testing::StatusIs(absl::StatusCode::kInternal));
}

}  // namespace
}  // namespace weightstore

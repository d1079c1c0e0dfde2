#include "client/parallel_copy.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "core/crc32c.h"

namespace weightstore::client {
namespace {

TEST(ParallelCopyTest, EveryByteIsCopiedOnceWhateverThePieces) {
  ::setenv("WEIGHTSTORE_COPY_THREADS", "3", /*overwrite=*/1);
  for (const size_t size : {size_t{0}, size_t{1}, size_t{4} << 20, (size_t{9} << 20) + 3}) {
    std::vector<std::byte> from(size), to(size, std::byte{0});
    for (size_t k = 0; k < size; ++k) from[k] = std::byte(static_cast<unsigned char>(k * 131 + k / 4096));
    ParallelMemcpy(std::span<std::byte>(to), from.data());
    EXPECT_TRUE(from == to) << size;
  }
  // The pieces tile [0, size) exactly.
  absl::Mutex mu;
  std::vector<int> seen(1000, 0);
  ASSERT_TRUE(CopyInPieces(1000, 64, [&](uint64_t at, uint64_t length) {
                absl::MutexLock lock(&mu);
                for (uint64_t k = at; k < at + length; ++k) ++seen[k];
                return absl::OkStatus();
              }).ok());
  EXPECT_THAT(seen, ::testing::Each(1));
}

TEST(ParallelCopyTest, RunCopyJobsCopiesEveryPieceOfEveryJobOnce) {
  ::setenv("WEIGHTSTORE_COPY_THREADS", "3", /*overwrite=*/1);
  // Jobs of no bytes, of one piece, and of pieces that do not divide them.
  const std::vector<uint64_t> sizes = {0, 10, 1000, 64, 7};
  absl::Mutex mu;
  std::vector<std::vector<int>> seen;
  for (uint64_t size : sizes) seen.emplace_back(size, 0);
  std::vector<CopyJob> jobs;
  for (size_t j = 0; j < sizes.size(); ++j) {
    jobs.push_back({sizes[j], 64, [&, j](uint64_t at, uint64_t length) {
                      EXPECT_LE(length, 64u);
                      absl::MutexLock lock(&mu);
                      for (uint64_t k = at; k < at + length; ++k) ++seen[j][k];
                      return absl::OkStatus();
                    }});
  }
  ASSERT_TRUE(RunCopyJobs(jobs).ok());
  for (size_t j = 0; j < sizes.size(); ++j) EXPECT_THAT(seen[j], ::testing::Each(1)) << "job " << j;
  // The first error is returned.
  jobs.push_back({100, 10, [](uint64_t at, uint64_t) {
                    return at == 50 ? absl::DataLossError("piece at 50") : absl::OkStatus();
                  }});
  EXPECT_EQ(RunCopyJobs(jobs).message(), "piece at 50");
}

TEST(ParallelCopyTest, CopyWithCrc32cChecksumsWhatItWroteAndCanDropTheSourcesPages) {
  ::setenv("WEIGHTSTORE_COPY_THREADS", "3", /*overwrite=*/1);
  for (const size_t size : {size_t{0}, size_t{5}, size_t{4} << 20, (size_t{13} << 20) + 7}) {
    std::vector<std::byte> from(size), to(size, std::byte{0});
    for (size_t k = 0; k < size; ++k) from[k] = std::byte(static_cast<unsigned char>(k * 197 + k / 977));
    const uint32_t crc = CopyWithCrc32c(std::span<std::byte>(to), from.data(), /*release_from=*/false);
    EXPECT_TRUE(from == to) << size;
    EXPECT_EQ(crc, Crc32c(absl::string_view(reinterpret_cast<const char*>(to.data()), size))) << size;
  }
  // A read-only mapping of a file: its pages are dropped, its bytes stay.
  const size_t size = size_t{12} << 20;
  char path[] = "/tmp/weightstore-copy-crc-XXXXXX";
  const int fd = ::mkstemp(path);
  ASSERT_GE(fd, 0);
  ::unlink(path);
  std::vector<std::byte> bytes(size);
  for (size_t k = 0; k < size; ++k) bytes[k] = std::byte(static_cast<unsigned char>(k * 7 + k / 4096));
  ASSERT_EQ(::write(fd, bytes.data(), size), static_cast<ssize_t>(size));
  void* mapped = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  const auto* from = static_cast<const std::byte*>(mapped);
  std::vector<std::byte> to(size);
  EXPECT_EQ(CopyWithCrc32c(std::span<std::byte>(to), from, /*release_from=*/true),
            Crc32c(absl::string_view(reinterpret_cast<const char*>(bytes.data()), size)));
  EXPECT_TRUE(to == bytes);
  // Pages dropped are mapped again from the file on the next read (that the
  // drop happens is local_store_test.cc's, through /proc/self/smaps).
  EXPECT_EQ(std::memcmp(from, bytes.data(), size), 0);
  ::munmap(mapped, size);
  ::close(fd);
}

// Read through a memfd's descriptor from an offset: every byte, its CRC32C
// across pieces (or none when not asked for), and a source that ends early
// fails naming it.
TEST(ParallelCopyTest, ParallelPreadReadsTheRangeAndChecksumsItWhenAsked) {
  ::setenv("WEIGHTSTORE_COPY_THREADS", "3", /*overwrite=*/1);
  const size_t total = (size_t{13} << 20) + 11;
  std::vector<std::byte> file(total);
  for (size_t k = 0; k < total; ++k) file[k] = std::byte(static_cast<unsigned char>(k * 197 + k / 4096));
  const int fd = ::memfd_create("pread-test", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, file.data(), total), static_cast<ssize_t>(total));
  for (const auto& [offset, size] :
       std::vector<std::pair<size_t, size_t>>{{0, 0}, {3, 5}, {4096, size_t{4} << 20}, {7, (size_t{13} << 20) + 4}}) {
    for (bool checksum : {true, false}) {
      std::vector<std::byte> to(size, std::byte{0});
      absl::StatusOr<uint32_t> crc = ParallelPread(std::span<std::byte>(to), fd, offset, "the memfd", checksum);
      ASSERT_TRUE(crc.ok()) << crc.status();
      EXPECT_TRUE(std::equal(to.begin(), to.end(), file.begin() + static_cast<ptrdiff_t>(offset))) << size;
      EXPECT_EQ(*crc, checksum ? Crc32c(absl::string_view(reinterpret_cast<const char*>(to.data()), to.size())) : 0u)
          << size;
    }
  }
  std::vector<std::byte> past(size_t{5} << 20);
  absl::StatusOr<uint32_t> short_read =
      ParallelPread(std::span<std::byte>(past), fd, total - 100, "the memfd", /*checksum=*/true);
  EXPECT_EQ(short_read.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(short_read.status().message()), ::testing::HasSubstr("the memfd"));
  ::close(fd);
}

TEST(ParallelCopyTest, AFailingPieceFailsTheCopyWithItsError) {
  // Which other pieces still run depends on the threads' timing: only the
  // error is asserted.
  std::atomic<int> calls{0};
  absl::Status status = CopyInPieces(100 << 20, 1 << 20, [&](uint64_t at, uint64_t) {
    calls.fetch_add(1);
    return at == (50u << 20) ? absl::DataLossError("piece 50") : absl::OkStatus();
  });
  EXPECT_EQ(status, absl::DataLossError("piece 50"));
  EXPECT_GE(calls.load(), 1);
}

}  // namespace
}  // namespace weightstore::client

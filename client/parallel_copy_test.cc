#include "client/parallel_copy.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "absl/synchronization/mutex.h"

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

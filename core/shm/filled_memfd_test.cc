#include "core/shm/filled_memfd.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/shm/sealed_memfd.h"
#include "tests/util/status_matchers.h"

namespace weightstore {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;
using Range = FilledMemfd::Range;

MATCHER_P2(IsRange, offset, length, "") {
  return arg.offset == static_cast<uint64_t>(offset) && arg.length == static_cast<uint64_t>(length);
}

void Write(FilledMemfd& segment, const Range& range, char c) {
  std::span<std::byte> out = segment.Writable(range);
  std::memset(out.data(), c, out.size());
}

TEST(FilledMemfdTest, IsSealedAgainstEveryWriterButTheDaemonsOwnMapping) {
  ASSERT_OK_AND_ASSIGN(auto segment, FilledMemfd::Create("filled-test", 1 << 20, ""));
  const int fd = segment->view()->fd();
  EXPECT_OK(CheckFilledSeals(fd, "segment"));
  EXPECT_THAT(CheckSealed(fd, "segment"), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("WRITE")));
  EXPECT_EQ(segment->view()->bytes().view(), std::string(1 << 20, '\0'));

  // A peer holding the read-only descriptor reopens it writable: the open
  // itself may succeed (a memfd's mode allows it), but no write lands.
  const int writable = ::open(absl::StrCat("/proc/self/fd/", fd).c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(writable, 0) << strerror(errno);
  EXPECT_EQ(::pwrite(writable, "x", 1, 0), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, writable, 0), MAP_FAILED);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(::ftruncate(writable, 0), 0);
  EXPECT_NE(::fcntl(writable, F_ADD_SEALS, F_SEAL_WRITE), 0) << "further seals are sealed too";
  ::close(writable);

  // The daemon's own mapping still fills it, and readers see the bytes.
  ASSERT_OK_AND_ASSIGN(std::vector<Range> mine, segment->Claim(std::vector<Range>{{4096, 10}}));
  ASSERT_THAT(mine, ElementsAre(IsRange(4096, 10)));
  Write(*segment, mine[0], 'a');
  segment->Finish(mine, /*written=*/true);
  EXPECT_EQ(segment->view()->bytes().Subspan(4096, 10).view(), std::string(10, 'a'));
}

TEST(FilledMemfdTest, ClaimsOnlyWhatNobodyFilledOrIsFilling) {
  ASSERT_OK_AND_ASSIGN(auto segment, FilledMemfd::Create("filled-test", 1000, ""));
  ASSERT_OK_AND_ASSIGN(std::vector<Range> first, segment->Claim(std::vector<Range>{{0, 100}, {50, 150}}));
  EXPECT_THAT(first, ElementsAre(IsRange(0, 200))) << "overlapping wants are one range";
  // Another caller asks for bytes partly being filled: it gets the rest only.
  ASSERT_OK_AND_ASSIGN(std::vector<Range> second, segment->Claim(std::vector<Range>{{100, 200}, {600, 10}}));
  EXPECT_THAT(second, ElementsAre(IsRange(200, 100), IsRange(600, 10)));
  Write(*segment, first[0], 'a');
  segment->Finish(first, /*written=*/true);
  for (const Range& r : second) Write(*segment, r, 'b');
  segment->Finish(second, /*written=*/true);
  EXPECT_EQ(segment->filled_bytes(), 310u);
  ASSERT_OK_AND_ASSIGN(std::vector<Range> again, segment->Claim(std::vector<Range>{{0, 300}}));
  EXPECT_TRUE(again.empty()) << "filled bytes are never written again";
  EXPECT_EQ(segment->WaitFilled(std::vector<Range>{{0, 300}, {600, 10}}), FilledMemfd::Wait::kFilled);
  EXPECT_EQ(segment->view()->bytes().Subspan(0, 300).view(), std::string(200, 'a') + std::string(100, 'b'));

  EXPECT_THAT(segment->Claim(std::vector<Range>{{990, 11}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pass the end")));
  EXPECT_THAT(segment->Claim(std::vector<Range>{{UINT64_MAX, 2}}), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(FilledMemfdTest, AWaiterSeesAnotherFillersBytesOrLearnsTheyWereGivenUp) {
  ASSERT_OK_AND_ASSIGN(auto segment, FilledMemfd::Create("filled-test", 8192, ""));
  const std::vector<Range> page0{{0, 4096}}, page1{{4096, 4096}};
  ASSERT_OK_AND_ASSIGN(std::vector<Range> mine, segment->Claim(page0));
  ASSERT_EQ(mine.size(), 1u);
  FilledMemfd::Wait waited = FilledMemfd::Wait::kCancelled;
  std::thread other([&] {
    absl::StatusOr<std::vector<Range>> theirs = segment->Claim(page0);
    EXPECT_TRUE(theirs.ok() && theirs->empty()) << "being filled: nothing to claim";
    waited = segment->WaitFilled(page0);
  });
  Write(*segment, mine[0], 'a');
  segment->Finish(mine, /*written=*/true);
  other.join();
  EXPECT_EQ(waited, FilledMemfd::Wait::kFilled);
  EXPECT_EQ(segment->view()->bytes().Subspan(0, 4096).view(), std::string(4096, 'a'));

  // A filler that fails gives its range up: the waiter is told, and claims it.
  ASSERT_OK_AND_ASSIGN(mine, segment->Claim(page1));
  std::vector<Range> reclaimed;
  std::thread waiter([&] {
    if (segment->WaitFilled(page1) != FilledMemfd::Wait::kGivenUp) return;
    absl::StatusOr<std::vector<Range>> again = segment->Claim(page1);
    if (again.ok()) reclaimed = *again;
  });
  segment->Finish(mine, /*written=*/false);
  waiter.join();
  EXPECT_THAT(reclaimed, ElementsAre(IsRange(4096, 4096)));
  EXPECT_EQ(segment->filled_bytes(), 4096u);
}

TEST(FilledMemfdTest, AWaitEndsWhenCancelledAndPagesAreChargedOnce) {
  ASSERT_OK_AND_ASSIGN(auto segment, FilledMemfd::Create("filled-test", 16 * 4096, ""));
  ASSERT_OK_AND_ASSIGN(std::vector<Range> mine, segment->Claim(std::vector<Range>{{0, 4096}}));
  // A filler that never finishes (a source stuck on a hung mount) holds a
  // waiter only until it is cancelled (the daemon stopping).
  std::atomic<bool> stop{false};
  std::thread waiter(
      [&] { EXPECT_EQ(segment->WaitFilled(mine, [&] { return stop.load(); }), FilledMemfd::Wait::kCancelled); });
  stop = true;
  waiter.join();
  segment->Finish(mine, /*written=*/false);

  // Two tensors sharing a page, filled by two requests: the page is charged once.
  const long page = ::sysconf(_SC_PAGESIZE);
  const std::vector<Range> a{{100, 1000}}, b{{1100, static_cast<uint64_t>(page)}};
  EXPECT_EQ(segment->UnchargedBytes(a), static_cast<uint64_t>(page));
  segment->MarkCharged(a);
  EXPECT_EQ(segment->UnchargedBytes(a), 0u);
  EXPECT_EQ(segment->UnchargedBytes(b), static_cast<uint64_t>(page)) << "its first page is a's";
  segment->MarkCharged(b);
  EXPECT_EQ(segment->UnchargedBytes(std::vector<Range>{{0, 3 * static_cast<uint64_t>(page)}}),
            static_cast<uint64_t>(page));
}

TEST(FilledMemfdTest, TheSealCheckNamesWhatIsMissing) {
  ASSERT_OK_AND_ASSIGN(auto whole,
                       CreateSealedMemfd("sealed-whole", 4096, [](std::span<std::byte>) { return absl::OkStatus(); }));
  EXPECT_OK(CheckFilledSeals(whole->fd(), "whole")) << "sealed whole is sealed enough";
  const int plain = CreateSealableMemfd(std::string(400, 'n'));  // a name past the kernel's 249 bytes
  ASSERT_GE(plain, 0) << strerror(errno);
  EXPECT_THAT(CheckFilledSeals(plain, "plain"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("plain is missing seals SHRINK, GROW, "
                                                                        "FUTURE_WRITE, SEAL")));
  ::close(plain);
}

}  // namespace
}  // namespace weightstore

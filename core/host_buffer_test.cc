#include "core/host_buffer.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <utility>
#include <vector>

#include "tests/util/status_matchers.h"

namespace weightstore {
namespace {

TEST(HostBufferTest, BuffersAreWritableAlignedAndFreezeWithoutACopy) {
  for (size_t size : {size_t{1}, size_t{4096}, (size_t{2} << 20) - 1, size_t{2} << 20, (size_t{3} << 20) + 5}) {
    ASSERT_OK_AND_ASSIGN(HostBuffer buffer, HostBuffer::Allocate(size));
    ASSERT_EQ(buffer.size(), size);
    const uintptr_t at = reinterpret_cast<uintptr_t>(buffer.data());
    // Small ones from the heap, cache-line aligned; large ones 2 MiB-aligned
    // mappings (the huge-page advice, or not, changes no address).
    EXPECT_EQ(at % (size >= (size_t{2} << 20) ? (size_t{2} << 20) : 64), 0u) << size;
    std::memset(buffer.data(), 0x5a, size);
    std::byte* data = buffer.data();
    SharedBytes frozen = std::move(buffer).Freeze();
    EXPECT_EQ(frozen.data(), data) << size;
    EXPECT_EQ(frozen.size(), size);
    EXPECT_EQ(frozen.data()[size - 1], std::byte{0x5a});
    // The only holder may write it; a second holder takes that away.
    EXPECT_EQ(HostBuffer::SoleWritable(frozen).size(), size);
    SharedBytes second = frozen;
    EXPECT_TRUE(HostBuffer::SoleWritable(frozen).empty());
  }
}

TEST(HostBufferTest, ASizeNoAddressSpaceHoldsIsRefusedBeforeItIsRounded) {
  EXPECT_EQ(HostBuffer::Allocate(SIZE_MAX - 4096).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(HostBuffer::Allocate(size_t{1} << 57).status().code(), absl::StatusCode::kResourceExhausted);
}

// Which pages of [p, p + length) are resident, one flag per page.
std::vector<bool> Resident(const std::byte* p, size_t length) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> flags((length + page - 1) / page);
  EXPECT_EQ(::mincore(const_cast<std::byte*>(p), length, flags.data()), 0);
  std::vector<bool> resident;
  for (unsigned char f : flags) resident.push_back((f & 1) != 0);
  return resident;
}

// Whether PrefaultForWriting populates here: the kernel knows
// MADV_POPULATE_WRITE (Linux 5.14 and later; 23, where the C library's
// headers lack it) and WEIGHTSTORE_PREFAULT=0 does not turn it off.
bool Populates() {
  const char* off = std::getenv("WEIGHTSTORE_PREFAULT");
  if (off != nullptr && std::string_view(off) == "0") return false;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  void* probe = ::mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  const bool ok = ::madvise(probe, page, 23) == 0;
  ::munmap(probe, page);
  return ok;
}

TEST(PrefaultForWritingTest, TakesThePagesUnderTheRangeAndOnlyThemWithoutChangingAByte) {
  if (!Populates()) GTEST_SKIP() << "no MADV_POPULATE_WRITE here (or WEIGHTSTORE_PREFAULT=0): the advice is a no-op";
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  // A fresh mapping of base pages: none resident until touched.
  const size_t length = 64 * page;
  void* raw = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(raw, MAP_FAILED);
  ::madvise(raw, length, MADV_NOHUGEPAGE);
  auto* p = static_cast<std::byte*>(raw);
  std::memset(p + 40 * page, 0x33, page);  // one page already written
  auto expect_resident = [&](std::vector<size_t> pages) {
    std::vector<bool> expected(64, false);
    for (size_t i : pages) expected[i] = true;
    EXPECT_EQ(Resident(p, length), expected);
  };
  expect_resident({40});

  // Unaligned at both ends: pages 3 to 36 hold bytes of the range.
  const int kErrno = 12345;
  errno = kErrno;
  PrefaultForWriting({p + 3 * page + 100, 33 * page + 10});
  EXPECT_EQ(errno, kErrno);  // advice only: errno is the caller's
  std::vector<size_t> want;
  for (size_t i = 3; i <= 36; ++i) want.push_back(i);
  want.push_back(40);
  expect_resident(want);
  // A range whose first whole page is mapped already is taken as written before.
  PrefaultForWriting({p + 40 * page, 20 * page});
  expect_resident(want);
  // A range under 64 KiB is not worth a call.
  PrefaultForWriting({p + 50 * page, size_t{16} << 10});
  expect_resident(want);
  // A range that only begins in a written page (an allocator's header, the
  // previous piece) is judged by its first whole page: populated.
  PrefaultForWriting({p + 40 * page + 100, 20 * page});
  for (size_t i = 41; i <= 60; ++i) want.push_back(i);
  expect_resident(want);
  // Still zeros, and the page written before keeps its bytes.
  for (size_t i = 0; i < length; ++i) {
    ASSERT_EQ(p[i], i / page == 40 ? std::byte{0x33} : std::byte{0}) << "byte " << i;
  }
  ::munmap(raw, length);
}

TEST(PrefaultForWritingTest, MemoryItCannotPopulateIsLeftAloneAndTheNextRangeIsStillPopulated) {
  if (!Populates()) GTEST_SKIP() << "no MADV_POPULATE_WRITE here (or WEIGHTSTORE_PREFAULT=0): the advice is a no-op";
  const size_t length = size_t{1} << 20;
  // Read-only: populating it for writing fails; no page is taken, errno is kept.
  void* raw = ::mmap(nullptr, length, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(raw, MAP_FAILED);
  errno = 0;
  PrefaultForWriting({static_cast<std::byte*>(raw), length});
  EXPECT_EQ(errno, 0);
  std::vector<bool> untouched = Resident(static_cast<std::byte*>(raw), length);
  EXPECT_TRUE(std::none_of(untouched.begin(), untouched.end(), [](bool r) { return r; }));
  ::munmap(raw, length);
  // The failure did not turn it off: a writable range is populated.
  ASSERT_OK_AND_ASSIGN(HostBuffer buffer, HostBuffer::Allocate(size_t{4} << 20));
  PrefaultForWriting(buffer.span());
  std::vector<bool> resident = Resident(buffer.data(), buffer.size());
  EXPECT_TRUE(std::all_of(resident.begin(), resident.end(), [](bool r) { return r; }));
}

}  // namespace
}  // namespace weightstore

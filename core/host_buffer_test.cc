#include "core/host_buffer.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
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

// Whether this kernel knows MADV_POPULATE_WRITE (Linux 5.14 and later).
bool KernelPopulates() {
#ifdef MADV_POPULATE_WRITE
  void* probe = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  const bool ok = ::madvise(probe, 4096, MADV_POPULATE_WRITE) == 0;
  ::munmap(probe, 4096);
  return ok;
#else
  return false;
#endif
}

TEST(PrefaultForWritingTest, TakesThePagesUnderTheRangeAndOnlyThemWithoutChangingAByte) {
  if (!KernelPopulates()) GTEST_SKIP() << "this kernel has no MADV_POPULATE_WRITE: the advice is a no-op";
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  // A fresh mapping of 4 KiB pages: none resident until touched.
  const size_t length = 64 * page;
  void* raw = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(raw, MAP_FAILED);
  ::madvise(raw, length, MADV_NOHUGEPAGE);
  auto* p = static_cast<std::byte*>(raw);
  std::memset(p + 40 * page, 0x33, page);  // one page already written
  ASSERT_EQ(Resident(p, length), [&] {
    std::vector<bool> expected(64, false);
    expected[40] = true;
    return expected;
  }());

  // Unaligned at both ends: pages 3 to 36 hold bytes of the range.
  PrefaultForWriting({p + 3 * page + 100, 33 * page + 10});
  std::vector<bool> resident = Resident(p, length);
  for (size_t i = 0; i < 64; ++i) EXPECT_EQ(resident[i], (i >= 3 && i <= 36) || i == 40) << "page " << i;
  // A range whose first page is mapped already is taken as written before.
  PrefaultForWriting({p + 40 * page, 20 * page});
  EXPECT_FALSE(Resident(p, length)[41]);
  // A range under 64 KiB is not worth a call.
  PrefaultForWriting({p + 50 * page, 4 * page});
  EXPECT_FALSE(Resident(p, length)[50]);
  // Still zeros, and the page written before keeps its bytes.
  for (size_t i = 0; i < length; ++i) {
    ASSERT_EQ(p[i], i / page == 40 ? std::byte{0x33} : std::byte{0}) << "byte " << i;
  }

  ::munmap(raw, length);
}

TEST(PrefaultForWritingTest, MemoryItCannotPopulateIsLeftAlone) {
  if (!KernelPopulates()) GTEST_SKIP() << "this kernel has no MADV_POPULATE_WRITE: the advice is a no-op";
  const size_t length = size_t{1} << 20;
  // Read-only: populating it for writing fails, and nothing else happens.
  void* raw = ::mmap(nullptr, length, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(raw, MAP_FAILED);
  PrefaultForWriting({static_cast<std::byte*>(raw), length});
  EXPECT_EQ(static_cast<const std::byte*>(raw)[length - 1], std::byte{0});
  ::munmap(raw, length);
  // And a later writable range is still populated (the failure did not turn it off).
  ASSERT_OK_AND_ASSIGN(HostBuffer buffer, HostBuffer::Allocate(size_t{4} << 20));
  PrefaultForWriting(buffer.span());
  std::vector<bool> resident = Resident(buffer.data(), buffer.size());
  EXPECT_TRUE(resident.front() && resident.back());
}

}  // namespace
}  // namespace weightstore

#include "core/host_buffer.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <utility>

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

}  // namespace
}  // namespace weightstore

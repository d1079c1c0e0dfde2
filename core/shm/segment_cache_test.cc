#include "core/shm/segment_cache.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/shm/sealed_memfd.h"
#include "core/shm/unix_socket.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

auto FillWith(char c, std::atomic<int>* calls = nullptr) {
  return [c, calls](SegmentWriter& out) {
    if (calls != nullptr) ++*calls;
    const std::vector<std::byte> bytes(out.size(), static_cast<std::byte>(c));
    return out.Write(0, bytes);
  };
}

TEST(SegmentCacheTest, BuildsOnceAndEvictsLeastRecentlyUsed) {
  SegmentCache cache(3000);
  std::atomic<int> calls{0};
  ASSERT_OK_AND_ASSIGN(auto a, cache.GetOrCreate("a", 1000, "a", FillWith('a', &calls)));
  ASSERT_OK_AND_ASSIGN(auto b, cache.GetOrCreate("b", 1000, "b", FillWith('b', &calls)));
  ASSERT_OK_AND_ASSIGN(auto a2, cache.GetOrCreate("a", 1000, "a", FillWith('a', &calls)));  // a is now newest
  EXPECT_EQ(a2.get(), a.get());
  EXPECT_EQ(calls.load(), 2);
  ASSERT_OK_AND_ASSIGN(auto c, cache.GetOrCreate("c", 1500, "c", FillWith('c', &calls)));  // evicts b
  SegmentCache::Stats s = cache.stats();
  EXPECT_EQ(s.segments, 2u);
  EXPECT_EQ(s.segment_bytes, 2500u);
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_EQ(s.hits, 1u);
  // b's holders keep valid bytes; asking again rebuilds it.
  EXPECT_EQ(b->bytes().view(), std::string(1000, 'b'));
  ASSERT_OK_AND_ASSIGN(auto b2, cache.GetOrCreate("b", 1000, "b", FillWith('b', &calls)));
  EXPECT_NE(b2.get(), b.get());
  EXPECT_EQ(calls.load(), 4);
}

TEST(SegmentCacheTest, RefusesWhatCanNeverFitAndForgetsFailedBuilds) {
  SegmentCache cache(1000);
  EXPECT_THAT(cache.GetOrCreate("big", 1001, "model 'x'", FillWith('x')),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("model 'x' needs 1001 bytes")));
  EXPECT_THAT(cache.GetOrCreate("bad", 10, "bad", [](SegmentWriter&) { return absl::InternalError("boom"); }),
              StatusIs(absl::StatusCode::kInternal));
  EXPECT_EQ(cache.stats().segment_bytes, 0u);
  EXPECT_OK(cache.GetOrCreate("bad", 10, "bad", FillWith('y')).status());
}

TEST(SegmentCacheTest, ReservationsAreNeverEvictedAndReleaseOnDestruction) {
  SegmentCache cache(1000);
  ASSERT_OK(cache.GetOrCreate("s", 600, "s", FillWith('s')).status());
  {
    ASSERT_OK_AND_ASSIGN(SegmentCache::Reservation r, cache.Reserve(700, "preloading 'p'"));  // evicts s
    EXPECT_EQ(cache.stats().segments, 0u);
    EXPECT_EQ(cache.stats().reserved_bytes, 700u);
    EXPECT_THAT(cache.GetOrCreate("t", 400, "t", FillWith('t')), StatusIs(absl::StatusCode::kResourceExhausted));
    EXPECT_THAT(cache.Reserve(301, "preloading 'q'"),
                StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("preloading 'q'")));
  }
  EXPECT_EQ(cache.stats().reserved_bytes, 0u);
  EXPECT_OK(cache.GetOrCreate("t", 1000, "t", FillWith('t')).status());
}

TEST(SegmentCacheTest, ConcurrentRequestsForOneKeyShareOneBuild) {
  SegmentCache cache(1 << 20);
  std::atomic<int> calls{0};
  std::vector<std::thread> threads;
  std::vector<const MappedFile*> got(8);
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      auto s = cache.GetOrCreate("k", 4096, "k", [&](SegmentWriter& out) {
        ++calls;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        return out.Write(0, std::vector<std::byte>(out.size(), std::byte{1}));
      });
      got[i] = s.ok() ? s->get() : nullptr;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(calls.load(), 1);
  for (const MappedFile* p : got) EXPECT_EQ(p, got[0]);
}

}  // namespace
}  // namespace weightstore

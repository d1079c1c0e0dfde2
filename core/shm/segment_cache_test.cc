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

// Sizes in pages: a segment is charged its size in whole pages, plus 3 bytes
// for each byte of its key.
const uint64_t kPage = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));

TEST(SegmentCacheTest, BuildsOnceAndEvictsLeastRecentlyUsed) {
  SegmentCache cache(3 * kPage + 16);
  std::atomic<int> calls{0};
  ASSERT_OK_AND_ASSIGN(auto a, cache.GetOrCreate("a", kPage, "a", FillWith('a', &calls)));
  ASSERT_OK_AND_ASSIGN(auto b, cache.GetOrCreate("b", kPage, "b", FillWith('b', &calls)));
  ASSERT_OK_AND_ASSIGN(auto a2, cache.GetOrCreate("a", kPage, "a", FillWith('a', &calls)));  // a is now newest
  EXPECT_EQ(a2.get(), a.get());
  EXPECT_EQ(calls.load(), 2);
  ASSERT_OK_AND_ASSIGN(auto c, cache.GetOrCreate("c", kPage + kPage / 2, "c", FillWith('c', &calls)));  // evicts b
  SegmentCache::Stats s = cache.stats();
  EXPECT_EQ(s.segments, 2u);
  EXPECT_EQ(s.segment_bytes, 2 * kPage + kPage / 2);
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_EQ(s.hits, 1u);
  // b's holders keep valid bytes; asking again rebuilds it.
  EXPECT_EQ(b->bytes().view(), std::string(kPage, 'b'));
  ASSERT_OK_AND_ASSIGN(auto b2, cache.GetOrCreate("b", kPage, "b", FillWith('b', &calls)));
  EXPECT_NE(b2.get(), b.get());
  EXPECT_EQ(calls.load(), 4);
}

TEST(SegmentCacheTest, RefusesWhatCanNeverFitAndForgetsFailedBuilds) {
  SegmentCache cache(kPage + 16);
  EXPECT_THAT(cache.GetOrCreate("big", kPage + 1, "model 'x'", FillWith('x')),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr(absl::StrCat("model 'x' needs ", kPage + 1))));
  EXPECT_THAT(cache.GetOrCreate("bad", 10, "bad", [](SegmentWriter&) { return absl::InternalError("boom"); }),
              StatusIs(absl::StatusCode::kInternal));
  EXPECT_EQ(cache.stats().segment_bytes, 0u);
  EXPECT_OK(cache.GetOrCreate("bad", 10, "bad", FillWith('y')).status());
}

TEST(SegmentCacheTest, EmptyAndTinySegmentsStillCostAPageAndTheirCountIsBounded) {
  // An attacker's stream of distinct keys for empty segments (a cast of a
  // [k:k] slice) neither escapes the budget nor piles up descriptors.
  SegmentCache cache(64 * kPage, /*max_segments=*/8);
  for (int k = 0; k < 100; ++k) {
    ASSERT_OK(cache.GetOrCreate(absl::StrCat("v|0:F16:[", k, ":", k, "]"), 0, "empty", FillWith('e')).status());
    SegmentCache::Stats s = cache.stats();
    EXPECT_LE(s.segments, 8u);
  }
  EXPECT_EQ(cache.stats().evictions, 92u);
  SegmentCache small(4 * kPage);  // one-byte segments: at most 4 fit
  for (int k = 0; k < 10; ++k) ASSERT_OK(small.GetOrCreate(absl::StrCat(k), 1, "tiny", FillWith('t')).status());
  EXPECT_LE(small.stats().segments, 3u);  // 4 pages, less the keys' bytes
}

TEST(SegmentCacheTest, ReservationsAreNeverEvictedAndReleaseOnDestruction) {
  SegmentCache cache(4 * kPage);
  ASSERT_OK(cache.GetOrCreate("s", 2 * kPage, "s", FillWith('s')).status());
  {
    ASSERT_OK_AND_ASSIGN(SegmentCache::Reservation r, cache.Reserve(3 * kPage, "preloading 'p'"));  // evicts s
    EXPECT_EQ(cache.stats().segments, 0u);
    EXPECT_EQ(cache.stats().reserved_bytes, 3 * kPage);
    EXPECT_THAT(cache.GetOrCreate("t", 400, "t", FillWith('t')), StatusIs(absl::StatusCode::kResourceExhausted));
    EXPECT_THAT(cache.Reserve(kPage + 1, "preloading 'q'"),
                StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("preloading 'q'")));
  }
  EXPECT_EQ(cache.stats().reserved_bytes, 0u);
  EXPECT_OK(cache.GetOrCreate("t", 3 * kPage, "t", FillWith('t')).status());
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

TEST(SegmentCacheTest, AFilledSegmentIsChargedAsItGrowsAndNotEvictedWhileLeased) {
  SegmentCache cache(6 * kPage);
  const std::string key = "filled|v|0";
  ASSERT_OK_AND_ASSIGN(SegmentCache::FilledLease lease, cache.GetOrCreateFilled(key, 64 * kPage, "copy of 'f'"));
  EXPECT_EQ(lease.segment().size(), 64 * kPage) << "sized as the file; charged only what is filled";
  EXPECT_EQ(cache.stats().segment_bytes, 0u);
  ASSERT_OK(cache.Grow(lease, 2 * kPage, "copy of 'f'"));
  EXPECT_EQ(cache.stats().segment_bytes, 2 * kPage);
  EXPECT_THAT(cache.Grow(lease, 4 * kPage, "copy of 'f'"),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("copy of 'f' needs")));
  {  // Asked again under its key: the same segment, a hit.
    ASSERT_OK_AND_ASSIGN(SegmentCache::FilledLease again, cache.GetOrCreateFilled(key, 64 * kPage, "copy of 'f'"));
    EXPECT_EQ(again.shared(), lease.shared());
    EXPECT_EQ(cache.stats().hits, 1u);
  }
  // Room is made from the other segments, never from a leased one.
  ASSERT_OK(cache.GetOrCreate("d", kPage, "d", FillWith('d')).status());
  EXPECT_THAT(cache.GetOrCreate("e", 4 * kPage, "e", FillWith('e')), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(cache.stats().segments, 2u) << "nothing is evicted for a request that cannot fit even then";
  EXPECT_THAT(cache.GetOrCreate(key, kPage, "k", FillWith('k')), StatusIs(absl::StatusCode::kInternal))
      << "a key names one kind of segment";
  std::shared_ptr<FilledMemfd> held = lease.shared();
  lease = SegmentCache::FilledLease();  // released: now it may go
  ASSERT_OK(cache.GetOrCreate("e", 4 * kPage, "e", FillWith('e')).status());
  EXPECT_EQ(cache.stats().segment_bytes, 5 * kPage) << "e and d";
  EXPECT_EQ(cache.stats().evictions, 1u) << "the filled one, the oldest";
  EXPECT_THAT(cache.Grow(SegmentCache::FilledLease(), kPage, "gone"), StatusIs(absl::StatusCode::kAborted));
  // Asked for after its eviction: a new, empty one.
  ASSERT_OK_AND_ASSIGN(SegmentCache::FilledLease fresh, cache.GetOrCreateFilled(key, 64 * kPage, "copy of 'f'"));
  EXPECT_NE(fresh.shared(), held);
  // Clear() keeps what is leased, and drops it once released.
  cache.Clear();
  EXPECT_EQ(cache.stats().segments, 1u);
  ASSERT_OK(cache.Grow(fresh, kPage, "copy of 'f'"));
  fresh = SegmentCache::FilledLease();
  cache.Clear();
  EXPECT_EQ(cache.stats().segments, 0u);
  EXPECT_EQ(cache.stats().segment_bytes, 0u);
}

}  // namespace
}  // namespace weightstore

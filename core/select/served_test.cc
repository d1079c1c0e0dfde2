#include "core/select/served.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "core/crc32c.h"
#include "core/formats/safetensors.h"
#include "tests/util/status_matchers.h"

namespace weightstore {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

// A 2x3 F32 tensor "w" stored row-major, and "s", a strided 3x2 view of the
// same six floats (w transposed), both over one storage.
std::shared_ptr<const Checkpoint> TwoViews() {
  auto values = std::make_shared<std::vector<float>>(std::vector<float>{1, 2, 3, 4, 5, 6});
  SharedBytes bytes(values, std::span<const std::byte>(reinterpret_cast<const std::byte*>(values->data()),
                                                       values->size() * sizeof(float)));
  auto storage = LazyStorage::Ready(bytes);
  std::vector<CheckpointEntry> entries(2);
  entries[0].spec = {"w", DType::kF32, {2, 3}};
  entries[0].layout.storage = storage;
  entries[1].spec = {"s", DType::kF32, {3, 2}};
  entries[1].layout.storage = storage;
  entries[1].layout.strides = {1, 3};
  auto checkpoint = Checkpoint::Create(kSafeTensorsFormat, "mem", {}, std::move(entries));
  EXPECT_OK(checkpoint.status());
  return *checkpoint;
}

std::shared_ptr<const Snapshot> Serve(const std::shared_ptr<const Checkpoint>& c, std::vector<SnapshotTensor> tensors) {
  auto snapshot = Snapshot::Create(c, std::move(tensors));
  EXPECT_OK(snapshot.status());
  return *snapshot;
}

std::vector<std::byte> Whole(const Snapshot& snapshot, const ServedTensorPlan& plan) {
  std::vector<std::byte> out(plan.byte_size);
  EXPECT_OK(MaterializeServed(snapshot, plan, 0, out));
  return out;
}

TEST(ServedTensorPlanTest, NamesEachTransformAndKeysTheServedBytes) {
  auto c = TwoViews();
  const CheckpointEntry& w = c->entries()[0];
  const CheckpointEntry& s = c->entries()[1];
  auto snapshot = Serve(c, {{{"as_stored", DType::kF32, {2, 3}}, &w, false},
                            {{"gathered", DType::kF32, {3, 2}}, &s, false},
                            {{"cast", DType::kF16, {2, 3}}, &w, false},
                            {{"transposed", DType::kF32, {3, 2}}, &w, true}});
  std::vector<ServedTensorPlan> plans;
  for (const SnapshotTensor& t : snapshot->tensors()) plans.push_back(PlanServedTensor(*snapshot, t));
  EXPECT_TRUE(plans[0].is_byte_range());
  EXPECT_TRUE(plans[1].gather && !plans[1].is_byte_range());
  EXPECT_TRUE(plans[2].cast && !plans[2].is_byte_range());
  EXPECT_TRUE(plans[3].transpose && !plans[3].is_byte_range());
  EXPECT_EQ(plans[2].byte_size, 12u);
  // Different served bytes, different keys; the name served under does not count.
  for (size_t i = 0; i < plans.size(); ++i) {
    for (size_t j = i + 1; j < plans.size(); ++j) EXPECT_NE(plans[i].key, plans[j].key) << i << " " << j;
  }
  auto renamed = Serve(c, {{{"other_name", DType::kF16, {2, 3}}, &w, false}});
  EXPECT_EQ(PlanServedTensor(*renamed, renamed->tensors()[0]).key, plans[2].key);
  EXPECT_EQ(plans[3].key, "0:F32:T");
  // A transpose of w and a gather of its transposed view serve the same floats.
  EXPECT_EQ(Whole(*snapshot, plans[1]), Whole(*snapshot, plans[3]));
}

TEST(ServedTensorPlanTest, AnyElementAlignedRangeMaterializesAsPartOfTheWhole) {
  auto c = TwoViews();
  auto snapshot = Serve(c, {{{"gathered", DType::kF32, {3, 2}}, &c->entries()[1], false},
                            {{"cast", DType::kF16, {2, 3}}, &c->entries()[0], false},
                            {{"transposed", DType::kBF16, {3, 2}}, &c->entries()[0], true}});
  for (const SnapshotTensor& t : snapshot->tensors()) {
    const ServedTensorPlan plan = PlanServedTensor(*snapshot, t);
    const std::vector<std::byte> whole = Whole(*snapshot, plan);
    const uint64_t element = DTypeSize(t.spec.dtype);
    for (uint64_t at = 0; at < plan.byte_size; at += element) {
      std::vector<std::byte> part(std::min<uint64_t>(2 * element, plan.byte_size - at));
      ASSERT_OK(MaterializeServed(*snapshot, plan, at, part));
      EXPECT_EQ(0, std::memcmp(part.data(), whole.data() + at, part.size())) << t.spec.name << " at " << at;
    }
    // Whole rows (a transpose's tiled path) as well as element pairs.
    for (uint64_t rows = 1; rows <= t.spec.shape[0]; ++rows) {
      const uint64_t row = plan.byte_size / t.spec.shape[0];
      std::vector<std::byte> band(rows * row);
      ASSERT_OK(
          MaterializeServed(*snapshot, plan, row, std::span(band).first(std::min(band.size(), plan.byte_size - row))));
      EXPECT_EQ(0, std::memcmp(band.data(), whole.data() + row, std::min(band.size(), plan.byte_size - row)))
          << t.spec.name << " rows from 1, " << rows;
    }
    std::vector<std::byte> misaligned(element);
    EXPECT_EQ(MaterializeServed(*snapshot, plan, 1, misaligned).code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(ServedTensorPlanTest, PiecesAreWholeElementsOrATransposesRowsAndMakeTheWholeTensor) {
  auto c = TwoViews();
  auto snapshot = Serve(c, {{{"as_stored", DType::kF32, {2, 3}}, &c->entries()[0], false},
                            {{"gathered", DType::kF32, {3, 2}}, &c->entries()[1], false},
                            {{"transposed", DType::kBF16, {3, 2}}, &c->entries()[0], true}});
  for (const SnapshotTensor& t : snapshot->tensors()) {
    const ServedTensorPlan plan = PlanServedTensor(*snapshot, t);
    // A transpose takes whole served rows, anything else whole elements: at
    // least one, else as many as fit in `about`.
    const uint64_t unit = plan.transpose ? plan.byte_size / t.spec.shape[0] : DTypeSize(t.spec.dtype);
    for (uint64_t about : {1, 3, 5, 8, 64}) {
      const uint64_t piece = ServedPieceBytes(plan, about);
      EXPECT_EQ(piece % unit, 0u) << t.spec.name << " " << about;
      EXPECT_LE(piece, std::max(about, unit)) << t.spec.name << " " << about;
      std::vector<std::byte> out(plan.byte_size);
      int asked = 0;
      ASSERT_OK(MaterializeServedInPieces(*snapshot, plan, out, about * DTypeSize(t.spec.dtype), [&] {
        ++asked;
        return false;
      }));
      EXPECT_EQ(out, Whole(*snapshot, plan)) << t.spec.name << " " << about;
      EXPECT_GE(asked, 1);
    }
  }
}

TEST(ServedTensorPlanTest, ACancelStopsBetweenPiecesAndWritesNoFurther) {
  auto c = TwoViews();
  auto snapshot = Serve(c, {{{"transposed", DType::kF32, {3, 2}}, &c->entries()[0], true}});
  const ServedTensorPlan plan = PlanServedTensor(*snapshot, snapshot->tensors()[0]);
  std::vector<std::byte> out(plan.byte_size, std::byte{0xAB});
  int asked = 0;
  // One row (8 bytes) a piece; the cancel comes before the second.
  EXPECT_THAT(MaterializeServedInPieces(*snapshot, plan, out, 8, [&] { return ++asked == 2; }),
              StatusIs(absl::StatusCode::kCancelled, HasSubstr("cancelled in tensor 'transposed' at byte 8 of 24")));
  const std::vector<std::byte> whole = Whole(*snapshot, plan);
  EXPECT_TRUE(std::equal(out.begin(), out.begin() + 8, whole.begin()));
  EXPECT_TRUE(std::all_of(out.begin() + 8, out.end(), [](std::byte b) { return b == std::byte{0xAB}; }));
}

TEST(ServedTensorPlanTest, ChecksumIsOfTheServedBytesAndCachedByKey) {
  auto c = TwoViews();
  auto snapshot = Serve(c, {{{"w", DType::kF32, {2, 3}}, &c->entries()[0], false},
                            {{"cast", DType::kBF16, {2, 3}}, &c->entries()[0], false}});
  ChecksumCache cache;
  for (const SnapshotTensor& t : snapshot->tensors()) {
    const ServedTensorPlan plan = PlanServedTensor(*snapshot, t);
    const std::vector<std::byte> bytes = Whole(*snapshot, plan);
    const uint32_t want = Crc32c(absl::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
    EXPECT_FALSE(cache.Find(plan.key).has_value());
    ASSERT_OK_AND_ASSIGN(uint32_t crc, ServedChecksum(*snapshot, plan, cache));
    EXPECT_EQ(crc, want) << t.spec.name;
    EXPECT_EQ(cache.Find(plan.key), want);
  }
}

TEST(ServedTensorPlanTest, ASourceThatChangedKeepsNoChecksum) {
  auto c = TwoViews();
  auto snapshot = Serve(c, {{{"w", DType::kF32, {2, 3}}, &c->entries()[0], false}});
  ChecksumCache changed([] { return absl::AbortedError("'mem' changed on disk"); });
  const ServedTensorPlan plan = PlanServedTensor(*snapshot, snapshot->tensors()[0]);
  EXPECT_EQ(ServedChecksum(*snapshot, plan, changed).status().code(), absl::StatusCode::kAborted);
  EXPECT_FALSE(changed.Find(plan.key).has_value());
}

TEST(ChecksumCacheTest, ConcurrentCallersComputeAKeyOnceAndAllGetItsValue) {
  ChecksumCache cache;
  std::atomic<int> computed{0};
  absl::Notification release;
  std::vector<std::thread> callers;
  std::vector<uint32_t> got(8, 0);
  std::atomic<int> waiting{0};
  for (int i = 0; i < 8; ++i) {
    callers.emplace_back([&, i] {
      bool counted = false;
      auto crc = cache.FindOrCompute(
          "k",
          [&]() -> absl::StatusOr<uint32_t> {
            ++computed;
            release.WaitForNotification();  // the others arrive meanwhile
            return 0x1234u;
          },
          [&] {  // asked only while waiting on another caller's computation
            if (!std::exchange(counted, true)) ++waiting;
            return false;
          });
      got[i] = crc.ok() ? *crc : 0;
    });
  }
  // Released once the seven others wait on the one computing (or, wrongly,
  // once a second computes too).
  while (waiting.load() < 7 && computed.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  release.Notify();
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(computed.load(), 1);
  EXPECT_EQ(got, std::vector<uint32_t>(8, 0x1234u));
}

TEST(ChecksumCacheTest, WaitersShareAnErrorButComputeAgainAfterACancel) {
  ChecksumCache cache;
  for (const absl::StatusCode code : {absl::StatusCode::kDataLoss, absl::StatusCode::kCancelled}) {
    SCOPED_TRACE(absl::StatusCodeToString(code));
    const std::string key = absl::StatusCodeToString(code);
    std::atomic<int> computed{0};
    absl::Notification release;
    absl::StatusOr<uint32_t> first, second;
    std::thread a([&] {
      first = cache.FindOrCompute(key, [&]() -> absl::StatusOr<uint32_t> {
        ++computed;
        release.WaitForNotification();
        return absl::Status(code, "from the first caller");
      });
    });
    while (computed.load() == 0) std::this_thread::yield();
    std::atomic<bool> b_waits{false};
    std::thread b([&] {
      second = cache.FindOrCompute(
          key,
          [&]() -> absl::StatusOr<uint32_t> {
            ++computed;
            return 42u;
          },
          [&] {  // asked only while waiting on a's computation
            b_waits = true;
            return false;
          });
    });
    // Released once b waits on a (or, wrongly, once b computes too).
    while (!b_waits.load() && computed.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    release.Notify();
    a.join();
    b.join();
    EXPECT_EQ(first.status().code(), code);
    if (code == absl::StatusCode::kCancelled) {  // a's client left; b's did not
      EXPECT_EQ(computed.load(), 2);
      EXPECT_EQ(second.value_or(0), 42u);
    } else {
      EXPECT_EQ(computed.load(), 1);
      EXPECT_EQ(second.status().code(), code);
    }
  }
}

TEST(ChecksumCacheTest, AWaiterWhoseCallerLeftStopsWaiting) {
  ChecksumCache cache;
  absl::Notification release, computing;
  std::thread a([&] {
    (void)cache.FindOrCompute("k", [&]() -> absl::StatusOr<uint32_t> {
      computing.Notify();
      release.WaitForNotification();
      return 1u;
    });
  });
  computing.WaitForNotification();
  std::atomic<bool> left{false};
  absl::StatusOr<uint32_t> waited;
  std::thread b([&] {
    waited = cache.FindOrCompute(
        "k", [] { return absl::StatusOr<uint32_t>(2u); }, [&] { return left.load(); });
  });
  left = true;
  b.join();  // while the first computation still runs
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kCancelled);
  release.Notify();
  a.join();
  EXPECT_EQ(cache.Find("k"), 1u);
}

TEST(ServedTensorPlanTest, ACancelledChecksumStopsAndKeepsNothing) {
  auto c = TwoViews();
  auto snapshot = Serve(c, {{{"cast", DType::kBF16, {2, 3}}, &c->entries()[0], false}});
  ChecksumCache cache;
  const ServedTensorPlan plan = PlanServedTensor(*snapshot, snapshot->tensors()[0]);
  EXPECT_THAT(ServedChecksum(*snapshot, plan, cache, [] { return true; }).status(),
              ::weightstore::testing::StatusIs(absl::StatusCode::kCancelled, ::testing::HasSubstr("'cast'")));
  EXPECT_FALSE(cache.Find(plan.key).has_value());
  EXPECT_TRUE(ServedChecksum(*snapshot, plan, cache, [] { return false; }).ok());
}

TEST(ChecksumCacheTest, AFailedComputationIsNotKeptAndTheNextCallerComputesAgain) {
  ChecksumCache cache;
  int calls = 0;
  auto fail = [&]() -> absl::StatusOr<uint32_t> {
    ++calls;
    return absl::DataLossError("'m.safetensors' is shorter than when it was listed");
  };
  EXPECT_EQ(cache.FindOrCompute("k", fail).status().code(), absl::StatusCode::kDataLoss);
  ASSERT_OK_AND_ASSIGN(uint32_t crc, cache.FindOrCompute("k", [&]() -> absl::StatusOr<uint32_t> {
    ++calls;
    return 7u;
  }));
  EXPECT_EQ(crc, 7u);
  EXPECT_EQ(calls, 2);
  // Kept now: not computed again.
  EXPECT_EQ(*cache.FindOrCompute("k", fail), 7u);
  EXPECT_EQ(calls, 2);
}

}  // namespace
}  // namespace weightstore

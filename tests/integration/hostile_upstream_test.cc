// A following node against an upstream that lies: a real trainer's daemon
// seen through a store that alters what it says (an element patch whose
// result is not what its digest says, a version id reused for other
// content), and one that publishes versions without end. The node here is
// in the test's process (a registry, a node cache, a follower), so that the
// lies sit between it and the real upstream.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/store.h"
#include "client/updates.h"
#include "core/catalog/registry.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "core/status_macros.h"
#include "origin/grpc_origin.h"
#include "origin/node_cache.h"
#include "tests/util/daemon.h"
#include "tests/util/metrics.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "tests/util/wait.h"

namespace weightstore {
namespace {

using testing::Daemon;

constexpr char kName[] = "m";
constexpr size_t kElements = 64 << 10;

// Version `v`: two F32 tensors, 1% of whose elements move at each version.
std::vector<SharedTensor> Version(int v) {
  std::vector<SharedTensor> out;
  for (int i = 0; i < 2; ++i) {
    std::vector<float> values(kElements);
    for (size_t k = 0; k < kElements; ++k) {
      values[k] = static_cast<float>((k + static_cast<size_t>(i) * 7) % 997) * 1e-3f;
      for (int step = 1; step <= v; ++step) {
        if ((k * 7919 + static_cast<size_t>(step) * 31) % 100 == 0) values[k] += 1e-2f * static_cast<float>(step);
      }
    }
    std::string bytes(reinterpret_cast<const char*>(values.data()), values.size() * 4);
    out.push_back({{absl::StrCat("layers.", i, ".weight"), DType::kF32, {kElements}}, SharedBytes::Copy(bytes)});
  }
  return out;
}

// How the store between the node and the upstream lies.
struct Lies {
  // Flips a byte of every element patch's body after its CRC32C was checked:
  // a patch whose result is not what its digest says.
  std::atomic<bool> patches{false};
  // Names the upstream's current version `reused` (an id the node keeps for
  // other content), translating it back when the node pins it.
  absl::Mutex mu;
  std::string reused ABSL_GUARDED_BY(mu), real ABSL_GUARDED_BY(mu);
  // Holds every listing (so every step) until opened.
  bool closed ABSL_GUARDED_BY(mu) = false;
  int held_listings ABSL_GUARDED_BY(mu) = 0;
  std::atomic<int> patches_altered{0};
  // Begins every whole tensor twice, as a stream resumed after a break
  // begins the tensor it was in again.
  std::atomic<bool> restart{false};
  std::atomic<int> restarts{0};
  // After the tensors listed, sends one more of 64 GiB: more than listed.
  std::atomic<bool> flood{false};
  std::atomic<int> floods_refused{0};
  std::string flood_error ABSL_GUARDED_BY(mu);
};

// The upstream's store, as the lies make it.
class LyingStore : public client::Store {
 public:
  LyingStore(std::unique_ptr<client::Store> inner, Lies* lies) : inner_(std::move(inner)), lies_(lies) {}

  absl::StatusOr<std::vector<client::CheckpointSummary>> ListCheckpoints(
      const std::shared_ptr<const std::atomic<bool>>& cancel) override {
    return inner_->ListCheckpoints(cancel);
  }
  absl::StatusOr<client::CheckpointSummary> GetCheckpoint(
      const std::string& name, const std::shared_ptr<const std::atomic<bool>>& cancel) override {
    auto summary = inner_->GetCheckpoint(name, cancel);
    if (summary.ok()) summary->version = Said(summary->version);
    return summary;
  }
  absl::StatusOr<client::TensorListing> ListTensors(const std::string& name, const client::Query& query) override {
    {
      absl::MutexLock lock(&lies_->mu);
      ++lies_->held_listings;
      lies_->mu.Await(absl::Condition(
          +[](bool* closed) { return !*closed; }, &lies_->closed));
      --lies_->held_listings;
    }
    auto listing = inner_->ListTensors(name, Pinned(query));
    if (listing.ok()) listing->version = Said(listing->version);
    return listing;
  }
  absl::Status FetchTensors(const std::string& name, const client::Query& query, client::TensorSink* sink) override {
    Sink lying(sink, this);
    WEIGHTSTORE_RETURN_IF_ERROR(inner_->FetchTensors(name, Pinned(query), &lying));
    if (!lies_->flood.load()) return absl::OkStatus();
    const TensorSpec flood{"flood.weight", DType::kF32, {uint64_t{16} << 30}};
    absl::StatusOr<std::span<std::byte>> span = sink->Begin(flood);
    if (span.ok()) return sink->End(flood);  // the node took 64 GiB it was never told of
    lies_->floods_refused.fetch_add(1);
    absl::MutexLock lock(&lies_->mu);
    lies_->flood_error = std::string(span.status().message());
    return span.status();
  }

 private:
  // The id said for `real`.
  std::string Said(const std::string& real) {
    absl::MutexLock lock(&lies_->mu);
    if (lies_->reused.empty()) return real;
    lies_->real = real;
    return lies_->reused;
  }
  // The query as the upstream must see it: a pin to the lie is a pin to the truth.
  client::Query Pinned(client::Query query) {
    absl::MutexLock lock(&lies_->mu);
    if (!lies_->reused.empty() && query.version == lies_->reused) query.version = lies_->real;
    return query;
  }

  class Sink : public client::TensorSink {
   public:
    Sink(client::TensorSink* inner, LyingStore* store) : inner_(inner), store_(store) {}
    absl::StatusOr<std::span<std::byte>> Begin(const TensorSpec& spec) override {
      if (store_->lies_->restart.load()) {
        auto first = inner_->Begin(spec);
        if (!first.ok()) return first;
        if (!first->empty()) (*first)[0] = std::byte{0x5a};  // part of it came, then the stream broke
        store_->lies_->restarts.fetch_add(1);
      }
      return inner_->Begin(spec);
    }
    absl::Status End(const TensorSpec& spec) override { return inner_->End(spec); }
    absl::StatusOr<std::span<std::byte>> BeginPatch(const TensorSpec& spec, const ElementPatch& header, uint64_t bytes,
                                                    const std::string& digest) override {
      auto span = inner_->BeginPatch(spec, header, bytes, digest);
      if (span.ok()) body_ = *span;
      return span;
    }
    absl::Status EndPatch(const TensorSpec& spec) override {
      if (store_->lies_->patches.load() && !body_.empty()) {
        body_.back() ^= std::byte{0x40};  // a value's byte
        store_->lies_->patches_altered.fetch_add(1);
      }
      return inner_->EndPatch(spec);
    }
    void OnVersion(const std::string& version) override { inner_->OnVersion(store_->Said(version)); }

   private:
    client::TensorSink* inner_;
    LyingStore* store_;
    std::span<std::byte> body_;
  };

  std::unique_ptr<client::Store> inner_;
  Lies* lies_;
};

class HostileUpstreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    trainer_models_ = testing::MakeScratchDir("hostile-trainer");
    testing::WriteFileOrDie(trainer_models_ + "/m.safetensors",
                            *SerializeCheckpoint(kSafeTensorsFormat, Version(0), {}));
    trainer_ = std::make_unique<Daemon>(trainer_models_);
    ASSERT_NE(trainer_->port(), 0) << trainer_->log();
    client::RemoteOptions options;
    options.deadline = std::chrono::seconds(60);
    ASSERT_OK_AND_ASSIGN(trainer_store_, client::ConnectRemoteStore(trainer_->address(), options));

    // The node, in this process.
    RegistryOptions registry;
    registry.models_dir = testing::MakeScratchDir("hostile-node");
    registry.tensor_digests = true;
    registry.kept_patch_bytes = 64 << 20;
    registry_ = std::make_unique<CheckpointRegistry>(registry);
    const std::string url = absl::StrCat("grpc://", trainer_->address());
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<origin::Origin> pulls, origin::OpenGrpcOrigin(url, {}));
    origin::FollowUpstream follow;
    client::RemoteOptions watching;
    watching.resume_window = std::chrono::milliseconds(0);
    ASSERT_OK_AND_ASSIGN(follow.watch, origin::OpenGrpcUpstream(url, watching));
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Store> steps, origin::OpenGrpcUpstream(url, {}));
    follow.steps = std::make_unique<LyingStore>(std::move(steps), &lies_);
    ASSERT_OK_AND_ASSIGN(cache_, origin::NodeCache::Open(registry_.get(), std::move(pulls), {}, std::move(follow)));
    ASSERT_OK(cache_->Pull(kName).status());
    versions_.push_back(registry_->Get(kName)->version());
  }

  // Pushes version `v` to the trainer (element patches against the one it
  // serves); returns its id.
  std::string Push(int v) {
    auto served = trainer_store_->ListTensors(kName, {});
    if (!served.ok()) return served.status().ToString();
    auto plan = client::PlanPush(*served, Version(v), Version(v - 1));
    if (!plan.ok()) return plan.status().ToString();
    auto pushed = trainer_store_->Push(kName, plan->request);
    if (!pushed.ok()) return pushed.status().ToString();
    versions_.push_back(pushed->version);
    return pushed->version;
  }

  void TearDown() override {
    absl::MutexLock lock(&lies_.mu);
    lies_.closed = false;  // no step stays waiting on a listing
  }

  std::string Held() const {
    auto v = registry_->Get(kName);
    return v != nullptr ? v->version() : "";
  }
  // Steps the node counted, patched or whole. A version is served a moment
  // before its step is counted: tests wait for the count, not the version.
  uint64_t Steps() const {
    const PullStats stats = cache_->Stats();
    const FollowedStats* s = Stats(stats);
    return s == nullptr ? 0 : s->steps_patched + s->steps_whole + s->steps_ranged;
  }
  bool WaitForSteps(uint64_t n) const {
    return testing::WaitUntil([&] { return Steps() >= n; });
  }
  const FollowedStats* Stats(const PullStats& s) const {
    for (const FollowedStats& c : s.follow.checkpoints) {
      if (c.name == kName) return &c;
    }
    return nullptr;
  }
  bool ServesBitExact(int v) const {
    auto held = registry_->Get(kName);
    if (held == nullptr) return false;
    for (const SharedTensor& want : Version(v)) {
      const CheckpointEntry* e = held->checkpoint()->Find(want.spec.name);
      if (e == nullptr) return false;
      auto got = held->checkpoint()->Read(*e);
      if (!got.ok() || got->bytes.view() != want.bytes.view()) return false;
    }
    return true;
  }

  std::string trainer_models_;
  std::unique_ptr<Daemon> trainer_;
  std::unique_ptr<client::Store> trainer_store_;
  Lies lies_;
  std::unique_ptr<CheckpointRegistry> registry_;
  std::unique_ptr<origin::NodeCache> cache_;
  std::vector<std::string> versions_;
};

TEST_F(HostileUpstreamTest, APatchThatLiesIsDroppedAndItsTensorFetchedWholeAndCounted) {
  lies_.patches = true;
  const std::string v1 = Push(1);
  ASSERT_TRUE(testing::WaitUntil([&] { return Held() == v1; })) << Held();
  ASSERT_TRUE(WaitForSteps(1));
  EXPECT_GT(lies_.patches_altered.load(), 0);
  EXPECT_TRUE(ServesBitExact(1));
  const PullStats stats = cache_->Stats();
  const FollowedStats* s = Stats(stats);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->fallbacks.at("patch_failed"), 1u);
  EXPECT_EQ(s->steps_whole, 1u);
  EXPECT_EQ(s->steps_patched, 0u);

  // Honest again: the next step comes as patches.
  lies_.patches = false;
  const std::string v2 = Push(2);
  ASSERT_TRUE(testing::WaitUntil([&] { return Held() == v2; })) << Held();
  ASSERT_TRUE(WaitForSteps(2));
  EXPECT_TRUE(ServesBitExact(2));
  EXPECT_EQ(Stats(cache_->Stats())->steps_patched, 1u);
}

// A whole tensor begun again (a stream resumed mid-tensor) is taken again,
// not counted twice: the step that falls back to whole tensors succeeds.
TEST_F(HostileUpstreamTest, ATensorBegunAgainByAResumedStreamIsTakenOnce) {
  lies_.patches = true;  // so the step falls back to whole tensors
  lies_.restart = true;
  const std::string v1 = Push(1);
  ASSERT_TRUE(testing::WaitUntil([&] { return Held() == v1; })) << Held();
  ASSERT_TRUE(WaitForSteps(1));
  EXPECT_GT(lies_.restarts.load(), 0);
  EXPECT_TRUE(ServesBitExact(1));
  EXPECT_EQ(Stats(cache_->Stats())->fallbacks.at("patch_failed"), 1u);
}

// A step takes into memory one tensor at a time, and no more in all than
// the upstream listed: a tensor sent past that is refused before it is held,
// the step fails, and the node keeps serving what it had.
TEST_F(HostileUpstreamTest, MoreThanTheListingSaidIsRefusedBeforeItIsHeld) {
  lies_.flood = true;
  const std::string v1 = Push(1);
  ASSERT_TRUE(testing::WaitUntil([&] { return lies_.floods_refused.load() >= 2; }));
  {
    absl::MutexLock lock(&lies_.mu);
    EXPECT_THAT(lies_.flood_error, ::testing::HasSubstr("does not say is coming"));
    EXPECT_THAT(lies_.flood_error, ::testing::HasSubstr("'flood.weight'"));
  }
  EXPECT_EQ(Held(), versions_[0]);
  EXPECT_TRUE(ServesBitExact(0));
  EXPECT_GE(Stats(cache_->Stats())->failures, 1u);

  // Honest again: the retried step takes v1.
  lies_.flood = false;
  ASSERT_TRUE(testing::WaitUntil([&] { return Held() == v1; })) << Held();
  EXPECT_TRUE(ServesBitExact(1));
}

TEST_F(HostileUpstreamTest, AnIdReusedForOtherContentIsRefusedAndBlockedUntilTheNextVersion) {
  const std::string v1 = Push(1);
  ASSERT_TRUE(testing::WaitUntil([&] { return Held() == v1; })) << Held();
  {
    absl::MutexLock lock(&lies_.mu);
    lies_.reused = versions_[0];  // v0's id, which the node keeps, for v2's content
  }
  Push(2);
  ASSERT_TRUE(testing::WaitUntil([&] {
    const PullStats stats = cache_->Stats();
    return Stats(stats) != nullptr && Stats(stats)->blocked;
  }));
  const PullStats stats = cache_->Stats();
  EXPECT_THAT(Stats(stats)->blocked_reason, ::testing::HasSubstr("names other tensors"));
  EXPECT_EQ(Held(), v1);
  EXPECT_TRUE(ServesBitExact(1));
  EXPECT_EQ(registry_->FindManifest(kName, versions_[0])->tensors().size(), 2u);

  // Truthful again: the next version unblocks it.
  {
    absl::MutexLock lock(&lies_.mu);
    lies_.reused.clear();
  }
  const std::string v3 = Push(3);
  ASSERT_TRUE(testing::WaitUntil([&] { return Held() == v3; })) << Held();
  EXPECT_TRUE(ServesBitExact(3));
}

// Versions without end: however many the upstream publishes while a step
// waits, the node takes only the newest, in one step, and keeps no more than
// --kept-versions of them.
TEST_F(HostileUpstreamTest, VersionsWithoutEndAreTakenNewestOnlyInOneStep) {
  const std::string v1 = Push(1);
  ASSERT_TRUE(testing::WaitUntil([&] { return Held() == v1; })) << Held();
  ASSERT_TRUE(WaitForSteps(1));
  const uint64_t before = Steps();
  {
    absl::MutexLock lock(&lies_.mu);
    lies_.closed = true;
  }
  std::string last;
  for (int v = 2; v <= 31; ++v) last = Push(v);
  // The node's step is waiting on its listing, behind by what was announced.
  ASSERT_TRUE(testing::WaitUntil([&] {
    absl::MutexLock lock(&lies_.mu);
    return lies_.held_listings == 1;
  }));
  ASSERT_TRUE(testing::WaitUntil([&] { return Stats(cache_->Stats())->lag_versions >= 1; }));
  {
    absl::MutexLock lock(&lies_.mu);
    lies_.closed = false;
  }
  ASSERT_TRUE(testing::WaitUntil([&] { return Held() == last && Stats(cache_->Stats())->lag_versions == 0; }))
      << Held();
  EXPECT_TRUE(ServesBitExact(31));
  EXPECT_EQ(Steps() - before, 1u);  // 30 versions, one step
  size_t kept = 0;
  for (const std::string& id : versions_) kept += registry_->FindManifest(kName, id) != nullptr ? 1 : 0;
  EXPECT_LE(kept, registry_->options().kept_versions);
}

}  // namespace
}  // namespace weightstore

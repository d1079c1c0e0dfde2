#include "origin/node_cache.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "core/catalog/push.h"
#include "core/checkpoint.h"
#include "core/crc32c.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "nlohmann/json.hpp"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore::origin {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;
namespace fs = std::filesystem;

// A safetensors file of `count` F32 tensors of `floats` values each.
std::string Model(int count, size_t floats, int seed) {
  std::vector<SharedTensor> tensors;
  for (int i = 0; i < count; ++i) {
    std::vector<std::byte> bytes(floats * 4);
    for (size_t k = 0; k < bytes.size(); ++k) bytes[k] = std::byte((k * 31 + i * 7 + seed) & 0xff);
    tensors.push_back(
        {{absl::StrCat("layer.", i, ".weight"), DType::kF32, {floats}}, SharedBytes::FromVector(std::move(bytes))});
  }
  return *SerializeCheckpoint(kSafeTensorsFormat, tensors, {});
}

// An origin in memory: one single-file checkpoint per name. Counts the bytes
// it sends; can corrupt a byte, or fail once after some bytes.
class FakeOrigin : public Origin {
 public:
  void Put(const std::string& name, std::string bytes) {
    absl::MutexLock lock(&mu_);
    files_[name] = std::move(bytes);
  }
  // A sharded checkpoint: (path, bytes) of each file, its index last. Each
  // file's etag is its CRC32C (plus the epoch, when set: etags that name a
  // version, as a daemon's do), and the version one of them all. The listing
  // gives each file's CRC32C, as a daemon's does, unless `list_crc32c_` is
  // off (S3's listing has none).
  void PutFiles(const std::string& name, const std::vector<std::pair<std::string, std::string>>& files) {
    absl::MutexLock lock(&mu_);
    sharded_[name].clear();
    for (const auto& [path, bytes] : files) {
      files_[path] = bytes;
      sharded_[name].push_back(path);
    }
  }
  // Uploads a sharded checkpoint's index again, with the same bytes: a new
  // etag (as SSE-KMS gives one that is no MD5), so a new version.
  void UploadIndexAgain(const std::string& name) {
    absl::MutexLock lock(&mu_);
    index_uploads_[name]++;
  }
  std::string Describe() const override { return "fake://origin"; }
  int parallel_reads() const override { return 3; }
  void Cancel() override { cancelled_ = true; }
  absl::StatusOr<OriginCheckpoint> Find(const std::string& name) override {
    finds_.fetch_add(1);
    if (auto sharded = FindSharded(name)) return *sharded;
    if (!sizes_.empty()) {  // a listing that lies about sizes
      OriginCheckpoint c{name, "v1", {}};
      for (size_t i = 0; i < sizes_.size(); ++i) {
        const bool main = i + 1 == sizes_.size();
        c.files.push_back({main ? name + ".safetensors.index.json" : absl::StrCat(name, "-", i, ".safetensors"), name,
                           name, sizes_[i], "v1", ""});
      }
      return c;
    }
    absl::MutexLock lock(&mu_);
    auto it = files_.find(name);
    if (it == files_.end()) return absl::NotFoundError(absl::StrCat("no '", name, "' here"));
    OriginFile f;
    f.checkpoint = name;
    f.path = name + ".safetensors";
    f.key = name;
    f.size = it->second.size();
    f.etag = version_;
    f.crc32c = absl::StrFormat("%08x", Crc32c(it->second));
    OriginCheckpoint c{name, version_, {}};
    c.apart = apart_.contains(name);
    if (auto b = beside_.find(name); b != beside_.end()) {
      const std::string folder = fs::path(name).parent_path().string();
      for (const auto& [file, bytes] : b->second) {
        OriginFile config;
        config.checkpoint = name;
        config.path = folder.empty() ? file : folder + "/" + file;
        config.key = absl::StrCat("beside:", name, "/", file);
        config.size = bytes.size();
        config.etag = version_;
        config.crc32c = absl::StrFormat("%08x", Crc32c(bytes));
        config.beside = true;
        files_[config.key] = bytes;
        c.files.push_back(std::move(config));
      }
    }
    c.files.push_back(std::move(f));
    return c;
  }
  absl::Status Read(const OriginFile& file, uint64_t offset, uint64_t length, const ByteSink& sink) override {
    std::string bytes;
    {
      absl::MutexLock lock(&mu_);
      bytes = files_.at(file.key).substr(offset, length);
    }
    if (corrupt_at_ >= offset && corrupt_at_ < offset + length) bytes[corrupt_at_ - offset] ^= 0x01;
    for (size_t done = 0; done < bytes.size(); done += 4096) {
      if (fail_after_ >= 0 && sent_.load() >= static_cast<uint64_t>(fail_after_)) {
        fail_after_ = -1;
        return absl::UnavailableError("the origin went away");
      }
      if (delay_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      while (stall_.load() && !cancelled_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (cancelled_.load()) return absl::CancelledError("cancelled");
      const absl::string_view piece = absl::string_view(bytes).substr(done, 4096);
      if (absl::Status s = sink(piece); !s.ok()) return s;
      sent_.fetch_add(piece.size());  // what the node took
    }
    return absl::OkStatus();
  }

  std::atomic<uint64_t> sent_{0};
  std::atomic<int> finds_{0};
  std::atomic<bool> delay_{false};
  std::atomic<bool> stall_{false};  // sends nothing until cancelled
  std::atomic<bool> cancelled_{false};
  uint64_t corrupt_at_ = UINT64_MAX;
  std::atomic<int64_t> fail_after_{-1};
  std::vector<uint64_t> sizes_;
  std::string version_ = "v1";   // of every checkpoint
  std::set<std::string> apart_;  // names it keeps apart (a hub snapshot's)
  // Files it lists beside a checkpoint (its quantization configs), by name:
  // (file name, bytes).
  std::map<std::string, std::vector<std::pair<std::string, std::string>>> beside_;
  std::atomic<int> epoch_{0};
  std::atomic<bool> list_crc32c_{true};

 private:
  std::optional<OriginCheckpoint> FindSharded(const std::string& name) {
    absl::MutexLock lock(&mu_);
    auto it = sharded_.find(name);
    if (it == sharded_.end()) return std::nullopt;
    OriginCheckpoint c{name, "", {}};
    std::string etags;
    for (const std::string& path : it->second) {
      const std::string crc = absl::StrFormat("%08x", Crc32c(files_.at(path)));
      std::string etag = crc;
      if (path == it->second.back() && index_uploads_[name] > 0) absl::StrAppend(&etag, "-", index_uploads_[name]);
      if (epoch_ > 0) etag = absl::StrCat("e", epoch_.load(), ":", etag);
      c.files.push_back({path, name, path, files_.at(path).size(), etag, list_crc32c_ ? crc : ""});
      etags += etag;
    }
    c.version = absl::StrFormat("s%08x", Crc32c(etags));
    return c;
  }

  absl::Mutex mu_;
  std::map<std::string, std::string> files_;
  std::map<std::string, std::vector<std::string>> sharded_;  // name: its files' paths
  std::map<std::string, int> index_uploads_;                 // name: times its index was uploaded again
};

class NodeCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    models_ = testing::MakeScratchDir("node-cache");
    RegistryOptions options;
    options.models_dir = models_;
    registry_ = std::make_unique<CheckpointRegistry>(options);
    auto origin = std::make_unique<FakeOrigin>();
    origin_ = origin.get();
    NodeCacheOptions cache_options;
    cache_options.part_bytes = 64 << 10;  // several parts per file
    cache_options.max_bytes = budget_;
    auto cache = NodeCache::Open(registry_.get(), std::move(origin), cache_options);
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = *std::move(cache);
  }

  // As the next run would: a new registry and cache on the same folder (its
  // origin, empty, filled by `fill`), and its first scan.
  // One step of a followed `name` from `held`, as the follower takes it:
  // BeginStep, Repull, then EndStep with what was published.
  absl::StatusOr<FollowedCache::Repulled> Step(const std::string& name, const CheckpointVersion& held) {
    if (!cache_->BeginStep(name, held)) return absl::FailedPreconditionError("BeginStep refused the step");
    absl::StatusOr<FollowedCache::Repulled> step = cache_->Repull(name, held);
    cache_->EndStep(name, step.ok() ? step->version.get() : nullptr);
    return step;
  }
  void Restart(const std::function<void(FakeOrigin&)>& fill = {}) {
    cache_.reset();
    registry_ = std::make_unique<CheckpointRegistry>(RegistryOptions{.models_dir = models_});
    auto origin = std::make_unique<FakeOrigin>();
    if (fill) fill(*origin);
    origin_ = origin.get();
    auto reopened = NodeCache::Open(registry_.get(), std::move(origin), NodeCacheOptions{});
    ASSERT_TRUE(reopened.ok()) << reopened.status();
    cache_ = *std::move(reopened);
    registry_->Rescan();
  }

  uint64_t budget_ = 0;
  std::string models_;
  std::unique_ptr<CheckpointRegistry> registry_;
  FakeOrigin* origin_ = nullptr;
  std::unique_ptr<NodeCache> cache_;
};

TEST_F(NodeCacheTest, ConcurrentRequestsForAMissingCheckpointShareOneTransfer) {
  const std::string model = Model(8, 20000, 1);  // 640 KB: ten parts
  origin_->Put("llama/tiny", model);
  origin_->delay_ = true;
  std::vector<std::thread> clients;
  std::atomic<int> ok{0}, joined{0};
  for (int i = 0; i < 8; ++i) {
    clients.emplace_back([&] {
      auto pulled = cache_->Pull("llama/tiny");
      if (pulled.ok()) ++ok;
      if (pulled.ok() && pulled->joined) ++joined;
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(ok.load(), 8);
  EXPECT_GE(joined.load(), 1);
  EXPECT_EQ(origin_->sent_.load(), model.size());  // every byte once
  EXPECT_EQ(origin_->finds_.load(), 1);
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/llama/tiny.safetensors"), model);
  // It is served now, and the next pull is a hit.
  ASSERT_TRUE(registry_->Find("llama/tiny").ok());
  auto again = cache_->Pull("llama/tiny");
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->already_present);
  EXPECT_EQ(cache_->Stats().cache_bytes, model.size());
}

// Issue 26, finding 10: a pull refused for what the origin holds (here more
// files than a node takes) is remembered as a missing name is, and the cache
// tells the origin its bound, so that an S3 origin refuses before any HEAD.
TEST_F(NodeCacheTest, APullRefusedForWhatTheOriginHoldsIsRememberedForAWhile) {
  EXPECT_EQ(origin_->max_files(), NodeCacheOptions().max_files);
  origin_->sizes_.assign(NodeCacheOptions().max_files + 1, 10);
  EXPECT_THAT(cache_->Pull("many").status(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("4097 files")));
  const int finds = origin_->finds_.load();
  EXPECT_THAT(cache_->Pull("many").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("refused moments ago")));
  EXPECT_EQ(origin_->finds_.load(), finds);
  // A refusal of the node's own making (a file in the way) is not remembered:
  // the next pull asks again and goes through once the file is gone.
  origin_->sizes_.clear();
  origin_->Put("blocked", Model(2, 100, 1));
  fs::create_directories(models_ + "/blocked.safetensors");  // in the way, and no checkpoint
  EXPECT_THAT(cache_->Pull("blocked").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("exists and is not served")));
  fs::remove_all(models_ + "/blocked.safetensors");
  EXPECT_TRUE(cache_->Pull("blocked").ok());
}

TEST_F(NodeCacheTest, ANameTheOriginLacksIsNotFoundAndRememberedForAWhile) {
  origin_->Put("m", Model(2, 1000, 2));
  ASSERT_TRUE(cache_->Pull("m").ok());
  auto version = registry_->Find("m");
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ((*version)->checkpoint()->size(), 2u);
  EXPECT_THAT(cache_->Pull("absent").status(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("fake://origin")));
  // Asked again at once: answered without asking the origin.
  const int finds = origin_->finds_.load();
  EXPECT_THAT(cache_->Pull("absent").status(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("moments ago")));
  EXPECT_EQ(origin_->finds_.load(), finds);
  // A name that cannot be a path is refused before the origin is asked.
  EXPECT_THAT(cache_->Pull("../escape").status(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("cannot be pulled")));
  EXPECT_EQ(origin_->finds_.load(), finds);
  EXPECT_FALSE(fs::exists(fs::path(models_).parent_path() / "escape.safetensors"));
  EXPECT_THAT(cache_->Pull(std::string("bad\0name", 8)).status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(NodeCacheTest, PullAsyncReturnsAtOnceAndDeliversTheOutcomeOnTheTransfersThread) {
  origin_->Put("m", Model(8, 20000, 10));
  origin_->stall_ = true;  // the pull cannot end until it is let go
  absl::Notification returned;
  // Lets the pull go once the calls returned, or after 30 s: a PullAsync that
  // waits for its pull fails below rather than hanging the test.
  std::thread release([&] {
    (void)returned.WaitForNotificationWithTimeout(absl::Seconds(30));
    origin_->stall_ = false;
  });
  absl::Mutex mu;
  std::vector<absl::StatusOr<PullResult>> outcomes;
  const auto before = std::chrono::steady_clock::now();
  for (int i = 0; i < 3; ++i) {
    cache_->PullAsync("m", [&](absl::StatusOr<PullResult> r) {
      absl::MutexLock lock(&mu);
      outcomes.push_back(std::move(r));
    });
  }
  const auto took = std::chrono::steady_clock::now() - before;
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(outcomes.empty()) << "nobody waited: the pull is still stalled";
  }
  returned.Notify();
  release.join();
  std::cout << "three PullAsync calls returned in "
            << std::chrono::duration_cast<std::chrono::microseconds>(took).count() << " us\n";
  absl::MutexLock lock(&mu);
  mu.Await(absl::Condition(
      +[](std::vector<absl::StatusOr<PullResult>>* o) { return o->size() == 3; }, &outcomes));
  int joined = 0;
  for (const auto& r : outcomes) {
    ASSERT_TRUE(r.ok()) << r.status();
    joined += r->joined ? 1 : 0;
  }
  EXPECT_EQ(joined, 2);
}

TEST_F(NodeCacheTest, ShutdownEndsAStalledPullAndRefusesNewOnes) {
  origin_->Put("m", Model(8, 20000, 11));
  origin_->stall_ = true;
  absl::Notification done;
  absl::Status status;
  cache_->PullAsync("m", [&](absl::StatusOr<PullResult> r) {
    status = r.status();
    done.Notify();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  cache_->Shutdown();
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(120)));
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(cache_->Pull("m").status(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("stopping")));
}

TEST_F(NodeCacheTest, AnInterruptedPullResumesFromItsLastVerifiedByte) {
  const std::string model = Model(8, 20000, 3);
  origin_->Put("m", model);
  origin_->fail_after_ = 300000;
  EXPECT_THAT(cache_->Pull("m").status(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("went away")));
  EXPECT_EQ(registry_->Get("m"), nullptr);  // nothing half-written is served
  EXPECT_FALSE(fs::exists(models_ + "/m.safetensors"));
  const uint64_t before = origin_->sent_.load();
  EXPECT_GE(before, 300000u);
  EXPECT_LT(before, model.size());
  ASSERT_TRUE(cache_->Pull("m").ok());
  // Only what was missing came again: every byte sent was kept.
  EXPECT_EQ(origin_->sent_.load(), model.size());
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/m.safetensors"), model);
}

TEST_F(NodeCacheTest, APullResumesAfterTheDaemonRestarts) {
  const std::string model = Model(8, 20000, 4);
  origin_->Put("m", model);
  origin_->fail_after_ = 200000;
  EXPECT_FALSE(cache_->Pull("m").ok());
  const uint64_t before = origin_->sent_.load();
  // A new cache on the same folder (the daemon restarted) with a new origin.
  cache_.reset();
  auto origin = std::make_unique<FakeOrigin>();
  FakeOrigin* second = origin.get();
  second->Put("m", model);
  auto reopened = NodeCache::Open(registry_.get(), std::move(origin), NodeCacheOptions{.part_bytes = 64 << 10});
  ASSERT_TRUE(reopened.ok());
  ASSERT_TRUE((*reopened)->Pull("m").ok());
  EXPECT_EQ(before + second->sent_.load(), model.size());
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/m.safetensors"), model);
}

TEST_F(NodeCacheTest, ACorruptedByteFromTheOriginIsCaughtAndNeverServed) {
  const std::string model = Model(4, 20000, 5);
  origin_->Put("m", model);
  origin_->corrupt_at_ = 123456;
  EXPECT_THAT(cache_->Pull("m").status(), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("CRC32C")));
  EXPECT_EQ(registry_->Get("m"), nullptr);
  EXPECT_FALSE(fs::exists(models_ + "/m.safetensors"));
  EXPECT_EQ(registry_->Rescan().added.size(), 0u);
  // The next pull fetches the file afresh, and a sound copy is served.
  origin_->corrupt_at_ = UINT64_MAX;
  ASSERT_TRUE(cache_->Pull("m").ok());
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/m.safetensors"), model);
}

TEST_F(NodeCacheTest, SizesThatOverflowWhenAddedAreRefusedBeforeAnyByteMoves) {
  origin_->sizes_ = {UINT64_MAX - (uint64_t{1} << 26), (uint64_t{1} << 26) + 1};  // sum to 0 mod 2^64
  EXPECT_THAT(cache_->Pull("m").status(), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("limit")));
  EXPECT_EQ(origin_->sent_.load(), 0u);
}

TEST_F(NodeCacheTest, FilesThatWouldNotLieSideBySideApartAreRefusedBeforeAnyByteMoves) {
  // Its shards' names carry the '@' of the revision: no file in a folder
  // apart may be named so.
  origin_->sizes_ = {1000, 2000};
  EXPECT_THAT(cache_->Pull("acme/x@v1").status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("does not lie beside the others")));
  EXPECT_EQ(origin_->sent_.load(), 0u);
  EXPECT_FALSE(fs::exists(models_ + "/.weightstore-cache/placed"));
}

TEST_F(NodeCacheTest, AResumeWhosePartialFileIsGoneFetchesThatFileAgain) {
  const std::string model = Model(8, 20000, 12);
  origin_->Put("m", model);
  origin_->fail_after_ = 300000;
  ASSERT_FALSE(cache_->Pull("m").ok());
  // The partial file goes, its progress stays (a crash between the two).
  for (const auto& dir : fs::directory_iterator(models_ + "/.weightstore-cache/partial")) {
    ASSERT_TRUE(fs::remove(dir.path() / "0"));
  }
  ASSERT_TRUE(cache_->Pull("m").ok());
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/m.safetensors"), model);
}

// A cache whose origin has "s" (`model`) but sends nothing until unstalled,
// and that lets one request wait on a pull besides the one that started it.
struct StalledCache {
  explicit StalledCache(const std::string& model) {
    auto fake = std::make_unique<FakeOrigin>();
    origin = fake.get();
    origin->Put("s", model);
    origin->stall_ = true;
    auto opened = NodeCache::Open(&registry, std::move(fake), NodeCacheOptions{.max_waiters = 1});
    EXPECT_TRUE(opened.ok()) << opened.status();
    if (opened.ok()) cache = *std::move(opened);
  }
  CheckpointRegistry registry{RegistryOptions{.models_dir = testing::MakeScratchDir("node-cache-stalled")}};
  FakeOrigin* origin = nullptr;
  std::unique_ptr<NodeCache> cache;
};

TEST_F(NodeCacheTest, WaitersOnOneFlightAreBounded) {
  StalledCache stalled(Model(8, 20000, 13));
  ASSERT_NE(stalled.cache, nullptr);
  NodeCache* cache = stalled.cache.get();
  absl::Mutex mu;
  std::vector<absl::Status> outcomes;
  auto record = [&](absl::StatusOr<PullResult> r) {
    absl::MutexLock lock(&mu);
    outcomes.push_back(r.status());
  };
  for (int i = 0; i < 3; ++i) cache->PullAsync("s", record);  // the first starts it, one more may wait
  {
    absl::MutexLock lock(&mu);
    ASSERT_EQ(outcomes.size(), 1u);
    EXPECT_THAT(outcomes[0], StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("wait for it")));
  }
  cache->Shutdown();  // the stalled pull ends, and both waiters hear of it
  absl::MutexLock lock(&mu);
  mu.Await(absl::Condition(
      +[](std::vector<absl::Status>* o) { return o->size() == 3; }, &outcomes));
}

TEST_F(NodeCacheTest, AWaiterWhoseClientLeftIsToldAtOnceAndFreesItsPlaceWhileThePullGoesOn) {
  const std::string model = Model(8, 20000, 15);
  StalledCache stalled(model);
  ASSERT_NE(stalled.cache, nullptr);
  NodeCache* cache = stalled.cache.get();
  FakeOrigin* slow = stalled.origin;
  absl::Mutex mu;
  std::map<int, absl::StatusOr<PullResult>> outcomes;
  auto record = [&](int who) {
    return [&, who](absl::StatusOr<PullResult> r) {
      absl::MutexLock lock(&mu);
      outcomes.emplace(who, std::move(r));
    };
  };
  const uint64_t starter = cache->PullAsync("s", record(1));
  const uint64_t joiner = cache->PullAsync("s", record(2));
  ASSERT_NE(starter, 0u);
  ASSERT_NE(joiner, 0u);
  EXPECT_EQ(cache->PullAsync("s", record(3)), 0u);  // refused: one waiter already
  cache->Abandon("s", joiner);
  {
    absl::MutexLock lock(&mu);
    ASSERT_EQ(outcomes.count(2), 1u);  // told on the abandoning thread
    EXPECT_THAT(outcomes.at(2).status(), StatusIs(absl::StatusCode::kCancelled, HasSubstr("'s'")));
    EXPECT_THAT(outcomes.at(3).status(), StatusIs(absl::StatusCode::kResourceExhausted));
  }
  EXPECT_NE(cache->PullAsync("s", record(4)), 0u);  // its place is free again
  cache->Abandon("s", joiner);                      // stale: nothing
  cache->Abandon("s", starter);                     // the caller that started it leaves too
  slow->stall_ = false;
  absl::MutexLock lock(&mu);
  mu.Await(absl::Condition(
      +[](std::map<int, absl::StatusOr<PullResult>>* o) { return o->count(4) == 1; }, &outcomes));
  EXPECT_THAT(outcomes.at(1).status(), StatusIs(absl::StatusCode::kCancelled));
  ASSERT_TRUE(outcomes.at(4).ok()) << outcomes.at(4).status();
  EXPECT_TRUE(outcomes.at(4)->joined);
  EXPECT_EQ(outcomes.size(), 4u);                 // each told once
  EXPECT_NE(stalled.registry.Get("s"), nullptr);  // the pull went on
  EXPECT_EQ(slow->sent_.load(), model.size());
}

TEST_F(NodeCacheTest, AbandonedPartialPullsAreRemovedAtStart) {
  const std::string old_partial = models_ + "/.weightstore-cache/partial/abandoned";
  fs::create_directories(old_partial);
  testing::WriteFileOrDie(old_partial + "/0", std::string(1000, 'x'));
  fs::last_write_time(old_partial, fs::file_time_type::clock::now() - std::chrono::hours(25));
  cache_.reset();
  auto reopened = NodeCache::Open(registry_.get(), std::make_unique<FakeOrigin>(), NodeCacheOptions{});
  ASSERT_TRUE(reopened.ok());
  EXPECT_FALSE(fs::exists(old_partial));
}

TEST_F(NodeCacheTest, APulledCheckpointKeepsTheOriginsVersionIdAcrossRestartsUntilReplaced) {
  origin_->version_ = "9f86d081884c7d65";
  origin_->Put("m", Model(2, 1000, 20));
  ASSERT_TRUE(cache_->Pull("m").ok());
  EXPECT_EQ(registry_->Get("m")->version(), "9f86d081884c7d65");

  // The next run serves it under the same id: a client pinned to it carries on.
  ASSERT_NO_FATAL_FAILURE(Restart());
  ASSERT_NE(registry_->Get("m"), nullptr);
  EXPECT_EQ(registry_->Get("m")->version(), "9f86d081884c7d65");
  EXPECT_TRUE(registry_->Find("m", "9f86d081884c7d65").ok());

  // Replaced by someone else: other contents, so an id of the node's own.
  std::this_thread::sleep_for(std::chrono::milliseconds(15));
  testing::WriteFileOrDie(models_ + "/m.safetensors.tmp", Model(1, 100, 21));
  fs::rename(models_ + "/m.safetensors.tmp", models_ + "/m.safetensors");
  registry_->Rescan();
  ASSERT_NE(registry_->Get("m"), nullptr);
  EXPECT_NE(registry_->Get("m")->version(), "9f86d081884c7d65");

  // Once the cache is gone, nothing asks it (the registry outlives it).
  cache_.reset();
  registry_->Rescan();
  EXPECT_NE(registry_->Get("m"), nullptr);
}

TEST_F(NodeCacheTest, AnIdTheRegistryHadToReissueIsNotCarriedOverAgain) {
  origin_->Put("m", Model(2, 1000, 25));
  ASSERT_TRUE(cache_->Pull("m").ok());
  ASSERT_EQ(registry_->Get("m")->version(), "v1");
  // Written in place within one timestamp tick: the same file version, other
  // bytes, so the registry issues an id of its own...
  registry_->Get("m")->MarkModified();
  registry_->Rescan();
  const std::string reissued = registry_->Get("m")->version();
  EXPECT_NE(reissued, "v1");
  // ...and the next run must not name those bytes "v1" again.
  ASSERT_NO_FATAL_FAILURE(Restart());
  ASSERT_NE(registry_->Get("m"), nullptr);
  EXPECT_NE(registry_->Get("m")->version(), "v1");
}

TEST_F(NodeCacheTest, AnOriginVersionThatIsNoValidIdIsNotCarriedOver) {
  for (const std::string& bad :
       {std::string(65, 'a'), std::string("has space"), std::string("../x"), std::string("nul\0inside", 10)}) {
    SCOPED_TRACE(bad);
    const std::string name = absl::StrCat("m", bad.size());
    origin_->version_ = bad;
    origin_->Put(name, Model(1, 100, 22));
    ASSERT_TRUE(cache_->Pull(name).ok());
    const std::string& id = registry_->Get(name)->version();
    EXPECT_NE(id, bad);
    EXPECT_EQ(id.size(), 16u);  // the registry's own
  }
}

// The ledger as JSON, and written back (as a daemon killed mid-placement left it).
nlohmann::json ReadLedger(const std::string& models) {
  return nlohmann::json::parse(testing::ReadFileOrEmpty(models + "/.weightstore-cache/ledger.json"));
}
void WriteLedger(const std::string& models, const nlohmann::json& j) {
  testing::WriteFileOrDie(models + "/.weightstore-cache/ledger.json", j.dump());
}
// As the node cache records a file it places: device, inode, size, mtime (ns).
std::array<uint64_t, 4> Identity(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), static_cast<uint64_t>(st.st_size),
          static_cast<uint64_t>(st.st_mtim.tv_sec) * 1000000000u + static_cast<uint64_t>(st.st_mtim.tv_nsec)};
}

TEST_F(NodeCacheTest, AKillAfterEveryFileWasPlacedLeavesACheckpointTheNextRunKeeps) {
  const std::string model = Model(2, 1000, 23);
  origin_->Put("m", model);
  ASSERT_TRUE(cache_->Pull("m").ok());
  cache_.reset();
  nlohmann::json ledger = ReadLedger(models_);
  EXPECT_FALSE(ledger["m"].contains("placing"));  // a finished pull leaves none
  // As recorded just before the renames, and never completed.
  ledger["m"]["placing"] = true;
  ledger["m"]["identities"] = {Identity(models_ + "/m.safetensors")};
  ledger["m"]["file_version"] = "";
  WriteLedger(models_, ledger);

  ASSERT_NO_FATAL_FAILURE(Restart());
  EXPECT_EQ(cache_->Stats().cache_bytes, model.size());  // the cache's again: evictable
  ASSERT_NE(registry_->Get("m"), nullptr);
  EXPECT_EQ(registry_->Get("m")->version(), "v1");  // the origin's
}

TEST_F(NodeCacheTest, AKillMidPlacementRemovesTheFilesThisCachePlacedAndNoOthers) {
  // The index was renamed into place, its first shard not; an operator's file
  // sits where the second shard would have gone.
  testing::WriteFileOrDie(models_ + "/s.safetensors.index.json", "{\"weight_map\": {}}");
  testing::WriteFileOrDie(models_ + "/s-2.safetensors", "the operator's");
  const std::array<uint64_t, 4> index = Identity(models_ + "/s.safetensors.index.json");
  std::array<uint64_t, 4> operators = Identity(models_ + "/s-2.safetensors");
  operators[3] += 1;  // same inode, size (as if reused), another mtime: not the file this cache placed
  nlohmann::json ledger = nlohmann::json::object();
  ledger["s"] = {{"paths", {"s-1.safetensors", "s-2.safetensors", "s.safetensors.index.json"}},
                 {"bytes", 100},
                 {"last_used_unix_ms", 1},
                 {"version", "v9"},
                 {"file_version", ""},
                 {"placing", true},
                 {"identities", {{index[0], index[1] + 1000, 1, 1}, operators, index}}};
  cache_.reset();
  WriteLedger(models_, ledger);
  // The partial pull it came from stays, for the next pull to resume.
  const std::string partial = models_ + "/.weightstore-cache/partial/" + Sha256Hex("s");
  fs::create_directories(partial);
  testing::WriteFileOrDie(partial + "/progress.json", "{}");
  auto reopened = NodeCache::Open(registry_.get(), std::make_unique<FakeOrigin>(), NodeCacheOptions{});
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  EXPECT_TRUE(fs::exists(partial + "/progress.json"));
  EXPECT_FALSE(fs::exists(models_ + "/s.safetensors.index.json"));  // this cache's, half placed: gone
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/s-2.safetensors"), "the operator's");
  EXPECT_EQ((*reopened)->Stats().cache_bytes, 0u);
  reopened->reset();
  EXPECT_FALSE(ReadLedger(models_).contains("s"));
}

// A follower's step from an origin without patches (FollowedCache::Repull).
TEST_F(NodeCacheTest, ARepullPlacesTheOriginsNewVersionOverTheHeldOneUnderTheOriginsId) {
  const std::string v1 = Model(2, 1000, 25), v2 = Model(2, 1000, 26);
  origin_->Put("m", v1);
  ASSERT_TRUE(cache_->Pull("m").ok());
  std::shared_ptr<const CheckpointVersion> held = registry_->Get("m");
  ASSERT_NE(held, nullptr);
  EXPECT_EQ(held->version(), "v1");

  // The origin still has the version held: nothing moves.
  ASSERT_TRUE(cache_->BeginStep("m", *held));
  ASSERT_OK_AND_ASSIGN(FollowedCache::Repulled same, cache_->Repull("m", *held));
  cache_->EndStep("m", nullptr);
  EXPECT_EQ(same.version, nullptr);
  EXPECT_EQ(same.bytes, 0u);

  origin_->Put("m", v2);
  origin_->version_ = "v2";
  ASSERT_TRUE(cache_->BeginStep("m", *held));
  ASSERT_OK_AND_ASSIGN(FollowedCache::Repulled next, cache_->Repull("m", *held));
  // Published, and the ledger not yet told (EndStep): still followed, at the
  // version served, so that a watch reopened now keeps following it.
  EXPECT_EQ(cache_->Followed(), (std::map<std::string, std::string>{{"m", "v2"}}));
  cache_->EndStep("m", next.version.get());
  ASSERT_NE(next.version, nullptr);
  EXPECT_EQ(next.version->version(), "v2");
  EXPECT_EQ(next.bytes, v2.size());
  EXPECT_EQ(registry_->Get("m")->version(), "v2");
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/m.safetensors"), v2);
  EXPECT_TRUE(fs::is_empty(models_ + "/.weightstore-cache/partial"));
  EXPECT_EQ(cache_->Followed(), (std::map<std::string, std::string>{{"m", "v2"}}));
  EXPECT_EQ(cache_->Stats().cache_bytes, v2.size());
  // The version replaced is still readable by whoever holds it.
  EXPECT_EQ(held->version(), "v1");

  ASSERT_NO_FATAL_FAILURE(Restart());
  ASSERT_NE(registry_->Get("m"), nullptr);
  EXPECT_EQ(registry_->Get("m")->version(), "v2");
}

TEST_F(NodeCacheTest, ARepullOfAFileThatDoesNotOpenReplacesNothing) {
  const std::string v1 = Model(1, 1000, 27);
  origin_->Put("m", v1);
  ASSERT_TRUE(cache_->Pull("m").ok());
  std::shared_ptr<const CheckpointVersion> held = registry_->Get("m");
  origin_->Put("m", "not a SafeTensors file");
  origin_->version_ = "v2";
  ASSERT_TRUE(cache_->BeginStep("m", *held));
  EXPECT_THAT(cache_->Repull("m", *held).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("does not open")));
  EXPECT_EQ(cache_->Followed(), (std::map<std::string, std::string>{{"m", "v1"}})) << "followed through the step";
  cache_->EndStep("m", nullptr);
  EXPECT_EQ(registry_->Get("m")->version(), "v1");
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/m.safetensors"), v1);
  EXPECT_EQ(cache_->Followed(), (std::map<std::string, std::string>{{"m", "v1"}}));
}

// What was published on the node while a step downloaded (a client's push,
// or an operator's file renamed in place before any rescan) is never
// overwritten by the step.
TEST_F(NodeCacheTest, ARepullNeverOverwritesWhatWasPublishedOrPutInPlaceMeanwhile) {
  const std::string v1 = Model(1, 1000, 29);
  origin_->Put("m", v1);
  ASSERT_TRUE(cache_->Pull("m").ok());
  std::shared_ptr<const CheckpointVersion> held = registry_->Get("m");
  origin_->Put("m", Model(1, 1000, 30));
  origin_->version_ = "v2";
  ASSERT_TRUE(cache_->BeginStep("m", *held));  // the step starts from v1

  // A client pushes to the node meanwhile.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PushSession> push, registry_->BeginPush("m", {.base_version = held->version()}));
  const std::string bytes(4000, '\x11');
  ASSERT_OK(push->BeginTensor({"layer.0.weight", DType::kF32, {1000}}, Crc32c(bytes)));
  ASSERT_OK(push->Append(bytes));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const CheckpointVersion> pushed, registry_->FinishPush(std::move(push)));
  const std::string theirs = testing::ReadFileOrEmpty(models_ + "/m.safetensors");

  EXPECT_THAT(cache_->Repull("m", *held).status(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("replaced or unloaded meanwhile")));
  cache_->EndStep("m", nullptr);
  EXPECT_EQ(registry_->Get("m"), pushed);
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/m.safetensors"), theirs);
  EXPECT_TRUE(fs::is_empty(models_ + "/.weightstore-cache/partial"));  // the download is not kept

  // An operator's file renamed in place, no rescan since: the registry still
  // serves the push, whose file is gone.
  std::shared_ptr<const CheckpointVersion> served = registry_->Get("m");
  const std::string operators = Model(1, 1000, 31);
  testing::WriteFileOrDie(models_ + "/m.operator", operators);
  ASSERT_EQ(std::rename((models_ + "/m.operator").c_str(), (models_ + "/m.safetensors").c_str()), 0);
  testing::WriteFileOrDie(models_ + "/.weightstore-cache/partial/staged", Model(1, 1000, 32));
  EXPECT_THAT(
      registry_->ReplaceFile(*served, models_ + "/.weightstore-cache/partial/staged", "v3", "following 'm'").status(),
      StatusIs(absl::StatusCode::kAborted, HasSubstr("outside weightstored meanwhile")));
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/m.safetensors"), operators);
}

TEST_F(NodeCacheTest, ARepullWhoseBytesFailTheOriginsChecksumIsBlockedNotFetchedAgainOnATimer) {
  const std::string v1 = Model(1, 1000, 33);
  origin_->Put("m", v1);
  ASSERT_TRUE(cache_->Pull("m").ok());
  std::shared_ptr<const CheckpointVersion> held = registry_->Get("m");
  origin_->Put("m", Model(1, 1000, 34));
  origin_->version_ = "v2";
  origin_->corrupt_at_ = 100;
  ASSERT_TRUE(cache_->BeginStep("m", *held));
  EXPECT_THAT(cache_->Repull("m", *held).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("until the origin has another version")));
  cache_->EndStep("m", nullptr);
  EXPECT_EQ(registry_->Get("m")->version(), "v1");
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/m.safetensors"), v1);
  EXPECT_TRUE(fs::is_empty(models_ + "/.weightstore-cache/partial"));
  EXPECT_EQ(cache_->Stats().cache_bytes, v1.size());
}

TEST_F(NodeCacheTest, AKillAfterARepullsRenameLeavesTheNewVersionTheCachesUnderTheOriginsId) {
  const std::string v1 = Model(1, 1000, 35), v2 = Model(1, 1000, 36);
  origin_->Put("m", v1);
  ASSERT_TRUE(cache_->Pull("m").ok());
  const std::string held_file_version = registry_->Get("m")->file_version();
  cache_.reset();
  // v2 renamed into place; the ledger still says it was being placed.
  testing::WriteFileOrDie(models_ + "/m.v2", v2);
  ASSERT_EQ(std::rename((models_ + "/m.v2").c_str(), (models_ + "/m.safetensors").c_str()), 0);
  nlohmann::json ledger = ReadLedger(models_);
  ledger["m"]["placing"] = true;
  ledger["m"]["version"] = "v2";
  ledger["m"]["identities"] = {Identity(models_ + "/m.safetensors")};
  ledger["m"]["replacing_version"] = "v1";
  ledger["m"]["replacing_file_version"] = held_file_version;
  WriteLedger(models_, ledger);

  ASSERT_NO_FATAL_FAILURE(Restart());
  ASSERT_NE(registry_->Get("m"), nullptr);
  EXPECT_EQ(registry_->Get("m")->version(), "v2");
  EXPECT_EQ(cache_->Stats().cache_bytes, v2.size());
  EXPECT_EQ(cache_->Followed(), (std::map<std::string, std::string>{{"m", "v2"}}));
}

TEST_F(NodeCacheTest, AKillBeforeARepullsRenameLeavesTheHeldVersionTheCaches) {
  const std::string v1 = Model(2, 1000, 28);
  origin_->Put("m", v1);
  ASSERT_TRUE(cache_->Pull("m").ok());
  cache_.reset();
  nlohmann::json ledger = ReadLedger(models_);
  // As recorded just before the rename of v2 over v1, which never happened.
  const std::string held_file_version = ledger["m"]["file_version"];
  ledger["m"]["placing"] = true;
  ledger["m"]["version"] = "v2";
  ledger["m"]["identities"] = {{1, 2, 3, 4}};
  ledger["m"]["replacing_version"] = "v1";
  ledger["m"]["replacing_file_version"] = held_file_version;
  ledger["m"]["file_version"] = held_file_version;
  WriteLedger(models_, ledger);

  ASSERT_NO_FATAL_FAILURE(Restart());
  ASSERT_NE(registry_->Get("m"), nullptr);
  EXPECT_EQ(registry_->Get("m")->version(), "v1");  // still the origin's id
  EXPECT_EQ(cache_->Stats().cache_bytes, v1.size());
  EXPECT_EQ(cache_->Followed(), (std::map<std::string, std::string>{{"m", "v1"}}));
}

// A sharded checkpoint: shards a and b, and their index.
std::vector<std::pair<std::string, std::string>> ShardedModel(int seed_a, int seed_b) {
  return {{"m-a.safetensors", Model(1, 1000, seed_a)},
          {"m-b.safetensors", absl::StrReplaceAll(Model(1, 1000, seed_b), {{"layer.0.", "layer.1."}})},
          {"m.safetensors.index.json",
           R"({"weight_map": {"layer.0.weight": "m-a.safetensors", "layer.1.weight": "m-b.safetensors"}})"}};
}

TEST_F(NodeCacheTest, APullCutShortKeepsTheFilesTheOriginsNextVersionListsUnchanged) {
  // Shards of 320 KB, a and b, and their index: the first attempt is cut
  // inside them. `b_first` lists b before a.
  auto files = [](const std::string& name, int seed_b, bool b_first) {
    std::vector<std::pair<std::string, std::string>> out = {
        {name + "-a.safetensors", Model(4, 20000, 60)},
        {name + "-b.safetensors", absl::StrReplaceAll(Model(4, 20000, seed_b), {{"layer.", "other."}})}};
    if (b_first) std::swap(out[0], out[1]);
    std::string map;
    for (int i = 0; i < 4; ++i) {
      absl::StrAppend(&map, i == 0 ? "" : ",", "\"layer.", i, ".weight\": \"", name, "-a.safetensors\", \"other.", i,
                      ".weight\": \"", name, "-b.safetensors\"");
    }
    out.emplace_back(name + ".safetensors.index.json", absl::StrCat("{\"weight_map\": {", map, "}}"));
    return out;
  };
  // Bytes of each file an attempt kept, from its progress record.
  auto kept = [&](const std::string& name) {
    std::map<std::string, uint64_t> out;
    const nlohmann::json j = nlohmann::json::parse(
        testing::ReadFileOrEmpty(models_ + "/.weightstore-cache/partial/" + Sha256Hex(name) + "/progress.json"));
    for (const auto& f : j["files"]) {
      uint64_t done = 0;
      for (uint64_t d : f["done"]) done += d;
      out[f["path"].get<std::string>()] = done;
    }
    return out;
  };
  for (const bool checkable : {true, false}) {
    SCOPED_TRACE(checkable ? "listed with CRC32Cs" : "listed with no checksum");
    const std::string name = checkable ? "m" : "n";
    origin_->list_crc32c_ = checkable;
    origin_->PutFiles(name, files(name, 70, /*b_first=*/false));
    const uint64_t before = origin_->sent_.load();
    origin_->fail_after_ = static_cast<int64_t>(before) + 200000;
    EXPECT_THAT(cache_->Pull(name).status(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("went away")));
    const std::map<std::string, uint64_t> first = kept(name);
    ASSERT_GT(first.at(name + "-a.safetensors"), 0u);

    // The origin moves on to a version whose shard b differs (as a trainer
    // uploading shard by shard would leave it), listed first: what was kept
    // of shard a and the index carries over, when it can be checked whole.
    const auto next = files(name, 71, /*b_first=*/true);
    origin_->PutFiles(name, next);
    uint64_t total = 0;
    for (const auto& [path, bytes] : next) total += bytes.size();
    const uint64_t carried =
        checkable ? first.at(name + "-a.safetensors") + first.at(name + ".safetensors.index.json") : 0;
    const uint64_t sent = origin_->sent_.load();
    ASSERT_OK(cache_->Pull(name).status());
    EXPECT_EQ(origin_->sent_.load() - sent, total - carried);
    for (const auto& [path, bytes] : next) EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/" + path), bytes) << path;
    ASSERT_NE(registry_->Get(name), nullptr);
  }

  // A partial file spoilt on disk while it waited is caught by the check
  // whole, and the pull fails rather than place it.
  origin_->list_crc32c_ = true;
  origin_->PutFiles("o", files("o", 70, /*b_first=*/false));
  origin_->fail_after_ = static_cast<int64_t>(origin_->sent_.load()) + 200000;
  EXPECT_FALSE(cache_->Pull("o").ok());
  const std::string folder = models_ + "/.weightstore-cache/partial/" + Sha256Hex("o");
  {
    // A byte the progress record says was kept: which parts the cut left
    // filled depends on how the reading threads were scheduled.
    const nlohmann::json j = nlohmann::json::parse(testing::ReadFileOrEmpty(folder + "/progress.json"));
    ASSERT_EQ(j["files"][0]["path"], "o-a.safetensors");
    std::optional<uint64_t> offset;
    const auto& done = j["files"][0]["done"];
    for (size_t k = 0; k < done.size() && !offset; ++k) {
      if (done[k].get<uint64_t>() > 0) offset = k * (64 << 10) + done[k].get<uint64_t>() / 2;
    }
    ASSERT_TRUE(offset.has_value()) << "the cut pull kept nothing of o-a.safetensors";
    std::string bytes = testing::ReadFileOrEmpty(folder + "/0");
    ASSERT_LT(*offset, bytes.size());
    bytes[*offset] ^= 0x40;
    testing::WriteFileOrDie(folder + "/0", bytes);
  }
  origin_->PutFiles("o", files("o", 71, /*b_first=*/true));
  EXPECT_THAT(cache_->Pull("o").status(), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("o-a.safetensors")));
  EXPECT_EQ(registry_->Get("o"), nullptr);
}

TEST_F(NodeCacheTest, AShardedRepullFetchesOnlyTheShardsThatChangedAndPutsThemInPlaceAsOneStep) {
  origin_->PutFiles("m", ShardedModel(40, 50));
  ASSERT_TRUE(cache_->Pull("m").ok());
  std::shared_ptr<const CheckpointVersion> held = registry_->Get("m");
  ASSERT_NE(held, nullptr);
  const std::array<uint64_t, 4> b = Identity(models_ + "/m-b.safetensors");
  const std::array<uint64_t, 4> index = Identity(models_ + "/m.safetensors.index.json");

  const auto next = ShardedModel(41, 50);  // shard a changed
  origin_->PutFiles("m", next);
  const uint64_t sent = origin_->sent_.load();
  // Asked from inside the step's publish (its ledger entry marked placing
  // until the step ends), the cache still follows it: a poll or watch taken
  // then must not lose it.
  std::vector<std::map<std::string, std::string>> seen;
  const uint64_t listener = registry_->AddListener([&](const std::string& n) {
    if (n == "m") seen.push_back(cache_->Followed());
  });
  ASSERT_OK_AND_ASSIGN(FollowedCache::Repulled step, Step("m", *held));
  registry_->RemoveListener(listener);
  ASSERT_FALSE(seen.empty());
  EXPECT_TRUE(seen.front().contains("m"));
  ASSERT_NE(step.version, nullptr);
  EXPECT_EQ(step.version, registry_->Get("m"));
  EXPECT_EQ(step.bytes, next[0].second.size());
  EXPECT_EQ(origin_->sent_.load() - sent, next[0].second.size()) << "only shard a came";
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/m-a.safetensors"), next[0].second);
  EXPECT_EQ(Identity(models_ + "/m-b.safetensors"), b);
  EXPECT_EQ(Identity(models_ + "/m.safetensors.index.json"), index);
  EXPECT_TRUE(fs::is_empty(models_ + "/.weightstore-cache/partial"));
  const std::string id = step.version->version();
  EXPECT_EQ(cache_->Followed(), (std::map<std::string, std::string>{{"m", id}}));

  // The next step knows what it holds across a restart: again only what moved.
  const auto third = ShardedModel(41, 51);  // shard b changed
  ASSERT_NO_FATAL_FAILURE(Restart([&](FakeOrigin& o) { o.PutFiles("m", third); }));
  held = registry_->Get("m");
  ASSERT_NE(held, nullptr);
  EXPECT_EQ(held->version(), id);
  EXPECT_EQ(cache_->Followed(), (std::map<std::string, std::string>{{"m", id}}));
  ASSERT_OK_AND_ASSIGN(step, Step("m", *held));
  ASSERT_NE(step.version, nullptr);
  EXPECT_EQ(origin_->sent_.load(), third[1].second.size()) << "only shard b came";
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/m-b.safetensors"), third[1].second);
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/m-a.safetensors"), third[0].second);

  // Etags that name the version (an upstream daemon's) all move at each
  // step; the listing's CRC32C shows which bytes did not.
  held = registry_->Get("m");
  origin_->epoch_ = 1;
  const auto fourth = ShardedModel(42, 51);  // shard a changed
  origin_->PutFiles("m", fourth);
  const uint64_t before_fourth = origin_->sent_.load();
  ASSERT_OK_AND_ASSIGN(step, Step("m", *held));
  ASSERT_NE(step.version, nullptr);
  EXPECT_EQ(origin_->sent_.load() - before_fourth, fourth[0].second.size()) << "only shard a came";
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/m-a.safetensors"), fourth[0].second);
}

// A new index over the same shards (the two tensors swap shards): the shards
// and the index that moved are pulled and put in place as one step, the index
// last, and the node serves the new version whole.
TEST_F(NodeCacheTest, AShardedRepullWhoseIndexMovedTensorsBetweenTheSameShardsPutsTheNewIndexInPlace) {
  origin_->PutFiles("m", ShardedModel(40, 50));
  ASSERT_TRUE(cache_->Pull("m").ok());
  std::shared_ptr<const CheckpointVersion> held = registry_->Get("m");
  ASSERT_NE(held, nullptr);
  const std::string layer0 = Model(1, 1000, 61);
  const std::string layer1 = absl::StrReplaceAll(Model(1, 1000, 62), {{"layer.0.", "layer.1."}});
  const std::vector<std::pair<std::string, std::string>> next = {
      {"m-a.safetensors", layer1},
      {"m-b.safetensors", layer0},
      {"m.safetensors.index.json",
       R"({"weight_map": {"layer.0.weight": "m-b.safetensors", "layer.1.weight": "m-a.safetensors"}})"}};
  origin_->PutFiles("m", next);
  const uint64_t sent = origin_->sent_.load();
  ASSERT_OK_AND_ASSIGN(FollowedCache::Repulled step, Step("m", *held));
  ASSERT_NE(step.version, nullptr);
  EXPECT_EQ(step.version, registry_->Get("m"));
  uint64_t all = 0;
  for (const auto& [path, bytes] : next) {
    all += bytes.size();
    EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/" + path), bytes) << path;
  }
  EXPECT_EQ(origin_->sent_.load() - sent, all);
  EXPECT_EQ(step.bytes, all);
  ASSERT_OK_AND_ASSIGN(auto b_alone, Checkpoint::Open(models_ + "/m-b.safetensors"));
  EXPECT_EQ(step.version->checkpoint()->Read("layer.0.weight")->bytes.view(),
            b_alone->Read("layer.0.weight")->bytes.view());
  EXPECT_TRUE(fs::is_empty(models_ + "/.weightstore-cache/partial"));
  EXPECT_FALSE(fs::exists(PublishingRecordPath(models_ + "/m.safetensors.index.json")));
  const std::string id = step.version->version();
  EXPECT_EQ(cache_->Followed(), (std::map<std::string, std::string>{{"m", id}}));
  // Held as placed, under the origin's id, across a restart.
  ASSERT_NO_FATAL_FAILURE(Restart([&](FakeOrigin& o) { o.PutFiles("m", next); }));
  ASSERT_NE(registry_->Get("m"), nullptr);
  EXPECT_EQ(registry_->Get("m")->version(), id);
  EXPECT_EQ(cache_->Followed(), (std::map<std::string, std::string>{{"m", id}}));
}

// A new index that leaves a shard held unnamed (both tensors in shard a):
// refused before anything is replaced, the version held still served.
TEST_F(NodeCacheTest, AShardedRepullWhoseIndexDropsAShardReplacesNothing) {
  origin_->PutFiles("m", ShardedModel(40, 50));
  ASSERT_TRUE(cache_->Pull("m").ok());
  std::shared_ptr<const CheckpointVersion> held = registry_->Get("m");
  ASSERT_NE(held, nullptr);
  const std::string a_before = testing::ReadFileOrEmpty(models_ + "/m-a.safetensors");
  const std::string index_before = testing::ReadFileOrEmpty(models_ + "/m.safetensors.index.json");
  auto next = ShardedModel(41, 50);
  next[0].second = Model(2, 1000, 41);
  next[2].second = R"({"weight_map": {"layer.0.weight": "m-a.safetensors", "layer.1.weight": "m-a.safetensors"}})";
  origin_->PutFiles("m", next);
  EXPECT_THAT(Step("m", *held).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("names 1 of its 2 shards")));
  EXPECT_EQ(registry_->Get("m"), held);
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/m-a.safetensors"), a_before);
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/m.safetensors.index.json"), index_before);
  EXPECT_TRUE(fs::is_empty(models_ + "/.weightstore-cache/partial"));
}

// An index uploaded again with its bytes (a new etag, so a new version) and
// no shard moved: the files held are the origin's new version, published
// under its id with nothing fetched but the index and nothing renamed.
TEST_F(NodeCacheTest, AnIndexUploadedAgainWithTheSameBytesPublishesTheFilesHeldUnderTheOriginsNewId) {
  const auto files = ShardedModel(40, 50);
  origin_->list_crc32c_ = false;  // as S3 lists
  origin_->PutFiles("m", files);
  ASSERT_TRUE(cache_->Pull("m").ok());
  std::shared_ptr<const CheckpointVersion> held = registry_->Get("m");
  ASSERT_NE(held, nullptr);
  std::vector<std::array<uint64_t, 4>> before;
  for (const auto& [path, bytes] : files) before.push_back(Identity(models_ + "/" + path));

  origin_->UploadIndexAgain("m");
  ASSERT_OK_AND_ASSIGN(OriginCheckpoint listed, origin_->Find("m"));
  ASSERT_NE(listed.version, held->version());
  const uint64_t sent = origin_->sent_.load();
  ASSERT_OK_AND_ASSIGN(FollowedCache::Repulled step, Step("m", *held));
  ASSERT_NE(step.version, nullptr);
  EXPECT_EQ(step.version, registry_->Get("m"));
  EXPECT_EQ(step.version->version(), listed.version);
  EXPECT_EQ(origin_->sent_.load() - sent, files[2].second.size()) << "the index alone, to compare";
  EXPECT_TRUE(step.version->checkpoint()->files() == held->checkpoint()->files()) << "the same mappings";
  for (size_t i = 0; i < files.size(); ++i) {
    EXPECT_EQ(Identity(models_ + "/" + files[i].first), before[i]) << files[i].first << " was not touched";
  }
  EXPECT_EQ(cache_->Followed(), (std::map<std::string, std::string>{{"m", listed.version}}));
  EXPECT_EQ(cache_->Stats().cache_bytes, files[0].second.size() + files[1].second.size() + files[2].second.size());

  // Held under that id across a restart.
  ASSERT_NO_FATAL_FAILURE(Restart());
  ASSERT_NE(registry_->Get("m"), nullptr);
  EXPECT_EQ(registry_->Get("m")->version(), listed.version);
  EXPECT_EQ(cache_->Followed(), (std::map<std::string, std::string>{{"m", listed.version}}));
}

// Killed between the registry's renames of a sharded step's shards: the next
// start finishes them from the registry's record, and the new version is the
// cache's, under the origin's id.
TEST_F(NodeCacheTest, AKillBetweenTheRenamesOfAShardedRepullIsFinishedAtTheNextStart) {
  origin_->PutFiles("m", ShardedModel(60, 70));
  ASSERT_TRUE(cache_->Pull("m").ok());
  const std::string held_file_version = registry_->Get("m")->file_version();
  cache_.reset();
  const auto next = ShardedModel(61, 71);
  const std::string new_a = ".m-a.safetensors.new.1-2-3.tmp", new_b = ".m-b.safetensors.new.1-2-4.tmp";
  testing::WriteFileOrDie(models_ + "/" + new_a, next[0].second);
  testing::WriteFileOrDie(models_ + "/" + new_b, next[1].second);
  // The registry's record, and the ledger's, both written before the renames.
  std::string record;
  for (const auto& [from, to] :
       {std::pair<std::string, std::string>{new_a, "m-a.safetensors"}, {new_b, "m-b.safetensors"}}) {
    struct stat f {
    }, t{};
    ASSERT_EQ(::stat((models_ + "/" + from).c_str(), &f), 0);
    ASSERT_EQ(::stat((models_ + "/" + to).c_str(), &t), 0);
    absl::StrAppend(&record, from, "\t", to, "\t", f.st_ino, "\t", t.st_ino, "\t", t.st_size, "\t",
                    static_cast<int64_t>(t.st_mtim.tv_sec) * 1000000000 + t.st_mtim.tv_nsec, "\n");
  }
  testing::WriteFileOrDie(PublishingRecordPath(models_ + "/m.safetensors.index.json"), record);
  nlohmann::json ledger = ReadLedger(models_);
  ledger["m"].erase("etags");  // as BeginReplacing records the step
  ledger["m"]["replacing_version"] = ledger["m"]["version"];
  ledger["m"]["placing"] = true;
  ledger["m"]["version"] = "v2";
  ledger["m"]["identities"] = {Identity(models_ + "/" + new_a), Identity(models_ + "/" + new_b),
                               Identity(models_ + "/m.safetensors.index.json")};
  ledger["m"]["replacing_file_version"] = held_file_version;
  WriteLedger(models_, ledger);
  ASSERT_EQ(std::rename((models_ + "/" + new_a).c_str(), (models_ + "/m-a.safetensors").c_str()), 0);  // one of two

  const auto third = ShardedModel(61, 72);
  ASSERT_NO_FATAL_FAILURE(Restart([&](FakeOrigin& o) {
    o.list_crc32c_ = false;  // as S3 lists
    o.PutFiles("m", third);
  }));
  std::shared_ptr<const CheckpointVersion> held = registry_->Get("m");
  ASSERT_NE(held, nullptr);
  EXPECT_EQ(held->version(), "v2");
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/m-b.safetensors"), next[1].second);
  EXPECT_FALSE(fs::exists(PublishingRecordPath(models_ + "/m.safetensors.index.json")));
  EXPECT_EQ(cache_->Followed(), (std::map<std::string, std::string>{{"m", "v2"}}));
  // Which files were whose was not recorded: the next step fetches them all
  // (the index compared, the shards replaced), and ends where the origin is.
  ASSERT_OK_AND_ASSIGN(FollowedCache::Repulled step, Step("m", *held));
  ASSERT_NE(step.version, nullptr);
  EXPECT_EQ(origin_->sent_.load(), third[0].second.size() + third[1].second.size() + third[2].second.size());
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/m-a.safetensors"), third[0].second);
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/m-b.safetensors"), third[1].second);
}

TEST_F(NodeCacheTest, APullRefusedByFilesStillInPlaceKeepsTheirLedgerEntry) {
  const std::string model = Model(2, 1000, 24);
  origin_->Put("m", model);
  ASSERT_TRUE(cache_->Pull("m").ok());
  // An operator unloads it: its files stay, and so does the cache's claim on them.
  ASSERT_TRUE(registry_->Unload("m").ok());
  const uint64_t sent = origin_->sent_.load();
  EXPECT_THAT(cache_->Pull("m").status(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("exists")));
  EXPECT_EQ(origin_->sent_.load(), sent);                // refused before any byte moved
  EXPECT_EQ(cache_->Stats().cache_bytes, model.size());  // still counted, still evictable
  cache_.reset();
  EXPECT_TRUE(ReadLedger(models_).contains("m"));
}

TEST_F(NodeCacheTest, AFileTheOperatorPutThereIsNeverReplaced) {
  origin_->Put("m", Model(2, 1000, 6));
  testing::WriteFileOrDie(models_ + "/m.safetensors", "not a checkpoint");
  EXPECT_THAT(cache_->Pull("m").status(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("exists")));
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/m.safetensors"), "not a checkpoint");
}

class NodeCacheBudgetTest : public NodeCacheTest {
 protected:
  void SetUp() override {
    model_ = Model(4, 20000, 7);      // 320 KB
    budget_ = model_.size() * 5 / 2;  // two fit, three do not
    NodeCacheTest::SetUp();
    for (const char* name : {"a", "b", "c", "d"}) origin_->Put(name, model_);
  }
  std::string model_;
};

TEST_F(NodeCacheBudgetTest, TheLeastRecentlyUsedIsEvictedAndNeverOneInUse) {
  ASSERT_TRUE(cache_->Pull("a").ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_TRUE(cache_->Pull("b").ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  // "a" is in use by a stream: it holds its version.
  auto held = registry_->Find("a");
  ASSERT_TRUE(held.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_TRUE(registry_->Find("b").ok());  // "b" is now the most recently used, but "a" is held
  ASSERT_TRUE(cache_->Pull("c").ok());
  EXPECT_NE(registry_->Get("a"), nullptr);
  EXPECT_EQ(registry_->Get("b"), nullptr);
  EXPECT_FALSE(fs::exists(models_ + "/b.safetensors"));
  EXPECT_EQ(cache_->Stats().evictions, 1u);
  held = absl::NotFoundError("dropped");

  // A same-host process maps "c": its descriptor carries a shared flock.
  int mapped = ::open((models_ + "/c.safetensors").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(mapped, 0);
  ASSERT_EQ(::flock(mapped, LOCK_SH), 0);
  ASSERT_TRUE(cache_->Pull("d").ok());  // "a" goes: no longer held
  EXPECT_EQ(registry_->Get("a"), nullptr);
  EXPECT_NE(registry_->Get("c"), nullptr);
  // Now "c" (mapped) and "d" fill the budget and neither can go.
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  auto held_d = registry_->Find("d");
  EXPECT_THAT(cache_->Pull("a").status(), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("in use: c, d")));
  ::close(mapped);
}

TEST_F(NodeCacheBudgetTest, WhenEvictingCouldNotMakeRoomNothingIsEvicted) {
  ASSERT_TRUE(cache_->Pull("a").ok());
  ASSERT_TRUE(cache_->Pull("b").ok());
  auto held = registry_->Find("b");  // in use
  ASSERT_TRUE(held.ok());
  origin_->Put("double", Model(8, 20000, 9));  // fits the budget, but only with "b" gone too
  EXPECT_THAT(cache_->Pull("double").status(), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("in use: b")));
  EXPECT_NE(registry_->Get("a"), nullptr);  // not evicted for nothing
  EXPECT_EQ(cache_->Stats().evictions, 0u);
}

TEST_F(NodeCacheBudgetTest, ACheckpointReplacedSincePulledIsForgottenNotEvicted) {
  ASSERT_TRUE(cache_->Pull("a").ok());
  ASSERT_TRUE(cache_->Pull("b").ok());
  // "a" is replaced in place by someone else (a push, an upload, an operator).
  std::this_thread::sleep_for(std::chrono::milliseconds(15));
  const std::string mine = Model(1, 100, 14);
  testing::WriteFileOrDie(models_ + "/a.safetensors.tmp", mine);
  fs::rename(models_ + "/a.safetensors.tmp", models_ + "/a.safetensors");
  registry_->Rescan();
  // "c" needs room: "a" is not the cache's any more, so it is forgotten (not
  // removed), which makes room without evicting "b".
  ASSERT_TRUE(cache_->Pull("c").ok());
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/a.safetensors"), mine);
  EXPECT_NE(registry_->Get("b"), nullptr);
  EXPECT_EQ(cache_->Stats().evictions, 0u);
  EXPECT_EQ(cache_->Stats().cache_bytes, 2 * model_.size());  // "b" and "c"
}

TEST_F(NodeCacheBudgetTest, FilesReplacedWhileNotServedAreForgottenNotEvicted) {
  ASSERT_TRUE(cache_->Pull("a").ok());
  ASSERT_TRUE(cache_->Pull("b").ok());
  // "a" is unloaded, then an operator puts their own file in its place; no
  // scan has served it yet.
  ASSERT_TRUE(registry_->Unload("a").ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(15));
  const std::string mine = Model(1, 100, 16);
  testing::WriteFileOrDie(models_ + "/a.safetensors.tmp", mine);
  fs::rename(models_ + "/a.safetensors.tmp", models_ + "/a.safetensors");
  ASSERT_TRUE(cache_->Pull("c").ok());  // "a" was least recently used
  EXPECT_EQ(testing::ReadFileOrEmpty(models_ + "/a.safetensors"), mine);
  EXPECT_NE(registry_->Get("b"), nullptr);
  EXPECT_EQ(cache_->Stats().evictions, 0u);
}

TEST_F(NodeCacheBudgetTest, ACheckpointLargerThanTheBudgetIsRefusedBeforeAnyTransfer) {
  origin_->Put("huge", Model(12, 20000, 8));
  EXPECT_THAT(cache_->Pull("huge").status(), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("budget")));
  EXPECT_EQ(origin_->sent_.load(), 0u);
}

// The files of a checkpoint placed apart: its folder under the cache's.
std::vector<std::string> ApartFiles(const std::string& models) {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(models + "/.weightstore-cache/placed", ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_regular_file() && it->path().filename() != ".name") {
      out.push_back(it->path().lexically_relative(models).string());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST_F(NodeCacheBudgetTest, HubNamesArePlacedApartServedAcrossRestartsAndEvictedWithTheirFolder) {
  origin_->Put("acme/a@v1", model_);
  origin_->Put("acme/b", model_);
  origin_->apart_.insert("acme/b");  // a hub snapshot upstream
  ASSERT_OK(cache_->Pull("acme/a@v1").status());
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_OK(cache_->Pull("acme/b").status());
  ASSERT_NE(registry_->Get("acme/a@v1"), nullptr);
  ASSERT_NE(registry_->Get("acme/b"), nullptr);
  EXPECT_EQ(registry_->Get("acme/a@v1")->version(), "v1");  // the origin's id
  // Nothing at the names, where a scan would find it; each in its folder.
  EXPECT_FALSE(fs::exists(models_ + "/acme"));
  const std::vector<std::string> placed = ApartFiles(models_);
  ASSERT_EQ(placed.size(), 2u) << ::testing::PrintToString(placed);
  for (const std::string& p : placed) {  // each folder records its name
    EXPECT_THAT(testing::ReadFileOrEmpty(models_ + "/" + fs::path(p).parent_path().string() + "/.name"),
                ::testing::AnyOf("acme/a@v1", "acme/b"));
  }
  for (const std::string& p : placed) EXPECT_TRUE(absl::EndsWith(p, "/checkpoint.safetensors")) << p;
  EXPECT_NE(fs::path(placed[0]).parent_path(), fs::path(placed[1]).parent_path());
  registry_->Rescan();
  EXPECT_NE(registry_->Get("acme/a@v1"), nullptr);
  EXPECT_NE(registry_->Get("acme/b"), nullptr);

  // "c" needs room: the least recently used goes, with its folder.
  origin_->Put("c", model_);
  ASSERT_OK(cache_->Pull("c").status());
  EXPECT_EQ(registry_->Get("acme/a@v1"), nullptr);
  EXPECT_EQ(ApartFiles(models_).size(), 1u);
  EXPECT_EQ(cache_->Stats().evictions, 1u);

  // Unloaded, its files are still in place: a pull is refused, as for a file
  // at its name, and the ledger keeps it.
  ASSERT_OK(registry_->Unload("acme/b"));
  EXPECT_THAT(cache_->Pull("acme/b").status(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("exists")));
  ASSERT_OK(registry_->Load(models_ + "/" + ApartFiles(models_)[0], "acme/b").status());

  // At the next start: a folder a killed pull left empty goes; what the
  // ledger names is served again, as the cache's.
  const std::string emptied = models_ + "/.weightstore-cache/placed/0123456789abcdef0123456789abcdef";
  fs::create_directories(emptied);
  Restart();
  EXPECT_FALSE(fs::exists(emptied));
  ASSERT_NE(registry_->Get("acme/b"), nullptr);
  EXPECT_EQ(registry_->Get("acme/b")->version(), "v1");
  EXPECT_NE(registry_->Get("c"), nullptr);
  EXPECT_EQ(cache_->Stats().cache_bytes, 2 * model_.size());

  // A ledger lost (or an entry dropped: files pushed to since) never costs
  // the files: served again under the name their folder records, as the
  // operator's, neither counted nor evicted.
  cache_.reset();
  fs::remove(models_ + "/.weightstore-cache/ledger.json");
  Restart();
  ASSERT_NE(registry_->Get("acme/b"), nullptr);
  EXPECT_EQ(ApartFiles(models_).size(), 1u);
  EXPECT_EQ(cache_->Stats().cache_bytes, 0u);
}

TEST_F(NodeCacheBudgetTest, ConfigsBesideAHubSnapshotArePlacedInItsFolderCountedKeptAndEvictedWithIt) {
  const std::string quant = R"({"quantization": {"quant_algo": "NVFP4"}})";
  const std::string config = R"({"model_type": "llama", "quantization_config": {"quant_method": "modelopt"}})";
  origin_->apart_.insert("acme/q");
  origin_->Put("acme/q", model_);
  origin_->beside_["acme/q"] = {{"hf_quant_config.json", quant}, {"config.json", config}};
  // Listed beside a checkpoint the node keeps at its name, they would be
  // other checkpoints' too: not taken.
  origin_->beside_["plain"] = {{"config.json", config}};
  origin_->Put("plain", model_);
  ASSERT_OK(cache_->Pull("acme/q").status());
  ASSERT_OK(cache_->Pull("plain").status());
  EXPECT_FALSE(fs::exists(models_ + "/config.json"));
  ASSERT_NE(registry_->Get("plain"), nullptr);
  EXPECT_EQ(registry_->Get("plain")->checkpoint()->quantization(), nullptr);

  auto expect_served_with_configs = [&] {
    std::shared_ptr<const CheckpointVersion> served = registry_->Get("acme/q");
    ASSERT_NE(served, nullptr);
    ASSERT_NE(served->checkpoint()->quantization(), nullptr);
    EXPECT_EQ(served->checkpoint()->quantization()->source(), "hf_quant_config.json");
    const fs::path folder = fs::path(served->path()).parent_path();
    EXPECT_EQ(testing::ReadFileOrEmpty((folder / "hf_quant_config.json").string()), quant);
    EXPECT_EQ(testing::ReadFileOrEmpty((folder / "config.json").string()), config);
  };
  expect_served_with_configs();
  const std::string folder = fs::path(registry_->Get("acme/q")->path()).parent_path().string();
  EXPECT_EQ(cache_->Stats().cache_bytes, 2 * model_.size() + quant.size() + config.size());

  // Evicted (the least recently used, to make room for "c"), they go with
  // it, and so does its folder.
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_OK(registry_->Find("plain").status());
  ASSERT_OK(cache_->Pull("c").status());
  EXPECT_EQ(registry_->Get("acme/q"), nullptr);
  EXPECT_FALSE(fs::exists(folder));
  EXPECT_EQ(cache_->Stats().cache_bytes, 2 * model_.size());

  // Pulled again, they come again; and a restart keeps them as the
  // checkpoint's, counted.
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_OK(cache_->Pull("acme/q").status());
  expect_served_with_configs();
  Restart();
  expect_served_with_configs();
  EXPECT_EQ(cache_->Stats().cache_bytes, 2 * model_.size() + quant.size() + config.size());

  // A config that does not parse fails the pull, and nothing of it stays:
  // the only folder apart is acme/q's.
  const std::string folder_now =
      fs::path(registry_->Get("acme/q")->path()).parent_path().lexically_relative(models_).string();
  origin_->apart_.insert("acme/bad");
  origin_->Put("acme/bad", model_);
  origin_->beside_["acme/bad"] = {{"hf_quant_config.json", "{not json"}};
  EXPECT_THAT(cache_->Pull("acme/bad").status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("hf_quant_config.json")));
  EXPECT_EQ(registry_->Get("acme/bad"), nullptr);
  const std::vector<std::string> placed = {folder_now + "/checkpoint.safetensors", folder_now + "/config.json",
                                           folder_now + "/hf_quant_config.json"};
  EXPECT_EQ(ApartFiles(models_), placed);

  // A ledger edited to name acme/q's configs beside another checkpoint, mid
  // placement, never costs acme/q its files: only the configs in a
  // checkpoint's own folder are its.
  cache_.reset();
  nlohmann::json ledger = ReadLedger(models_);
  ledger["plain"]["beside"] = {placed[1], placed[2]};
  ledger["plain"]["placing"] = true;
  ledger["plain"]["identities"] = {{1, 2, 3, 4}};
  WriteLedger(models_, ledger);
  Restart();
  EXPECT_EQ(ApartFiles(models_), placed);
  expect_served_with_configs();

  // Its weights removed by hand, the configs left would be in the way of the
  // next pull: the next start removes them with the folder, and the name is
  // pulled again.
  cache_.reset();
  fs::remove(models_ + "/" + placed[0]);
  Restart([&](FakeOrigin& origin) {
    origin.apart_.insert("acme/q");
    origin.Put("acme/q", model_);
    origin.beside_["acme/q"] = {{"hf_quant_config.json", quant}, {"config.json", config}};
  });
  EXPECT_TRUE(ApartFiles(models_).empty()) << ::testing::PrintToString(ApartFiles(models_));
  ASSERT_OK(cache_->Pull("acme/q").status());
  expect_served_with_configs();
}

TEST_F(NodeCacheBudgetTest, TheLedgerSurvivesARestart) {
  ASSERT_TRUE(cache_->Pull("a").ok());
  cache_.reset();
  auto origin = std::make_unique<FakeOrigin>();
  auto reopened = NodeCache::Open(registry_.get(), std::move(origin), NodeCacheOptions{.max_bytes = budget_});
  ASSERT_TRUE(reopened.ok());
  EXPECT_EQ((*reopened)->Stats().cache_bytes, model_.size());
}

}  // namespace
}  // namespace weightstore::origin

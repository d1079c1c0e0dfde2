// Following with real daemons on loopback: a trainer's weightstored that a
// training loop pushes element-patch steps to, and nodes started with
// `--origin grpc://... --follow` that keep what they pulled at the upstream's
// newest version (a regional tier following the trainer, nodes following the
// regional tier), served under the upstream's version ids, bit for bit.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "client/store.h"
#include "client/updates.h"
#include "core/checkpoint.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "tests/util/checkpoints.h"
#include "tests/util/daemon.h"
#include "tests/util/metrics.h"
#include "tests/util/serving.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "tests/util/wait.h"
#include "tests/util/watcher.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore {
namespace {

using client::CheckpointEvent;
using testing::Daemon;
using testing::Watcher;

// A version's tensors: name to bytes.
using Tensors = std::map<std::string, std::string>;

constexpr char kName[] = "m";
// Tensors every training step changes (1% of their elements), and their
// element counts; and frozen ones no step changes (big enough that a node
// fetching them would show in its received bytes).
constexpr int kChanging = 4;
constexpr size_t kChangingElements[kChanging] = {64 << 10, 128 << 10, 192 << 10, 256 << 10};
constexpr int kFrozen = 2;
constexpr size_t kFrozenElements = 64 << 10;

std::string ChangingName(int i) { return absl::StrCat("layers.", i, ".weight"); }
std::string FrozenName(int i) { return absl::StrCat("norm.", i, ".weight"); }

Tensors InitialTensors() {
  Tensors out;
  auto fill = [](size_t elements, int seed) {
    std::string bytes(elements * 4, '\0');
    for (size_t k = 0; k < elements; ++k) {
      const float v = static_cast<float>(static_cast<int>((k * 2654435761u + seed * 97) % 2001) - 1000) * 1e-4f;
      std::memcpy(bytes.data() + 4 * k, &v, 4);
    }
    return bytes;
  };
  for (int i = 0; i < kChanging; ++i) out[ChangingName(i)] = fill(kChangingElements[i], i + 1);
  for (int i = 0; i < kFrozen; ++i) out[FrozenName(i)] = fill(kFrozenElements, 100 + i);
  return out;
}

// Training step `step` (1, 2, ...): 1% of every changing tensor's elements
// move a little (another 1% each step), but for changing tensor `rewrite`
// (if any), all of whose elements move; the frozen ones stay.
Tensors NextStep(const Tensors& current, int step, int rewrite = -1) {
  Tensors next = current;
  for (int i = 0; i < kChanging; ++i) {
    std::string& bytes = next[ChangingName(i)];
    const size_t n = bytes.size() / 4;
    for (size_t k = 0; k < n; ++k) {
      if (i != rewrite && (k * 7919 + static_cast<size_t>(step) * 31 + static_cast<size_t>(i)) % 100 != 0) continue;
      float v;
      std::memcpy(&v, bytes.data() + 4 * k, 4);
      v += 1e-3f * static_cast<float>(step);
      std::memcpy(bytes.data() + 4 * k, &v, 4);
    }
  }
  return next;
}

std::vector<SharedTensor> AsShared(const Tensors& tensors) {
  std::vector<SharedTensor> out;
  for (const auto& [name, bytes] : tensors) {
    const uint64_t elements = bytes.size() / 4;
    out.push_back({{name, DType::kF32, {elements / 256, 256}}, SharedBytes::Copy(bytes)});
  }
  return out;
}

Tensors ToMap(const std::vector<SharedTensor>& tensors) {
  Tensors out;
  for (const SharedTensor& t : tensors) out[t.spec.name] = std::string(t.bytes.view());
  return out;
}

uint64_t BytesOf(const Tensors& tensors) {
  uint64_t n = 0;
  for (const auto& [_, bytes] : tensors) n += bytes.size();
  return n;
}

// A daemon, its models folder and a client of it.
struct Served {
  std::unique_ptr<Daemon> daemon;
  std::unique_ptr<client::Store> store;
  std::string models;

  // The version it serves of the checkpoint ("" while it serves none).
  std::string Version() const {
    auto info = store->GetCheckpoint(kName);
    return info.ok() ? info->version : "";
  }
  // What the daemon logged, less its per-request lines (a test polls it).
  std::string Log() const {
    std::string out;
    for (absl::string_view line : absl::StrSplit(daemon->log(), '\n')) {
      if (!absl::StrContains(line, "\"msg\":\"request\"")) absl::StrAppend(&out, line, "\n");
    }
    return out;
  }
  double Metric(absl::string_view name, absl::string_view label = "") const {
    if (label.empty()) return testing::MetricValue(daemon->metrics_port(), name, {"checkpoint=\"m\""});
    return testing::MetricValue(daemon->metrics_port(), name, {"checkpoint=\"m\"", label});
  }
  double Connected() const {
    return testing::MetricValue(daemon->metrics_port(), "weightstore_follow_upstream_connected");
  }
};

Served Connect(std::unique_ptr<Daemon> daemon, std::string models) {
  Served s;
  s.daemon = std::move(daemon);
  s.models = std::move(models);
  // A deadline that only keeps a daemon that never answers from hanging the test.
  client::RemoteOptions options;
  options.deadline = std::chrono::seconds(60);
  if (s.daemon->port() != 0) s.store = *client::ConnectRemoteStore(s.daemon->address(), options);
  return s;
}

class FollowingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    trainer_models_ = testing::MakeScratchDir("follow-trainer");
    current_ = InitialTensors();
    checkpoint_bytes_ = BytesOf(current_);
    WriteCheckpoint();
    StartTrainer();
    if (HasFatalFailure()) return;
    const std::string v0 = trainer_.Version();
    ASSERT_FALSE(v0.empty()) << trainer_.Log();
    {
      absl::MutexLock lock(&versions_mu_);
      versions_[v0] = current_;
    }
    order_.push_back(v0);
  }

  // The trainer's checkpoint as it starts, from current_: one file.
  virtual void WriteCheckpoint() {
    testing::WriteFileOrDie(trainer_models_ + "/m.safetensors",
                            *SerializeCheckpoint(kSafeTensorsFormat, AsShared(current_), {}));
  }

  void StartTrainer(const std::string& listen = "127.0.0.1:0", std::vector<std::string> args = {}) {
    trainer_ = Connect(std::make_unique<Daemon>(trainer_models_, std::move(args), listen), trainer_models_);
    ASSERT_NE(trainer_.daemon->port(), 0) << trainer_.Log();
  }

  // Stops the trainer and starts it again on `listen` with `args`; its
  // current version is then the only one the test has seen.
  void RestartTrainer(const std::string& listen, std::vector<std::string> args = {}) {
    trainer_ = Served();
    StartTrainer(listen, std::move(args));
    if (HasFatalFailure()) return;
    order_ = {trainer_.Version()};
    absl::MutexLock lock(&versions_mu_);
    versions_[order_[0]] = current_;
  }

  // Starts a node following `upstream`, pulling the checkpoint at start, on
  // `models` (a fresh folder when empty).
  Served StartFollower(const Daemon& upstream, std::string models = "", bool follow = true,
                       const std::vector<std::string>& extra = {}) {
    if (models.empty()) models = testing::MakeScratchDir("follow-node");
    std::vector<std::string> args = {"--pull", kName, "--metrics-listen", "127.0.0.1:0"};
    if (follow) args.insert(args.begin(), "--follow");
    args.insert(args.end(), extra.begin(), extra.end());
    Served node = Connect(testing::StartNode(upstream, models, args), models);
    EXPECT_NE(node.daemon->port(), 0) << node.Log();
    return node;
  }

  // One training step pushed to the trainer (element patches against the
  // version it serves, but for changing tensor `rewrite`, whole); returns the
  // new version id ("" on failure).
  std::string Step(int rewrite = -1) {
    ++step_;
    Tensors next = NextStep(current_, step_, rewrite);
    auto served = trainer_.store->ListTensors(kName, {});
    if (!served.ok()) {
      ADD_FAILURE() << "step " << step_ << ": " << served.status();
      return "";
    }
    const std::vector<SharedTensor> next_shared = AsShared(next), base_shared = AsShared(current_);
    auto plan = client::PlanPush(*served, next_shared, base_shared);
    if (!plan.ok()) {
      ADD_FAILURE() << "step " << step_ << ": " << plan.status();
      return "";
    }
    EXPECT_EQ(plan->digests, trainer_digests_) << "step " << step_;
    if (trainer_digests_) {
      EXPECT_EQ(plan->request.patched.size(), static_cast<size_t>(rewrite < 0 ? kChanging : kChanging - 1))
          << "step " << step_;
      EXPECT_EQ(plan->request.tensors.size(), rewrite < 0 ? 0u : 1u) << "step " << step_;
      EXPECT_EQ(plan->unchanged, static_cast<size_t>(kFrozen)) << "step " << step_;
    } else {
      // A trainer without digests lists none: every tensor goes whole.
      EXPECT_TRUE(plan->request.patched.empty()) << "step " << step_;
      EXPECT_EQ(plan->request.tensors.size(), static_cast<size_t>(kChanging + kFrozen)) << "step " << step_;
    }
    auto pushed = trainer_.store->Push(kName, plan->request);
    if (!pushed.ok()) {
      ADD_FAILURE() << "step " << step_ << ": " << pushed.status();
      return "";
    }
    {
      absl::MutexLock lock(&versions_mu_);
      versions_[pushed->version] = next;
    }
    order_.push_back(pushed->version);
    current_ = std::move(next);
    return pushed->version;
  }

  // Checks that the node's file on disk holds `version`'s tensors, and that
  // no temporary of a rewrite is left beside it.
  void ExpectOnDisk(const Served& node, const std::string& version, const std::string& what) {
    EXPECT_EQ(testing::TensorsOf(testing::ReadFileOrEmpty(node.models + "/m.safetensors")), VersionTensors(version))
        << what << ": the file on disk is not version " << version;
    EXPECT_EQ(testing::UploadTemporariesIn(node.models), 0u) << what;
  }

  Tensors VersionTensors(const std::string& version) {
    absl::MutexLock lock(&versions_mu_);
    auto it = versions_.find(version);
    return it == versions_.end() ? Tensors() : it->second;
  }

  // Waits until `node` serves `version`; adds a failure if it never does.
  static bool WaitForVersion(const Served& node, const std::string& version, const std::string& what) {
    const bool reached = testing::WaitUntil([&] { return node.Version() == version; });
    EXPECT_TRUE(reached) << what << " serves " << node.Version() << ", not " << version << "\n" << node.Log();
    return reached;
  }

  // Fetches every tensor from `node` and checks that it serves `version`
  // exactly as the trainer pushed it.
  void ExpectServesBitExact(const Served& node, const std::string& version, const std::string& what) {
    auto fetched = node.store->FetchVersioned(kName, {});
    ASSERT_TRUE(fetched.ok()) << what << ": " << fetched.status() << "\n" << node.Log();
    EXPECT_EQ(fetched->version, version) << what;
    const Tensors want = VersionTensors(version);
    ASSERT_FALSE(want.empty()) << what << ": no such version " << version;
    const Tensors got = ToMap(fetched->tensors);
    EXPECT_EQ(got.size(), want.size()) << what;
    for (const auto& [name, bytes] : want) {
      auto it = got.find(name);
      ASSERT_NE(it, got.end()) << what << ": no " << name;
      EXPECT_TRUE(it->second == bytes) << what << ": " << name << " differs from version " << version;
    }
  }

  std::string trainer_models_;
  Served trainer_;
  Tensors current_;
  uint64_t checkpoint_bytes_ = 0;
  int step_ = 0;
  // Whether the trainer lists tensor digests (Step() then pushes patches).
  bool trainer_digests_ = true;
  absl::Mutex versions_mu_;
  std::map<std::string, Tensors> versions_ ABSL_GUARDED_BY(versions_mu_);
  std::vector<std::string> order_;  // version ids, oldest first
};

TEST_F(FollowingTest, NodesFollowATrainerThroughARegionalTierBitExactWithElementPatches) {
  Served regional = StartFollower(*trainer_.daemon);
  ASSERT_NE(regional.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(regional, order_[0], "regional"));
  Served n1 = StartFollower(*regional.daemon);
  Served n2 = StartFollower(*regional.daemon);
  ASSERT_NE(n1.daemon->port(), 0);
  ASSERT_NE(n2.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(n1, order_[0], "n1"));
  ASSERT_TRUE(WaitForVersion(n2, order_[0], "n2"));
  // N1's own clients: a watcher, and a holder of the tensors of version 0.
  Watcher watcher(n1.store.get(), {.name = kName, .known = {{kName, order_[0]}}});
  client::HeldTensors held;
  ASSERT_OK(client::UpdateTensors(*n1.store, kName, {}, &held).status());
  ASSERT_EQ(held.version, order_[0]);

  Served n3;
  bool n2_stopped = false;
  for (int s = 1; s <= 8; ++s) {
    SCOPED_TRACE(absl::StrCat("step ", s));
    if (s == 3) {
      ASSERT_TRUE(n2.daemon->Stop()) << n2.Log();
      n2_stopped = true;
    }
    const std::string v = Step();
    ASSERT_FALSE(v.empty());
    ASSERT_TRUE(WaitForVersion(regional, v, "regional"));
    ASSERT_TRUE(WaitForVersion(n1, v, "n1"));
    if (!n2_stopped) {
      ASSERT_TRUE(WaitForVersion(n2, v, "n2"));
    }
    if (n3.daemon != nullptr) {
      ASSERT_TRUE(WaitForVersion(n3, v, "n3"));
    }
    EXPECT_TRUE(watcher.WaitForReplacement(v)) << "n1's watcher never heard of " << v;
    if (s == 4) {  // a node that joins late pulls the regional tier's version 4 and follows from there
      n3 = StartFollower(*regional.daemon);
      ASSERT_NE(n3.daemon->port(), 0);
      ASSERT_TRUE(WaitForVersion(n3, v, "n3"));
    }
    if (s == 5) {  // N2 comes back three versions behind
      n2.daemon->Signal(SIGCONT);
      n2_stopped = false;
      ASSERT_TRUE(WaitForVersion(n2, v, "n2 (resumed)"));
      // N1's client brings what it holds from version 0 to 5.
      ASSERT_OK_AND_ASSIGN(client::UpdateResult r, client::UpdateTensors(*n1.store, kName, {}, &held));
      EXPECT_EQ(r.new_version, v);
      EXPECT_TRUE(r.delta) << r.full_reason;
      EXPECT_EQ(ToMap(held.tensors), VersionTensors(v));
    }
    if (s == 6) {
      // A client of N1 holding version 5 gets 6 from N1 as a delta of
      // element patches: N1 publishes each step as a replacement of the last.
      ASSERT_EQ(held.version, order_[5]);
      client::Query since;
      since.since_version = order_[5];
      ASSERT_OK_AND_ASSIGN(client::TensorListing listing, n1.store->ListTensors(kName, since));
      EXPECT_EQ(listing.version, v);
      ASSERT_TRUE(listing.delta.has_value());
      EXPECT_TRUE(listing.delta->delta) << listing.delta->full_reason;
      EXPECT_EQ(listing.delta->changed_tensors, static_cast<uint64_t>(kChanging));
      EXPECT_EQ(listing.delta->unchanged_tensors, static_cast<uint64_t>(kFrozen));
      for (const client::TensorDescription& t : listing.tensors) {
        EXPECT_EQ(t.unchanged, t.spec.name.rfind("norm.", 0) == 0) << t.spec.name;
      }
      ASSERT_OK_AND_ASSIGN(client::UpdateResult r, client::UpdateTensors(*n1.store, kName, {}, &held));
      EXPECT_EQ(r.old_version, order_[5]);
      EXPECT_EQ(r.new_version, v);
      EXPECT_TRUE(r.delta) << r.full_reason;
      EXPECT_EQ(r.changed.size(), static_cast<size_t>(kChanging));
      EXPECT_EQ(r.patched.size(), static_cast<size_t>(kChanging)) << r.patch_reason << r.patch_failure;
      EXPECT_LT(r.fetched_bytes, checkpoint_bytes_ / 10) << "of " << checkpoint_bytes_;
      EXPECT_EQ(ToMap(held.tensors), VersionTensors(v));
    }
  }
  const std::string last = order_.back();
  for (const auto& [served, name] : std::vector<std::pair<const Served*, const char*>>{
           {&regional, "regional"}, {&n1, "n1"}, {&n2, "n2"}, {&n3, "n3"}}) {
    const Served* node = served;  // (a lambda may not capture a structured binding before C++20's clang 16)
    const char* what = name;
    SCOPED_TRACE(what);
    ASSERT_TRUE(WaitForVersion(*node, last, what));
    ExpectServesBitExact(*node, last, what);
    ExpectOnDisk(*node, last, what);
    EXPECT_TRUE(testing::WaitUntil([&] { return node->Metric("weightstore_follow_lag_versions") == 0; }))
        << node->Metric("weightstore_follow_lag_versions");
    EXPECT_GE(node->Metric("weightstore_follow_lag_seconds"), 0);
    EXPECT_EQ(node->Connected(), 1);
    EXPECT_LE(node->Metric("weightstore_follow_failures_total"), 0) << node->Log();
  }

  // The regional tier took each of the 8 steps as element patches: a few
  // percent of the checkpoint's bytes each.
  const double patch_updates = regional.Metric("weightstore_follow_updates_total", "how=\"patches\"");
  const double whole_updates = regional.Metric("weightstore_follow_updates_total", "how=\"whole\"");
  const double patch_bytes = regional.Metric("weightstore_follow_received_bytes_total", "kind=\"patch\"");
  const double whole_bytes = regional.Metric("weightstore_follow_received_bytes_total", "kind=\"whole\"");
  std::cout << "regional tier: " << patch_updates << " updates by patches, " << whole_updates << " with whole tensors; "
            << patch_bytes << " bytes of patches, " << whole_bytes << " whole, for 8 steps of a " << checkpoint_bytes_
            << "-byte checkpoint\n";
  EXPECT_EQ(patch_updates, 8) << testing::HttpGet(regional.daemon->metrics_port(), "/metrics");
  EXPECT_LE(whole_updates, 0);
  EXPECT_GT(patch_bytes, 0);
  EXPECT_LT(patch_bytes, 8 * 0.1 * static_cast<double>(checkpoint_bytes_));
  EXPECT_LE(whole_bytes, 0);
  // So did the nodes below it, from the regional tier's own patches (N2
  // composed ones for its three versions; N3 from version 4).
  for (const auto& [node, what] :
       std::vector<std::pair<const Served*, const char*>>{{&n1, "n1"}, {&n2, "n2"}, {&n3, "n3"}}) {
    EXPECT_GT(node->Metric("weightstore_follow_updates_total", "how=\"patches\""), 0) << what;
    EXPECT_LE(node->Metric("weightstore_follow_received_bytes_total", "kind=\"whole\""), 0) << what;
  }
  EXPECT_EQ(n1.Metric("weightstore_follow_updates_total", "how=\"patches\""), 8);

  // N1's watcher heard of every step as a replacement of the one before.
  std::vector<std::string> replaced;
  for (const CheckpointEvent& e : watcher.events()) {
    if (e.kind != CheckpointEvent::Kind::kReplaced) continue;
    replaced.push_back(e.new_version);
    EXPECT_TRUE(e.delta) << e.full_reason;
    EXPECT_EQ(e.changed_count, static_cast<uint64_t>(kChanging)) << e.new_version;
    EXPECT_EQ(e.unchanged_count, static_cast<uint64_t>(kFrozen)) << e.new_version;
  }
  EXPECT_EQ(replaced, std::vector<std::string>(order_.begin() + 1, order_.end()));
}

// A sharded checkpoint, as transformers saves one: an index and three
// shards, the last holding only tensors no step changes.
class ShardedFollowingTest : public FollowingTest {
 protected:
  static std::string Shard(int i) { return absl::StrCat("m-0000", i, "-of-00003.safetensors"); }
  void WriteCheckpoint() override {
    const std::vector<SharedTensor> all = AsShared(current_);
    std::map<int, std::vector<SharedTensor>> shards;
    std::string weight_map;
    for (const SharedTensor& t : all) {
      const int shard = absl::StartsWith(t.spec.name, "norm.") ? 3 : t.spec.name < ChangingName(kChanging / 2) ? 1 : 2;
      shards[shard].push_back(t);
      absl::StrAppend(&weight_map, weight_map.empty() ? "" : ", ", "\"", t.spec.name, "\": \"", Shard(shard), "\"");
    }
    for (const auto& [i, tensors] : shards) {
      testing::WriteFileOrDie(trainer_models_ + "/" + Shard(i),
                              *SerializeCheckpoint(kSafeTensorsFormat, tensors, {{"format", "pt"}}));
    }
    testing::WriteFileOrDie(
        trainer_models_ + "/m.safetensors.index.json",
        absl::StrCat(R"({"metadata": {"total_size": )", checkpoint_bytes_, R"(}, "weight_map": {)", weight_map, "}}"));
  }
  // The index and shards under `models` (where a node placed them), by file
  // name, with their inodes.
  // With `paths`, also their paths.
  static std::map<std::string, ino_t> Files(const std::string& models, std::vector<std::string>* paths = nullptr) {
    std::map<std::string, ino_t> files;
    for (auto it = std::filesystem::recursive_directory_iterator(models); it != decltype(it)(); ++it) {
      const std::filesystem::directory_entry& e = *it;
      const std::string name = e.path().filename();
      // Not into the node's hidden folders (its cache's partial downloads
      // come and go while the test looks).
      if (name[0] == '.' && e.is_directory()) {
        it.disable_recursion_pending();
        continue;
      }
      if (e.is_regular_file() && name[0] != '.' && absl::StrContains(name, ".safetensors")) {
        struct stat st {};
        files[name] = ::stat(e.path().c_str(), &st) == 0 ? st.st_ino : 0;
        if (paths != nullptr) paths->push_back(e.path());
      }
    }
    return files;
  }
  // The tensors of the sharded checkpoint under `models`, read from its files.
  static Tensors OnDisk(const std::string& models) {
    for (auto it = std::filesystem::recursive_directory_iterator(models); it != decltype(it)(); ++it) {
      const std::filesystem::directory_entry& e = *it;
      if (e.path().filename().string()[0] == '.' && e.is_directory()) {
        it.disable_recursion_pending();
        continue;
      }
      if (absl::EndsWith(e.path().string(), ".safetensors.index.json")) {
        auto opened = Checkpoint::Open(e.path().string());
        if (!opened.ok()) return {};
        Tensors out;
        for (const CheckpointEntry& entry : (*opened)->entries()) {
          out[entry.spec.name] = std::string((*opened)->Read(entry)->bytes.view());
        }
        return out;
      }
    }
    return {};
  }
};

// The trainer's pushes rewrite only the shards of the tensors they change,
// and a regional tier and a node below it follow, bit exact, by element
// patches: each rewrites the same shards, never the frozen one.
TEST_F(ShardedFollowingTest, AShardedCheckpointIsFollowedByPatchesRewritingOnlyItsChangedShards) {
  Served regional = StartFollower(*trainer_.daemon);
  ASSERT_NE(regional.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(regional, order_[0], "regional"));
  Served node = StartFollower(*regional.daemon);
  ASSERT_NE(node.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(node, order_[0], "node"));
  std::map<std::string, std::map<std::string, ino_t>> before;
  // Held open, so that a file replaced keeps its inode number from reuse.
  std::vector<std::ifstream> held;
  for (const Served* s : {&trainer_, &regional, &node}) {
    std::vector<std::string> paths;
    before[s->models] = Files(s->models, &paths);
    ASSERT_EQ(before[s->models].size(), 4u) << s->models;  // the index and three shards
    for (const std::string& path : paths) held.emplace_back(path);
  }
  for (int s = 1; s <= 3; ++s) {
    SCOPED_TRACE(absl::StrCat("step ", s));
    const std::string v = Step();
    ASSERT_FALSE(v.empty());
    ASSERT_TRUE(WaitForVersion(regional, v, "regional"));
    ASSERT_TRUE(WaitForVersion(node, v, "node"));
  }
  // A version is served before its follower has counted the step and
  // removed the step's temporaries: wait for that, then look.
  for (const Served* s : {&regional, &node}) {
    EXPECT_TRUE(testing::WaitUntil([&] { return s->Metric("weightstore_follow_lag_versions") == 0; })) << s->Log();
  }
  const std::string last = order_.back();
  for (const auto& [served, name] : std::vector<std::pair<const Served*, const char*>>{
           {&trainer_, "trainer"}, {&regional, "regional"}, {&node, "node"}}) {
    const Served* s = served;
    SCOPED_TRACE(name);
    if (s != &trainer_) ExpectServesBitExact(*s, last, name);
    EXPECT_EQ(OnDisk(s->models), VersionTensors(last));
    EXPECT_EQ(testing::UploadTemporariesIn(s->models), 0u);
    // The changed shards are new files; the index and the frozen shard are
    // the ones there before the first step.
    const std::map<std::string, ino_t> after = Files(s->models);
    ASSERT_EQ(after.size(), 4u);
    const std::map<std::string, ino_t>& was = before[s->models];
    for (const auto& [file, inode] : after) {
      const bool changes = absl::StrContains(file, "00001-") || absl::StrContains(file, "00002-");
      EXPECT_EQ(inode != was.at(file), changes) << file;
    }
  }
  for (const auto& [served, name] :
       std::vector<std::pair<const Served*, const char*>>{{&regional, "regional"}, {&node, "node"}}) {
    EXPECT_EQ(served->Metric("weightstore_follow_updates_total", "how=\"patches\""), 3) << name << served->Log();
    EXPECT_LE(served->Metric("weightstore_follow_received_bytes_total", "kind=\"whole\""), 0) << name;
    EXPECT_LE(served->Metric("weightstore_follow_failures_total"), 0) << name << served->Log();
  }
}

TEST_F(FollowingTest, ClientsOfAFollowingNodeOnlyEverSeeWholeVersions) {
  Served node = StartFollower(*trainer_.daemon);
  ASSERT_NE(node.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(node, order_[0], "node"));
  // The reader records what each fetch reported and a digest of every
  // tensor; they are checked once the steps are done (a fetch may report a
  // version before the trainer's push has returned it to this test).
  struct Seen {
    std::string version;
    std::map<std::string, std::string> digests;
  };
  absl::Mutex mu;
  std::vector<Seen> seen;
  std::vector<std::string> errors;
  std::string latest;
  int aborted = 0;
  std::atomic<bool> stop{false};
  std::thread reader([&] {
    auto store = *client::ConnectRemoteStore(node.daemon->address());
    while (!stop) {
      auto fetched = store->FetchVersioned(kName, {});
      Seen s;
      if (fetched.ok()) {
        s.version = fetched->version;
        for (const SharedTensor& t : fetched->tensors) s.digests[t.spec.name] = testing::Sha256Hex(t.bytes.view());
      }
      absl::MutexLock lock(&mu);
      if (!fetched.ok()) {
        // A fetch whose version was replaced while it ran is refused whole.
        if (absl::IsAborted(fetched.status())) {
          ++aborted;
        } else {
          errors.push_back(fetched.status().ToString());
        }
        continue;
      }
      latest = s.version;
      seen.push_back(std::move(s));
    }
  });
  for (int s = 1; s <= 6; ++s) {
    const std::string v = Step();
    ASSERT_FALSE(v.empty());
    if (s % 2 == 0) {  // else the next step may come before the node has this one
      ASSERT_TRUE(WaitForVersion(node, v, "node"));
    }
  }
  EXPECT_TRUE(testing::WaitUntil([&] {
    absl::MutexLock lock(&mu);
    return latest == order_.back();
  }));
  stop = true;
  reader.join();

  std::set<std::string> versions_seen;
  int mismatches = 0;
  for (const Seen& s : seen) {
    versions_seen.insert(s.version);
    const Tensors want = VersionTensors(s.version);
    std::map<std::string, std::string> want_digests;
    for (const auto& [name, bytes] : want) want_digests[name] = testing::Sha256Hex(bytes);
    if (want.empty() || s.digests != want_digests) {
      ++mismatches;
      ADD_FAILURE() << "a fetch reported version " << s.version << " with other tensors";
    }
  }
  std::cout << seen.size() << " fetches saw " << versions_seen.size() << " of " << order_.size() << " versions; "
            << aborted << " were refused for a replaced version\n";
  EXPECT_GT(seen.size(), 0u);
  EXPECT_EQ(mismatches, 0);
  EXPECT_TRUE(errors.empty()) << errors.size()
                              << " fetches failed, the first: " << (errors.empty() ? "" : errors.front());
}

TEST_F(FollowingTest, ANodeKeepsServingWhileItsUpstreamIsGoneAndCatchesUpWhenItIsBack) {
  // The trainer on a port it gets back after a restart.
  const std::string address = trainer_.daemon->address();
  RestartTrainer(address);
  if (HasFatalFailure()) return;
  Served node = StartFollower(*trainer_.daemon);
  ASSERT_NE(node.daemon->port(), 0);
  const std::string v1 = Step();
  ASSERT_FALSE(v1.empty());
  ASSERT_TRUE(WaitForVersion(node, v1, "node"));
  EXPECT_TRUE(testing::WaitUntil([&] { return node.Connected() == 1; })) << node.Connected();

  trainer_.daemon->Signal(SIGKILL);
  ASSERT_NE(trainer_.daemon->WaitExit(30000), -1);
  // The node notices, and serves what it had meanwhile.
  EXPECT_TRUE(testing::WaitUntil([&] { return node.Connected() == 0; })) << node.Log();
  EXPECT_EQ(node.Version(), v1);
  ExpectServesBitExact(node, v1, "node, its upstream gone");

  // Back on the same port and models folder; the next step reaches the node.
  trainer_ = Served();
  StartTrainer(address);
  const std::string restarted = trainer_.Version();
  ASSERT_FALSE(restarted.empty());
  {
    absl::MutexLock lock(&versions_mu_);
    versions_[restarted] = current_;  // the same tensors, whether or not under the same id
  }
  const std::string v2 = Step();
  ASSERT_FALSE(v2.empty());
  ASSERT_TRUE(WaitForVersion(node, v2, "node, its upstream back"));
  ExpectServesBitExact(node, v2, "node, its upstream back");
  EXPECT_TRUE(testing::WaitUntil([&] { return node.Connected() == 1; })) << node.Log();
  EXPECT_TRUE(testing::WaitUntil([&] { return node.Metric("weightstore_follow_lag_versions") == 0; }));
  std::cout << "follow failures while the upstream was gone: " << node.Metric("weightstore_follow_failures_total")
            << "; trainer's version after its restart " << (restarted == v1 ? "kept" : "changed") << "\n";
}

TEST_F(FollowingTest, ARestartedNodeServesItsFollowedVersionFromDiskAndCatchesUpFromIt) {
  const std::string models = testing::MakeScratchDir("follow-restarted");
  Served node = StartFollower(*trainer_.daemon, models);
  ASSERT_NE(node.daemon->port(), 0);
  const std::string v1 = Step();
  ASSERT_FALSE(v1.empty());
  ASSERT_TRUE(WaitForVersion(node, v1, "node"));
  ExpectServesBitExact(node, v1, "node");
  ExpectOnDisk(node, v1, "node");
  node = Served();  // SIGTERM, waits for the exit

  // A step the node misses; then the trainer stops answering while the node
  // starts again, so that it serves what its disk holds.
  const std::string v2 = Step();
  ASSERT_FALSE(v2.empty());
  ASSERT_TRUE(trainer_.daemon->Stop());
  node = StartFollower(*trainer_.daemon, models);
  ASSERT_NE(node.daemon->port(), 0);
  EXPECT_EQ(node.Version(), v1) << node.Log();
  ExpectServesBitExact(node, v1, "restarted node");
  EXPECT_LE(testing::MetricValue(node.daemon->metrics_port(), "weightstore_origin_pulled_bytes_total"), 0);

  trainer_.daemon->Signal(SIGCONT);
  ASSERT_TRUE(WaitForVersion(node, v2, "restarted node"));
  ExpectServesBitExact(node, v2, "restarted node");
  ExpectOnDisk(node, v2, "restarted node");
  // It caught up from v1, by patches, never pulling the checkpoint again.
  EXPECT_EQ(node.Metric("weightstore_follow_updates_total", "how=\"patches\""), 1)
      << testing::HttpGet(node.daemon->metrics_port(), "/metrics");
  EXPECT_LE(testing::MetricValue(node.daemon->metrics_port(), "weightstore_origin_pulled_bytes_total"), 0);
}

TEST_F(FollowingTest, ANodeWithoutFollowKeepsTheVersionItPulled) {
  const std::string socket = testing::MakeScratchDir("sock") + "/ws.sock";
  Served follower = StartFollower(*trainer_.daemon, "", /*follow=*/true, {"--socket", socket});
  Served puller = StartFollower(*trainer_.daemon, "", /*follow=*/false);
  ASSERT_NE(follower.daemon->port(), 0);
  ASSERT_NE(puller.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(puller, order_[0], "puller"));
  for (int s = 1; s <= 2; ++s) {
    const std::string v = Step();
    ASSERT_FALSE(v.empty());
    ASSERT_TRUE(WaitForVersion(follower, v, "follower"));
  }
  EXPECT_EQ(puller.Version(), order_[0]);
  ExpectServesBitExact(puller, order_[0], "puller");
  // Only a following node says how it stands against its upstream.
  ASSERT_OK_AND_ASSIGN(client::CheckpointSummary followed, follower.store->GetCheckpoint(kName));
  ASSERT_TRUE(followed.follow.has_value());
  EXPECT_EQ(followed.follow->upstream, absl::StrCat("grpc://", trainer_.daemon->address()));
  EXPECT_EQ(followed.follow->upstream_version, order_.back());
  // The socket says the same, in its listing too.
  ASSERT_OK_AND_ASSIGN(auto local, client::ConnectSharedMemoryStore(socket));
  ASSERT_OK_AND_ASSIGN(client::CheckpointSummary over_socket, local->GetCheckpoint(kName));
  ASSERT_TRUE(over_socket.follow.has_value());
  EXPECT_EQ(over_socket.follow->upstream, followed.follow->upstream);
  EXPECT_EQ(over_socket.follow->upstream_version, order_.back());
  ASSERT_OK_AND_ASSIGN(std::vector<client::CheckpointSummary> listed, local->ListCheckpoints());
  ASSERT_EQ(listed.size(), 1u);
  ASSERT_TRUE(listed[0].follow.has_value());
  EXPECT_EQ(listed[0].follow->upstream_version, order_.back());
  ASSERT_OK_AND_ASSIGN(client::CheckpointSummary pulled, puller.store->GetCheckpoint(kName));
  EXPECT_FALSE(pulled.follow.has_value());
  EXPECT_NE(puller.Connected(), 1);
  EXPECT_LE(puller.Metric("weightstore_follow_updates_total"), 0);
}

TEST_F(FollowingTest, ATensorTheUpstreamKeepsNoPatchOfComesWholeAndTheRestAsPatches) {
  Served node = StartFollower(*trainer_.daemon);
  ASSERT_NE(node.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(node, order_[0], "node"));
  const std::string v1 = Step();
  ASSERT_FALSE(v1.empty());
  ASSERT_TRUE(WaitForVersion(node, v1, "node"));
  // Every element of layers.0 changes: a patch of it would be no smaller, so
  // it is pushed, kept and followed whole; the others as patches.
  const std::string v2 = Step(/*rewrite=*/0);
  ASSERT_FALSE(v2.empty());
  ASSERT_TRUE(WaitForVersion(node, v2, "node"));
  ExpectServesBitExact(node, v2, "node");
  ExpectOnDisk(node, v2, "node");
  EXPECT_EQ(node.Metric("weightstore_follow_updates_total", "how=\"patches\""), 1);
  EXPECT_EQ(node.Metric("weightstore_follow_updates_total", "how=\"whole\""), 1);
  // Whole: layers.0 alone (not the frozen tensors, nor the patched ones).
  const double whole = node.Metric("weightstore_follow_received_bytes_total", "kind=\"whole\"");
  const double rewritten = static_cast<double>(kChangingElements[0] * 4);
  EXPECT_GE(whole, rewritten);
  EXPECT_LE(whole, rewritten * 1.01) << "more than the one tensor that changed throughout";
  EXPECT_GT(node.Metric("weightstore_follow_received_bytes_total", "kind=\"patch\""), 0);
}

TEST_F(FollowingTest, AnUpstreamKeepingNoPatchesIsFollowedWithTheChangedTensorsWholeAndOnlyThose) {
  RestartTrainer("127.0.0.1:0", {"--kept-patch-bytes", "0"});
  if (HasFatalFailure()) return;
  Served node = StartFollower(*trainer_.daemon);
  ASSERT_NE(node.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(node, order_[0], "node"));
  for (int s = 1; s <= 2; ++s) {
    const std::string v = Step();
    ASSERT_FALSE(v.empty());
    ASSERT_TRUE(WaitForVersion(node, v, "node"));
    ExpectServesBitExact(node, v, "node");
  }
  ExpectOnDisk(node, order_.back(), "node");
  EXPECT_EQ(node.Metric("weightstore_follow_updates_total", "how=\"whole\""), 2);
  EXPECT_LE(node.Metric("weightstore_follow_updates_total", "how=\"patches\""), 0);
  EXPECT_LE(node.Metric("weightstore_follow_received_bytes_total", "kind=\"patch\""), 0);
  // The changing tensors, twice; never the frozen ones.
  double changing = 0;
  for (size_t n : kChangingElements) changing += static_cast<double>(n * 4);
  const double whole = node.Metric("weightstore_follow_received_bytes_total", "kind=\"whole\"");
  EXPECT_GE(whole, 2 * changing);
  EXPECT_LE(whole, 2 * changing * 1.01) << "more than the tensors that changed";
}

// Lines of `log` that contain `text`.
int LinesWith(const std::string& log, absl::string_view text) {
  int n = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n')) n += absl::StrContains(line, text) ? 1 : 0;
  return n;
}

TEST_F(FollowingTest, AStepTheNodeCannotCheckIsBlockedAndTriedAgainOnlyAtTheUpstreamsNextVersion) {
  // The trainer lists no digests, so no step of a node can be checked.
  RestartTrainer("127.0.0.1:0", {"--tensor-digests=false", "--metrics-listen", "127.0.0.1:0"});
  if (HasFatalFailure()) return;
  trainer_digests_ = false;
  Served node = StartFollower(*trainer_.daemon);
  ASSERT_NE(node.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(node, order_[0], "node"));
  ASSERT_TRUE(testing::WaitUntil([&] { return node.Connected() == 1; })) << node.Log();
  EXPECT_EQ(node.Metric("weightstore_follow_blocked"), 0) << testing::HttpGet(node.daemon->metrics_port(), "/metrics");
  EXPECT_EQ(node.Metric("weightstore_follow_failures_total"), 0);
  const double served_before = testing::MetricValue(trainer_.daemon->metrics_port(), "weightstore_served_bytes_total");

  const std::string v1 = Step();
  ASSERT_FALSE(v1.empty());
  EXPECT_TRUE(testing::WaitUntil([&] {
    return node.Metric("weightstore_follow_blocked") == 1 && node.Metric("weightstore_follow_failures_total") == 1;
  })) << testing::HttpGet(node.daemon->metrics_port(), "/metrics")
      << node.Log();
  EXPECT_EQ(node.Metric("weightstore_follow_lag_versions"), 1);
  // Not tried again on a timer: a second has passed since the upstream
  // announced v1 (the lag says so), past the first backoffs (200 ms, 400 ms),
  // and the step was tried once.
  EXPECT_TRUE(testing::WaitUntil([&] { return node.Metric("weightstore_follow_lag_seconds") >= 1; }))
      << node.Metric("weightstore_follow_lag_seconds");
  EXPECT_EQ(node.Metric("weightstore_follow_failures_total"), 1) << node.Log();
  EXPECT_EQ(node.Metric("weightstore_follow_blocked"), 1);
  // It serves its old version meanwhile, bit for bit, and nothing was written.
  EXPECT_EQ(node.Version(), order_[0]);
  ExpectServesBitExact(node, order_[0], "blocked node");
  ExpectOnDisk(node, order_[0], "blocked node");
  const std::string log = node.Log();
  EXPECT_EQ(LinesWith(log, "'m' stays at its version until the upstream has another"), 1) << log;
  EXPECT_EQ(LinesWith(log, "without a digest"), 1) << log;
  const double served_once = testing::MetricValue(trainer_.daemon->metrics_port(), "weightstore_served_bytes_total");

  // The upstream's next version is worth one more try, which fails alike.
  const std::string v2 = Step();
  ASSERT_FALSE(v2.empty());
  EXPECT_TRUE(testing::WaitUntil([&] {
    return node.Metric("weightstore_follow_failures_total") == 2 && node.Metric("weightstore_follow_blocked") == 1;
  })) << testing::HttpGet(node.daemon->metrics_port(), "/metrics")
      << node.Log();
  EXPECT_EQ(node.Metric("weightstore_follow_lag_versions"), 2);
  EXPECT_EQ(node.Version(), order_[0]);
  ExpectServesBitExact(node, order_[0], "blocked node, two versions behind");
  EXPECT_EQ(LinesWith(node.Log(), "'m' stays at its version until the upstream has another"), 2) << node.Log();
  EXPECT_LE(node.Metric("weightstore_follow_updates_total"), 0);
  EXPECT_LE(node.Metric("weightstore_follow_received_bytes_total"), 0);
  const double served_twice = testing::MetricValue(trainer_.daemon->metrics_port(), "weightstore_served_bytes_total");
  // What blocks a step is found on the listing: no tensor was fetched.
  EXPECT_LT(served_once - served_before, checkpoint_bytes_ / 100);
  EXPECT_LT(served_twice - served_once, checkpoint_bytes_ / 100);
}

// A followed checkpoint whose file an operator replaces on the node is the
// operator's from then: no longer followed, and never overwritten by a step.
TEST_F(FollowingTest, AFileAnOperatorPutInPlaceOfAFollowedOneIsNoLongerFollowedNorOverwritten) {
  Served node = StartFollower(*trainer_.daemon);
  Served witness = StartFollower(*trainer_.daemon);
  ASSERT_NE(node.daemon->port(), 0);
  ASSERT_NE(witness.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(node, order_[0], "node"));
  ASSERT_TRUE(WaitForVersion(witness, order_[0], "witness"));
  ASSERT_TRUE(testing::WaitUntil([&] { return node.Metric("weightstore_follow_lag_versions") == 0; }));

  // The operator's own checkpoint under the same name, renamed into place.
  const std::string theirs = *SerializeCheckpoint(kSafeTensorsFormat, {AsShared(InitialTensors()).front()}, {});
  testing::WriteFileOrDie(node.models + "/m.safetensors.operator", theirs);
  ASSERT_EQ(std::rename((node.models + "/m.safetensors.operator").c_str(), (node.models + "/m.safetensors").c_str()),
            0);
  node.daemon->Signal(SIGHUP);  // rescan
  ASSERT_TRUE(testing::WaitUntil([&] { return node.Version() != order_[0] && !node.Version().empty(); })) << node.Log();
  const std::string operators = node.Version();
  // No longer followed: its series are gone.
  EXPECT_TRUE(testing::WaitUntil([&] { return node.Metric("weightstore_follow_lag_versions") == -1; }))
      << testing::HttpGet(node.daemon->metrics_port(), "/metrics");
  // Nor held to follow: no alert that it is not followed.
  EXPECT_EQ(testing::MetricValue(node.daemon->metrics_port(), "weightstore_follow_unfollowed_checkpoints"), 0);
  EXPECT_EQ(testing::MetricValue(node.daemon->metrics_port(), "weightstore_follow_checkpoints"), 0);

  // A step reaches the witness; the node keeps the operator's file.
  const std::string v1 = Step();
  ASSERT_FALSE(v1.empty());
  ASSERT_TRUE(WaitForVersion(witness, v1, "witness"));
  EXPECT_EQ(node.Version(), operators);
  EXPECT_EQ(testing::ReadFileOrEmpty(node.models + "/m.safetensors"), theirs);
}

// --follow-only: a node follows the checkpoints so named and serves the rest
// as pulled, saying so once in its log. A node without the flag, beside it,
// takes the same upstream's steps of both. Neither counts a checkpoint as
// held to follow and not followed.
TEST_F(FollowingTest, FollowOnlyFollowsTheCheckpointsItNamesAndServesTheRestAsPulled) {
  const std::string pinned_v0 = *SerializeCheckpoint(kSafeTensorsFormat, {AsShared(InitialTensors()).front()}, {});
  testing::WriteFileOrDie(trainer_models_ + "/pinned.safetensors", pinned_v0);
  trainer_.daemon->Signal(SIGHUP);
  auto trainer_version_of = [&](const std::string& name) {
    auto info = trainer_.store->GetCheckpoint(name);
    return info.ok() ? info->version : std::string();
  };
  ASSERT_TRUE(testing::WaitUntil([&] { return !trainer_version_of("pinned").empty(); })) << trainer_.Log();
  const std::string pinned_first = trainer_version_of("pinned");

  Served node = StartFollower(*trainer_.daemon, "", /*follow=*/true, {"--pull", "pinned", "--follow-only", "m*"});
  Served control = StartFollower(*trainer_.daemon, "", /*follow=*/true, {"--pull", "pinned"});
  ASSERT_NE(node.daemon->port(), 0);
  ASSERT_NE(control.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(node, order_[0], "node"));
  auto node_version_of = [&](const std::string& name) {
    auto info = node.store->GetCheckpoint(name);
    return info.ok() ? info->version : std::string();
  };
  ASSERT_TRUE(testing::WaitUntil([&] { return node_version_of("pinned") == pinned_first; })) << node.Log();
  EXPECT_TRUE(testing::WaitUntil([&] {
    return absl::StrContains(node.Log(), "'pinned' is held but not followed: --follow-only names it not");
  })) << node.Log();
  EXPECT_THAT(node.Log(), ::testing::HasSubstr("following only the checkpoints named by --follow-only: 'm*'"));
  auto gauge = [&](absl::string_view name) { return testing::MetricValue(node.daemon->metrics_port(), name); };
  EXPECT_TRUE(testing::WaitUntil([&] { return gauge("weightstore_follow_checkpoints") == 1; }))
      << testing::HttpGet(node.daemon->metrics_port(), "/metrics");
  EXPECT_EQ(gauge("weightstore_follow_unfollowed_checkpoints"), 0);

  // The upstream moves both: pinned first, then m. The node takes m's step,
  // and keeps the pinned version it pulled.
  testing::WriteFileOrDie(trainer_models_ + "/pinned.safetensors.next",
                          *SerializeCheckpoint(kSafeTensorsFormat, {AsShared(InitialTensors()).back()}, {}));
  ASSERT_EQ(std::rename((trainer_models_ + "/pinned.safetensors.next").c_str(),
                        (trainer_models_ + "/pinned.safetensors").c_str()),
            0);
  trainer_.daemon->Signal(SIGHUP);
  ASSERT_TRUE(testing::WaitUntil([&] { return trainer_version_of("pinned") != pinned_first; })) << trainer_.Log();
  const std::string v1 = Step();
  ASSERT_FALSE(v1.empty());
  ASSERT_TRUE(WaitForVersion(node, v1, "node"));
  ExpectServesBitExact(node, v1, "node");
  // The control node took both steps, pinned's first.
  auto control_version_of = [&](const std::string& name) {
    auto info = control.store->GetCheckpoint(name);
    return info.ok() ? info->version : std::string();
  };
  ASSERT_TRUE(WaitForVersion(control, v1, "control"));
  ASSERT_TRUE(testing::WaitUntil([&] { return control_version_of("pinned") == trainer_version_of("pinned"); }))
      << control.Log();
  EXPECT_EQ(node_version_of("pinned"), pinned_first);
  EXPECT_EQ(testing::ReadFileOrEmpty(node.models + "/pinned.safetensors"), pinned_v0);
  EXPECT_EQ(
      testing::MetricValue(node.daemon->metrics_port(), "weightstore_follow_lag_versions", {"checkpoint=\"pinned\""}),
      -1)
      << "pinned has follow series";
  EXPECT_THAT(node.Log(), ::testing::Not(::testing::HasSubstr("'pinned' is at version")));
  ASSERT_OK_AND_ASSIGN(client::CheckpointSummary pinned, node.store->GetCheckpoint("pinned"));
  EXPECT_FALSE(pinned.follow.has_value());
  EXPECT_EQ(gauge("weightstore_follow_checkpoints"), 1);
  EXPECT_EQ(gauge("weightstore_follow_unfollowed_checkpoints"), 0);
}

// A step writes the new version beside the one held: the cache's budget
// must hold both. It makes room as a pull does (the least recently used
// checkpoint goes), and a budget that cannot hold both fails the step,
// evicting nothing, while the node serves what it holds.
TEST_F(FollowingTest, AStepMakesRoomUnderTheCacheBudgetOrSaysItCannot) {
  testing::WriteFileOrDie(trainer_models_ + "/n.safetensors",
                          *SerializeCheckpoint(kSafeTensorsFormat, AsShared(current_), {}));
  trainer_.daemon->Signal(SIGHUP);
  ASSERT_TRUE(testing::WaitUntil([&] { return trainer_.store->GetCheckpoint("n").ok(); }));
  const uint64_t file = testing::ReadFileOrEmpty(trainer_models_ + "/m.safetensors").size();
  auto start = [&](uint64_t budget, bool pull_n) {
    const std::string models = testing::MakeScratchDir("follow-budget");
    std::vector<std::string> args = {
        "--follow", "--pull", kName, "--cache-max-bytes", std::to_string(budget), "--metrics-listen", "127.0.0.1:0"};
    if (pull_n) args.insert(args.end(), {"--pull", "n"});
    Served node = Connect(testing::StartNode(*trainer_.daemon, models, args), models);
    EXPECT_NE(node.daemon->port(), 0) << node.Log();
    return node;
  };
  auto serves = [](const Served& node, const std::string& name) {
    auto listed = node.store->ListCheckpoints();  // not GetCheckpoint, which would pull it
    if (!listed.ok()) return false;
    for (const auto& c : *listed) {
      if (c.name == name) return true;
    }
    return false;
  };
  // Room for both checkpoints, and half of one more.
  Served roomy = start(file * 5 / 2, /*pull_n=*/true);
  // Room for one and a half.
  Served tight = start(file * 3 / 2, /*pull_n=*/false);
  ASSERT_NE(roomy.daemon->port(), 0);
  ASSERT_NE(tight.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(roomy, order_[0], "roomy node"));
  ASSERT_TRUE(testing::WaitUntil([&] { return serves(roomy, "n"); })) << roomy.Log();
  ASSERT_TRUE(WaitForVersion(tight, order_[0], "tight node"));

  const std::string v1 = Step();
  ASSERT_FALSE(v1.empty());
  // The roomy node evicted n, pulled after m but not in use, to take the step.
  ASSERT_TRUE(WaitForVersion(roomy, v1, "roomy node"));
  ExpectServesBitExact(roomy, v1, "roomy node");
  EXPECT_FALSE(serves(roomy, "n"));
  EXPECT_EQ(testing::MetricValue(roomy.daemon->metrics_port(), "weightstore_node_cache_evictions_total"), 1);
  // n is no longer followed (no series of it left behind), and nothing held
  // goes unfollowed.
  EXPECT_TRUE(testing::WaitUntil([&] {
    return testing::MetricValue(roomy.daemon->metrics_port(), "weightstore_follow_checkpoints") == 1;
  })) << testing::HttpGet(roomy.daemon->metrics_port(), "/metrics");
  EXPECT_EQ(testing::MetricValue(roomy.daemon->metrics_port(), "weightstore_follow_lag_versions", {"checkpoint=\"n\""}),
            -1);
  EXPECT_EQ(testing::MetricValue(roomy.daemon->metrics_port(), "weightstore_follow_unfollowed_checkpoints"), 0);
  // The tight node cannot hold both versions of m: it says so and serves v0.
  ASSERT_TRUE(testing::WaitUntil([&] { return tight.Metric("weightstore_follow_failures_total") >= 1; }))
      << tight.Log();
  EXPECT_THAT(tight.Log(), ::testing::HasSubstr("the cache budget is"));
  EXPECT_EQ(tight.Version(), order_[0]);
  ExpectServesBitExact(tight, order_[0], "tight node");
  EXPECT_EQ(tight.Metric("weightstore_follow_lag_versions"), 1);
}

TEST_F(FollowingTest, AStepsFetchIsBoundedByTheChangedTensorsNotTheWholeCheckpoint) {
  const std::string v1 = Step();
  ASSERT_FALSE(v1.empty());
  uint64_t changing = 0;
  for (size_t n : kChangingElements) changing += n * 4;
  ASSERT_LT(changing, checkpoint_bytes_);
  client::Query since;
  since.since_version = order_[0];
  since.patches = true;  // patches count at their tensors' size
  EXPECT_THAT(client::FetchChanged(*trainer_.store, kName, since, changing - 1),
              testing::StatusIs(absl::StatusCode::kResourceExhausted, ::testing::HasSubstr("lists more than")));
  ASSERT_OK_AND_ASSIGN(client::ChangedTensors changed, client::FetchChanged(*trainer_.store, kName, since, changing));
  EXPECT_EQ(changed.version, v1);
  EXPECT_TRUE(changed.delta) << changed.full_reason;
  EXPECT_EQ(changed.patched.size() + changed.received.size(), static_cast<size_t>(kChanging));
}

// weightstored run to be refused at start: its exit status and what it
// printed; it would serve (and be stopped by `timeout`) if it were not.
int RunRefused(const std::string& args, std::string* out) {
  const std::string models = testing::MakeScratchDir("follow-refused");
  const std::string port_file = models + "/port";
  const int status = testing::RunCommand(absl::StrCat("timeout 60 ", testing::DaemonPath(), " --models ", models,
                                                      " --listen 127.0.0.1:0 --port-file ", port_file, " ", args),
                                         out);
  EXPECT_TRUE(testing::ReadFileOrEmpty(port_file).empty()) << "it served: " << *out;
  return status;
}

TEST(FollowingFlagsTest, FollowWithoutTensorDigestsIsRefusedAtStart) {
  std::string out;
  EXPECT_NE(RunRefused("--origin grpc://127.0.0.1:1 --follow --tensor-digests=false --pull m", &out), 0);
  EXPECT_THAT(out, ::testing::HasSubstr("needs tensor digests")) << out;
  EXPECT_THAT(out, ::testing::Not(::testing::HasSubstr("weightstored: serving"))) << out;
  // --check-config refuses the same flags.
  EXPECT_NE(RunRefused("--origin grpc://127.0.0.1:1 --follow --tensor-digests=false --check-config", &out), 0);
  EXPECT_THAT(out, ::testing::HasSubstr("needs tensor digests")) << out;
  // With digests (the default) the same flags start a daemon: the refusal is theirs.
  Daemon with_digests(testing::MakeScratchDir("follow-digests"),
                      {"--origin", "grpc://127.0.0.1:1", "--follow", "--pull", "m"});
  EXPECT_NE(with_digests.port(), 0) << with_digests.log();
}

// A file another writer laid out in its own order (not the dtype-then-name
// order of weightstore's and the safetensors library's writers): the node's
// copy keeps that order at every step, so contiguous index ranges select the
// same tensors on both.
TEST(FollowingOrderTest, ANodesCopyKeepsTheUpstreamsTensorOrderAcrossSteps) {
  const std::string upstream_models = testing::MakeScratchDir("follow-order-upstream");
  const std::string file = upstream_models + "/o.safetensors";
  auto write = [&](float seed) {
    std::vector<SharedTensor> tensors;
    for (const char* name : {"z.weight", "a.weight", "m.weight"}) {
      std::vector<std::byte> bytes(4096 * 4);
      for (size_t k = 0; k < bytes.size(); ++k) bytes[k] = std::byte((k * 7 + name[0] + int(seed)) & 0xff);
      tensors.push_back({{name, DType::kF32, {4096}}, SharedBytes::FromVector(std::move(bytes))});
    }
    ASSERT_OK_AND_ASSIGN(auto writer, CheckpointWriter::Create(file + ".tmp", kSafeTensorsFormat,
                                                               {.overwrite = true, .keep_order = true}));
    for (const SharedTensor& t : tensors) {
      SharedBytes bytes = t.bytes;
      ASSERT_OK(writer->Add(t.spec, [bytes] { return absl::StatusOr<SharedBytes>(bytes); }));
    }
    ASSERT_OK(writer->Finish());
    std::filesystem::rename(file + ".tmp", file);
  };
  write(1);
  Daemon upstream(upstream_models);
  ASSERT_NE(upstream.port(), 0) << upstream.log();
  auto order_of = [](const std::string& address) {
    std::vector<std::string> names;
    auto store = client::ConnectRemoteStore(address);
    if (!store.ok()) return names;
    auto listed = (*store)->ListTensors("o", {});
    if (listed.ok()) {
      for (const auto& d : listed->tensors) names.push_back(d.spec.name);
    }
    return names;
  };
  ASSERT_THAT(order_of(upstream.address()), ::testing::ElementsAre("z.weight", "a.weight", "m.weight"));
  const std::string models = testing::MakeScratchDir("follow-order-node");
  auto node = testing::StartNode(upstream, models, {"--follow", "--pull", "o"});
  ASSERT_NE(node->port(), 0) << node->log();
  EXPECT_THAT(order_of(node->address()), ::testing::ElementsAre("z.weight", "a.weight", "m.weight"));

  // The upstream's file is rewritten (every tensor changed), in its order.
  std::this_thread::sleep_for(std::chrono::milliseconds(15));  // a new mtime
  write(2);
  auto stub = testing::NewStub(upstream.address());
  grpc::ClientContext ctx;
  v1::RescanResponse rescanned;
  ASSERT_TRUE(stub->Rescan(&ctx, v1::RescanRequest(), &rescanned).ok());
  auto version_of = [](const std::string& address) {
    auto store = client::ConnectRemoteStore(address);
    if (!store.ok()) return std::string();
    auto info = (*store)->GetCheckpoint("o");
    return info.ok() ? info->version : std::string();
  };
  const std::string v2 = version_of(upstream.address());
  ASSERT_TRUE(testing::WaitUntil([&] { return version_of(node->address()) == v2; })) << node->log();
  EXPECT_THAT(order_of(node->address()), ::testing::ElementsAre("z.weight", "a.weight", "m.weight"));
  EXPECT_EQ(testing::ReadFileOrEmpty(models + "/o.safetensors"), testing::ReadFileOrEmpty(file))
      << "the node's file is not the upstream's, byte for byte";
}

TEST(FollowingFlagsTest, FollowWithoutAnOriginIsRefusedAtStart) {
  std::string out;
  EXPECT_NE(RunRefused("--follow", &out), 0);
  EXPECT_THAT(out, ::testing::HasSubstr("--follow needs --origin")) << out;
}

TEST(FollowingFlagsTest, FollowOnlyPatternsAreBoundedAndNeedFollow) {
  std::string out;
  EXPECT_NE(RunRefused("--origin grpc://127.0.0.1:1 --follow-only m --pull m", &out), 0);
  EXPECT_THAT(out, ::testing::HasSubstr("--follow-only requires --follow")) << out;
  EXPECT_NE(RunRefused("--origin grpc://127.0.0.1:1 --follow=false --follow-only m --pull m", &out), 0);
  EXPECT_THAT(out, ::testing::HasSubstr("--follow-only needs --follow")) << out;
  // In the config file, as a list.
  const std::string config = testing::MakeScratchDir("follow-only-config") + "/weightstored.toml";
  testing::WriteFileOrDie(config,
                          "origin = \"grpc://127.0.0.1:1\"\nfollow = true\nfollow-only = [\"policy\", \"org/*\"]\n");
  EXPECT_EQ(RunRefused(absl::StrCat("--config ", config, " --check-config"), &out), 0) << out;
  EXPECT_THAT(out, ::testing::HasSubstr("follow-only=[\"policy\", \"org/*\"]")) << out;
  testing::WriteFileOrDie(config, "origin = \"grpc://127.0.0.1:1\"\nfollow = false\nfollow-only = [\"policy\"]\n");
  EXPECT_NE(RunRefused(absl::StrCat("--config ", config, " --check-config"), &out), 0) << out;
  EXPECT_THAT(out, ::testing::HasSubstr("--follow-only needs --follow")) << out;
  EXPECT_NE(RunRefused("--origin grpc://127.0.0.1:1 --follow --follow-only 'a*b*c*' --check-config", &out), 0);
  EXPECT_THAT(out, ::testing::HasSubstr("--follow-only: pattern 'a*b*c*': more than 2 '*'")) << out;
  EXPECT_NE(RunRefused(absl::StrCat("--origin grpc://127.0.0.1:1 --follow --follow-only ", std::string(1025, 'x'),
                                    " --check-config"),
                       &out),
            0);
  EXPECT_THAT(out, ::testing::HasSubstr("1025 bytes; 1 to 1024")) << out;
  EXPECT_EQ(
      RunRefused("--origin grpc://127.0.0.1:1 --follow --follow-only 'org/*' --follow-only m --check-config", &out), 0)
      << out;
  EXPECT_THAT(out, ::testing::HasSubstr("follow-only")) << out;
}

}  // namespace
}  // namespace weightstore

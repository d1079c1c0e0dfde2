// Weight updates against a real weightstored: a trainer publishes versions of a
// GPT-style checkpoint, each changing a different 10% of its tensors; watchers
// hear of each and bring their tensors up to date with delta fetches, which
// must equal a full fetch of the same version bit for bit.
#include "client/updates.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <grpcpp/create_channel.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/store.h"
#include "core/checkpoint.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "tests/util/daemon.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "tests/util/watcher.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore {
namespace {

namespace pb = ::weightstore::v1;
using client::CheckpointEvent;
using testing::Daemon;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::UnorderedElementsAreArray;
using testing::Watcher;
using ::weightstore::testing::StatusIs;

// A small GPT-style state dict: embeddings, then per layer attention and MLP
// weights and norms; 4 + 8 * layers tensors.
class Model {
 public:
  explicit Model(int layers) {
    Add("wte.weight", {64, 32});
    Add("wpe.weight", {16, 32});
    for (int l = 0; l < layers; ++l) {
      const std::string p = absl::StrCat("h.", l, ".");
      Add(p + "ln_1.weight", {32});
      Add(p + "attn.c_attn.weight", {32, 96});
      Add(p + "attn.c_attn.bias", {96});
      Add(p + "attn.c_proj.weight", {32, 32});
      Add(p + "ln_2.weight", {32});
      Add(p + "mlp.c_fc.weight", {32, 128});
      Add(p + "mlp.c_proj.weight", {128, 32});
      Add(p + "mlp.c_proj.bias", {32});
    }
    Add("ln_f.weight", {32});
    Add("ln_f.bias", {32});
  }
  size_t size() const { return tensors_.size(); }
  const std::vector<SharedTensor>& tensors() const { return tensors_; }
  const std::string& name(size_t i) const { return tensors_[i].spec.name; }
  // New values for tensor i.
  void Change(size_t i) { tensors_[i] = Random(tensors_[i].spec.name, tensors_[i].spec.shape); }
  // A training step's worth of change to tensor i: about `fraction` of its
  // elements (at least one) move a little.
  void Nudge(size_t i, double fraction) {
    std::string bytes(tensors_[i].bytes.view());
    const size_t n = bytes.size() / 4;
    std::uniform_int_distribution<size_t> pick(0, n - 1);
    for (size_t k = 0; k < std::max<size_t>(1, static_cast<size_t>(n * fraction)); ++k) {
      float v;
      const size_t at = 4 * pick(rng_);
      std::memcpy(&v, bytes.data() + at, 4);
      v += 1e-3f;
      std::memcpy(bytes.data() + at, &v, 4);
    }
    tensors_[i].bytes = SharedBytes::Copy(bytes);
  }
  uint64_t bytes() const {
    uint64_t total = 0;
    for (const SharedTensor& t : tensors_) total += t.bytes.size();
    return total;
  }
  // Writes the model as a trainer publishes: a temporary renamed over `path`.
  void Publish(const std::string& path) const {
    // Timestamps are coarse and freed inode numbers come back: keep two
    // versions from looking like one file.
    std::this_thread::sleep_for(std::chrono::milliseconds(15));
    const std::string temporary = path + ".tmp-publish";
    testing::WriteFileOrDie(temporary, *SerializeCheckpoint(kSafeTensorsFormat, tensors_, {}));
    ASSERT_EQ(std::rename(temporary.c_str(), path.c_str()), 0);
  }

 private:
  void Add(const std::string& name, std::vector<uint64_t> shape) { tensors_.push_back(Random(name, shape)); }
  SharedTensor Random(const std::string& name, const std::vector<uint64_t>& shape) {
    uint64_t n = 1;
    for (uint64_t d : shape) n *= d;
    std::vector<std::byte> bytes(n * 4);
    std::normal_distribution<float> normal(0, 0.02f);
    for (uint64_t k = 0; k < n; ++k) {
      const float v = normal(rng_);
      std::memcpy(bytes.data() + 4 * k, &v, 4);
    }
    return SharedTensor{{name, DType::kF32, shape}, SharedBytes::FromVector(std::move(bytes))};
  }
  std::mt19937 rng_{42};
  std::vector<SharedTensor> tensors_;
};

bool IsReplacement(const CheckpointEvent& e) { return e.kind == CheckpointEvent::Kind::kReplaced; }
bool IsSynced(const CheckpointEvent& e) { return e.kind == CheckpointEvent::Kind::kSynced; }

// The same tensors, by name (a written file may order them otherwise).
void ExpectSameTensors(const std::vector<SharedTensor>& got, const std::vector<SharedTensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  std::map<std::string, const SharedTensor*> wanted;
  for (const SharedTensor& t : want) wanted[t.spec.name] = &t;
  for (const SharedTensor& t : got) {
    auto it = wanted.find(t.spec.name);
    ASSERT_NE(it, wanted.end()) << t.spec.name;
    EXPECT_EQ(t.spec, it->second->spec);
    EXPECT_EQ(t.bytes.view(), it->second->bytes.view()) << t.spec.name;
  }
}

// Has `daemon` rescan its models folder.
void RescanDaemon(const Daemon& daemon) {
  auto stub = pb::WeightStore::NewStub(grpc::CreateChannel(daemon.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  pb::RescanResponse resp;
  ASSERT_TRUE(stub->Rescan(&ctx, pb::RescanRequest(), &resp).ok());
}

class UpdatesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    models_ = testing::MakeScratchDir("updates");
    path_ = models_ + "/gpt.safetensors";
    model_.Publish(path_);
    socket_ = testing::MakeScratchDir("updates-socket") + "/ws.sock";
    daemon_ = std::make_unique<Daemon>(models_, std::vector<std::string>{"--kept-versions", "8", "--socket", socket_});
    ASSERT_NE(daemon_->port(), 0) << daemon_->log();
    store_ = *client::ConnectRemoteStore(daemon_->address());
  }
  // Publishes the model with tensors [first, first + count) changed, and has
  // the daemon rescan. Returns the changed names. `committed`: when the new
  // file was in place.
  std::vector<std::string> PublishChanging(size_t first, size_t count,
                                           std::chrono::steady_clock::time_point* committed = nullptr) {
    std::vector<std::string> names;
    for (size_t i = first; i < first + count; ++i) {
      model_.Change(i % model_.size());
      names.push_back(model_.name(i % model_.size()));
    }
    model_.Publish(path_);
    if (committed != nullptr) *committed = std::chrono::steady_clock::now();
    Rescan();
    return names;
  }
  void Rescan() { RescanDaemon(*daemon_); }
  std::string Version() { return store_->GetCheckpoint("gpt")->version; }

  Model model_{6};  // 52 tensors: 10% is 5
  std::string models_, path_, socket_;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<client::Store> store_;
};

TEST_F(UpdatesTest, ListingsCarryEachTensorsDigestAndMarkWhatIsUnchanged) {
  ASSERT_OK_AND_ASSIGN(client::TensorListing before, store_->ListTensors("gpt", {}));
  ASSERT_EQ(before.tensors.size(), model_.size());
  for (const auto& t : before.tensors) EXPECT_EQ(t.digest.size(), 32u) << t.spec.name;
  EXPECT_FALSE(before.delta.has_value());
  const std::vector<std::string> changed = PublishChanging(0, 5);
  client::Query since;
  since.since_version = before.version;
  ASSERT_OK_AND_ASSIGN(client::TensorListing after, store_->ListTensors("gpt", since));
  ASSERT_TRUE(after.delta.has_value());
  EXPECT_TRUE(after.delta->delta) << after.delta->full_reason;
  EXPECT_EQ(after.delta->changed_tensors, 5u);
  EXPECT_EQ(after.delta->unchanged_tensors, model_.size() - 5);
  std::vector<std::string> marked_changed;
  for (size_t i = 0; i < after.tensors.size(); ++i) {
    if (!after.tensors[i].unchanged) marked_changed.push_back(after.tensors[i].spec.name);
    EXPECT_EQ(after.tensors[i].unchanged, after.tensors[i].digest == before.tensors[i].digest);
  }
  EXPECT_THAT(marked_changed, UnorderedElementsAreArray(changed));
}

TEST_F(UpdatesTest, AFetchSinceAVersionSkipsTheUnchangedIndicesAndSaysSoOnItsFirstChunk) {
  // What a client of the raw API (grpcurl, another language) sees.
  const std::string v1 = Version();
  const std::vector<std::string> changed = PublishChanging(20, 3);
  auto stub = pb::WeightStore::NewStub(grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials()));
  auto fetch = [&](const std::string& since) {
    grpc::ClientContext ctx;
    pb::FetchTensorsRequest req;
    req.set_name("gpt");
    req.set_since_version(since);
    auto reader = stub->FetchTensors(&ctx, req);
    std::vector<pb::TensorChunk> firsts;  // each tensor's first chunk
    pb::TensorChunk chunk;
    while (reader->Read(&chunk)) {
      if (chunk.has_info()) firsts.push_back(chunk);
    }
    EXPECT_TRUE(reader->Finish().ok());
    return firsts;
  };
  std::vector<pb::TensorChunk> firsts = fetch(v1);
  ASSERT_EQ(firsts.size(), 3u);
  EXPECT_TRUE(firsts[0].delta().delta());
  EXPECT_EQ(firsts[0].delta().since_version(), v1);
  EXPECT_EQ(firsts[0].delta().changed_tensors(), 3u);
  EXPECT_EQ(firsts[0].delta().unchanged_tensors(), model_.size() - 3);
  std::vector<std::string> names;
  for (const auto& c : firsts) {
    names.push_back(c.info().name());
    EXPECT_EQ(c.info().digest().size(), 32u);
  }
  EXPECT_THAT(names, UnorderedElementsAreArray(changed));
  EXPECT_LT(firsts[0].tensor_index(), firsts[1].tensor_index());
  std::vector<pb::TensorChunk> all = fetch("not-kept");
  ASSERT_EQ(all.size(), model_.size());
  EXPECT_FALSE(all[0].delta().delta());
  EXPECT_THAT(all[0].delta().full_reason(), HasSubstr("not-kept"));
  grpc::ClientContext ctx;
  pb::FetchTensorsRequest req;
  req.set_name("gpt");
  req.set_since_version(std::string(65, 'v'));
  auto reader = stub->FetchTensors(&ctx, req);
  pb::TensorChunk chunk;
  while (reader->Read(&chunk)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST(UpdatesDigestsOffTest, ADaemonWithoutDigestsServesFullFetchesAndSaysWhy) {
  const std::string models = testing::MakeScratchDir("no-digests");
  Model model(1);
  model.Publish(models + "/m.safetensors");
  Daemon daemon(models, {"--tensor-digests=false"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto store = *client::ConnectRemoteStore(daemon.address());
  client::HeldTensors held;
  ASSERT_OK(client::UpdateTensors(*store, "m", {}, &held).status());
  ASSERT_OK_AND_ASSIGN(client::TensorListing listing, store->ListTensors("m", {}));
  EXPECT_TRUE(listing.tensors[0].digest.empty());
  ASSERT_OK_AND_ASSIGN(client::UpdateResult r, client::UpdateTensors(*store, "m", {}, &held));
  EXPECT_FALSE(r.delta);
  EXPECT_THAT(r.full_reason, HasSubstr("--tensor-digests"));
}

TEST_F(UpdatesTest, TwoWatchersFollowFiveVersionsWithDeltasEqualToFullFetches) {
  // One watcher applies the daemon's deltas as they come; the other fetches
  // with a selection (renamed, cast to F16), as an inference engine would.
  client::Query renamed;
  renamed.selection.renames = {{"^h\\.", "layers."}};
  renamed.selection.dtype = DType::kF16;
  client::HeldTensors plain, cast;
  ASSERT_OK(client::UpdateTensors(*store_, "gpt", {}, &plain).status());
  ASSERT_OK(client::UpdateTensors(*store_, "gpt", renamed, &cast).status());
  auto other = *client::ConnectRemoteStore(daemon_->address());
  Watcher watcher(store_.get(), {.name = "gpt", .known = {{"gpt", plain.version}}});
  Watcher prefix_watcher(other.get(), {.prefix = "g", .known = {{"gpt", cast.version}}});
  ASSERT_TRUE(watcher.WaitFor(IsSynced));
  ASSERT_TRUE(prefix_watcher.WaitFor(IsSynced));
  for (int v = 0; v < 5; ++v) {
    SCOPED_TRACE(absl::StrCat("version ", v + 2));
    std::chrono::steady_clock::time_point committed;
    const std::vector<std::string> changed = PublishChanging(5 * v + 3, 5, &committed);
    for (Watcher* w : {&watcher, &prefix_watcher}) {
      std::optional<CheckpointEvent> event = w->WaitFor(IsReplacement);
      ASSERT_TRUE(event.has_value());
      std::printf("version %d: the event came %.1f ms after the file was in place (rescan and digests included)\n",
                  v + 2,
                  std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - committed).count());
      EXPECT_TRUE(event->delta) << event->full_reason;
      EXPECT_THAT(event->changed, UnorderedElementsAreArray(changed));
      EXPECT_TRUE(event->added.empty() && event->removed.empty());
      EXPECT_EQ(event->unchanged_count, model_.size() - 5);
      EXPECT_EQ(event->new_version, Version());
    }
    ASSERT_OK_AND_ASSIGN(client::UpdateResult r, client::UpdateTensors(*store_, "gpt", {}, &plain));
    EXPECT_TRUE(r.delta) << r.full_reason;
    EXPECT_THAT(r.changed, UnorderedElementsAreArray(changed));
    EXPECT_EQ(r.fetched_tensors, 5u);
    ASSERT_OK_AND_ASSIGN(client::UpdateResult rc, client::UpdateTensors(*store_, "gpt", renamed, &cast));
    EXPECT_TRUE(rc.delta) << rc.full_reason;
    EXPECT_EQ(rc.fetched_tensors, 5u);
    client::Query pinned;
    pinned.version = plain.version;
    ASSERT_OK_AND_ASSIGN(auto full, store_->FetchAll("gpt", pinned));
    ExpectSameTensors(plain.tensors, full);
    renamed.version = cast.version;
    ASSERT_OK_AND_ASSIGN(auto full_cast, store_->FetchAll("gpt", renamed));
    renamed.version.clear();
    ExpectSameTensors(cast.tensors, full_cast);
  }
  EXPECT_THAT(watcher.Stop(), StatusIs(absl::StatusCode::kCancelled));
}

TEST_F(UpdatesTest, ElementPatchesBringHeldTensorsToTheNewVersionBitForBitWithAFewPercentOfTheBytes) {
  client::HeldTensors held;
  ASSERT_OK(client::UpdateTensors(*store_, "gpt", {}, &held).status());
  // Every tensor moves a little, as in an RL step: whole-tensor deltas would
  // send everything.
  for (size_t i = 0; i < model_.size(); ++i) model_.Nudge(i, 0.01);
  model_.Publish(path_);
  Rescan();
  client::HeldTensors behind = held;  // a late joiner, from here
  ASSERT_OK_AND_ASSIGN(client::UpdateResult r, client::UpdateTensors(*store_, "gpt", {}, &held));
  EXPECT_TRUE(r.delta) << r.full_reason;
  EXPECT_EQ(r.patch_failure, "");
  EXPECT_EQ(r.patch_reason, "");
  EXPECT_EQ(r.changed.size(), model_.size());
  EXPECT_EQ(r.patched.size(), model_.size());
  EXPECT_LE(r.fetched_bytes, model_.bytes() / 20) << "of " << model_.bytes();
  ExpectSameTensors(held.tensors, model_.tensors());

  // Three versions later, the late joiner gets one composed patch per tensor.
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < model_.size(); ++i) model_.Nudge(i, 0.01);
    model_.Publish(path_);
    Rescan();
  }
  ASSERT_OK_AND_ASSIGN(r, client::UpdateTensors(*store_, "gpt", {}, &behind));
  EXPECT_EQ(r.patched.size(), model_.size());
  EXPECT_LE(r.fetched_bytes, model_.bytes() / 5);
  ExpectSameTensors(behind.tensors, model_.tensors());
  // Three steps behind too; `held` alone holds its tensors, which an update
  // made: the patches are written in place.
  std::vector<const std::byte*> memory;
  for (const SharedTensor& t : held.tensors) memory.push_back(t.bytes.data());
  ASSERT_OK_AND_ASSIGN(r, client::UpdateTensors(*store_, "gpt", {}, &held));
  EXPECT_EQ(r.patched.size(), model_.size());
  ExpectSameTensors(held.tensors, model_.tensors());
  for (size_t i = 0; i < held.tensors.size(); ++i) EXPECT_EQ(held.tensors[i].bytes.data(), memory[i]) << i;

  // A held tensor that is not what its version says (changed here): its
  // patched result fails the digest check, and the changed tensors come whole.
  const std::string tampered = held.tensors[0].spec.name;
  {
    std::string bytes(held.tensors[0].bytes.view());
    bytes[0] ^= 1;
    held.tensors[0].bytes = SharedBytes::Copy(bytes);
  }
  for (size_t i = 0; i < model_.size(); ++i) model_.Nudge(i, 0.01);
  model_.Publish(path_);
  Rescan();
  ASSERT_OK_AND_ASSIGN(r, client::UpdateTensors(*store_, "gpt", {}, &held));
  EXPECT_THAT(r.patch_failure, HasSubstr(absl::StrCat("tensor '", tampered, "' patched has digest")));
  EXPECT_TRUE(r.patched.empty());
  EXPECT_EQ(r.fetched_bytes, model_.bytes());
  ExpectSameTensors(held.tensors, model_.tensors());

  // Served otherwise than stored (a cast): the changed tensors come whole,
  // equal to a full fetch.
  client::Query bf16;
  bf16.selection.dtype = DType::kBF16;
  client::HeldTensors cast;
  ASSERT_OK(client::UpdateTensors(*store_, "gpt", bf16, &cast).status());
  for (size_t i = 0; i < model_.size(); ++i) model_.Nudge(i, 0.01);
  model_.Publish(path_);
  Rescan();
  ASSERT_OK_AND_ASSIGN(r, client::UpdateTensors(*store_, "gpt", bf16, &cast));
  EXPECT_TRUE(r.patched.empty());
  EXPECT_EQ(r.changed.size(), model_.size());
  ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> full, store_->FetchAll("gpt", bf16));
  ExpectSameTensors(cast.tensors, full);
}

TEST_F(UpdatesTest, ASocketClientMapsOneSegmentOfElementPatchesInsteadOfTheChangedTensors) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::SharedMemoryStore> shm, client::ConnectSharedMemoryStore(socket_));
  client::HeldTensors held;
  ASSERT_OK(client::UpdateTensors(*shm, "gpt", {}, &held).status());
  const std::string since = held.version;
  for (size_t i = 0; i < model_.size(); ++i) model_.Nudge(i, 0.01);
  model_.Publish(path_);
  Rescan();

  // What the socket passes: one sealed memfd of patches, a few percent of the
  // checkpoint, and no tensor's bytes.
  client::Query query;
  query.since_version = since;
  query.patches = true;
  ASSERT_OK_AND_ASSIGN(client::MappedTensors mapped, shm->MapTensors("gpt", query));
  ASSERT_EQ(mapped.patches.size(), model_.size());
  ASSERT_EQ(mapped.segments.size(), 1u);
  EXPECT_LE(mapped.segments[0]->size(), model_.bytes() / 20) << "of " << model_.bytes();
  for (size_t i = 0; i < mapped.tensors.size(); ++i) {
    EXPECT_TRUE(mapped.descriptions[i].patched) << mapped.descriptions[i].spec.name;
    EXPECT_TRUE(mapped.tensors[i].bytes.empty());
  }
  // Unasked, the changed tensors are mapped as before.
  query.patches = false;
  ASSERT_OK_AND_ASSIGN(client::MappedTensors whole, shm->MapTensors("gpt", query));
  EXPECT_TRUE(whole.patches.empty());
  ASSERT_EQ(whole.tensors.size(), model_.size());
  ExpectSameTensors(whole.tensors, model_.tensors());

  // An update applies them: into copies of the held tensors, which were the
  // daemon's read-only mappings...
  ASSERT_OK_AND_ASSIGN(client::UpdateResult r, client::UpdateTensors(*shm, "gpt", {}, &held));
  EXPECT_TRUE(r.delta) << r.full_reason;
  EXPECT_EQ(r.patch_failure, "");
  EXPECT_EQ(r.patched.size(), model_.size());
  EXPECT_LE(r.fetched_bytes, model_.bytes() / 20);
  ExpectSameTensors(held.tensors, model_.tensors());
  // ...and the next one writes those copies in place.
  std::vector<const std::byte*> memory;
  for (const SharedTensor& t : held.tensors) memory.push_back(t.bytes.data());
  for (size_t i = 0; i < model_.size(); ++i) model_.Nudge(i, 0.01);
  model_.Publish(path_);
  Rescan();
  ASSERT_OK_AND_ASSIGN(r, client::UpdateTensors(*shm, "gpt", {}, &held));
  EXPECT_EQ(r.patched.size(), model_.size());
  ExpectSameTensors(held.tensors, model_.tensors());
  for (size_t i = 0; i < held.tensors.size(); ++i) EXPECT_EQ(held.tensors[i].bytes.data(), memory[i]) << i;

  // A sink gets them as it does over gRPC.
  query.since_version = since;
  query.patches = true;
  client::CollectingSink sink(nullptr, /*take_patches=*/true);
  ASSERT_OK(shm->FetchTensors("gpt", query, &sink));
  EXPECT_TRUE(sink.tensors().empty());
  EXPECT_EQ(sink.patches().size(), model_.size());
}

TEST(UpdatesPatchesOffTest, PatchesPastTheSegmentBudgetLeaveTheSocketMappingTheTensorsAndSayWhy) {
  const std::string models = testing::MakeScratchDir("updates-tight");
  Model model(6);
  model.Publish(models + "/gpt.safetensors");
  const std::string socket = testing::MakeScratchDir("updates-tight-socket") + "/ws.sock";
  // Room for no patch segment; the file itself is passed, as ever.
  Daemon daemon(models, {"--socket", socket, "--shm-budget", "1024", "--socket-file-segments", "always"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto shm = *client::ConnectSharedMemoryStore(socket);
  client::HeldTensors held;
  ASSERT_OK(client::UpdateTensors(*shm, "gpt", {}, &held).status());
  for (size_t i = 0; i < model.size(); ++i) model.Nudge(i, 0.01);
  model.Publish(models + "/gpt.safetensors");
  RescanDaemon(daemon);
  ASSERT_OK_AND_ASSIGN(client::UpdateResult r, client::UpdateTensors(*shm, "gpt", {}, &held));
  EXPECT_TRUE(r.delta) << r.full_reason;
  EXPECT_TRUE(r.patched.empty());
  EXPECT_THAT(r.patch_reason, HasSubstr("do not fit the segment budget (--shm-budget)"));
  EXPECT_EQ(r.changed.size(), model.size());
  ExpectSameTensors(held.tensors, model.tensors());
}

TEST(UpdatesPatchesOffTest, ADaemonKeepingNoPatchesSendsChangedTensorsWhole) {
  const std::string models = testing::MakeScratchDir("updates-nopatch");
  Model model(2);
  model.Publish(models + "/gpt.safetensors");
  const std::string socket = testing::MakeScratchDir("updates-nopatch-socket") + "/ws.sock";
  Daemon daemon(models, {"--kept-patch-bytes", "0", "--socket", socket});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto store = *client::ConnectRemoteStore(daemon.address());
  client::HeldTensors held;
  ASSERT_OK(client::UpdateTensors(*store, "gpt", {}, &held).status());
  client::HeldTensors mapped = held;
  for (size_t i = 0; i < model.size(); ++i) model.Nudge(i, 0.01);
  model.Publish(models + "/gpt.safetensors");
  RescanDaemon(daemon);
  ASSERT_OK_AND_ASSIGN(client::UpdateResult r, client::UpdateTensors(*store, "gpt", {}, &held));
  EXPECT_TRUE(r.delta);
  EXPECT_TRUE(r.patched.empty());
  EXPECT_THAT(r.patch_reason, HasSubstr("no element patches are kept from version"));
  EXPECT_EQ(r.fetched_bytes, model.bytes());
  ExpectSameTensors(held.tensors, model.tensors());
  // The socket says so too, and maps the tensors.
  auto shm = *client::ConnectSharedMemoryStore(socket);
  ASSERT_OK_AND_ASSIGN(r, client::UpdateTensors(*shm, "gpt", {}, &mapped));
  EXPECT_TRUE(r.patched.empty());
  EXPECT_THAT(r.patch_reason, HasSubstr("no element patches are kept from version"));
  ExpectSameTensors(mapped.tensors, model.tensors());
}

TEST_F(UpdatesTest, AWatcherAwayForThreeVersionsCatchesUpInOneStep) {
  client::HeldTensors held;
  ASSERT_OK(client::UpdateTensors(*store_, "gpt", {}, &held).status());
  std::vector<std::string> changed;
  for (int v = 0; v < 3; ++v) {
    for (const std::string& n : PublishChanging(10 * v, 5)) changed.push_back(n);
  }
  Watcher watcher(store_.get(), {.name = "gpt", .known = {{"gpt", held.version}}});
  std::optional<CheckpointEvent> event = watcher.WaitFor([](const CheckpointEvent&) { return true; });
  ASSERT_TRUE(event.has_value());
  EXPECT_EQ(event->kind, CheckpointEvent::Kind::kReplaced);
  EXPECT_EQ(event->old_version, held.version);
  EXPECT_THAT(event->changed, UnorderedElementsAreArray(changed));
  ASSERT_OK_AND_ASSIGN(client::UpdateResult r, client::UpdateTensors(*store_, "gpt", {}, &held));
  EXPECT_TRUE(r.delta);
  EXPECT_EQ(r.fetched_tensors, 15u);
  ASSERT_OK_AND_ASSIGN(auto full, store_->FetchAll("gpt", {}));
  ExpectSameTensors(held.tensors, full);
}

TEST_F(UpdatesTest, ABaseVersionTheDaemonDoesNotKeepIsAFullFetchThatSaysSo) {
  client::HeldTensors held;
  ASSERT_OK(client::UpdateTensors(*store_, "gpt", {}, &held).status());
  held.version = "0123456789abcdef";
  ASSERT_OK_AND_ASSIGN(client::UpdateResult r, client::UpdateTensors(*store_, "gpt", {}, &held));
  EXPECT_FALSE(r.delta);
  EXPECT_THAT(r.full_reason, HasSubstr("0123456789abcdef"));
  EXPECT_EQ(r.fetched_tensors, model_.size());
  // Tensors held from another selection are fetched again, not trusted.
  client::HeldTensors wrong = held;
  wrong.tensors.resize(3);
  PublishChanging(0, 1);
  ASSERT_OK_AND_ASSIGN(client::UpdateResult w, client::UpdateTensors(*store_, "gpt", {}, &wrong));
  EXPECT_FALSE(w.delta);
  EXPECT_THAT(w.full_reason, HasSubstr("is not held"));
  ASSERT_OK_AND_ASSIGN(auto full, store_->FetchAll("gpt", {}));
  ExpectSameTensors(wrong.tensors, full);
}

// Tensors a caller fetched itself, as shard rank 0, have the shapes rank 1's
// have: with no recorded selection they must be fetched whole, or rank 0's
// rows would pass as rank 1's, unchanged.
TEST_F(UpdatesTest, HeldTensorsWhoseSelectionWasNotRecordedAreFetchedWholeNotTrustedAsAnotherShardRank) {
  client::Query rank0;
  rank0.selection.shard.world_size = 2;
  rank0.selection.shard.rules = {{"weight$", ShardSplit{0}}};
  client::Query rank1 = rank0;
  rank1.selection.shard.rank = 1;
  client::HeldTensors held;
  ASSERT_OK_AND_ASSIGN(held.tensors, store_->FetchAll("gpt", rank0));
  held.version = Version();
  for (client::Store* store : {store_.get(), static_cast<client::Store*>(nullptr)}) {
    std::unique_ptr<client::Store> mapper;
    if (store == nullptr) {
      ASSERT_OK_AND_ASSIGN(mapper, client::ConnectSharedMemoryStore(socket_));
      store = mapper.get();
    }
    client::HeldTensors h = held;
    ASSERT_OK_AND_ASSIGN(client::UpdateResult r, client::UpdateTensors(*store, "gpt", rank1, &h));
    EXPECT_FALSE(r.delta);
    EXPECT_THAT(r.full_reason, HasSubstr("selection is not recorded"));
    ASSERT_OK_AND_ASSIGN(auto want, store_->FetchAll("gpt", rank1));
    ExpectSameTensors(h.tensors, want);
    // Recorded, the same selection is a delta with nothing to fetch.
    EXPECT_EQ(h.selection, client::SelectionKey(rank1));
    ASSERT_OK_AND_ASSIGN(r, client::UpdateTensors(*store, "gpt", rank1, &h));
    EXPECT_TRUE(r.delta) << r.full_reason;
    EXPECT_EQ(r.fetched_tensors, 0u);
  }
}

// Tensors held in memory of their own, as the Python package's module or
// dict is: patches are written in place; what came whole is copied in.
class OwnMemory final : public client::UpdateDestination {
 public:
  std::optional<Held> Find(const std::string& name) const override {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) return std::nullopt;
    return Held{it->second.spec.dtype, it->second.spec.shape, !unpatchable_.contains(name)};
  }
  std::vector<std::string> Names() const override {
    std::vector<std::string> names;
    for (const auto& [name, t] : tensors_) names.push_back(name);
    return names;
  }
  bool fixed_names() const override { return fixed_; }
  absl::StatusOr<std::vector<client::PatchDestination>> PatchInto(std::span<const client::ReceivedPatch> patches,
                                                                  bool* in_place) override {
    ++patch_calls_;
    *in_place = true;
    std::vector<client::PatchDestination> to;
    for (const client::ReceivedPatch& p : patches) to.push_back({tensors_.at(p.spec.name).bytes});
    return to;
  }
  void Take(const client::Updated& updated) {
    for (const SharedTensor& t : updated.received) {
      tensors_[t.spec.name] = {t.spec, std::vector<std::byte>(t.bytes.span().begin(), t.bytes.span().end())};
    }
  }
  SharedTensor Get(const std::string& name) const {
    const Owned& t = tensors_.at(name);
    return {t.spec, SharedBytes::Copy(std::string(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size()))};
  }
  void Drop(const std::string& name) { tensors_.erase(name); }
  void set_fixed(bool fixed) { fixed_ = fixed; }
  void set_unpatchable(const std::string& name) { unpatchable_.insert(name); }
  int patch_calls() const { return patch_calls_; }

 private:
  struct Owned {
    TensorSpec spec;
    std::vector<std::byte> bytes;
  };
  std::map<std::string, Owned> tensors_;
  std::set<std::string> unpatchable_;
  bool fixed_ = false;
  int patch_calls_ = 0;
};

// The update algorithm decides for every destination alike: patches only
// where every held tensor takes one, and a destination that takes no new
// tensors is checked before anything is written.
TEST_F(UpdatesTest, UpdateIntoAsksForPatchesOnlyWhereEveryHeldTensorTakesOneAndChecksAFixedDestinationFirst) {
  OwnMemory memory;
  ASSERT_OK_AND_ASSIGN(client::Updated first, client::UpdateInto(*store_, "gpt", {}, "", "", memory));
  EXPECT_EQ(first.result.added.size(), model_.size());
  memory.Take(first);
  auto step = [&] {
    for (size_t i = 0; i < model_.size(); ++i) model_.Nudge(i, 0.01);
    model_.Publish(path_);
    Rescan();
  };

  // One tensor that cannot take a patch (a GPU tensor without the kernel):
  // every changed tensor comes whole.
  step();
  memory.set_unpatchable(model_.name(3));
  ASSERT_OK_AND_ASSIGN(client::Updated whole,
                       client::UpdateInto(*store_, "gpt", {}, first.result.new_version, first.selection, memory));
  EXPECT_TRUE(whole.result.delta) << whole.result.full_reason;
  EXPECT_TRUE(whole.result.patched.empty());
  EXPECT_EQ(whole.received.size(), model_.size());
  EXPECT_EQ(memory.patch_calls(), 0);
  memory.Take(whole);

  // All of them can: patches, written in place and checked.
  step();
  memory = OwnMemory();
  memory.Take(whole);
  ASSERT_OK_AND_ASSIGN(client::Updated patched,
                       client::UpdateInto(*store_, "gpt", {}, whole.result.new_version, whole.selection, memory));
  EXPECT_EQ(patched.result.patched.size(), model_.size());
  EXPECT_TRUE(patched.received.empty());
  EXPECT_EQ(memory.patch_calls(), 1);
  for (size_t i = 0; i < model_.size(); ++i) ExpectSameTensors({memory.Get(model_.name(i))}, {model_.tensors()[i]});

  // A fixed destination (a module) that lacks a tensor the update writes:
  // refused, naming it, before any patch is written.
  step();
  memory.Drop(model_.name(0));
  memory.set_fixed(true);
  const SharedTensor before = memory.Get(model_.name(1));
  EXPECT_THAT(client::UpdateInto(*store_, "gpt", {}, patched.result.new_version, patched.selection, memory),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr(absl::StrCat(model_.name(0), ": not held, and these tensors take no new ones"))));
  EXPECT_EQ(memory.patch_calls(), 1);
  ExpectSameTensors({memory.Get(model_.name(1))}, {before});
}

// A fetch tells which version it sent, over every transport and however
// many streams: what a caller records to update those tensors later.
TEST_F(UpdatesTest, AFetchSaysWhichVersionItSentOverEveryTransport) {
  const std::string version = Version();
  client::RemoteOptions one_stream;
  one_stream.parallel_streams = 1;
  client::RemoteOptions four_streams;
  four_streams.parallel_streams = 4;
  std::vector<std::unique_ptr<client::Store>> stores;
  stores.push_back(*client::ConnectRemoteStore(daemon_->address(), one_stream));
  stores.push_back(*client::ConnectRemoteStore(daemon_->address(), four_streams));
  stores.push_back(*client::ConnectSharedMemoryStore(socket_));
  stores.push_back(*client::OpenLocalStore(models_));
  for (const auto& store : stores) {
    ASSERT_OK_AND_ASSIGN(client::Store::Fetched fetched, store->FetchVersioned("gpt", {}));
    EXPECT_EQ(fetched.tensors.size(), model_.size());
    if (store.get() == stores.back().get()) {
      EXPECT_FALSE(fetched.version.empty());  // the local store names versions of its own
    } else {
      EXPECT_EQ(fetched.version, version);
    }
  }
}

TEST_F(UpdatesTest, RemovalAndReturnAreEventsAndWatchRequestsAreChecked) {
  Watcher watcher(store_.get(), {});
  ASSERT_TRUE(watcher.WaitFor([](const CheckpointEvent& e) { return e.kind == CheckpointEvent::Kind::kAdded; }));
  ASSERT_TRUE(watcher.WaitFor(IsSynced));
  std::filesystem::remove(path_);
  Rescan();
  std::optional<CheckpointEvent> removed = watcher.WaitFor([](const CheckpointEvent&) { return true; });
  ASSERT_TRUE(removed.has_value());
  EXPECT_EQ(removed->kind, CheckpointEvent::Kind::kRemoved);
  EXPECT_EQ(removed->name, "gpt");

  auto refused = [&](client::WatchOptions o) { return store_->Watch(o, [](const CheckpointEvent&) { return false; }); };
  EXPECT_THAT(refused({.name = std::string(600, 'x')}), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(refused({.known = {{"gpt", std::string(65, 'v')}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("known version of 'gpt'")));
  EXPECT_THAT(refused({.known = {{"gpt", ""}}}), StatusIs(absl::StatusCode::kInvalidArgument));
  std::map<std::string, std::string> many;
  for (int i = 0; i < 10001; ++i) many[absl::StrCat("m", i)] = "v";
  EXPECT_THAT(refused({.known = many}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("10000")));
  EXPECT_OK(refused({.name = "gpt"}));  // the callback's false ends it
}

TEST_F(UpdatesTest, TheCliWatchesAndFetchesOnlyWhatChangedSinceAVersion) {
  const std::string cli = testing::ShellQuote(testing::CliPath());
  const std::string v1 = Version();
  std::string out;
  ASSERT_EQ(testing::RunCommand(absl::StrCat(cli, " watch --server ", daemon_->address(), " gpt --json --count 2"),
                                &out, false),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr(absl::StrCat("{\"event\":\"added\",\"name\":\"gpt\",\"new_version\":\"", v1)));
  EXPECT_THAT(out, HasSubstr("{\"event\":\"synced\"}"));
  const std::vector<std::string> changed = PublishChanging(7, 5);
  const std::string file = testing::MakeScratchDir("cli-delta") + "/delta.safetensors";
  ASSERT_EQ(testing::RunCommand(
                absl::StrCat(cli, " fetch --server ", daemon_->address(), " gpt ", file, " --no-progress --since ", v1),
                &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("5 changed tensors, 47 unchanged left out"));
  ASSERT_OK_AND_ASSIGN(auto delta, Checkpoint::Open(file));
  std::vector<std::string> names;
  for (const auto& e : delta->entries()) names.push_back(e.spec.name);
  EXPECT_THAT(names, UnorderedElementsAreArray(changed));
  EXPECT_EQ(delta->metadata().at("weightstore.since_version"), v1);
  ASSERT_EQ(testing::RunCommand(absl::StrCat(cli, " fetch --server ", daemon_->address(), " gpt ", file,
                                             " --overwrite --no-progress --since 00ff"),
                                &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("full fetch of 'gpt'"));
  EXPECT_EQ((*Checkpoint::Open(file))->size(), model_.size());
}

TEST_F(UpdatesTest, ATrainerPushesFiveVersionsAndTwoWatchersApplyEachDeltaBitForBit) {
  // The trainer holds the model and pushes only what it changed. One watcher
  // fetches its deltas over gRPC; the other follows a prefix on a connection
  // of its own and maps its deltas through the socket, keeping the mappings
  // of what did not change.
  client::HeldTensors a, b;
  ASSERT_OK(client::UpdateTensors(*store_, "gpt", {}, &a).status());
  ASSERT_OK_AND_ASSIGN(auto mapper, client::ConnectSharedMemoryStore(socket_));
  ASSERT_OK(client::UpdateTensors(*mapper, "gpt", {}, &b).status());
  auto other = *client::ConnectRemoteStore(daemon_->address());
  Watcher watcher(store_.get(), {.name = "gpt", .known = {{"gpt", a.version}}});
  Watcher prefix_watcher(other.get(), {.prefix = "gp", .known = {{"gpt", b.version}}});
  ASSERT_TRUE(watcher.WaitFor(IsSynced));
  ASSERT_TRUE(prefix_watcher.WaitFor(IsSynced));
  std::string base = a.version;
  for (int v = 0; v < 5; ++v) {
    SCOPED_TRACE(absl::StrCat("push ", v + 1));
    client::PushRequest push{.base_version = base};
    std::vector<std::string> changed;
    for (size_t i = 5 * static_cast<size_t>(v) + 1; i < 5 * static_cast<size_t>(v) + 6; ++i) {
      model_.Change(i);
      push.tensors.push_back(model_.tensors()[i]);
      changed.push_back(model_.name(i));
    }
    const auto began = std::chrono::steady_clock::now();
    ASSERT_OK_AND_ASSIGN(client::CheckpointSummary pushed, store_->Push("gpt", push));
    const double push_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - began).count();
    EXPECT_NE(pushed.version, base);
    base = pushed.version;
    for (Watcher* w : {&watcher, &prefix_watcher}) {
      std::optional<CheckpointEvent> event = w->WaitFor(IsReplacement);
      ASSERT_TRUE(event.has_value());
      std::printf("push %d: the push took %.1f ms; the watcher had its event %.1f ms after the push began\n", v + 1,
                  push_ms, std::chrono::duration<double, std::milli>(w->last_event_at() - began).count());
      EXPECT_EQ(event->new_version, pushed.version);
      EXPECT_THAT(event->changed, UnorderedElementsAreArray(changed));
    }
    std::map<std::string, const std::byte*> mapped_before;
    for (const SharedTensor& t : b.tensors) mapped_before[t.spec.name] = t.bytes.data();
    for (auto [held, store] : {std::pair<client::HeldTensors*, client::Store*>{&a, store_.get()},
                               std::pair<client::HeldTensors*, client::Store*>{&b, mapper.get()}}) {
      ASSERT_OK_AND_ASSIGN(client::UpdateResult r, client::UpdateTensors(*store, "gpt", {}, held));
      EXPECT_TRUE(r.delta) << r.full_reason;
      EXPECT_THAT(r.changed, UnorderedElementsAreArray(changed));
      EXPECT_EQ(r.fetched_tensors, changed.size());
      ExpectSameTensors(held->tensors, model_.tensors());  // the trainer's state, bit for bit
    }
    for (const SharedTensor& t : b.tensors) {
      const bool was_changed = std::find(changed.begin(), changed.end(), t.spec.name) != changed.end();
      EXPECT_EQ(t.bytes.data() == mapped_before[t.spec.name], !was_changed) << t.spec.name << ": mapping kept?";
    }
  }
}

TEST_F(UpdatesTest, BadPushesAreRefusedWithClearErrorsAndChangeNothing) {
  const std::string v1 = Version();
  const std::string bytes_before = testing::ReadFileOrEmpty(path_);
  SharedTensor t = model_.tensors()[3];
  SharedTensor wrong_shape{{t.spec.name, DType::kF32, {t.spec.shape[0] / 2, t.spec.shape[1] * 2}}, t.bytes};
  EXPECT_THAT(store_->Push("gpt", {.base_version = v1, .tensors = {wrong_shape}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(t.spec.name)));
  SharedTensor wrong_dtype{{t.spec.name, DType::kI32, t.spec.shape}, t.bytes};
  EXPECT_THAT(store_->Push("gpt", {.base_version = v1, .tensors = {wrong_dtype}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is I32")));
  EXPECT_THAT(store_->Push("gpt", {.base_version = "0123abcd", .tensors = {t}}),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("0123abcd")));
  EXPECT_THAT(store_->Push("nope", {.base_version = v1, .tensors = {t}}), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(Version(), v1);
  EXPECT_EQ(testing::ReadFileOrEmpty(path_), bytes_before);
  for (const auto& e : std::filesystem::directory_iterator(models_)) {
    EXPECT_EQ(e.path().filename(), "gpt.safetensors");  // no staging file left behind
  }
}

TEST_F(UpdatesTest, ADeltaUnderContiguousIndicesFallsBackWhenTensorsComeOrGo) {
  // h.1's tensors are removed: with contiguous indices, "h.2..." is then
  // served as "h.1...", from a tensor the client does not hold under that name.
  client::Query contiguous;
  contiguous.selection.contiguous_indices = true;
  client::HeldTensors held;
  ASSERT_OK(client::UpdateTensors(*store_, "gpt", contiguous, &held).status());
  std::vector<std::string> remove;
  for (size_t i = 0; i < model_.size(); ++i) {
    if (model_.name(i).rfind("h.1.", 0) == 0) remove.push_back(model_.name(i));
  }
  ASSERT_OK(store_->Push("gpt", {.base_version = held.version, .remove = remove}).status());
  ASSERT_OK_AND_ASSIGN(client::UpdateResult r, client::UpdateTensors(*store_, "gpt", contiguous, &held));
  EXPECT_FALSE(r.delta);
  EXPECT_THAT(r.full_reason, HasSubstr("contiguous indices"));
  ASSERT_OK_AND_ASSIGN(auto full, store_->FetchAll("gpt", contiguous));
  ExpectSameTensors(held.tensors, full);
  // Without renumbering the same push is a delta.
  client::HeldTensors plain;
  ASSERT_OK(client::UpdateTensors(*store_, "gpt", {}, &plain).status());
  model_.Change(0);
  ASSERT_OK(store_->Push("gpt", {.base_version = plain.version, .tensors = {model_.tensors()[0]}}).status());
  ASSERT_OK_AND_ASSIGN(client::UpdateResult p, client::UpdateTensors(*store_, "gpt", {}, &plain));
  EXPECT_TRUE(p.delta) << p.full_reason;
  EXPECT_EQ(p.fetched_tensors, 1u);
}

TEST_F(UpdatesTest, TheCliPushesOnlyTheTensorsThatChanged) {
  const std::string cli = testing::ShellQuote(testing::CliPath());
  const std::string v1 = Version();
  for (size_t i : {2, 9, 17}) model_.Change(i);
  const std::string file = testing::MakeScratchDir("cli-push") + "/next.safetensors";
  model_.Publish(file);
  std::string out;
  ASSERT_EQ(testing::RunCommand(
                absl::StrCat(cli, " push --server ", daemon_->address(), " gpt ", file, " --only-changed"), &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr(absl::StrCat("pushed 3 of ", model_.size(), " tensors")));
  EXPECT_THAT(out, HasSubstr(absl::StrCat("(was ", v1, ")")));
  ASSERT_OK_AND_ASSIGN(auto served, store_->FetchAll("gpt", {}));
  ExpectSameTensors(served, model_.tensors());
}

TEST_F(UpdatesTest, TheCliPushesElementPatchesAgainstTheBaseFileAndWorkersGetThemToo) {
  const std::string cli = testing::ShellQuote(testing::CliPath());
  const std::string folder = testing::MakeScratchDir("cli-push-patch");
  model_.Publish(folder + "/base.safetensors");  // the trainer's last push: the served version
  client::HeldTensors held;
  ASSERT_OK(client::UpdateTensors(*store_, "gpt", {}, &held).status());
  for (size_t i = 0; i < model_.size(); ++i) model_.Nudge(i, 0.01);
  model_.Change(5);  // one tensor changed throughout: sent whole
  model_.Publish(folder + "/next.safetensors");
  std::string out;
  ASSERT_EQ(testing::RunCommand(absl::StrCat(cli, " push --server ", daemon_->address(), " gpt ", folder,
                                             "/next.safetensors --only-changed --base ", folder, "/base.safetensors"),
                                &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr(absl::StrCat("pushed ", model_.size(), " of ", model_.size(), " tensors")));
  EXPECT_THAT(out, HasSubstr(absl::StrCat(model_.size() - 1, " as element patches")));
  ASSERT_OK_AND_ASSIGN(auto served, store_->FetchAll("gpt", {}));
  ExpectSameTensors(served, model_.tensors());
  // The daemon diffed the pushed version against its base: workers get patches.
  ASSERT_OK_AND_ASSIGN(client::UpdateResult r, client::UpdateTensors(*store_, "gpt", {}, &held));
  EXPECT_EQ(r.patched.size(), model_.size() - 1);
  ExpectSameTensors(held.tensors, model_.tensors());
  // A base file that is not the served version: its tensors go whole.
  model_.Nudge(0, 0.01);
  model_.Publish(folder + "/next.safetensors");
  ASSERT_EQ(testing::RunCommand(absl::StrCat(cli, " push --server ", daemon_->address(), " gpt ", folder,
                                             "/next.safetensors --only-changed --base ", folder, "/base.safetensors"),
                                &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("pushed 1 of"));
  EXPECT_THAT(out, Not(HasSubstr("element patches")));
  ASSERT_OK_AND_ASSIGN(served, store_->FetchAll("gpt", {}));
  ExpectSameTensors(served, model_.tensors());
}

// A `weightstore watch` process that is stopped (SIGSTOP) once its watch is
// synced: a client whose connection stays open and never reads again, so never
// answers the daemon's GOAWAY. Killed when destroyed.
class StoppedWatchProcess {
 public:
  StoppedWatchProcess(const std::string& address, const std::string& token) {
    output_ = testing::MakeScratchDir("stopped-watch") + "/output";
    std::vector<std::string> args = {testing::CliPath(), "watch", "--server", address, "--token", token};
    pid_ = ::fork();
    if (pid_ == 0) {  // none of the test's output pipes, as Daemon
      const int out = ::open(output_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int null = ::open("/dev/null", O_RDONLY);
      ::dup2(null, 0);
      ::dup2(out, 1);
      ::dup2(out, 2);
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
  }
  ~StoppedWatchProcess() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  // Waits for the watch to be synced (60 s only catches one that never is),
  // then stops the process; false if it exited or was not synced in time.
  bool StopOnceSynced() {
    const auto start = std::chrono::steady_clock::now();
    while (!absl::StrContains(output(), "synced\n")) {
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      if (std::chrono::steady_clock::now() - start > std::chrono::seconds(60)) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ::kill(pid_, SIGSTOP);
    int status = 0;
    return ::waitpid(pid_, &status, WUNTRACED) == pid_ && WIFSTOPPED(status);
  }
  std::string output() const { return testing::ReadFileOrEmpty(output_); }

 private:
  pid_t pid_ = -1;
  std::string output_;
};

TEST(UpdatesLimitsTest, WatchesAreCappedAuthenticatedAndEndedAtShutdown) {
  const std::string models = testing::MakeScratchDir("watch-limits");
  Model(1).Publish(models + "/m.safetensors");
  const std::string tokens = testing::MakeScratchDir("watch-tokens") + "/tokens";
  testing::WriteFileOrDie(tokens, "read read-token-0123456789\nadmin admin-token-0123456789\n");
  // A grace far past the bound below: a stop that waited for it cannot pass
  // for a prompt one.
  Daemon daemon(models, {"--max-watches", "2", "--tokens-file", tokens, "--grace-seconds", "600"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  // One watch from another process, which then stops: its connection never
  // reads the daemon's GOAWAY, and would hold a daemon that waits for it.
  StoppedWatchProcess stopped(daemon.address(), "read-token-0123456789");
  ASSERT_TRUE(stopped.StopOnceSynced()) << stopped.output() << daemon.log();
  client::RemoteOptions o;
  o.token = "read-token-0123456789";
  auto store = *client::ConnectRemoteStore(daemon.address(), o);
  auto anonymous = *client::ConnectRemoteStore(daemon.address());
  EXPECT_THAT(anonymous->Watch({}, [](const CheckpointEvent&) { return true; }),
              StatusIs(absl::StatusCode::kUnauthenticated));
  // Pushing takes the admin scope.
  const std::string v1 = store->GetCheckpoint("m")->version;
  Model model(1);
  model.Change(0);
  EXPECT_THAT(store->Push("m", {.base_version = v1, .tensors = {model.tensors()[0]}}),
              StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(anonymous->Push("m", {.base_version = v1, .tensors = {model.tensors()[0]}}),
              StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_EQ(store->GetCheckpoint("m")->version, v1);
  Watcher first(store.get(), {});
  ASSERT_TRUE(first.WaitFor(IsSynced));
  EXPECT_THAT(store->Watch({}, [](const CheckpointEvent&) { return true; }),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("--max-watches")));
  // Neither the open watches nor the idle clients (`store`, `anonymous`, the
  // stopped process) hold the daemon for its grace. (Idle clients used to:
  // gRPC's graceful GOAWAY waited for acks their channels read every 5 s, and
  // the stopped process's never comes; see Shutdown.) Measured to its
  // "stopped"; the exit after it (an ASan build's leak check included) is
  // bounded by the grace only.
  const auto start = std::chrono::steady_clock::now();
  daemon.Signal(SIGTERM);
  while (!absl::StrContains(daemon.log(), "weightstored: stopped") &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(60)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const auto stopped_after = std::chrono::steady_clock::now() - start;
  std::cout << "the daemon stopped " << std::chrono::duration_cast<std::chrono::milliseconds>(stopped_after).count()
            << " ms after SIGTERM (grace: 600 s)\n";
  // Only a stop that waited for the grace (or a machine stalled for a minute)
  // breaks this bound.
  EXPECT_LT(stopped_after, std::chrono::seconds(60)) << daemon.log();
  EXPECT_EQ(daemon.WaitExit(60000), 0) << daemon.log();
}

// A Hugging Face hub cache served by repo id: moving refs/main to a new
// snapshot is a new version of "acme/gpt", and a watcher hears of it as a
// replacement that names exactly the changed tensors.
TEST(HubCacheUpdatesTest, MovingRefsMainIsAReplacementWatchersSeeAsADelta) {
  namespace fs = std::filesystem;
  const std::string models = testing::MakeScratchDir("hub-updates");
  const std::string repo = models + "/hub/models--acme--gpt";
  Model model(2);
  auto publish = [&](const std::string& commit) {
    fs::create_directories(repo + "/blobs");
    fs::create_directories(repo + "/snapshots/" + commit);
    fs::create_directories(repo + "/refs");
    model.Publish(repo + "/blobs/" + commit + "-blob");
    fs::create_symlink("../../blobs/" + commit + "-blob", repo + "/snapshots/" + commit + "/model.safetensors");
    testing::WriteFileOrDie(repo + "/refs/main", commit);
  };
  publish("c1");
  Daemon daemon(models, {"--kept-versions", "4"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  std::unique_ptr<client::Store> store = *client::ConnectRemoteStore(daemon.address());
  ASSERT_OK_AND_ASSIGN(client::CheckpointSummary info, store->GetCheckpoint("acme/gpt"));
  Watcher watcher(store.get(), {.name = "acme/gpt"});
  ASSERT_TRUE(watcher.WaitFor(IsSynced));

  model.Change(3);
  model.Change(7);
  publish("c2");
  auto stub = pb::WeightStore::NewStub(grpc::CreateChannel(daemon.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  pb::RescanResponse resp;
  ASSERT_TRUE(stub->Rescan(&ctx, pb::RescanRequest(), &resp).ok());
  std::optional<CheckpointEvent> replaced = watcher.WaitFor(IsReplacement);
  ASSERT_TRUE(replaced.has_value());
  EXPECT_EQ(replaced->name, "acme/gpt");
  EXPECT_EQ(replaced->old_version, info.version);
  EXPECT_TRUE(replaced->delta) << replaced->full_reason;
  EXPECT_THAT(replaced->changed, UnorderedElementsAreArray({model.name(3), model.name(7)}));
  // The repo id now serves the new snapshot; the old one is still there by commit.
  ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> now, store->FetchAll("acme/gpt", {}));
  ExpectSameTensors(now, model.tensors());
  EXPECT_OK(store->GetCheckpoint("acme/gpt@c1").status());
}

}  // namespace
}  // namespace weightstore

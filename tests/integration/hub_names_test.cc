// Hugging Face hub names down the tiers: an upstream weightstored serves a
// hub cache (core/catalog/hub_cache.h) by repo id, revision and commit, and a
// node (--origin grpc://...) pulls, serves and follows those very names, each
// checkpoint in a folder of its own, so that two repos' shards of one name
// ("model-00001-of-00002.safetensors") never meet.
#include <gtest/gtest.h>
#include <signal.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/store.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "core/status_macros.h"
#include "tests/util/daemon.h"
#include "tests/util/metrics.h"
#include "tests/util/serving.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "tests/util/wait.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore {
namespace {

namespace fs = std::filesystem;
using Tensors = std::map<std::string, std::string>;

// `count` float tensors of `floats` elements, their bytes drawn from `seed`.
std::vector<SharedTensor> MakeTensors(int count, size_t floats, int seed) {
  std::vector<SharedTensor> out;
  for (int i = 0; i < count; ++i) {
    std::vector<std::byte> bytes(floats * 4);
    for (size_t k = 0; k < bytes.size(); ++k) bytes[k] = std::byte((k * 31 + i * 7 + seed * 13) & 0xff);
    out.push_back(
        {{absl::StrCat("layers.", i, ".weight"), DType::kF32, {floats}}, SharedBytes::FromVector(std::move(bytes))});
  }
  return out;
}

Tensors ToMap(const std::vector<SharedTensor>& tensors) {
  Tensors out;
  for (const SharedTensor& t : tensors) out[t.spec.name] = std::string(t.bytes.view());
  return out;
}

// One hub repo folder under <models>/hub, as huggingface_hub lays it out:
// files in blobs/, snapshots/<commit>/ of symlinks to them, refs/<ref>.
class HubRepo {
 public:
  HubRepo(const std::string& models, const std::string& org, const std::string& name)
      : dir_(absl::StrCat(models, "/hub/models--", org, "--", name)) {
    fs::create_directories(dir_ + "/blobs");
    fs::create_directories(dir_ + "/refs");
  }

  // Snapshot `commit` of `tensors`: one model.safetensors, or the index and
  // two shards transformers names (model-0000N-of-00002.safetensors).
  void Snapshot(const std::string& commit, const std::vector<SharedTensor>& tensors, bool sharded) {
    fs::create_directories(dir_ + "/snapshots/" + commit);
    if (!sharded) {
      Blob(commit, "model.safetensors", *SerializeCheckpoint(kSafeTensorsFormat, tensors, {}));
      return;
    }
    std::string map;
    const size_t half = tensors.size() / 2;
    for (int s = 0; s < 2; ++s) {
      std::vector<SharedTensor> part(tensors.begin() + (s == 0 ? 0 : half),
                                     s == 0 ? tensors.begin() + half : tensors.end());
      const std::string file = absl::StrCat("model-0000", s + 1, "-of-00002.safetensors");
      Blob(commit, file, *SerializeCheckpoint(kSafeTensorsFormat, part, {}));
      for (const SharedTensor& t : part) {
        absl::StrAppend(&map, map.empty() ? "" : ",", "\"", t.spec.name, "\":\"", file, "\"");
      }
    }
    Blob(commit, "model.safetensors.index.json", absl::StrCat("{\"metadata\":{},\"weight_map\":{", map, "}}"));
  }

  // A file of snapshot `commit` that is no weights (a config).
  void File(const std::string& commit, const std::string& file, const std::string& bytes) { Blob(commit, file, bytes); }

  // Points `ref` at `commit` (atomically, as huggingface_hub writes it).
  void Ref(const std::string& ref, const std::string& commit) {
    testing::WriteFileOrDie(dir_ + "/refs/" + ref + ".tmp", commit);
    fs::rename(dir_ + "/refs/" + ref + ".tmp", dir_ + "/refs/" + ref);
  }

 private:
  void Blob(const std::string& commit, const std::string& file, const std::string& bytes) {
    const std::string blob = absl::StrCat(commit, "-", file);
    testing::WriteFileOrDie(dir_ + "/blobs/" + blob, bytes);
    fs::create_symlink("../../blobs/" + blob, dir_ + "/snapshots/" + commit + "/" + file);
  }

  std::string dir_;
};

// What `address` serves as `name`: its version and tensors.
struct Served {
  std::string version;
  Tensors tensors;
};
absl::StatusOr<Served> FetchServed(const std::string& address, const std::string& name) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::unique_ptr<client::Store> store, client::ConnectRemoteStore(address));
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto fetched, store->FetchVersioned(name, {}));
  return Served{fetched.version, ToMap(fetched.tensors)};
}

void Rescan(const testing::Daemon& daemon) {
  auto stub = testing::NewStub(daemon.address());
  grpc::ClientContext ctx;
  v1::RescanResponse resp;
  ASSERT_TRUE(stub->Rescan(&ctx, v1::RescanRequest(), &resp).ok());
}

// Files under `models`, outside the node cache's own folder.
std::vector<std::string> FilesOutsideTheCache(const std::string& models) {
  std::vector<std::string> out;
  for (auto it = fs::recursive_directory_iterator(models); it != fs::recursive_directory_iterator(); ++it) {
    if (it->path().filename() == ".weightstore-cache") {
      it.disable_recursion_pending();
    } else if (!it->is_directory()) {
      out.push_back(it->path().lexically_relative(models).string());
    }
  }
  return out;
}

class HubNamesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    upstream_models_ = testing::MakeScratchDir("hub-upstream");
    // Two sharded repos of one org, whose shards have the same file names;
    // acme/a also has an older snapshot that the tag v1 names.
    HubRepo a(upstream_models_, "acme", "a"), b(upstream_models_, "acme", "b");
    a.Snapshot("c0ffee0", MakeTensors(4, 4096, 1), /*sharded=*/true);
    a.Snapshot("c1", MakeTensors(4, 4096, 2), /*sharded=*/true);
    a.Ref("main", "c1");
    a.Ref("v1", "c0ffee0");
    b.Snapshot("d1", MakeTensors(4, 4096, 3), /*sharded=*/true);
    b.Ref("main", "d1");
    upstream_ = std::make_unique<testing::Daemon>(upstream_models_);
    ASSERT_NE(upstream_->port(), 0) << upstream_->log();
  }

  // Adds a failure unless `node` serves `name` as the upstream does, version
  // id and bytes alike.
  void ExpectServedAsUpstream(const testing::Daemon& node, const std::string& name) {
    ASSERT_OK_AND_ASSIGN(Served want, FetchServed(upstream_->address(), name));
    ASSERT_OK_AND_ASSIGN(Served got, FetchServed(node.address(), name));
    EXPECT_EQ(got.version, want.version) << name;
    EXPECT_EQ(got.tensors.size(), want.tensors.size()) << name;
    EXPECT_TRUE(got.tensors == want.tensors) << name << ": the node's bytes differ from the upstream's";
  }

  std::string upstream_models_;
  std::unique_ptr<testing::Daemon> upstream_;
};

TEST_F(HubNamesTest, ANodePullsRepoIdsRevisionsAndCommitsWhoseShardsShareFileNamesAndKeepsThemAcrossARestart) {
  const std::string models = testing::MakeScratchDir("hub-node");
  const std::vector<std::string> names = {"acme/a", "acme/b", "acme/a@v1", "acme/a@c1"};
  {
    auto node = testing::StartNode(*upstream_, models, {"--metrics-listen", "127.0.0.1:0"});
    ASSERT_NE(node->port(), 0) << node->log();
    for (const std::string& name : names) ExpectServedAsUpstream(*node, name);
    // Revision and repo id name other bytes: v1 is an older snapshot.
    ASSERT_OK_AND_ASSIGN(Served main, FetchServed(node->address(), "acme/a"));
    ASSERT_OK_AND_ASSIGN(Served v1, FetchServed(node->address(), "acme/a@v1"));
    EXPECT_NE(main.version, v1.version);
    EXPECT_FALSE(main.tensors == v1.tensors);
    // Each in a folder of its own: nothing lies in the models folder where a
    // scan would serve it under another name.
    EXPECT_TRUE(FilesOutsideTheCache(models).empty()) << ::testing::PrintToString(FilesOutsideTheCache(models));
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Store> store, client::ConnectRemoteStore(node->address()));
    ASSERT_OK_AND_ASSIGN(std::vector<client::CheckpointSummary> listed, store->ListCheckpoints());
    std::vector<std::string> listed_names;
    for (const auto& c : listed) listed_names.push_back(c.name);
    EXPECT_EQ(listed_names, (std::vector<std::string>{"acme/a", "acme/a@c1", "acme/a@v1", "acme/b"}));
    // A rescan keeps them.
    Rescan(*node);
    for (const std::string& name : names) EXPECT_OK(store->GetCheckpoint(name).status()) << name;
    // A tier below pulls the same names from this node, apart as well.
    const std::string below_models = testing::MakeScratchDir("hub-node-below");
    auto below = testing::StartNode(*node, below_models);
    ASSERT_NE(below->port(), 0) << below->log();
    for (const std::string& name : names) ExpectServedAsUpstream(*below, name);
    EXPECT_TRUE(FilesOutsideTheCache(below_models).empty())
        << ::testing::PrintToString(FilesOutsideTheCache(below_models));
  }
  // Restarted while the upstream does not answer: served from disk, under
  // the upstream's ids, nothing pulled again.
  ASSERT_TRUE(upstream_->Stop());
  auto node = testing::StartNode(*upstream_, models, {"--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(node->port(), 0) << node->log();
  upstream_->Signal(SIGCONT);
  for (const std::string& name : names) ExpectServedAsUpstream(*node, name);
  EXPECT_LE(testing::MetricValue(node->metrics_port(), "weightstore_origin_pulled_bytes_total"), 0);
}

// The files a node placed beside `name`'s weights in its folder apart, by
// file name: what `from` lists of them.
std::map<std::string, std::string> ConfigsPlacedBeside(const std::string& models, const std::string& name) {
  std::map<std::string, std::string> out;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(models + "/.weightstore-cache/placed", ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (it->path().filename() != ".name" || testing::ReadFileOrEmpty(it->path().string()) != name) continue;
    for (const char* config : {"hf_quant_config.json", "config.json"}) {
      const fs::path file = it->path().parent_path() / config;
      if (fs::exists(file)) out[config] = testing::ReadFileOrEmpty(file.string());
    }
  }
  return out;
}

TEST_F(HubNamesTest, ANodeServesAQuantizedHubSnapshotWithTheConfigsBesideItDownTheTiers) {
  // An NVFP4 snapshot as ModelOpt writes it: packed values, their scales, a
  // tensor the config leaves alone, and hf_quant_config.json and config.json
  // beside them (links into blobs/, as the hub cache keeps them).
  auto tensor = [](const std::string& name, DType dtype, std::vector<uint64_t> shape) {
    TensorSpec spec{name, dtype, std::move(shape)};
    std::vector<std::byte> bytes(spec.byte_size());
    for (size_t k = 0; k < bytes.size(); ++k) bytes[k] = std::byte((k * 7 + 3) & 0x7f);
    return SharedTensor{spec, SharedBytes::FromVector(std::move(bytes))};
  };
  const std::string quant = R"({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4",
      "group_size": 16, "exclude_modules": ["lm_head"]}})";
  const std::string config = R"({"model_type": "llama", "quantization_config": {"quant_method": "modelopt"}})";
  HubRepo q(upstream_models_, "acme", "q");
  q.Snapshot("f1",
             {tensor("model.layers.0.mlp.down_proj.weight", DType::kU8, {64, 32}),
              tensor("model.layers.0.mlp.down_proj.weight_scale", DType::kF8E4M3, {64, 4}),
              tensor("model.norm.weight", DType::kF32, {64})},
             /*sharded=*/false);
  q.File("f1", "hf_quant_config.json", quant);
  q.File("f1", "config.json", config);
  q.Ref("main", "f1");
  Rescan(*upstream_);

  // What a daemon says of the checkpoint's quantization, and of its weight's.
  auto quantization = [](const testing::Daemon& daemon) -> std::pair<std::string, std::string> {
    absl::StatusOr<std::unique_ptr<client::Store>> store = client::ConnectRemoteStore(daemon.address());
    if (!store.ok()) return {store.status().ToString(), ""};
    absl::StatusOr<client::CheckpointSummary> summary = (*store)->GetCheckpoint("acme/q");
    absl::StatusOr<client::TensorListing> listing = (*store)->ListTensors("acme/q", {});
    if (!summary.ok() || !listing.ok()) return {summary.status().ToString(), listing.status().ToString()};
    for (const client::TensorDescription& t : listing->tensors) {
      if (t.spec.name == "model.layers.0.mlp.down_proj.weight") return {summary->quantization, t.quantization};
    }
    return {summary->quantization, "(no weight listed)"};
  };
  const auto want = quantization(*upstream_);
  ASSERT_THAT(want.first, ::testing::HasSubstr("NVFP4"));
  ASSERT_EQ(want.second, "NVFP4, 4-bit values, blocks of 1x16 (hf_quant_config.json)");

  const std::string models = testing::MakeScratchDir("hub-quantized-node");
  const std::string below_models = testing::MakeScratchDir("hub-quantized-below");
  auto node = testing::StartNode(*upstream_, models);
  ASSERT_NE(node->port(), 0) << node->log();
  ExpectServedAsUpstream(*node, "acme/q");
  EXPECT_EQ(quantization(*node), want) << node->log();
  // The regional tier's own folder is what the tier below pulls from.
  auto below = testing::StartNode(*node, below_models);
  ASSERT_NE(below->port(), 0) << below->log();
  ExpectServedAsUpstream(*below, "acme/q");
  EXPECT_EQ(quantization(*below), want) << below->log();
  const std::map<std::string, std::string> configs = {{"hf_quant_config.json", quant}, {"config.json", config}};
  EXPECT_EQ(ConfigsPlacedBeside(models, "acme/q"), configs);
  EXPECT_EQ(ConfigsPlacedBeside(below_models, "acme/q"), configs);
  // Still nothing in the models folder where a scan would serve it.
  EXPECT_TRUE(FilesOutsideTheCache(models).empty()) << ::testing::PrintToString(FilesOutsideTheCache(models));

  // Restarted: served from its folder with the configs.
  below.reset();
  below = testing::StartNode(*node, below_models);
  ASSERT_NE(below->port(), 0) << below->log();
  EXPECT_EQ(quantization(*below), want) << below->log();

  // A config linked out of its repo folder is not served: a repo whose
  // config.json points at another file the daemon can read.
  HubRepo leak(upstream_models_, "acme", "leak");
  leak.Snapshot("g1", {tensor("model.norm.weight", DType::kF32, {64})}, /*sharded=*/false);
  testing::WriteFileOrDie(upstream_models_ + "/outside.json", R"({"secret": 1})");
  fs::create_symlink(upstream_models_ + "/outside.json",
                     upstream_models_ + "/hub/models--acme--leak/snapshots/g1/config.json");
  leak.Ref("main", "g1");
  Rescan(*upstream_);
  ExpectServedAsUpstream(*node, "acme/leak");
  EXPECT_TRUE(ConfigsPlacedBeside(models, "acme/leak").empty());
}

TEST_F(HubNamesTest, AFollowingNodeTakesASnapshotWhoseIndexChangedAsItsFilesInTheNamesFolder) {
  // A sharded repo whose next snapshot adds a tensor: no step of element
  // patches can write it under the shards held, so it comes as the files
  // that changed, placed in the name's own folder as the pull placed them.
  HubRepo h(upstream_models_, "acme", "h");
  std::vector<SharedTensor> tensors = MakeTensors(4, 8192, 7);
  h.Snapshot("k1", tensors, /*sharded=*/true);
  h.File("k1", "config.json", R"({"model_type": "llama"})");
  h.Ref("main", "k1");
  Rescan(*upstream_);
  const std::string models = testing::MakeScratchDir("hub-index-follower");
  auto node =
      testing::StartNode(*upstream_, models, {"--follow", "--pull", "acme/h", "--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(node->port(), 0) << node->log();
  ExpectServedAsUpstream(*node, "acme/h");

  std::vector<SharedTensor> more = MakeTensors(5, 8192, 7);
  h.Snapshot("k2", more, /*sharded=*/true);
  h.Ref("main", "k2");
  Rescan(*upstream_);
  ASSERT_OK_AND_ASSIGN(Served want, FetchServed(upstream_->address(), "acme/h"));
  ASSERT_EQ(want.tensors.size(), 5u);
  ASSERT_TRUE(testing::WaitUntil([&] {
    absl::StatusOr<Served> got = FetchServed(node->address(), "acme/h");
    return got.ok() && got->version == want.version;
  })) << node->log();
  ExpectServedAsUpstream(*node, "acme/h");
  EXPECT_EQ(testing::MetricValue(node->metrics_port(), "weightstore_follow_blocked"), 0) << node->log();
  // Still all in its folder, the config kept.
  EXPECT_TRUE(FilesOutsideTheCache(models).empty()) << ::testing::PrintToString(FilesOutsideTheCache(models));
  EXPECT_EQ(ConfigsPlacedBeside(models, "acme/h"),
            (std::map<std::string, std::string>{{"config.json", R"({"model_type": "llama"})"}}));
  // And a restart serves the new version from there.
  node.reset();
  node = testing::StartNode(*upstream_, models, {"--follow", "--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(node->port(), 0) << node->log();
  ExpectServedAsUpstream(*node, "acme/h");
}

TEST_F(HubNamesTest, AFollowingNodeDoesNotTakeASnapshotWhoseQuantizationConfigChanged) {
  auto tensor = [](const std::string& name, DType dtype, std::vector<uint64_t> shape, int seed) {
    TensorSpec spec{name, dtype, std::move(shape)};
    std::vector<std::byte> bytes(spec.byte_size());
    for (size_t k = 0; k < bytes.size(); ++k) bytes[k] = std::byte((k * 7 + seed) & 0x7f);
    return SharedTensor{spec, SharedBytes::FromVector(std::move(bytes))};
  };
  // `more` adds a layer: a sharded checkpoint then comes as its files, not
  // as patches, and is refused all the same.
  auto snapshot = [&](int seed, bool more) {
    std::vector<SharedTensor> out = {tensor("model.layers.0.mlp.down_proj.weight", DType::kU8, {64, 32}, seed),
                                     tensor("model.layers.0.mlp.down_proj.weight_scale", DType::kF8E4M3, {64, 4}, 1),
                                     tensor("model.norm.weight", DType::kF32, {64}, 1)};
    if (more) out.push_back(tensor("model.norm.bias", DType::kF32, {64}, 2));
    return out;
  };
  for (const bool sharded : {false, true}) {
    SCOPED_TRACE(sharded ? "sharded" : "one file");
    const std::string repo = sharded ? "qs" : "q", name = "acme/" + repo;
    HubRepo q(upstream_models_, "acme", repo);
    q.Snapshot("f1", snapshot(3, false), sharded);
    q.File("f1", "hf_quant_config.json", R"({"quantization": {"quant_algo": "NVFP4"}})");
    q.Ref("main", "f1");
    Rescan(*upstream_);
    const std::string models = testing::MakeScratchDir("hub-quantized-follower");
    auto node = testing::StartNode(*upstream_, models, {"--follow", "--pull", name, "--metrics-listen", "127.0.0.1:0"});
    ASSERT_NE(node->port(), 0) << node->log();
    ASSERT_OK_AND_ASSIGN(Served before, FetchServed(node->address(), name));

    // The ref moves to a snapshot whose config leaves the layer unquantized.
    q.Snapshot("f2", snapshot(5, sharded), sharded);
    q.File("f2", "hf_quant_config.json",
           R"({"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["model.layers.0.mlp.down_proj"]}})");
    q.Ref("main", "f2");
    Rescan(*upstream_);
    ASSERT_OK_AND_ASSIGN(Served moved, FetchServed(upstream_->address(), name));
    ASSERT_NE(moved.version, before.version);
    // Blocked, saying why; the node serves the version its config describes.
    ASSERT_TRUE(testing::WaitUntil([&] {
      return testing::MetricValue(node->metrics_port(), "weightstore_follow_blocked") == 1;
    })) << node->log();
    EXPECT_THAT(node->log(), ::testing::AllOf(::testing::HasSubstr("quantizes tensor"),
                                              ::testing::HasSubstr("model.layers.0.mlp.down_proj.weight")));
    ASSERT_OK_AND_ASSIGN(Served after, FetchServed(node->address(), name));
    EXPECT_EQ(after.version, before.version);
    EXPECT_TRUE(after.tensors == before.tensors);
  }
}

TEST_F(HubNamesTest, AnUnusableRevisionNameIsRefusedAndTheNodeServesOn) {
  const std::string models = testing::MakeScratchDir("hub-node-names");
  auto node = testing::StartNode(*upstream_, models);
  ASSERT_NE(node->port(), 0) << node->log();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Store> store, client::ConnectRemoteStore(node->address()));
  for (const std::string bad : {"acme/a@", "acme/a@v1@v2", "acme/a@../x", "@v1", "acme/a@.hidden"}) {
    absl::StatusOr<client::CheckpointSummary> got = store->GetCheckpoint(bad);
    EXPECT_FALSE(got.ok()) << bad;
  }
  // The upstream lacks the revision: NotFound, named.
  absl::StatusOr<client::CheckpointSummary> absent = store->GetCheckpoint("acme/a@v9");
  EXPECT_EQ(absent.status().code(), absl::StatusCode::kNotFound) << absent.status();
  ExpectServedAsUpstream(*node, "acme/a@v1");
}

TEST_F(HubNamesTest, AFollowingNodeTakesTheNewSnapshotWhenTheRefMovesAndKeepsTheCommitItPinned) {
  HubRepo s(upstream_models_, "acme", "s");
  std::vector<SharedTensor> tensors = MakeTensors(4, 16384, 5);
  s.Snapshot("e1", tensors, /*sharded=*/false);
  const std::string config = R"({"model_type": "llama"})";
  s.File("e1", "config.json", config);
  s.Ref("main", "e1");
  Rescan(*upstream_);
  const std::string models = testing::MakeScratchDir("hub-follower");
  auto node = testing::StartNode(
      *upstream_, models, {"--follow", "--pull", "acme/s", "--pull", "acme/s@e1", "--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(node->port(), 0) << node->log();
  ExpectServedAsUpstream(*node, "acme/s");
  ASSERT_OK_AND_ASSIGN(Served before, FetchServed(node->address(), "acme/s@e1"));

  // The repo moves on: one tensor changed in a new snapshot, refs/main moved.
  std::vector<SharedTensor> next = tensors;
  {
    std::vector<std::byte> bytes(next[2].bytes.size());
    std::memcpy(bytes.data(), next[2].bytes.data(), bytes.size());
    for (size_t k = 0; k < bytes.size(); k += 97) bytes[k] = std::byte(~static_cast<unsigned>(bytes[k]) & 0xff);
    next[2].bytes = SharedBytes::FromVector(std::move(bytes));
  }
  s.Snapshot("e2", next, /*sharded=*/false);
  s.File("e2", "config.json", R"({"model_type": "llama", "torch_dtype": "float32"})");
  s.Ref("main", "e2");
  Rescan(*upstream_);
  ASSERT_OK_AND_ASSIGN(Served want, FetchServed(upstream_->address(), "acme/s"));
  ASSERT_NE(want.version, before.version);
  ASSERT_TRUE(testing::WaitUntil([&] {
    absl::StatusOr<Served> got = FetchServed(node->address(), "acme/s");
    return got.ok() && got->version == want.version;
  })) << node->log();
  ExpectServedAsUpstream(*node, "acme/s");
  // The step came as element patches, and the commit is still the commit.
  EXPECT_GE(testing::MetricValue(node->metrics_port(), "weightstore_follow_updates_total", {"how=\"patches\""}), 1)
      << node->log();
  ASSERT_OK_AND_ASSIGN(Served pinned, FetchServed(node->address(), "acme/s@e1"));
  EXPECT_EQ(pinned.version, before.version);
  EXPECT_TRUE(pinned.tensors == before.tensors);
  // The config pulled beside it stays as pulled through the step (e2's
  // quantizes nothing either, so the step is taken).
  EXPECT_EQ(ConfigsPlacedBeside(models, "acme/s"), (std::map<std::string, std::string>{{"config.json", config}}));
}

}  // namespace
}  // namespace weightstore

// Following an S3 origin with real daemons on loopback: a bucket on s3rver
// whose object a trainer overwrites, a regional daemon started with
// `--origin s3://... --follow` that polls the listing and pulls each new
// version whole, and a node following the regional daemon, which gets the
// same versions, under the same ids, as element patches.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/store.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"
#include "origin/s3_origin.h"
#include "tests/util/checkpoints.h"
#include "tests/util/daemon.h"
#include "tests/util/metrics.h"
#include "tests/util/s3rver.h"
#include "tests/util/serving.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "tests/util/wait.h"

namespace weightstore {
namespace {

using testing::Daemon;

// Tensor name to bytes.
using Tensors = std::map<std::string, std::string>;

constexpr char kName[] = "m";

// Version `v` of the trainer's checkpoint: two F32 tensors of 64 Ki
// elements, 1% of whose elements move at each version, and a frozen one.
Tensors TrainerVersion(int v) {
  Tensors out;
  for (const char* name : {"layers.0.weight", "layers.1.weight", "norm.weight"}) {
    std::string bytes(size_t{64} << 12, '\0');
    const bool frozen = absl::StartsWith(name, "norm");
    for (size_t k = 0; k < bytes.size() / 4; ++k) {
      float value = static_cast<float>(k % 1000) * 1e-3f;
      for (int step = 1; step <= v && !frozen; ++step) {
        if ((k * 7919 + static_cast<size_t>(step) * 31) % 100 == 0) value += 1e-2f * static_cast<float>(step);
      }
      std::memcpy(bytes.data() + 4 * k, &value, 4);
    }
    out[name] = std::move(bytes);
  }
  return out;
}

std::string SafeTensorsFile(const Tensors& tensors) {
  std::vector<SharedTensor> shared;
  for (const auto& [name, bytes] : tensors) {
    shared.push_back({{name, DType::kF32, {bytes.size() / 4}}, SharedBytes::Copy(bytes)});
  }
  return *SerializeCheckpoint(kSafeTensorsFormat, shared, {});
}

// A daemon, its models folder and a client of it.
struct Node {
  std::unique_ptr<Daemon> daemon;
  std::unique_ptr<client::Store> store;
  std::string models;

  std::string Version() const {
    auto info = store->GetCheckpoint(kName);
    return info.ok() ? info->version : "";
  }
  Tensors Served() const {
    auto fetched = store->FetchVersioned(kName, {});
    if (!fetched.ok()) return {};
    Tensors out;
    for (const SharedTensor& t : fetched->tensors) out[t.spec.name] = std::string(t.bytes.view());
    return out;
  }
  double Metric(absl::string_view name, absl::string_view label = "") const {
    if (label.empty()) return testing::MetricValue(daemon->metrics_port(), name, {"checkpoint=\"m\""});
    return testing::MetricValue(daemon->metrics_port(), name, {"checkpoint=\"m\"", label});
  }
  std::string Log() const {
    std::string out;
    for (absl::string_view line : absl::StrSplit(daemon->log(), '\n')) {
      if (!absl::StrContains(line, "\"msg\":\"request\"")) absl::StrAppend(&out, line, "\n");
    }
    return out;
  }
};

class S3FollowingTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new testing::S3rver();
    start_ = new absl::Status(server_->Start());
  }
  static void TearDownTestSuite() {
    delete server_;
    delete start_;
    server_ = nullptr;
    start_ = nullptr;
  }

  void SetUp() override {
    ASSERT_TRUE(start_->ok()) << "s3rver is needed for these tests: " << *start_;
    // Each test keeps to its own folder of the bucket.
    prefix_ = absl::AsciiStrToLower(::testing::UnitTest::GetInstance()->current_test_info()->name());
  }

  std::string Url() const { return absl::StrCat("s3://", testing::kS3rverBucket, "/", prefix_); }
  absl::Status Put(const std::string& relative_key, absl::string_view data) {
    return server_->Put(absl::StrCat(prefix_, "/", relative_key), data);
  }
  // The id S3 gives the checkpoint's current objects: what a node must serve.
  std::string OriginVersion() {
    origin::S3Config config;
    config.access_key_id = config.secret_access_key = testing::kS3rverKey;
    config.endpoint = server_->endpoint();
    auto made = origin::S3Origin::Create(Url(), config);
    if (!made.ok()) return made.status().ToString();
    auto version = (*made)->Version(kName);
    return version.ok() ? *version : version.status().ToString();
  }

  static Node Connect(std::unique_ptr<Daemon> daemon, std::string models) {
    Node n;
    n.daemon = std::move(daemon);
    n.models = std::move(models);
    client::RemoteOptions options;
    options.deadline = std::chrono::seconds(60);  // only keeps a hung daemon from hanging the test
    if (n.daemon->port() != 0) n.store = *client::ConnectRemoteStore(n.daemon->address(), options);
    return n;
  }

  // A daemon following the bucket (polling every 0.1 s), pulling the
  // checkpoint at start, on `models` (a fresh folder when empty).
  Node StartRegional(std::string models = "", std::vector<std::string> more = {}) {
    if (models.empty()) models = testing::MakeScratchDir("s3-follow-regional");
    std::vector<std::string> args = {"--origin",
                                     Url(),
                                     "--follow",
                                     "--follow-interval",
                                     "0.1",
                                     "--aws-endpoint-url",
                                     server_->endpoint(),
                                     "--aws-access-key-id",
                                     testing::kS3rverKey,
                                     "--aws-secret-access-key",
                                     testing::kS3rverKey,
                                     "--pull",
                                     kName,
                                     "--metrics-listen",
                                     "127.0.0.1:0"};
    args.insert(args.end(), more.begin(), more.end());
    Node n = Connect(std::make_unique<Daemon>(models, args), models);
    EXPECT_NE(n.daemon->port(), 0) << n.daemon->log();
    return n;
  }

  // Waits until `node` serves `version`; adds a failure if it never does.
  static bool WaitForVersion(const Node& node, const std::string& version, const std::string& what) {
    const bool reached = testing::WaitUntil([&] { return node.Version() == version; });
    EXPECT_TRUE(reached) << what << " serves '" << node.Version() << "', not " << version << "\n" << node.Log();
    return reached;
  }

  static testing::S3rver* server_;
  static absl::Status* start_;
  std::string prefix_;
};
testing::S3rver* S3FollowingTest::server_ = nullptr;
absl::Status* S3FollowingTest::start_ = nullptr;

TEST_F(S3FollowingTest, AnOverwrittenObjectIsServedUnderItsS3VersionAndReachesTheNextTierAsPatches) {
  ASSERT_OK(Put("m.safetensors", SafeTensorsFile(TrainerVersion(0))));
  const std::string v0 = OriginVersion();
  Node regional = StartRegional();
  ASSERT_NE(regional.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(regional, v0, "regional"));
  const std::string node_models = testing::MakeScratchDir("s3-follow-node");
  Node node = Connect(testing::StartNode(*regional.daemon, node_models,
                                         {"--follow", "--pull", kName, "--metrics-listen", "127.0.0.1:0"}),
                      node_models);
  ASSERT_NE(node.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(node, v0, "node"));

  uint64_t whole_bytes = 0;
  std::string id;
  for (int v = 1; v <= 3; ++v) {
    const std::string file = SafeTensorsFile(TrainerVersion(v));
    ASSERT_OK(Put("m.safetensors", file));
    whole_bytes += file.size();
    id = OriginVersion();
    ASSERT_NE(id, v0);
    // The same id on both tiers, the same bytes, the file on disk the object.
    ASSERT_TRUE(WaitForVersion(regional, id, absl::StrCat("regional at version ", v)));
    ASSERT_TRUE(WaitForVersion(node, id, absl::StrCat("node at version ", v)));
    EXPECT_TRUE(regional.Served() == TrainerVersion(v)) << "version " << v;
    EXPECT_TRUE(node.Served() == TrainerVersion(v)) << "version " << v;
    EXPECT_TRUE(testing::ReadFileOrEmpty(regional.models + "/m.safetensors") == file) << "version " << v;
  }
  EXPECT_EQ(regional.Metric("weightstore_follow_updates_total", "how=\"whole\""), 3) << regional.Log();
  EXPECT_EQ(regional.Metric("weightstore_follow_received_bytes_total", "kind=\"whole\""),
            static_cast<double>(whole_bytes));
  EXPECT_EQ(regional.Metric("weightstore_follow_lag_versions"), 0);
  EXPECT_EQ(testing::MetricValue(regional.daemon->metrics_port(), "weightstore_follow_upstream_connected"), 1);
  // The regional daemon diffed each version against the one it replaced: the
  // node below it took every step as element patches.
  EXPECT_EQ(node.Metric("weightstore_follow_updates_total", "how=\"patches\""), 3) << node.Log();
  EXPECT_EQ(node.Metric("weightstore_follow_updates_total", "how=\"whole\""), 0) << node.Log();

  // Each tier says what it follows and how it stands: the client API, and
  // `weightstore ls`.
  ASSERT_OK_AND_ASSIGN(client::CheckpointSummary info, regional.store->GetCheckpoint(kName));
  ASSERT_TRUE(info.follow.has_value());
  EXPECT_THAT(info.follow->upstream, ::testing::StartsWith(Url()));
  EXPECT_EQ(info.follow->upstream_version, id);
  EXPECT_EQ(info.follow->lag_versions, 0u);
  EXPECT_TRUE(info.follow->upstream_connected);
  EXPECT_EQ(info.follow->blocked, "");
  std::string out;
  ASSERT_EQ(testing::RunCommand(absl::StrCat(testing::CliPath(), " ls --json --server ", node.daemon->address()), &out),
            0)
      << out;
  const nlohmann::json listed = nlohmann::json::parse(out, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(listed.is_array() && listed.size() == 1) << out;
  EXPECT_EQ(listed[0]["version"], id) << out;
  EXPECT_EQ(listed[0]["follow"]["upstream"], absl::StrCat("grpc://", regional.daemon->address())) << out;
  EXPECT_EQ(listed[0]["follow"]["upstream_version"], id) << out;
  EXPECT_EQ(listed[0]["follow"]["lag_versions"], 0) << out;
  ASSERT_EQ(testing::RunCommand(absl::StrCat(testing::CliPath(), " ls --server ", node.daemon->address()), &out), 0);
  EXPECT_THAT(out, ::testing::HasSubstr("UPSTREAM")) << out;
  EXPECT_THAT(out, ::testing::HasSubstr(absl::StrCat("current  grpc://", regional.daemon->address()))) << out;
}

TEST_F(S3FollowingTest, AnObjectThatDoesNotOpenIsBlockedWhileTheNodeServesWhatItHeld) {
  ASSERT_OK(Put("m.safetensors", SafeTensorsFile(TrainerVersion(0))));
  const std::string v0 = OriginVersion();
  Node regional = StartRegional();
  ASSERT_NE(regional.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(regional, v0, "regional"));

  // Stopped while s3rver writes the object in place, so that no poll lists
  // a part of it (which its MD5 would block first, with another reason).
  ASSERT_TRUE(regional.daemon->Stop());
  ASSERT_OK(Put("m.safetensors", "not a SafeTensors file, written over the good one"));
  regional.daemon->Signal(SIGCONT);
  ASSERT_TRUE(testing::WaitUntil([&] {
    return regional.Metric("weightstore_follow_blocked") == 1 && absl::StrContains(regional.Log(), "does not open");
  })) << regional.Log();
  EXPECT_EQ(regional.Version(), v0);
  ASSERT_OK_AND_ASSIGN(client::CheckpointSummary info, regional.store->GetCheckpoint(kName));
  ASSERT_TRUE(info.follow.has_value());
  EXPECT_THAT(info.follow->blocked, ::testing::HasSubstr("does not open"));
  // Behind by the bad object: by one version, or more when a poll listed the
  // object while s3rver was still writing it (a size or ETag of its own, which
  // is a version of its own: the flapping listing of docs/origin.md).
  EXPECT_GE(info.follow->lag_versions, 1u);
  EXPECT_NE(info.follow->upstream_version, v0);
  EXPECT_TRUE(regional.Served() == TrainerVersion(0));
  // Nothing of it is kept to be resumed.
  EXPECT_TRUE(std::filesystem::is_empty(regional.models + "/.weightstore-cache/partial"));

  // The next good version unblocks it.
  ASSERT_OK(Put("m.safetensors", SafeTensorsFile(TrainerVersion(1))));
  const std::string v1 = OriginVersion();
  ASSERT_TRUE(WaitForVersion(regional, v1, "regional"));
  EXPECT_TRUE(regional.Served() == TrainerVersion(1));
  EXPECT_EQ(regional.Metric("weightstore_follow_blocked"), 0);
}

TEST_F(S3FollowingTest, ABudgetThatCannotHoldTheNextVersionBesideTheServedOneSaysSoAndEvictsNothing) {
  const std::string file = SafeTensorsFile(TrainerVersion(0));
  ASSERT_OK(Put("m.safetensors", file));
  const std::string v0 = OriginVersion();
  // Room for one version, not for the next beside it.
  Node regional = StartRegional("", {"--cache-max-bytes", std::to_string(file.size() * 3 / 2)});
  ASSERT_NE(regional.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(regional, v0, "regional"));

  // s3rver writes an object in place (a listing meanwhile sees part of it
  // under the old ETag, another version): the regional daemon is stopped
  // while it does, so that it lists only the whole new version.
  ASSERT_TRUE(regional.daemon->Stop());
  ASSERT_OK(Put("m.safetensors", SafeTensorsFile(TrainerVersion(1))));
  regional.daemon->Signal(SIGCONT);
  ASSERT_TRUE(testing::WaitUntil([&] { return absl::StrContains(regional.Log(), "the cache budget is"); }))
      << regional.Log();
  EXPECT_GE(regional.Metric("weightstore_follow_failures_total"), 1);
  EXPECT_EQ(regional.Version(), v0);
  EXPECT_TRUE(regional.Served() == TrainerVersion(0));
  EXPECT_EQ(regional.Metric("weightstore_follow_lag_versions"), 1);
  ASSERT_OK_AND_ASSIGN(client::CheckpointSummary info, regional.store->GetCheckpoint(kName));
  ASSERT_TRUE(info.follow.has_value());
  EXPECT_EQ(info.follow->lag_versions, 1u);
  EXPECT_EQ(info.follow->blocked, "");  // retried: room may come
}

TEST_F(S3FollowingTest, ARestartedNodeServesTheVersionOnItsDiskAndCatchesUpFromIt) {
  ASSERT_OK(Put("m.safetensors", SafeTensorsFile(TrainerVersion(0))));
  const std::string v0 = OriginVersion();
  const std::string models = testing::MakeScratchDir("s3-follow-restart");
  {
    Node regional = StartRegional(models);
    ASSERT_NE(regional.daemon->port(), 0);
    ASSERT_TRUE(WaitForVersion(regional, v0, "regional"));
    ASSERT_OK(Put("m.safetensors", SafeTensorsFile(TrainerVersion(1))));
    ASSERT_TRUE(WaitForVersion(regional, OriginVersion(), "regional"));
  }  // stopped
  const std::string v1 = OriginVersion();
  ASSERT_OK(Put("m.safetensors", SafeTensorsFile(TrainerVersion(2))));
  const std::string v2 = OriginVersion();
  Node again = StartRegional(models);
  ASSERT_NE(again.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(again, v2, "restarted regional"));
  EXPECT_TRUE(again.Served() == TrainerVersion(2));
  // It started from its disk (v1, under S3's id), not from a new pull.
  EXPECT_THAT(again.Log(), ::testing::HasSubstr(absl::StrCat("'m' is at version ", v2)));
  EXPECT_EQ(again.Metric("weightstore_follow_updates_total", "how=\"whole\""), 1);
  EXPECT_NE(v1, v2);
}

// A sharded checkpoint whose trainer uploads every shard again at each step
// (and the index, unchanged): the node fetches only the shards whose bytes
// moved, puts them in place as one step, and the tier below takes each step
// as element patches. One whose index changes is followed too, its new index
// put in place last.
TEST_F(S3FollowingTest, AShardedCheckpointIsFollowedFetchingOnlyTheShardsThatChanged) {
  auto shard_name = [](int i) { return absl::StrCat("m-0000", i, "-of-00003.safetensors"); };
  // layers.0 and layers.1 change at each version; norm.weight, in the last
  // shard, never does.
  auto upload = [&](int v, std::map<int, std::string>* sizes) -> absl::Status {
    std::string index = "{\"metadata\":{},\"weight_map\":{";
    int i = 0;
    for (const auto& [name, bytes] : TrainerVersion(v)) {
      const std::string file = SafeTensorsFile({{name, bytes}});
      WEIGHTSTORE_RETURN_IF_ERROR(Put(shard_name(i), file));
      if (sizes != nullptr) (*sizes)[i] = file;
      absl::StrAppend(&index, i > 0 ? "," : "", "\"", name, "\":\"", shard_name(i), "\"");
      ++i;
    }
    absl::StrAppend(&index, "}}");
    return Put("m.safetensors.index.json", index);
  };
  std::map<int, std::string> files;
  ASSERT_OK(upload(0, &files));
  const std::string first = OriginVersion();
  Node regional = StartRegional();
  ASSERT_NE(regional.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(regional, first, "regional"));
  const std::string node_models = testing::MakeScratchDir("s3-follow-sharded-node");
  Node node = Connect(testing::StartNode(*regional.daemon, node_models,
                                         {"--follow", "--pull", kName, "--metrics-listen", "127.0.0.1:0"}),
                      node_models);
  ASSERT_NE(node.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(node, first, "node"));
  auto inode = [&](const std::string& file) {
    struct stat st {};
    return ::stat((regional.models + "/" + file).c_str(), &st) == 0 ? st.st_ino : 0;
  };
  const ino_t frozen = inode(shard_name(2)), index = inode("m.safetensors.index.json");
  ASSERT_NE(frozen, 0u);

  uint64_t changed_bytes = 0;
  for (int v = 1; v <= 2; ++v) {
    // Stopped while the shards go up one by one, so that the regional
    // daemon never lists a mix of two versions (which it would take as a
    // step of its own, and count).
    ASSERT_TRUE(regional.daemon->Stop());
    ASSERT_OK(upload(v, &files));
    regional.daemon->Signal(SIGCONT);
    changed_bytes += files[0].size() + files[1].size();
    const std::string id = OriginVersion();
    ASSERT_TRUE(WaitForVersion(regional, id, absl::StrCat("regional at version ", v)));
    ASSERT_TRUE(WaitForVersion(node, id, absl::StrCat("node at version ", v)));
    EXPECT_TRUE(regional.Served() == TrainerVersion(v)) << "version " << v;
    EXPECT_TRUE(node.Served() == TrainerVersion(v)) << "version " << v;
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(testing::ReadFileOrEmpty(regional.models + "/" + shard_name(i)) == files[i]) << v << " " << i;
    }
  }
  // Only the two changed shards came, each step; the frozen shard and the
  // index are the files first pulled.
  EXPECT_EQ(regional.Metric("weightstore_follow_updates_total", "how=\"whole\""), 2) << regional.Log();
  EXPECT_EQ(regional.Metric("weightstore_follow_received_bytes_total", "kind=\"whole\""),
            static_cast<double>(changed_bytes));
  EXPECT_EQ(inode(shard_name(2)), frozen);
  EXPECT_EQ(inode("m.safetensors.index.json"), index);
  EXPECT_EQ(testing::UploadTemporariesIn(regional.models), 0u);
  EXPECT_EQ(node.Metric("weightstore_follow_updates_total", "how=\"patches\""), 2) << node.Log();
  EXPECT_EQ(node.Metric("weightstore_follow_updates_total", "how=\"whole\""), 0) << node.Log();

  // A version whose index changes (two tensors swap shards): the regional
  // daemon pulls the two shards and the index and puts them in place as one
  // step, the index last. The node below gets the same tensors in the same
  // order, which its push writes under the shards it has.
  Tensors want = TrainerVersion(2);
  const std::string swapped_index =
      absl::StrCat("{\"metadata\":{},\"weight_map\":{\"layers.0.weight\":\"", shard_name(0),
                   "\",\"layers.1.weight\":\"", shard_name(2), "\",\"norm.weight\":\"", shard_name(1), "\"}}");
  ASSERT_OK(Put(shard_name(1), SafeTensorsFile({{"norm.weight", want.at("norm.weight")}})));
  ASSERT_OK(Put(shard_name(2), SafeTensorsFile({{"layers.1.weight", want.at("layers.1.weight")}})));
  ASSERT_OK(Put("m.safetensors.index.json", swapped_index));
  const std::string swapped = OriginVersion();
  ASSERT_TRUE(WaitForVersion(regional, swapped, "regional, tensors swapped")) << regional.Log();
  ASSERT_TRUE(WaitForVersion(node, swapped, "node, tensors swapped")) << node.Log();
  EXPECT_EQ(testing::ReadFileOrEmpty(regional.models + "/m.safetensors.index.json"), swapped_index);
  EXPECT_TRUE(regional.Served() == want);
  EXPECT_TRUE(node.Served() == want);

  // A version that adds a tensor: the node's push cannot add one to a
  // shard, so it pulls that version as the regional daemon's files.
  want["lm_head.weight"] = std::string(4096, '\x3c');
  const std::string grown_index = absl::StrCat("{\"metadata\":{},\"weight_map\":{\"layers.0.weight\":\"", shard_name(0),
                                               "\",\"layers.1.weight\":\"", shard_name(2), "\",\"lm_head.weight\":\"",
                                               shard_name(2), "\",\"norm.weight\":\"", shard_name(1), "\"}}");
  ASSERT_OK(Put(shard_name(2), SafeTensorsFile({{"layers.1.weight", want.at("layers.1.weight")},
                                                {"lm_head.weight", want.at("lm_head.weight")}})));
  ASSERT_OK(Put("m.safetensors.index.json", grown_index));
  const std::string grown = OriginVersion();
  ASSERT_TRUE(WaitForVersion(regional, grown, "regional, a tensor added")) << regional.Log();
  ASSERT_TRUE(WaitForVersion(node, grown, "node, a tensor added")) << node.Log();
  for (const Node* n : {&regional, &node}) {
    EXPECT_TRUE(n->Served() == want);
    EXPECT_EQ(testing::ReadFileOrEmpty(n->models + "/m.safetensors.index.json"), grown_index);
    EXPECT_EQ(testing::UploadTemporariesIn(n->models), 0u);
  }
  EXPECT_EQ(regional.Metric("weightstore_follow_updates_total", "how=\"whole\""), 4) << regional.Log();
  EXPECT_EQ(node.Metric("weightstore_follow_fallbacks_total", "reason=\"index_changed\""), 1) << node.Log();
  EXPECT_EQ(node.Metric("weightstore_follow_updates_total", "how=\"whole\""), 1) << node.Log();
}

// A trainer's checkpoints as the `safetensors` library writes them (torch,
// BF16, metadata), followed from S3 by a regional daemon and from it by a
// node, whose own file the library then reads back equal to the trainer's.
TEST_F(S3FollowingTest, ATrainersSafetensorsFilesReachTheNodeBelowAsTheLibraryReadsThem) {
  const std::string dir = testing::MakeScratchDir("s3-follow-torch");
  const std::string script = dir + "/trainer.py";
  testing::WriteFileOrDie(script, R"(import sys
import torch
from safetensors.torch import load_file, save_file
from safetensors import safe_open

mode, dir = sys.argv[1], sys.argv[2]
if mode == "write":
    g = torch.Generator().manual_seed(7)
    state = {f"model.layers.{i}.mlp.weight": torch.randn(256, 512, generator=g).to(torch.bfloat16) for i in range(3)}
    state["model.norm.weight"] = torch.ones(512, dtype=torch.bfloat16)
    save_file(state, f"{dir}/v0.safetensors", metadata={"format": "pt", "step": "0"})
    for t in list(state)[:3]:  # an RL step: 1% of the elements move
        flat = state[t].view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 100]
        flat[idx] += torch.tensor(0.01, dtype=torch.bfloat16)
    save_file(state, f"{dir}/v1.safetensors", metadata={"format": "pt", "step": "1"})
else:  # compare: the node's file against the trainer's
    want, got = load_file(f"{dir}/v1.safetensors"), load_file(sys.argv[3])
    assert want.keys() == got.keys(), (sorted(want), sorted(got))
    for k in want:
        assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k
    with safe_open(sys.argv[3], "pt") as f:
        assert f.metadata() == {"format": "pt", "step": "1"}, f.metadata()
    print("equal")
)");
  std::string out;
  ASSERT_EQ(testing::RunCommand(absl::StrCat(testing::TorchPython(), " ", script, " write ", dir), &out), 0) << out;
  ASSERT_OK(Put("m.safetensors", testing::ReadFileOrEmpty(dir + "/v0.safetensors")));
  Node regional = StartRegional();
  ASSERT_NE(regional.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(regional, OriginVersion(), "regional"));
  const std::string node_models = testing::MakeScratchDir("s3-follow-torch-node");
  Node node = Connect(testing::StartNode(*regional.daemon, node_models,
                                         {"--follow", "--pull", kName, "--metrics-listen", "127.0.0.1:0"}),
                      node_models);
  ASSERT_NE(node.daemon->port(), 0);
  ASSERT_TRUE(WaitForVersion(node, OriginVersion(), "node"));

  ASSERT_OK(Put("m.safetensors", testing::ReadFileOrEmpty(dir + "/v1.safetensors")));
  const std::string v1 = OriginVersion();
  ASSERT_TRUE(WaitForVersion(node, v1, "node"));
  EXPECT_EQ(node.Metric("weightstore_follow_updates_total", "how=\"patches\""), 1) << node.Log();
  // The node wrote its file itself (a push of the patches): the library
  // reads it as the trainer's.
  ASSERT_EQ(testing::RunCommand(
                absl::StrCat(testing::TorchPython(), " ", script, " compare ", dir, " ", node.models, "/m.safetensors"),
                &out),
            0)
      << out;
  EXPECT_THAT(out, ::testing::HasSubstr("equal"));
}

TEST(S3FollowingFlagsTest, AFollowIntervalOutOfItsRangeIsRefusedAtStart) {
  const std::string models = testing::MakeScratchDir("s3-follow-flags");
  std::string out;
  const int status = testing::RunCommand(
      absl::StrCat("timeout 60 ", testing::DaemonPath(), " --models ", models,
                   " --listen 127.0.0.1:0 --origin s3://bucket --follow --follow-interval 0 --check-config"),
      &out);
  EXPECT_NE(status, 0) << out;
  EXPECT_THAT(out, ::testing::HasSubstr("--follow-interval")) << out;
  // NaN passes a range check (every comparison with it is false).
  for (const char* value : {"nan", "-nan", "inf"}) {
    EXPECT_NE(testing::RunCommand(absl::StrCat("timeout 60 ", testing::DaemonPath(), " --models ", models,
                                               " --listen 127.0.0.1:0 --origin s3://bucket --follow --follow-interval ",
                                               value, " --check-config"),
                                  &out),
              0)
        << value << ": " << out;
    EXPECT_THAT(out, ::testing::HasSubstr("--follow-interval")) << value << ": " << out;
  }
}

}  // namespace
}  // namespace weightstore

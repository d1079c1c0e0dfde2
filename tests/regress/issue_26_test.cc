// Issue 26: the findings of an attacker's review of the newest surfaces, each
// against a real daemon (in this process, or a child on 127.0.0.1 port 0).
// Every test here failed before its fix.
#include <gmock/gmock.h>
#include <grpcpp/create_channel.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/store.h"
#include "client/updates.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "server/server.h"
#include "tests/util/daemon.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore {
namespace {

namespace pb = ::weightstore::v1;
using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

// A SafeTensors checkpoint of one F32 tensor "w" holding `values`.
std::string OneTensor(const std::vector<float>& values) {
  std::string bytes(values.size() * 4, '\0');
  std::memcpy(bytes.data(), values.data(), bytes.size());
  SharedTensor t{{"w", DType::kF32, {values.size()}}, SharedBytes::Copy(bytes)};
  return *SerializeCheckpoint(kSafeTensorsFormat, {t}, {});
}

// Finding 4: the socket's segment cache was keyed by version id and the
// plans' keys, without the checkpoint: two checkpoints with one id (an origin
// that names versions by a release tag, or by content) got each other's bytes.
TEST(Issue26Test, TwoCheckpointsWithOneVersionIdGetTheirOwnBytesOverTheSocket) {
  const std::string models = testing::MakeScratchDir("models");
  const std::string socket = testing::MakeScratchDir("sock") + "/ws.sock";
  server::ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.registry.models_dir = models;
  options.socket.path = socket;
  options.shm_budget_bytes = 64 << 20;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<server::WeightStoreServer> daemon, server::WeightStoreServer::Start(options));
  // Every version is "release-1", as a node cache carries an origin's ids.
  daemon->registry().SetVersionIds(
      [](const std::string&, const std::string&) -> std::optional<std::string> { return "release-1"; });
  testing::WriteFileOrDie(models + "/a.safetensors", OneTensor({1, 2, 3, 4}));
  testing::WriteFileOrDie(models + "/b.safetensors", OneTensor({5, 6, 7, 8}));
  daemon->registry().Rescan();
  ASSERT_EQ(daemon->registry().Get("a")->version(), daemon->registry().Get("b")->version());

  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::SharedMemoryStore> store, client::ConnectSharedMemoryStore(socket));
  client::Query cast;  // a cast is materialized into a segment, not mapped from the file
  cast.selection.dtype = DType::kF64;
  for (const auto& [name, first] : std::vector<std::pair<std::string, double>>{{"a", 1}, {"b", 5}, {"a", 1}}) {
    ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> got, store->FetchAll(name, cast));
    ASSERT_EQ(got.size(), 1u);
    ASSERT_EQ(got[0].bytes.size(), 32u);
    double value;
    std::memcpy(&value, got[0].bytes.view().data(), 8);
    EXPECT_EQ(value, first) << name;
  }
}

// Finding 8: held tensors of another selection (here another shard rank, with
// the same names, dtypes and shapes) were kept as unchanged.
TEST(Issue26Test, UpdateTensorsRefetchesWhatAnotherShardRankSelects) {
  const std::string models = testing::MakeScratchDir("models");
  testing::WriteFileOrDie(models + "/m.safetensors", OneTensor({1, 2, 3, 4}));
  server::ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.registry.models_dir = models;
  options.registry.tensor_digests = true;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<server::WeightStoreServer> daemon, server::WeightStoreServer::Start(options));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Store> store,
                       client::ConnectRemoteStore(absl::StrCat("127.0.0.1:", daemon->port())));
  auto rank = [](uint32_t r) {
    client::Query q;
    q.selection.shard = {.rank = r, .world_size = 2, .rules = {{"w", ShardSplit{.dim = 0}}}};
    return q;
  };
  client::HeldTensors held;
  ASSERT_OK(client::UpdateTensors(*store, "m", rank(0), &held).status());
  ASSERT_OK_AND_ASSIGN(client::UpdateResult same, client::UpdateTensors(*store, "m", rank(0), &held));
  EXPECT_TRUE(same.delta) << same.full_reason;
  EXPECT_EQ(same.fetched_bytes, 0u);
  ASSERT_OK_AND_ASSIGN(client::UpdateResult other, client::UpdateTensors(*store, "m", rank(1), &held));
  EXPECT_FALSE(other.delta);
  EXPECT_THAT(other.full_reason, ::testing::HasSubstr("selected otherwise"));
  ASSERT_EQ(held.tensors.size(), 1u);
  float second_half[2];
  std::memcpy(second_half, held.tensors[0].bytes.view().data(), 8);
  EXPECT_EQ(second_half[0], 3);
  EXPECT_EQ(second_half[1], 4);
}

// Finding 3: on a node with an origin, fetches of a checkpoint still being
// pulled held every FetchTensors slot for the whole pull, and every other
// fetch was refused. They now wait in a share of their own.
TEST(Issue26Test, FetchesWaitingOnAPullLeaveTheServingSlotsToOthers) {
  const std::string origin_models = testing::MakeScratchDir("origin-models");
  testing::WriteFileOrDie(origin_models + "/far.safetensors", OneTensor({1, 2}));
  testing::WriteFileOrDie(origin_models + "/warm.safetensors", OneTensor({0}));
  testing::Daemon origin(origin_models, {});
  ASSERT_NE(origin.port(), 0) << origin.log();
  const std::string node_models = testing::MakeScratchDir("node-models");
  testing::WriteFileOrDie(node_models + "/here.safetensors", OneTensor({3, 4}));
  testing::Daemon node(node_models, {"--origin", absl::StrCat("grpc://", origin.address()), "--max-concurrent-fetches",
                                     "4", "--max-fetches-per-peer", "4", "--max-fetches-waiting-on-pulls", "6",
                                     "--max-fetches-waiting-on-pulls-per-peer", "6"});
  ASSERT_NE(node.port(), 0) << node.log();
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Store> warm, client::ConnectRemoteStore(node.address()));
    ASSERT_OK(warm->FetchAll("warm", {}).status());  // the node's channel to its origin is up
  }
  ASSERT_TRUE(origin.Stop());  // answers nothing more: every pull from now on stalls

  auto stub = pb::WeightStore::NewStub(grpc::CreateChannel(node.address(), grpc::InsecureChannelCredentials()));
  struct Waiting {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<pb::TensorChunk>> reader;
  };
  std::vector<std::unique_ptr<Waiting>> waiting;
  for (int i = 0; i < 6; ++i) {  // more than the serving slots
    auto w = std::make_unique<Waiting>();
    pb::FetchTensorsRequest request;
    request.set_name("far");
    w->reader = stub->FetchTensors(&w->ctx, request);
    waiting.push_back(std::move(w));
  }
  // Each waits once the node has admitted it: the node counts them as pulls'
  // waiters. Then a seventh is one too many for the waiting share.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Store> store, client::ConnectRemoteStore(node.address()));
  grpc::Status extra;
  for (int attempt = 0; attempt < 500; ++attempt) {  // until all six are admitted
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    pb::FetchTensorsRequest request;
    request.set_name("far");
    auto reader = stub->FetchTensors(&ctx, request);
    pb::TensorChunk chunk;
    while (reader->Read(&chunk)) {
    }
    extra = reader->Finish();
    if (extra.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) break;
  }
  EXPECT_EQ(extra.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(extra.error_message(), HasSubstr("waiting on a pull"));
  // A checkpoint the node has is served all the same.
  ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> here, store->FetchAll("here", {}));
  ASSERT_EQ(here.size(), 1u);
  float first;
  std::memcpy(&first, here[0].bytes.view().data(), 4);
  EXPECT_EQ(first, 3);
  for (auto& w : waiting) w->ctx.TryCancel();
  for (auto& w : waiting) {
    pb::TensorChunk chunk;
    while (w->reader->Read(&chunk)) {
    }
    EXPECT_EQ(w->reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  origin.Signal(SIGCONT);
}

// Finding 2: a selection whose patterns cannot run as a DFA costs its whole
// 2 s budget on one of gRPC's threads; eight clients sending it took every
// thread. Such selections are now counted per client address and in all.
TEST(Issue26Test, CostlySelectionsFromOneAddressAreCountedAndOthersAreServed) {
  const std::string models = testing::MakeScratchDir("models");
  std::vector<SharedTensor> tensors;
  std::mt19937 rng(1);
  for (int i = 0; i < 50000; ++i) {  // 50,000 names of 150 random a's and b's
    std::string name = absl::StrCat("l.", i, ".");
    for (int k = 0; k < 150; ++k) name.push_back("ab"[rng() % 2]);
    tensors.push_back({{name, DType::kU8, {1}}, SharedBytes::Copy(std::string(1, '\0'))});
  }
  testing::WriteFileOrDie(models + "/many.safetensors", *SerializeCheckpoint(kSafeTensorsFormat, tensors, {}));
  testing::WriteFileOrDie(models + "/small.safetensors", OneTensor({1}));
  testing::Daemon daemon(models, {"--max-selections-per-peer", "1", "--max-concurrent-selections", "2"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = pb::WeightStore::NewStub(grpc::CreateChannel(daemon.address(), grpc::InsecureChannelCredentials()));
  // Four at once, each a couple of seconds of pattern matching: all but one
  // are refused at the door, naming the limit.
  bool gated = false;
  for (int attempt = 0; attempt < 5 && !gated; ++attempt) {
    std::vector<grpc::Status> statuses(4);
    std::vector<std::thread> clients;
    for (int c = 0; c < 4; ++c) {
      clients.emplace_back([&, c] {
        grpc::ClientContext ctx;
        pb::ListTensorsRequest request;
        request.set_name("many");
        request.mutable_selection()->add_include("a.{20}zz");
        pb::ListTensorsResponse response;
        statuses[c] = stub->ListTensors(&ctx, request, &response);
      });
    }
    // Meanwhile another client's calls are served.
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Store> store, client::ConnectRemoteStore(daemon.address()));
    ASSERT_OK(store->ListCheckpoints().status());
    ASSERT_OK(store->FetchAll("small", {}).status());
    for (auto& t : clients) t.join();
    for (const grpc::Status& s : statuses) {
      if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
          absl::StrContains(s.error_message(), "--max-selections-per-peer")) {
        gated = true;
      }
    }
  }
  EXPECT_TRUE(gated) << daemon.log();
}

// Finding 2, the rest: selections ran on gRPC's threads, so eight of them at
// once took the threads every other call needs. They now run on their own
// workers (here one), and the others are answered while all eight wait.
TEST(Issue26Test, CostlySelectionsRunOnTheirOwnWorkersWhileOtherCallsAreServed) {
  const std::string models = testing::MakeScratchDir("models");
  std::vector<SharedTensor> tensors;
  std::mt19937 rng(2);
  for (int i = 0; i < 50000; ++i) {
    std::string name = absl::StrCat("l.", i, ".");
    for (int k = 0; k < 150; ++k) name.push_back("ab"[rng() % 2]);
    tensors.push_back({{name, DType::kU8, {1}}, SharedBytes::Copy(std::string(1, '\0'))});
  }
  testing::WriteFileOrDie(models + "/many.safetensors", *SerializeCheckpoint(kSafeTensorsFormat, tensors, {}));
  testing::WriteFileOrDie(models + "/small.safetensors", OneTensor(std::vector<float>(1 << 20, 1.0f)));
  constexpr int kSelections = 8;
  const std::string n = std::to_string(kSelections);
  // Each selection may run for a minute: only cancelling ends them early.
  testing::Daemon daemon(models, {"--selection-threads", "1", "--max-concurrent-selections", n,
                                  "--max-selections-per-peer", n, "--max-selection-seconds", "60",
                                  "--max-selection-scan-bytes", "1TiB", "--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = pb::WeightStore::NewStub(grpc::CreateChannel(daemon.address(), grpc::InsecureChannelCredentials()));
  std::vector<grpc::ClientContext> contexts(kSelections);
  std::vector<grpc::Status> statuses(kSelections);
  std::vector<pb::ListTensorsResponse> responses(kSelections);
  std::atomic<int> finished{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < kSelections; ++c) {
    clients.emplace_back([&, c] {
      pb::ListTensorsRequest request;
      request.set_name("many");
      for (int r = 0; r < 200; ++r) {  // each costs a name's length squared
        pb::RenameRule* rule = request.mutable_selection()->add_renames();
        rule->set_pattern("a(?:[^z]*z)?");
        rule->set_replacement("a");
      }
      statuses[c] = stub->ListTensors(&contexts[c], request, &responses[c]);
      ++finished;
    });
  }
  // Once the daemon holds all eight (the gauge says so)...
  const std::string all_in = absl::StrCat("weightstore_selections_active ", kSelections);
  while (!absl::StrContains(testing::HttpGet(daemon.metrics_port(), "/metrics"), all_in) && finished == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto first_ended = [&] {
    for (size_t c = 0; c < statuses.size(); ++c) {
      if (!statuses[c].ok()) return absl::StrCat(c, ": ", statuses[c].error_message());
    }
    return std::string();
  };
  ASSERT_EQ(finished, 0) << "a selection ended early: " << first_ended();
  // ...another client's calls are answered, while all eight are still in.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Store> store, client::ConnectRemoteStore(daemon.address()));
  ASSERT_OK(store->ListCheckpoints().status());
  ASSERT_OK_AND_ASSIGN(auto small, store->FetchAll("small", {}));
  EXPECT_EQ(small.size(), 1u);
  EXPECT_EQ(finished, 0) << "the other calls were answered only after a selection ended: " << first_ended();
  for (grpc::ClientContext& ctx : contexts) ctx.TryCancel();
  for (auto& t : clients) t.join();
  for (const grpc::Status& s : statuses) EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
}

// The value of a gauge on the daemon's /metrics page (-1 when absent).
double Gauge(const testing::Daemon& daemon, absl::string_view family) {
  for (absl::string_view line : absl::StrSplit(testing::HttpGet(daemon.metrics_port(), "/metrics"), '\n')) {
    double value = 0;
    if (absl::ConsumePrefix(&line, family) && absl::ConsumePrefix(&line, " ") && absl::SimpleAtod(line, &value)) {
      return value;
    }
  }
  return -1;
}

// Finding 1, the rest: what the hub kept for watchers (each step's event and
// diff) stayed after they left. It is now let go, and the heap trimmed, once
// the last watch ends.
TEST(Issue26Test, WhatWatchesKeepIsGivenBackOnceTheLastWatchEnds) {
  const std::string models = testing::MakeScratchDir("models");
  auto checkpoint = [](int seed) {
    std::vector<SharedTensor> tensors;
    for (int i = 0; i < 2000; ++i) {
      tensors.push_back({{absl::StrCat("model.layers.", i, ".weight"), DType::kF32, {1}},
                         SharedBytes::Copy(std::string(4, static_cast<char>(i % 2 == 0 ? 1 : seed)))});
    }
    return *SerializeCheckpoint(kSafeTensorsFormat, tensors, {});
  };
  testing::WriteFileOrDie(models + "/m.safetensors", checkpoint(1));
  testing::Daemon daemon(models, {"--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = pb::WeightStore::NewStub(grpc::CreateChannel(daemon.address(), grpc::InsecureChannelCredentials()));
  constexpr int kWatchers = 4;
  std::vector<grpc::ClientContext> contexts(kWatchers);
  std::vector<std::unique_ptr<grpc::ClientReader<pb::CheckpointEvent>>> watches;
  pb::WatchCheckpointsRequest request;
  request.set_name("m");
  for (grpc::ClientContext& ctx : contexts) {
    watches.push_back(stub->WatchCheckpoints(&ctx, request));
    pb::CheckpointEvent event;
    do {
      ASSERT_TRUE(watches.back()->Read(&event));
    } while (event.kind() != pb::CheckpointEvent::SYNCED);
  }
  // A replacement: half the tensors change, and every watcher reads its event.
  testing::WriteFileOrDie(models + "/m.safetensors.tmp", checkpoint(7));
  std::filesystem::rename(models + "/m.safetensors.tmp", models + "/m.safetensors");
  grpc::ClientContext rescan_ctx;
  pb::RescanResponse rescanned;
  ASSERT_TRUE(stub->Rescan(&rescan_ctx, pb::RescanRequest(), &rescanned).ok());
  for (auto& watch : watches) {
    pb::CheckpointEvent event;
    ASSERT_TRUE(watch->Read(&event));
    EXPECT_EQ(event.kind(), pb::CheckpointEvent::REPLACED);
    EXPECT_TRUE(event.delta());
    EXPECT_EQ(event.changed_tensors().size(), 1000);
  }
  EXPECT_GT(Gauge(daemon, "weightstore_watch_cached_bytes"), 1000 * 20);
  EXPECT_EQ(Gauge(daemon, "weightstore_watches_active"), kWatchers);
  for (grpc::ClientContext& ctx : contexts) ctx.TryCancel();
  for (auto& watch : watches) (void)watch->Finish();
  // Waits for the daemon to see them go (a hang is caught by CTest's timeout).
  while (Gauge(daemon, "weightstore_watches_active") != 0 || Gauge(daemon, "weightstore_watch_cached_bytes") != 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace
}  // namespace weightstore

// The origin tier with real daemons on loopback: an origin weightstored and
// nodes pulling from it (weightstored --origin grpc://...).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <iostream>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client/store.h"
#include "core/crc32c.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "tests/util/daemon.h"
#include "tests/util/metrics.h"
#include "tests/util/serving.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "tests/util/wait.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore {
namespace {

namespace pb = ::weightstore::v1;
using testing::Daemon;
using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

std::vector<SharedTensor> Tensors(int count, size_t floats, int seed) {
  std::vector<SharedTensor> tensors;
  for (int i = 0; i < count; ++i) {
    std::vector<std::byte> bytes(floats * 4);
    for (size_t k = 0; k < bytes.size(); ++k) bytes[k] = std::byte((k * 13 + i * 5 + seed) & 0xff);
    tensors.push_back(
        {{absl::StrCat("blocks.", i, ".w"), DType::kF32, {floats}}, SharedBytes::FromVector(std::move(bytes))});
  }
  return tensors;
}

// Writes `tensors` as a sharded SafeTensors checkpoint: two shards and the
// index, in `folder` as <stem>.safetensors.index.json.
void WriteSharded(const std::string& folder, const std::string& stem, const std::vector<SharedTensor>& tensors) {
  std::string map;
  const size_t half = tensors.size() / 2;
  for (int s = 0; s < 2; ++s) {
    std::vector<SharedTensor> part(tensors.begin() + (s == 0 ? 0 : half),
                                   s == 0 ? tensors.begin() + half : tensors.end());
    const std::string file = absl::StrCat(stem, "-0000", s + 1, "-of-00002.safetensors");
    testing::WriteFileOrDie(folder + "/" + file, *SerializeCheckpoint(kSafeTensorsFormat, part, {}));
    for (const SharedTensor& t : part)
      absl::StrAppend(&map, map.empty() ? "" : ",", "\"", t.spec.name, "\":\"", file, "\"");
  }
  testing::WriteFileOrDie(folder + "/" + stem + ".safetensors.index.json",
                          absl::StrCat("{\"metadata\":{},\"weight_map\":{", map, "}}"));
}

// Every tensor of `name` from `address`, by name.
std::map<std::string, std::string> FetchAll(const std::string& address, const std::string& name, absl::Status* status) {
  std::map<std::string, std::string> out;
  auto store = client::ConnectRemoteStore(address);
  if (!store.ok()) {
    *status = store.status();
    return out;
  }
  auto fetched = (*store)->FetchAll(name, client::Query());
  if (!fetched.ok()) {
    *status = fetched.status();
    return out;
  }
  for (const auto& t : *fetched) {
    out[t.spec.name] = std::string(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
  }
  *status = absl::OkStatus();
  return out;
}

class OriginTest : public ::testing::Test {
 protected:
  void SetUp() override {
    origin_models_ = testing::MakeScratchDir("origin-models");
    std::filesystem::create_directories(origin_models_ + "/llm");
    single_ = Tensors(16, 64 << 10, 1);  // 4 MiB
    testing::WriteFileOrDie(origin_models_ + "/llm/small.safetensors",
                            *SerializeCheckpoint(kSafeTensorsFormat, single_, {}));
    sharded_ = Tensors(12, 48 << 10, 2);
    WriteSharded(origin_models_ + "/llm", "sharded", sharded_);
    StartOrigin();
  }
  void StartOrigin(const std::string& listen = "127.0.0.1:0") {
    origin_ = std::make_unique<Daemon>(origin_models_, std::vector<std::string>{}, listen);
    ASSERT_NE(origin_->port(), 0) << origin_->log();
  }
  std::unique_ptr<Daemon> StartNode(std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--metrics-listen", "127.0.0.1:0"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto node = testing::StartNode(*origin_, testing::MakeScratchDir("node-models"), args);
    EXPECT_NE(node->port(), 0) << node->log();
    return node;
  }
  static double PulledBytes(Daemon& node, const std::string& origin) {
    return testing::MetricValue(node.metrics_port(), "weightstore_origin_pulled_bytes_total",
                                {absl::StrCat("origin=\"grpc://", origin, "\"")});
  }
  static std::map<std::string, std::string> Expected(const std::vector<SharedTensor>& tensors) {
    std::map<std::string, std::string> out;
    for (const SharedTensor& t : tensors) {
      out[t.spec.name] = std::string(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
    }
    return out;
  }
  static uint64_t FolderBytes(const std::string& folder) {
    uint64_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator(folder)) {
      if (e.is_regular_file()) n += e.file_size();
    }
    return n;
  }

  std::string origin_models_;
  std::vector<SharedTensor> single_, sharded_;
  std::unique_ptr<Daemon> origin_;
};

TEST_F(OriginTest, EightClientsOnEachOfTwoNodesGetByteExactTensorsAndEachNodeReadsEachByteOnce) {
  auto node_a = StartNode();
  auto node_b = StartNode();
  for (const auto& [name, tensors] : std::vector<std::pair<std::string, std::vector<SharedTensor>*>>{
           {"llm/small", &single_}, {"llm/sharded", &sharded_}}) {
    const auto expected = Expected(*tensors);
    std::vector<std::thread> clients;
    std::atomic<int> exact{0};
    std::vector<std::string> errors(16);
    for (int i = 0; i < 16; ++i) {
      Daemon* node = i % 2 == 0 ? node_a.get() : node_b.get();
      clients.emplace_back([&, node, i, name = name] {
        absl::Status status;
        auto got = FetchAll(node->address(), name, &status);
        if (!status.ok()) errors[i] = std::string(status.message());
        if (got == expected) ++exact;
      });
    }
    for (auto& t : clients) t.join();
    EXPECT_EQ(exact.load(), 16) << name << ": " << absl::StrJoin(errors, " | ");
  }
  // Each node read the origin's files once: exactly their bytes.
  const double stored = static_cast<double>(FolderBytes(origin_models_ + "/llm"));
  EXPECT_EQ(PulledBytes(*node_a, origin_->address()), stored);
  EXPECT_EQ(PulledBytes(*node_b, origin_->address()), stored);
  EXPECT_EQ(testing::MetricValue(node_a->metrics_port(), "weightstore_origin_pulls_total", {"outcome=\"ok\""}), 2);
  EXPECT_GE(testing::MetricValue(node_a->metrics_port(), "weightstore_node_cache_lookups_total", {"result=\"miss\""}),
            2);
}

TEST_F(OriginTest, AnAdminPullPrefetchesAndTheFlagPullsAtStart) {
  auto node = StartNode({"--pull", "llm/sharded"});
  auto stub = testing::NewStub(node->address());
  grpc::ClientContext ctx;
  pb::PullCheckpointRequest request;
  request.set_name("llm/small");
  pb::PullCheckpointResponse response;
  ASSERT_TRUE(stub->PullCheckpoint(&ctx, request, &response).ok());
  EXPECT_FALSE(response.already_present());
  EXPECT_EQ(response.checkpoint().tensor_count(), 16u);
  EXPECT_GT(response.bytes_pulled(), 4u << 20);
  // --pull ran in the background: wait for it to be served.
  testing::WaitUntil([&] { return testing::MetricValue(node->metrics_port(), "weightstore_checkpoints_loaded") == 2; });
  grpc::ClientContext list_ctx;
  pb::ListCheckpointsResponse listed;
  ASSERT_TRUE(stub->ListCheckpoints(&list_ctx, pb::ListCheckpointsRequest(), &listed).ok());
  EXPECT_EQ(listed.checkpoints_size(), 2) << node->log();
  // Each is served under the origin's version id: a client pinned to the
  // version it saw on the origin fetches it from the node.
  auto origin_stub = testing::NewStub(origin_->address());
  for (const pb::CheckpointInfo& on_node : listed.checkpoints()) {
    grpc::ClientContext get_ctx;
    pb::GetCheckpointRequest get;
    get.set_name(on_node.name());
    pb::CheckpointInfo on_origin;
    ASSERT_TRUE(origin_stub->GetCheckpoint(&get_ctx, get, &on_origin).ok());
    EXPECT_EQ(on_node.version(), on_origin.version()) << on_node.name();
  }
  auto store = client::ConnectRemoteStore(node->address());
  ASSERT_TRUE(store.ok());
  client::Query pinned;
  pinned.version = listed.checkpoints(0).version();
  EXPECT_TRUE((*store)->FetchAll(listed.checkpoints(0).name(), pinned).ok());
  // A name the origin lacks is NOT_FOUND, naming the origin.
  absl::Status status;
  FetchAll(node->address(), "llm/absent", &status);
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kNotFound, HasSubstr("grpc://")));
}

TEST_F(OriginTest, AKilledOriginFailsClientsClearlyAndTheNodeResumesOnceItIsBack) {
  // Big enough that the pull is caught in flight.
  const auto big = Tensors(64, 1 << 20, 3);  // 256 MiB
  testing::WriteFileOrDie(origin_models_ + "/llm/big.safetensors", *SerializeCheckpoint(kSafeTensorsFormat, big, {}));
  const std::string origin_address = origin_->address();
  origin_.reset();
  StartOrigin(origin_address);
  auto node = StartNode({"--origin-parallel-reads", "1"});
  absl::Status first;
  std::thread client([&] { FetchAll(node->address(), "llm/big", &first); });
  double seen = 0;
  for (int i = 0; i < 20000 && seen <= 0; ++i) {
    seen = PulledBytes(*node, origin_address);
    if (seen <= 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  origin_->Signal(SIGKILL);
  origin_->WaitExit(30000);  // gone before another takes its port
  client.join();
  const double at_kill = PulledBytes(*node, origin_address);
  const double stored = static_cast<double>(std::filesystem::file_size(origin_models_ + "/llm/big.safetensors"));
  ASSERT_GT(at_kill, 0);
  if (at_kill < stored) {  // caught mid-pull (else the pull beat the kill)
    EXPECT_THAT(first, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("pulling 'llm/big' from grpc://")));
  }
  // Back on the same port, with the same files: the pull resumes.
  StartOrigin(origin_address);
  absl::Status second;
  auto got = FetchAll(node->address(), "llm/big", &second);
  ASSERT_TRUE(second.ok()) << second;
  EXPECT_TRUE(got == Expected(big));
  EXPECT_EQ(PulledBytes(*node, origin_address), stored);  // nothing read twice
}

TEST_F(OriginTest, PullsWaitingOnAStalledOriginNeverStopTheNodeServingOthersOrShuttingDown) {
  // A grace far past the bounds below: a stop that waited for it (pulls left
  // stalled, calls held on them) cannot pass for a prompt one.
  auto node = StartNode({"--max-pulls", "64", "--grace-seconds", "600"});
  ASSERT_TRUE(origin_->Stop());  // accepts connections, answers nothing, until the end of the test
  constexpr int kClients = 48;
  std::vector<std::thread> clients;
  absl::Mutex mu;
  std::vector<absl::Status> ended;      // each client's outcome, once its FetchAll returned
  for (int i = 0; i < kClients; ++i) {  // more than gRPC has threads for its handlers
    clients.emplace_back([&, i] {
      absl::Status status;
      FetchAll(node->address(), i % 4 == 0 ? absl::StrCat("llm/other", i) : "llm/small", &status);
      absl::MutexLock lock(&mu);
      ended.push_back(status);
    });
  }
  // Every client's call is in: 8 wait on the stalled pulls (the default
  // --max-fetches-waiting-on-pulls-per-peer), and the node refuses the others
  // at once. A client whose own connection to the node failed (one did, once,
  // on a loaded machine: gRPC's first attempt fails fast) ends with no call
  // in, and says so: UNAVAILABLE without "pulling".
  auto started = [&] {
    return testing::MetricValue(node->metrics_port(), "grpc_server_started_total",
                                {"grpc_service=\"weightstore.v1.WeightStore\""});
  };
  auto never_in = [&] {
    absl::MutexLock lock(&mu);
    return std::count_if(ended.begin(), ended.end(), [](const absl::Status& s) {
      return absl::IsUnavailable(s) && !absl::StrContains(s.message(), "pulling '");
    });
  };
  testing::WaitUntil([&] { return started() + static_cast<double>(never_in()) >= kClients; });
  EXPECT_GE(started() + static_cast<double>(never_in()), kClients) << node->log();
  std::cout << "calls in: " << started() << ", clients whose connection failed: " << never_in()
            << ", pulls in flight: " << testing::MetricValue(node->metrics_port(), "weightstore_origin_pulls_in_flight")
            << "\n";
  // Others are served meanwhile (the deadline only keeps a node that does not
  // answer from hanging the test).
  auto stub = testing::NewStub(node->address());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  pb::ListCheckpointsResponse listed;
  const auto asked = std::chrono::steady_clock::now();
  EXPECT_TRUE(stub->ListCheckpoints(&ctx, pb::ListCheckpointsRequest(), &listed).ok());
  std::cout << "a listing beside the stalled calls took "
            << std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - asked).count()
            << " ms\n";
  // The node stops promptly though its pulls are stalled: they are cancelled
  // (the clients retry meanwhile). The origin stays stopped until the node has
  // exited, so no pull can have ended on its own.
  const auto stopping = std::chrono::steady_clock::now();
  node->Signal(SIGTERM);
  // The bound is half the grace: under ASan on 2 busy cores a prompt stop
  // has taken 60-120 s here, a stop that waits for the grace takes 600.
  while (!absl::StrContains(node->log(), "weightstored: stopped") &&
         std::chrono::steady_clock::now() - stopping < std::chrono::seconds(300)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const auto stopped = std::chrono::steady_clock::now() - stopping;
  std::cout << "the node stopped " << std::chrono::duration_cast<std::chrono::milliseconds>(stopped).count()
            << " ms after SIGTERM (grace: 600 s)\n";
  // Far within the grace: only a stop that waited for it breaks this bound.
  EXPECT_LT(stopped, std::chrono::seconds(300)) << node->log();
  EXPECT_NE(node->WaitExit(300000), -1) << node->log();
  for (auto& t : clients) t.join();
  EXPECT_EQ(ended.size(), static_cast<size_t>(kClients));
  for (const absl::Status& status : ended) EXPECT_FALSE(status.ok());  // nothing could be pulled
  origin_->Signal(SIGCONT);
}

TEST_F(OriginTest, CallsWhoseClientsGiveUpWaitingOnAStalledPullEndAtOnce) {
  // One connection to the origin, opened (by a pull) before the origin
  // stops: a pull's call on it then waits for its own deadline, where one
  // on a connection never set up would fail once connecting timed out
  // (20 s), ending the pull the metric below counts.
  auto node = StartNode({"--origin-parallel-reads", "1"});
  {
    auto stub = testing::NewStub(node->address());
    grpc::ClientContext ctx;
    pb::GetCheckpointRequest request;
    request.set_name("llm/sharded");
    pb::CheckpointInfo info;
    ASSERT_TRUE(stub->GetCheckpoint(&ctx, request, &info).ok()) << node->log();
  }
  ASSERT_TRUE(origin_->Stop());
  auto stub = testing::NewStub(node->address());
  for (int i = 0; i < 20; ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    pb::GetCheckpointRequest request;
    request.set_name("llm/small");
    pb::CheckpointInfo info;
    EXPECT_EQ(stub->GetCheckpoint(&ctx, request, &info).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  for (int i = 0; i < 5; ++i) {  // and fetches, which wait on the pull before they stream
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    pb::FetchTensorsRequest request;
    request.set_name("llm/small");
    auto reader = stub->FetchTensors(&ctx, request);
    pb::TensorChunk chunk;
    while (reader->Read(&chunk)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  // The node let each call go when its client did, though the pull is stalled:
  // none waits for it any more.
  auto ended = [&](absl::string_view method) {
    return testing::MetricValue(node->metrics_port(), "grpc_server_handled_total",
                                {absl::StrCat("grpc_method=\"", method, "\"")});
  };
  testing::WaitUntil([&] { return ended("GetCheckpoint") >= 21 && ended("FetchTensors") >= 5; });
  EXPECT_EQ(ended("GetCheckpoint"), 21) << testing::HttpGet(node->metrics_port(), "/metrics");
  EXPECT_EQ(ended("FetchTensors"), 5);
  EXPECT_EQ(testing::MetricValue(node->metrics_port(), "weightstore_origin_pulls_in_flight"), 1);
  origin_->Signal(SIGCONT);
}

TEST_F(OriginTest, TheBudgetEvictsButNeverACheckpointMappedThroughTheSocket) {
  const std::string socket = testing::MakeScratchDir("origin-socket") + "/ws.sock";
  // Room for the small checkpoint (4 MiB) or the sharded one (2.3 MiB), not both.
  // Files themselves are passed (a client of another uid gets them so; this
  // one, of the daemon's uid, would otherwise get a sealed copy).
  auto node = StartNode({"--cache-max-bytes", "5000000", "--socket", socket, "--socket-file-segments", "always"});
  auto mapper = client::ConnectSharedMemoryStore(socket);
  ASSERT_TRUE(mapper.ok()) << mapper.status();
  auto mapped = (*mapper)->MapTensors("llm/small", client::Query());
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  absl::Status status;
  FetchAll(node->address(), "llm/sharded", &status);
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("in use: llm/small")));
  // Unmapped, it can go.
  mapped = absl::CancelledError("dropped");
  FetchAll(node->address(), "llm/sharded", &status);
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(testing::MetricValue(node->metrics_port(), "weightstore_node_cache_evictions_total"), 1);
  EXPECT_EQ(testing::MetricValue(node->metrics_port(), "weightstore_node_cache_budget_bytes"), 5000000);
}

TEST_F(OriginTest, TheUpstreamListsStoredFilesWithTheirCrcAndReadsRangesPinnedToAVersion) {
  auto stub = testing::NewStub(origin_->address());
  // Sixteen first listings at once, on checksum workers (one CRC pass per file:
  // ChecksumCacheTest): the same answer for all.
  std::vector<pb::ListCheckpointFilesResponse> listed(16);
  std::vector<grpc::Status> statuses(16);
  std::vector<std::thread> callers;
  for (int i = 0; i < 16; ++i) {
    callers.emplace_back([&, i] {
      grpc::ClientContext ctx;
      pb::ListCheckpointFilesRequest request;
      request.set_name("llm/sharded");
      statuses[i] = stub->ListCheckpointFiles(&ctx, request, &listed[i]);
    });
  }
  for (auto& t : callers) t.join();
  for (int i = 0; i < 16; ++i) {
    ASSERT_TRUE(statuses[i].ok()) << statuses[i].error_message();
    EXPECT_EQ(listed[i].SerializeAsString(), listed[0].SerializeAsString());
  }
  const pb::ListCheckpointFilesResponse& files = listed[0];
  ASSERT_EQ(files.files_size(), 3);
  EXPECT_TRUE(files.files(2).main());
  EXPECT_EQ(files.files(2).path(), ".safetensors.index.json");
  for (const pb::StoredFile& f : files.files()) {
    const std::string on_disk =
        testing::ReadFileOrEmpty(origin_models_ + "/llm/" + (f.main() ? "sharded" + f.path() : f.path()));
    EXPECT_EQ(f.size(), on_disk.size()) << f.path();
    EXPECT_EQ(f.crc32c(), absl::StrFormat("%08x", Crc32c(on_disk))) << f.path();
  }

  // A range of a shard, in chunks that each carry their CRC32C.
  const std::string shard = files.files(0).path();
  const std::string shard_bytes = testing::ReadFileOrEmpty(origin_models_ + "/llm/" + shard);
  auto read = [&](const std::string& version, const std::string& path, uint64_t offset, uint64_t length,
                  std::string* out) {
    grpc::ClientContext ctx;
    pb::ReadCheckpointFileRequest request;
    request.set_name("llm/sharded");
    request.set_version(version);
    request.set_path(path);
    request.set_offset(offset);
    request.set_length(length);
    auto reader = stub->ReadCheckpointFile(&ctx, request);
    pb::CheckpointFileChunk chunk;
    while (reader->Read(&chunk)) {
      EXPECT_EQ(chunk.offset(), offset + out->size());
      EXPECT_LE(chunk.data().size(), 1u << 20);
      EXPECT_EQ(chunk.crc32c(), Crc32c(chunk.data()));
      out->append(chunk.data());
    }
    return reader->Finish();
  };
  std::string got;
  const grpc::Status ranged = read(files.version(), shard, 12345, (1 << 20) + 7, &got);
  ASSERT_TRUE(ranged.ok()) << ranged.error_message();
  EXPECT_EQ(got, shard_bytes.substr(12345, (1 << 20) + 7));  // two chunks

  // What an attacker or a stale node asks for is refused, naming what is wrong.
  got.clear();
  EXPECT_EQ(read("", shard, 0, 0, &got).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(read(files.version(), "../../etc/passwd", 0, 0, &got).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(read(files.version(), shard, shard_bytes.size() + 1, 0, &got).error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(read("0123456789abcdef", shard, 0, 0, &got).error_code(), grpc::StatusCode::ABORTED);
  EXPECT_TRUE(got.empty()) << got.size();
  grpc::ClientContext ctx;
  pb::ListCheckpointFilesRequest request;
  request.set_name("llm/absent");
  pb::ListCheckpointFilesResponse none;
  EXPECT_EQ(stub->ListCheckpointFiles(&ctx, request, &none).error_code(), grpc::StatusCode::NOT_FOUND);
}

}  // namespace
}  // namespace weightstore

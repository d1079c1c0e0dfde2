// A real weightstored on 127.0.0.1 port 0, serving the shared fixtures (through
// symlinks, never copies), with real clients: the C++ Store, raw stubs, the CLI
// and a reflection-only Python client.
#include <gmock/gmock.h>
#include <grpcpp/create_channel.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/store.h"
#include "core/checkpoint.h"
#include "core/crc32c.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/util/daemon.h"
#include "tests/util/metrics.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "tests/util/wait.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore {
namespace {

namespace fs = std::filesystem;
namespace pb = ::weightstore::v1;
using testing::Daemon;
using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

// Writes a SafeTensors file of `count` F32 tensors of `floats` elements.
void WriteBig(const std::string& path, int count, size_t floats, float seed) {
  std::vector<SharedTensor> tensors;
  for (int i = 0; i < count; ++i) {
    std::vector<std::byte> data(floats * 4);
    for (size_t k = 0; k < floats; ++k) {
      float v = seed + static_cast<float>(i * 1000 + k % 1000);
      std::memcpy(data.data() + 4 * k, &v, 4);
    }
    tensors.push_back({{absl::StrCat("layer.", i), DType::kF32, {floats}}, SharedBytes::FromVector(std::move(data))});
  }
  testing::WriteFileOrDie(path, *SerializeCheckpoint(kSafeTensorsFormat, tensors, {{"seed", std::to_string(seed)}}));
}

std::unique_ptr<client::Store> Connect(const Daemon& d) { return *client::ConnectRemoteStore(d.address()); }

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    models_ = new std::string(testing::MakeFixtureModelsDir());
    daemon_ = new Daemon(*models_);
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(daemon_->port(), 0) << daemon_->log(); }

  static std::string* models_;
  static Daemon* daemon_;
};
std::string* ServerTest::models_ = nullptr;
Daemon* ServerTest::daemon_ = nullptr;

TEST_F(ServerTest, ListsEveryFixtureAndReportsTheBrokenOneWithoutStopping) {
  auto store = Connect(*daemon_);
  ASSERT_OK_AND_ASSIGN(auto list, store->ListCheckpoints());
  std::set<std::string> names;
  for (const auto& c : list) names.insert(c.name);
  EXPECT_TRUE(names.contains("burnpack/mnist"));
  EXPECT_TRUE(names.contains("safetensors/multi_layer"));
  EXPECT_TRUE(names.contains("pytorch-models/linear"));
  EXPECT_TRUE(names.contains("pytorch-reader/legacy_with_offsets"));
  EXPECT_FALSE(names.contains("pytorch-reader/broken"));
  EXPECT_THAT(daemon_->log(), HasSubstr("broken.pt"));
  EXPECT_EQ(list.size(), 1u + 1u + 13u + 29u);
}

TEST_F(ServerTest, GetCheckpointDescribesOneAndUnknownNamesAreNotFound) {
  auto store = Connect(*daemon_);
  ASSERT_OK_AND_ASSIGN(auto c, store->GetCheckpoint("burnpack/mnist"));
  EXPECT_EQ(c.format, "burnpack");
  EXPECT_EQ(c.tensor_count, 18u);
  EXPECT_EQ(c.total_bytes, 1043240u);
  EXPECT_EQ(c.version.size(), 32u);  // named by content (docs/updates.md)
  EXPECT_THAT(store->GetCheckpoint("nope"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("'nope'")));
  EXPECT_THAT(store->ListTensors("nope", {}), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(ServerTest, FetchAllOverParallelStreamsMatchesOneStream) {
  client::RemoteOptions parallel;
  parallel.parallel_streams = 3;
  auto one = Connect(*daemon_);
  ASSERT_OK_AND_ASSIGN(auto three, client::ConnectRemoteStore(daemon_->address(), parallel));
  for (const char* name : {"burnpack/mnist", "safetensors/multi_layer", "pytorch-models/linear"}) {
    SCOPED_TRACE(name);
    client::Query query;
    query.selection.dtype = DType::kF16;
    ASSERT_OK_AND_ASSIGN(auto want, one->FetchAll(name, query));
    ASSERT_OK_AND_ASSIGN(auto got, three->FetchAll(name, query));
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].spec, want[i].spec);
      EXPECT_TRUE(got[i].bytes.view() == want[i].bytes.view()) << want[i].spec.name;
    }
  }
}

TEST_F(ServerTest, FetchStopsAtEndIndexAndRefusesAnInvertedRange) {
  auto stub = pb::WeightStore::NewStub(grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials()));
  pb::FetchTensorsRequest req;
  req.set_name("burnpack/mnist");
  req.set_start_index(2);
  req.set_end_index(5);
  grpc::ClientContext ctx;
  auto reader = stub->FetchTensors(&ctx, req);
  pb::TensorChunk chunk;
  std::set<uint64_t> indices;
  while (reader->Read(&chunk)) indices.insert(chunk.tensor_index());
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(indices, (std::set<uint64_t>{2, 3, 4}));
  req.set_start_index(6);
  grpc::ClientContext ctx2;
  auto inverted = stub->FetchTensors(&ctx2, req);
  while (inverted->Read(&chunk)) {
  }
  grpc::Status status = inverted->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_THAT(status.error_message(), HasSubstr("end_index 5"));
}

TEST_F(ServerTest, FetchesEveryFixtureByteForByteWithAndWithoutTheCopyThread) {
  for (bool pipeline : {false, true}) {
    SCOPED_TRACE(pipeline ? "pipelined" : "one thread");
    client::RemoteOptions options;
    options.pipeline = pipeline;
    options.parallel_streams = 1;
    ASSERT_OK_AND_ASSIGN(auto store, client::ConnectRemoteStore(daemon_->address(), options));
    ASSERT_OK_AND_ASSIGN(auto list, store->ListCheckpoints());
    for (const auto& c : list) {
      SCOPED_TRACE(c.name);
      ASSERT_OK_AND_ASSIGN(auto local, Checkpoint::Open(*models_ + "/" + c.path));
      ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> fetched, store->FetchAll(c.name, {}));
      ASSERT_EQ(fetched.size(), local->size());
      for (size_t i = 0; i < fetched.size(); ++i) {
        ASSERT_OK_AND_ASSIGN(SharedTensor want, local->Read(local->entries()[i]));
        EXPECT_EQ(fetched[i].spec, want.spec);
        EXPECT_TRUE(fetched[i].bytes.view() == want.bytes.view()) << want.spec.name;
      }
    }
  }
}

TEST_F(ServerTest, ASinkErrorCancelsTheStreamAndIsReturnedAsIs) {
  for (bool pipeline : {false, true}) {
    SCOPED_TRACE(pipeline ? "pipelined" : "one thread");
    client::RemoteOptions options;
    options.pipeline = pipeline;
    options.chunk_bytes = 4096;  // many chunks queued behind the failing one
    ASSERT_OK_AND_ASSIGN(auto store, client::ConnectRemoteStore(daemon_->address(), options));
    struct FailingSink : client::CollectingSink {
      int ended = 0;
      absl::Status End(const TensorSpec& spec) override {
        if (++ended == 3) return absl::FailedPreconditionError(absl::StrCat("no room for '", spec.name, "'"));
        return CollectingSink::End(spec);
      }
    } sink;
    EXPECT_THAT(store->FetchTensors("burnpack/mnist", {}, &sink),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no room for")));
    EXPECT_EQ(sink.ended, 3);  // nothing reached the sink after its error
    EXPECT_EQ(sink.tensors().size(), 2u);
    EXPECT_OK(store->FetchAll("burnpack/mnist", {}));  // the store is still usable
  }
}

TEST_F(ServerTest, SelectionRunsOnTheServer) {
  auto store = Connect(*daemon_);
  client::Query query;
  query.selection.renames = {{R"(conv\.(.*))", "$1"}};
  query.selection.include = {R"(^conv1\.)"};
  query.selection.dtype = DType::kF16;
  query.with_checksums = true;
  ASSERT_OK_AND_ASSIGN(auto listing, store->ListTensors("pytorch-models/key_remap", query));
  ASSERT_EQ(listing.tensors.size(), 2u);  // file order: weight, then bias
  EXPECT_EQ(listing.tensors[1].spec.name, "conv1.bias");
  EXPECT_EQ(listing.tensors[1].source_name, "conv.conv1.bias");
  EXPECT_EQ(listing.tensors[1].spec.dtype, DType::kF16);
  ASSERT_OK_AND_ASSIGN(auto fetched, store->FetchAll("pytorch-models/key_remap", query));
  ASSERT_EQ(fetched.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(Crc32c(fetched[i].bytes.view()), listing.tensors[i].crc32c.value());
  EXPECT_EQ(fetched[0].spec.shape, (std::vector<uint64_t>{2, 2, 2, 2}));
}

TEST_F(ServerTest, TargetsAreAppliedOnTheServerWithTheLoadResult) {
  auto store = Connect(*daemon_);
  client::Query query;
  ASSERT_OK_AND_ASSIGN(query.target, TargetSchema::Load(testing::TestDataDir() + "/schemas/batch_norm.json"));
  query.selection.adapter = Adapter::kPyTorchToBurn;
  ASSERT_OK_AND_ASSIGN(auto listing, store->ListTensors("pytorch-models/batch_norm2d", query));
  ASSERT_TRUE(listing.apply_result.has_value());
  EXPECT_THAT(listing.apply_result->unused, ::testing::ElementsAre("norm1.num_batches_tracked"));
  ASSERT_OK_AND_ASSIGN(SharedTensor gamma, store->FetchTensor("pytorch-models/batch_norm2d", "norm1.gamma", query));
  EXPECT_EQ(gamma.spec.shape, std::vector<uint64_t>{5});
  query.selection.adapter = Adapter::kNone;
  EXPECT_THAT(store->ListTensors("pytorch-models/batch_norm2d", query),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("missing")));
}

TEST_F(ServerTest, BadRequestsGetClearCodesAndOthersKeepBeingServed) {
  auto store = Connect(*daemon_);
  client::Query bad;
  bad.selection.include = {"fc.("};
  EXPECT_THAT(store->ListTensors("pytorch-models/linear", bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'fc.('")));
  EXPECT_THAT(store->FetchAll("pytorch-models/linear", bad), StatusIs(absl::StatusCode::kInvalidArgument));
  client::Query huge;
  huge.selection.paths = {std::string(5 << 20, 'x')};  // over the 4 MiB request limit
  EXPECT_THAT(store->ListTensors("pytorch-models/linear", huge), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_OK(store->FetchAll("pytorch-models/linear", {}));
}

TEST_F(ServerTest, AClientThatStopsReadingDoesNotStopOthers) {
  auto channel = grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials());
  auto stub = pb::WeightStore::NewStub(channel);
  grpc::ClientContext stalled;
  pb::FetchTensorsRequest req;
  req.set_name("burnpack/mnist");
  req.set_chunk_bytes(4096);
  auto reader = stub->FetchTensors(&stalled, req);  // never read
  auto store = Connect(*daemon_);
  for (int i = 0; i < 5; ++i) EXPECT_OK(store->FetchAll("safetensors/multi_layer", {}));
  stalled.TryCancel();
  pb::TensorChunk chunk;
  while (reader->Read(&chunk)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

TEST_F(ServerTest, StreamsResumeFromAGivenTensorAndPinTheirVersion) {
  auto stub = pb::WeightStore::NewStub(grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  pb::FetchTensorsRequest req;
  req.set_name("burnpack/mnist");
  req.set_start_index(16);
  auto reader = stub->FetchTensors(&ctx, req);
  pb::TensorChunk chunk;
  std::vector<uint64_t> indices;
  while (reader->Read(&chunk)) {
    if (chunk.has_info()) indices.push_back(chunk.tensor_index());
  }
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_THAT(indices, ::testing::ElementsAre(16, 17));
  grpc::ClientContext ctx2;
  req.set_version("0000000000000000");
  auto stale = stub->FetchTensors(&ctx2, req);
  while (stale->Read(&chunk)) {
  }
  EXPECT_EQ(stale->Finish().error_code(), grpc::StatusCode::ABORTED);
}

TEST_F(ServerTest, OperatorsUseReflectionWithoutProtoFiles) {
  const std::string tool =
      absl::StrCat(testing::ShellQuote(testing::TorchPython()), " ",
                   testing::ShellQuote(testing::ToolsDir() + "/grpc_reflect.py"), " ", daemon_->address());
  std::string out;
  ASSERT_EQ(testing::RunCommand(tool + " list", &out, false), 0) << out;
  EXPECT_THAT(out, HasSubstr("weightstore.v1.WeightStore"));
  EXPECT_THAT(out, HasSubstr("grpc.health.v1.Health"));
  EXPECT_THAT(out, HasSubstr("grpc.reflection.v1alpha.ServerReflection"));
  ASSERT_EQ(testing::RunCommand(tool + " describe weightstore.v1.WeightStore", &out, false), 0) << out;
  EXPECT_THAT(out, HasSubstr("FetchTensors"));
  ASSERT_EQ(testing::RunCommand(tool + " describe grpc.health.v1.Health", &out, false), 0) << out;
  EXPECT_THAT(out, HasSubstr("Check"));
  ASSERT_EQ(testing::RunCommand(tool + " call grpc.health.v1.Health/Check '{\"service\": \"\"}'", &out, false), 0)
      << out;
  EXPECT_THAT(out, HasSubstr("SERVING"));
  ASSERT_EQ(
      testing::RunCommand(tool + " call weightstore.v1.WeightStore/ListTensors "
                                 "'{\"name\": \"pytorch-models/linear\", \"selection\": {\"include\": [\"^fc1\"]}}'",
                          &out, false),
      0)
      << out;
  nlohmann::json doc = nlohmann::json::parse(out);
  ASSERT_EQ(doc["tensors"].size(), 2u);
  EXPECT_EQ(doc["tensors"][1]["name"], "fc1.bias");
  ASSERT_EQ(
      testing::RunCommand(tool + " call weightstore.v1.WeightStore/GetCheckpoint '{\"name\": \"nope\"}'", &out, false),
      3);
  EXPECT_THAT(out, HasSubstr("NOT_FOUND"));
}

TEST_F(ServerTest, TheCliTalksToTheServer) {
  const std::string cli = testing::ShellQuote(testing::CliPath());
  std::string out;
  ASSERT_EQ(testing::RunCommand(absl::StrCat(cli, " ls --server ", daemon_->address()), &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("burnpack/mnist"));
  ASSERT_EQ(testing::RunCommand(absl::StrCat(cli, " inspect --server ", daemon_->address(),
                                             " pytorch-models/key_remap --rename 'conv\\.=' --json"),
                                &out, false),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("\"conv1.weight\""));
  const std::string dir = testing::MakeScratchDir("fetch");
  ASSERT_EQ(testing::RunCommand(absl::StrCat(cli, " fetch --server ", daemon_->address(), " burnpack/mnist ", dir,
                                             "/mnist.safetensors"),
                                &out),
            0)
      << out;
  ASSERT_EQ(testing::RunCommand(absl::StrCat(cli, " diff --exit-code ", dir, "/mnist.safetensors ",
                                             testing::ShellQuote(testing::FixturesDir() + "/burn/burnpack/mnist.bpk")),
                                &out),
            0)
      << out;
  EXPECT_NE(
      testing::RunCommand(absl::StrCat(cli, " fetch --server ", daemon_->address(), " nope ", dir, "/x.bpk"), &out), 0);
  EXPECT_FALSE(fs::exists(dir + "/x.bpk"));
}

// Daemons of their own: lifecycle, rescans, uploads.

TEST(ServerLifecycleTest, ASecondDaemonOnTheSamePortFailsLoudly) {
  const std::string models = testing::MakeScratchDir("models");
  Daemon first(models);
  ASSERT_NE(first.port(), 0) << first.log();
  std::string out;
  int rc = testing::RunCommand(
      absl::StrCat(testing::ShellQuote(testing::DaemonPath()), " --models ", models, " --listen ", first.address()),
      &out);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_THAT(out, HasSubstr("cannot listen"));
}

TEST(ServerLifecycleTest, SigtermReportsNotServingRefusesNewCallsAfterTheDrainAndLetsStreamsInFlightFinish) {
  const std::string models = testing::MakeScratchDir("models");
  WriteBig(models + "/big.safetensors", 24, 1 << 20, 1.0f);  // 96 MiB
  Daemon daemon(models, {"--drain-seconds", "1.5", "--grace-seconds", "60"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto channel = grpc::CreateChannel(daemon.address(), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  // Deadlines here and below only keep a hung daemon from hanging the test.
  auto check = [&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    grpc::health::v1::HealthCheckRequest req;
    grpc::health::v1::HealthCheckResponse resp;
    grpc::Status s = health->Check(&ctx, req, &resp);
    return s.ok() ? static_cast<int>(resp.status()) : -1;
  };
  EXPECT_EQ(check(), grpc::health::v1::HealthCheckResponse::SERVING);

  // A consumer that holds the stream after its first tensor until the test has
  // seen the drain end (so the stream outlives the drain, however slow the
  // machine), then reads slowly: 150 ms per tensor.
  struct HeldSink : client::CollectingSink {
    std::atomic<int>* ended;
    absl::Notification* release;
    absl::Status End(const TensorSpec& spec) override {
      std::this_thread::sleep_for(std::chrono::milliseconds(150));
      if (++*ended == 1) release->WaitForNotification();
      return CollectingSink::End(spec);
    }
  };
  std::atomic<int> ended{0};
  absl::Notification release;
  absl::Status fetch_status;
  std::thread fetch([&] {
    auto store = *client::ConnectRemoteStore(daemon.address());
    HeldSink sink;
    sink.ended = &ended;
    sink.release = &release;
    fetch_status = store->FetchTensors("big", {}, &sink);
  });
  while (ended.load() < 1) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  daemon.Signal(SIGTERM);
  const auto signalled = std::chrono::steady_clock::now();
  // NOT_SERVING from the signal on, through the drain (polled: a loaded machine
  // may take a moment to deliver the signal).
  int health_after_signal = grpc::health::v1::HealthCheckResponse::SERVING;
  while (health_after_signal == grpc::health::v1::HealthCheckResponse::SERVING &&
         std::chrono::steady_clock::now() - signalled < std::chrono::seconds(30)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    health_after_signal = check();
  }
  EXPECT_EQ(health_after_signal, grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  // Calls are still served during the drain (a balancer may not have noticed
  // yet), and refused after it, while the stream keeps its grace. The drain
  // began after `signalled`, so it lasts at least until signalled + 1.5 s.
  auto stub = pb::WeightStore::NewStub(channel);
  auto list = [&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    pb::ListCheckpointsResponse resp;
    return stub->ListCheckpoints(&ctx, pb::ListCheckpointsRequest(), &resp);
  };
  if (std::chrono::steady_clock::now() - signalled < std::chrono::milliseconds(500)) {
    EXPECT_TRUE(list().ok()) << "a call during the drain";
  }
  std::this_thread::sleep_until(signalled + std::chrono::milliseconds(1500));
  grpc::Status refused = list();
  while (refused.ok() && std::chrono::steady_clock::now() - signalled < std::chrono::seconds(30)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    refused = list();
  }
  std::cout
      << "calls were refused "
      << std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - signalled).count()
      << " ms after the signal (drain: 1.5 s)\n";
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(refused.error_message(), HasSubstr("shutting down"));
  EXPECT_EQ(ended.load(), 1) << "the stream is held in its grace";
  release.Notify();
  fetch.join();
  // The daemon keeps the connection until the client has every byte: exiting
  // earlier could reset it and drop the tail of the finished stream.
  EXPECT_OK(fetch_status) << "\n" << daemon.log();
  EXPECT_EQ(ended.load(), 24);
  EXPECT_EQ(daemon.WaitExit(120000), 0) << daemon.log();
}

class BrokenStreamTest : public ::testing::TestWithParam<bool> {};

// Fetches "big" (12 MiB in 1 MiB tensors) while its daemon is killed with -9
// and comes back on the same port: every tensor arrives once, byte for byte.
// With `inside_a_tensor`, in chunks of 16 KiB through a stream window of
// 256 KiB, the kill comes as the fourth tensor begins, which the break then
// cuts (no more of it can be on its way), so it is begun again; else after
// the third tensor ends, in the server's chunks of 1 MiB.
// With `lane`, the daemons have a data lane, which carries the tensors.
void ExpectAFetchResumesAfterAKill(bool pipeline, bool inside_a_tensor, bool lane = false) {
  SCOPED_TRACE(inside_a_tensor ? "the break inside a tensor" : "the break between tensors");
  const std::vector<std::string> flags =
      lane ? std::vector<std::string>{"--data-listen", "127.0.0.1:0", "--data-lane-handshake-timeout", "60"}
           : std::vector<std::string>{};
  const std::string models = testing::MakeScratchDir("models");
  WriteBig(models + "/big.safetensors", 12, 1 << 18, 5.0f);  // 12 MiB in 1 MiB tensors
  std::string address;
  {
    Daemon first(models);
    ASSERT_NE(first.port(), 0) << first.log();
    address = first.address();
    first.Signal(SIGKILL);
    first.WaitExit(30000);
  }
  // The same port again, so the client can reconnect to "the daemon".
  auto daemon = std::make_unique<Daemon>(models, flags, address);
  ASSERT_EQ(daemon->address(), address) << daemon->log();
  struct KillingSink : client::CollectingSink {
    std::function<void()> kill;
    bool inside_a_tensor = false;
    int begun = 0, ended = 0, restarted = 0;
    std::string open;  // the tensor begun and not ended
    absl::StatusOr<std::span<std::byte>> Begin(const TensorSpec& spec) override {
      ++begun;
      restarted += open == spec.name;
      open = spec.name;
      if (inside_a_tensor && begun == 4 && kill) kill();
      return CollectingSink::Begin(spec);
    }
    absl::Status End(const TensorSpec& spec) override {
      open.clear();
      if (!inside_a_tensor && ++ended == 3 && kill) kill();
      return CollectingSink::End(spec);
    }
    size_t OpenAhead() const override { return 1; }
  };
  KillingSink sink;
  sink.inside_a_tensor = inside_a_tensor;
  bool killed = false;
  sink.kill = [&] {  // kill -9 mid-stream, then come back on the same port
    killed = true;
    daemon->Signal(SIGKILL);
    daemon->WaitExit(30000);
    daemon = std::make_unique<Daemon>(models, flags, address);
  };
  client::RemoteOptions options;
  options.resume_backoff = std::chrono::milliseconds(200);
  options.pipeline = pipeline;
  if (inside_a_tensor) {
    options.chunk_bytes = 16 << 10;
    options.stream_window_bytes = 256 << 10;
  }
  auto store = *client::ConnectRemoteStore(address, options);
  ASSERT_OK(store->FetchTensors("big", {}, &sink));
  ASSERT_OK_AND_ASSIGN(auto local, Checkpoint::Open(models + "/big.safetensors"));
  ASSERT_EQ(sink.tensors().size(), local->size());
  for (size_t i = 0; i < local->size(); ++i) {  // each exactly once, in file order, byte for byte
    ASSERT_OK_AND_ASSIGN(SharedTensor want, local->Read(local->entries()[i]));
    EXPECT_EQ(sink.tensors()[i].spec.name, want.spec.name);
    EXPECT_TRUE(sink.tensors()[i].bytes.view() == want.bytes.view()) << want.spec.name;
  }
  EXPECT_TRUE(killed) << "the stream had to survive a kill -9 of its daemon";
  EXPECT_GE(sink.begun, 12);
  // (Over a lane the tensor cut may still have arrived whole: the kernel
  // holds more of the lane than a stream's window.)
  if (inside_a_tensor && !lane) {
    EXPECT_EQ(sink.restarted, 1);
  }
}

TEST_P(BrokenStreamTest, ResumesFromTheLastCompleteTensor) { ExpectAFetchResumesAfterAKill(GetParam(), false); }

TEST_P(BrokenStreamTest, ATensorCutByTheBreakIsBegunAgainAndArrivesWhole) {
  ExpectAFetchResumesAfterAKill(GetParam(), true);
}

TEST_P(BrokenStreamTest, AFetchOverTheDataLaneResumesAfterAKillAndEveryTensorArrivesWhole) {
  ExpectAFetchResumesAfterAKill(GetParam(), true, true);
}

TEST_P(BrokenStreamTest, AStreamThatCannotResumeSaysWhyItFirstBroke) {
  const std::string models = testing::MakeScratchDir("models");
  WriteBig(models + "/big.safetensors", 64, 1 << 18, 6.0f);  // 64 MiB: more than any window holds
  auto daemon = std::make_unique<Daemon>(models);
  ASSERT_NE(daemon->port(), 0) << daemon->log();
  struct KillingSink : client::CollectingSink {
    std::function<void()> after_third;
    int ended = 0;
    absl::Status End(const TensorSpec& spec) override {
      if (++ended == 3) after_third();
      return CollectingSink::End(spec);
    }
  } sink;
  sink.after_third = [&] {  // kill -9 mid-stream, and nobody comes back
    daemon->Signal(SIGKILL);
    daemon->WaitExit(5000);
  };
  client::RemoteOptions options;
  options.max_resumes = 1;
  options.resume_backoff = std::chrono::milliseconds(10);
  options.resume_window = std::chrono::milliseconds(500);
  options.pipeline = GetParam();
  auto store = *client::ConnectRemoteStore(daemon->address(), options);
  absl::Status status = store->FetchTensors("big", {}, &sink);
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("the stream broke (")));
  EXPECT_THAT(status.message(), HasSubstr("resuming at tensor "));
}

// A sink that runs `after_first` once the first tensor is complete.
struct AfterFirstTensorSink : client::CollectingSink {
  std::function<void()> after_first;
  int ended = 0;
  absl::Status End(const TensorSpec& spec) override {
    if (++ended == 1) after_first();
    return CollectingSink::End(spec);
  }
};

// Sets `flag` after `delay` on a thread of its own, and records when.
class DelayedCancel {
 public:
  DelayedCancel(std::shared_ptr<std::atomic<bool>> flag, std::chrono::milliseconds delay)
      : thread_([this, flag, delay] {
          std::this_thread::sleep_for(delay);
          set_at_ = std::chrono::steady_clock::now();
          flag->store(true);
        }) {}
  ~DelayedCancel() { Join(); }
  void Join() {
    if (thread_.joinable()) thread_.join();
  }
  // Milliseconds from the cancel to now (after Join()).
  int64_t MillisSinceCancel() const {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - set_at_).count();
  }

 private:
  std::chrono::steady_clock::time_point set_at_;
  std::thread thread_;
};

TEST_P(BrokenStreamTest, ACancelEndsAReadBlockedOnAStalledDaemonInMilliseconds) {
  const std::string models = testing::MakeScratchDir("models");
  WriteBig(models + "/big.safetensors", 64, 1 << 18, 7.0f);  // 64 MiB: more than any window holds
  Daemon daemon(models);
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto cancel = std::make_shared<std::atomic<bool>>(false);
  std::unique_ptr<DelayedCancel> canceller;
  AfterFirstTensorSink sink;
  sink.after_first = [&] {  // the daemon stops sending (SIGSTOP) but keeps the connection
    ASSERT_TRUE(daemon.Stop());
    canceller = std::make_unique<DelayedCancel>(cancel, std::chrono::milliseconds(300));
  };
  client::RemoteOptions options;
  options.pipeline = GetParam();
  auto store = *client::ConnectRemoteStore(daemon.address(), options);
  client::Query query;
  query.cancel = cancel;
  absl::Status status = store->FetchTensors("big", query, &sink);
  ASSERT_NE(canceller, nullptr);
  canceller->Join();
  const int64_t after = canceller->MillisSinceCancel();
  daemon.Signal(SIGCONT);
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kCancelled, HasSubstr("'big' was cancelled at tensor ")));
  std::cout << "a cancelled fetch returned " << after << " ms after the cancel\n";
  // Without the watch, the read would wait for the call's deadline (10
  // minutes): only that, or a machine stalled for as long, breaks this bound.
  EXPECT_LT(after, 30000) << "a cancelled fetch returned " << after << " ms after the cancel";
  EXPECT_LT(sink.ended, 64);
  ASSERT_OK(store->FetchAll("big", {}).status());  // the daemon and the store both still work
}

TEST_P(BrokenStreamTest, ACancelEndsTheWaitBeforeAResumeInMilliseconds) {
  const std::string models = testing::MakeScratchDir("models");
  WriteBig(models + "/big.safetensors", 64, 1 << 18, 8.0f);
  auto daemon = std::make_unique<Daemon>(models);
  ASSERT_NE(daemon->port(), 0) << daemon->log();
  auto cancel = std::make_shared<std::atomic<bool>>(false);
  std::unique_ptr<DelayedCancel> canceller;
  std::chrono::steady_clock::time_point killed_at;
  AfterFirstTensorSink sink;
  sink.after_first = [&] {  // kill -9: the stream breaks and the client waits to resume
    daemon->Signal(SIGKILL);
    daemon->WaitExit(5000);
    canceller = std::make_unique<DelayedCancel>(cancel, std::chrono::milliseconds(300));
    // The client reads on (and finds the stream broken) only once this
    // returns: its backoff starts after this, however long reaping took.
    killed_at = std::chrono::steady_clock::now();
  };
  client::RemoteOptions options;
  options.resume_backoff = std::chrono::seconds(10);  // the first resume's wait: 5 s, the cap
  options.pipeline = GetParam();
  auto store = *client::ConnectRemoteStore(daemon->address(), options);
  client::Query query;
  query.cancel = cancel;
  absl::Status status = store->FetchTensors("big", query, &sink);
  const auto returned_at = std::chrono::steady_clock::now();
  ASSERT_NE(canceller, nullptr);
  canceller->Join();
  const int64_t after = canceller->MillisSinceCancel();
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kCancelled, HasSubstr("was cancelled at tensor ")));
  std::cout << "a cancelled fetch returned " << after << " ms after the cancel\n";
  // The stream broke after the kill, so a fetch that slept through its backoff
  // returns 5 s after the kill at the earliest; one the cancel ended, sooner,
  // however slow the machine.
  EXPECT_LT(returned_at - killed_at, std::chrono::seconds(5))
      << "a cancelled fetch returned " << after << " ms after the cancel (the backoff is 5 s)";
}

TEST(ServerLifecycleTest, ATransposedTensorWhoseRowsDoNotDivideTheChunkArrivesExact) {
  // A Linear weight [300, 70] served transposed to Burn's [70, 300]: a served
  // row is 1200 bytes, so 4096-byte chunks carry 3 rows each (24 chunks).
  const std::string models = testing::MakeScratchDir("models");
  WriteBig(models + "/lin.safetensors", 1, 300 * 70, 2.0f);
  std::vector<SharedTensor> tensors;
  {
    ASSERT_OK_AND_ASSIGN(auto flat, Checkpoint::Open(models + "/lin.safetensors"));
    ASSERT_OK_AND_ASSIGN(SharedTensor t, flat->Read("layer.0"));
    tensors.push_back({{"fc.weight", DType::kF32, {300, 70}}, t.bytes});
  }
  testing::WriteFileOrDie(models + "/lin.safetensors", *SerializeCheckpoint(kSafeTensorsFormat, tensors, {}));
  Daemon daemon(models);
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  client::Query query;
  query.selection.adapter = Adapter::kPyTorchToBurn;
  TargetParameter param;
  param.path = "fc.weight";
  param.shape = {70, 300};
  param.module = "Linear";
  query.target = TargetSchema{{param}};
  client::RemoteOptions options;
  options.chunk_bytes = 4096;
  ASSERT_OK_AND_ASSIGN(auto remote, client::ConnectRemoteStore(daemon.address(), options));
  ASSERT_OK_AND_ASSIGN(auto local, client::OpenLocalStore(models));
  ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> got, remote->FetchAll("lin", query));
  ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> want, local->FetchAll("lin", query));
  ASSERT_EQ(got.size(), 1u);
  ASSERT_EQ(want.size(), 1u);
  EXPECT_EQ(got[0].spec.shape, (std::vector<uint64_t>{70, 300}));
  EXPECT_TRUE(got[0].bytes.view() == want[0].bytes.view());
  // Element (c, r) of the served tensor is element (r, c) of the stored one.
  const auto* stored = reinterpret_cast<const float*>(tensors[0].bytes.data());
  const auto* served = reinterpret_cast<const float*>(got[0].bytes.data());
  for (uint64_t c = 0; c < 70; c += 13) {
    for (uint64_t r = 0; r < 300; r += 37) EXPECT_EQ(served[c * 300 + r], stored[r * 70 + c]) << c << " " << r;
  }
}

TEST(CancelTest, ACancelEndsAListingWaitingOnAStalledDaemonInMilliseconds) {
  const std::string models = testing::MakeScratchDir("models");
  WriteBig(models + "/big.safetensors", 4, 1 << 10, 3.0f);
  Daemon daemon(models);
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto store = Connect(daemon);
  ASSERT_OK(store->ListTensors("big", {}).status());  // connected
  ASSERT_TRUE(daemon.Stop());
  auto cancel = std::make_shared<std::atomic<bool>>(false);
  absl::StatusOr<client::TensorListing> listing;
  {
    DelayedCancel canceller(cancel, std::chrono::milliseconds(300));
    client::Query query;
    query.cancel = cancel;
    query.with_checksums = true;
    listing = store->ListTensors("big", query);
    canceller.Join();
    const int64_t after = canceller.MillisSinceCancel();
    std::cout << "a cancelled listing returned " << after << " ms after the cancel\n";
    // Without the watch, the call would wait for its deadline (10 minutes):
    // only that, or a machine stalled for as long, breaks this bound.
    EXPECT_LT(after, 30000);
  }
  daemon.Signal(SIGCONT);
  EXPECT_THAT(listing.status(), StatusIs(absl::StatusCode::kCancelled));
  ASSERT_OK(store->ListTensors("big", {}).status());
}

// A sink that sets `cancel` when the first tensor begins, and counts ends.
struct CancelOnBeginSink : client::CollectingSink {
  std::shared_ptr<std::atomic<bool>> cancel;
  int ended = 0;
  absl::StatusOr<std::span<std::byte>> Begin(const TensorSpec& spec) override {
    absl::StatusOr<std::span<std::byte>> out = CollectingSink::Begin(spec);
    cancel->store(true);
    return out;
  }
  absl::Status End(const TensorSpec& spec) override {
    ++ended;
    return CollectingSink::End(spec);
  }
};

// The pieces themselves: ServedTensorPlanTest.ACancelStopsBetweenPieces...
TEST(CancelTest, ALocalFetchAsksItsCancelInsideATensorNotOnlyBetweenTensors) {
  const std::string models = testing::MakeScratchDir("models");
  WriteBig(models + "/big.safetensors", 1, 1u << 20, 4.0f);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Store> store, client::OpenLocalStore(models));
  CancelOnBeginSink sink;
  sink.cancel = std::make_shared<std::atomic<bool>>(false);
  client::Query query;
  query.cancel = sink.cancel;
  EXPECT_THAT(
      store->FetchTensors("big", query, &sink),
      StatusIs(absl::StatusCode::kCancelled, HasSubstr("fetch of 'big': cancelled in tensor 'layer.0' at byte 0")));
  EXPECT_EQ(sink.ended, 0);
  // Without a cancel the same tensor arrives whole.
  ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> all, store->FetchAll("big", {}));
  ASSERT_EQ(all.size(), 1u);
  ASSERT_OK_AND_ASSIGN(auto file, Checkpoint::Open(models + "/big.safetensors"));
  ASSERT_OK_AND_ASSIGN(SharedTensor want, file->Read("layer.0"));
  EXPECT_TRUE(all[0].bytes.view() == want.bytes.view());
}

INSTANTIATE_TEST_SUITE_P(CopyThread, BrokenStreamTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Pipelined" : "OneThread";
                         });

TEST(ServerLifecycleTest, TheCopyingBaselineServesTheSameBytes) {
  // --copy-payloads exists for benchmarks; it must still be correct.
  const std::string models = testing::MakeScratchDir("models");
  WriteBig(models + "/big.safetensors", 5, 300000, 9.0f);  // tensors over several chunks
  Daemon daemon(models, {"--copy-payloads"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  ASSERT_OK_AND_ASSIGN(auto local, Checkpoint::Open(models + "/big.safetensors"));
  ASSERT_OK_AND_ASSIGN(auto fetched, Connect(daemon)->FetchAll("big", {}));
  ASSERT_EQ(fetched.size(), local->size());
  for (size_t i = 0; i < fetched.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(SharedTensor want, local->Read(local->entries()[i]));
    EXPECT_TRUE(fetched[i].bytes.view() == want.bytes.view()) << want.spec.name;
  }
}

TEST(ServerLifecycleTest, SighupPicksUpNewAndReplacedFilesAsNewVersions) {
  const std::string models = testing::MakeScratchDir("models");
  WriteBig(models + "/a.safetensors", 1, 16, 1.0f);
  Daemon daemon(models);
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto store = Connect(daemon);
  ASSERT_OK_AND_ASSIGN(auto before, store->GetCheckpoint("a"));
  // Replace by rename, as every weightstore writer does; add another.
  WriteBig(models + "/.a.tmp", 1, 16, 2.0f);
  fs::rename(models + "/.a.tmp", models + "/a.safetensors");
  fs::create_directories(models + "/sub");
  WriteBig(models + "/sub/b.safetensors", 2, 8, 3.0f);
  daemon.Signal(SIGHUP);
  ASSERT_TRUE(testing::WaitUntil([&] { return store->GetCheckpoint("sub/b").ok(); })) << daemon.log();
  ASSERT_OK_AND_ASSIGN(auto after, store->GetCheckpoint("a"));
  EXPECT_NE(after.version, before.version);
  EXPECT_EQ(after.metadata.at("seed"), "2.000000");
  EXPECT_OK(store->GetCheckpoint("sub/b"));
  fs::remove(models + "/sub/b.safetensors");
  daemon.Signal(SIGHUP);
  ASSERT_TRUE(testing::WaitUntil([&] { return !store->GetCheckpoint("sub/b").ok(); })) << daemon.log();
  EXPECT_THAT(store->GetCheckpoint("sub/b"), StatusIs(absl::StatusCode::kNotFound));
}

TEST(ServerLifecycleTest, AQueryPinnedToAVersionIsAbortedOnceThatVersionIsReplaced) {
  const std::string models = testing::MakeScratchDir("models");
  WriteBig(models + "/a.safetensors", 2, 16, 1.0f);
  const std::string socket_path = testing::MakeScratchDir("socket") + "/ws.sock";
  Daemon daemon(models, {"--socket", socket_path});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  ASSERT_OK_AND_ASSIGN(auto local, client::OpenLocalStore(models));
  ASSERT_OK_AND_ASSIGN(auto socket, client::ConnectSharedMemoryStore(socket_path));
  std::vector<std::unique_ptr<client::Store>> stores;
  stores.push_back(Connect(daemon));
  stores.push_back(std::move(socket));
  ASSERT_OK_AND_ASSIGN(auto listing, stores[0]->ListTensors("a", {}));
  client::Query pinned;
  pinned.version = listing.version;
  for (auto& store : stores) {
    EXPECT_OK(store->FetchAll("a", pinned));
    EXPECT_OK(store->ListTensors("a", pinned));
  }
  WriteBig(models + "/.a.tmp", 2, 16, 2.0f);
  fs::rename(models + "/.a.tmp", models + "/a.safetensors");
  daemon.Signal(SIGHUP);
  ASSERT_TRUE(testing::WaitUntil([&] {
    absl::StatusOr<client::TensorListing> now = stores[0]->ListTensors("a", {});
    return now.ok() && now->version != listing.version;
  })) << daemon.log();
  for (auto& store : stores) {
    EXPECT_THAT(store->FetchAll("a", pinned),
                StatusIs(absl::StatusCode::kAborted, HasSubstr(absl::StrCat("version ", listing.version, " is gone"))));
    EXPECT_THAT(store->ListTensors("a", pinned), StatusIs(absl::StatusCode::kAborted));
    EXPECT_OK(store->FetchAll("a", {}));  // unpinned: the new version
  }
  // In-process, the local store's registry has its own versions: a stranger is refused the same way.
  client::Query stranger;
  stranger.version = "0000000000000000";
  EXPECT_THAT(local->FetchAll("a", stranger), StatusIs(absl::StatusCode::kAborted, HasSubstr("is gone")));
  EXPECT_OK(local->FetchAll("a", {}));
}

TEST(ServerLifecycleTest, AdminCallsLoadUnloadUploadAndRescan) {
  const std::string models = testing::MakeScratchDir("models");
  Daemon daemon(models, {"--load-root", testing::FixturesDir(), "--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = pb::WeightStore::NewStub(grpc::CreateChannel(daemon.address(), grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    pb::LoadCheckpointRequest req;
    req.set_path(testing::FixturesDir() + "/burn/burnpack/mnist.bpk");
    req.set_name("digits");
    pb::CheckpointInfo info;
    ASSERT_TRUE(stub->LoadCheckpoint(&ctx, req, &info).ok());
    EXPECT_EQ(info.tensor_count(), 18u);
  }
  {
    grpc::ClientContext ctx;
    pb::UnloadCheckpointRequest req;
    req.set_name("digits");
    pb::UnloadCheckpointResponse resp;
    EXPECT_TRUE(stub->UnloadCheckpoint(&ctx, req, &resp).ok());
    grpc::ClientContext again;
    EXPECT_EQ(stub->UnloadCheckpoint(&again, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  auto upload = [&](const std::string& name, const std::string& bytes) {
    grpc::ClientContext ctx;
    pb::CheckpointInfo info;
    auto writer = stub->PutCheckpoint(&ctx, &info);
    pb::PutCheckpointRequest header;
    header.mutable_header()->set_name(name);
    header.mutable_header()->set_extension("safetensors");
    header.mutable_header()->set_size(bytes.size());
    writer->Write(header);
    for (size_t off = 0; off < bytes.size(); off += 1 << 20) {
      pb::PutCheckpointRequest part;
      part.set_data(bytes.substr(off, 1 << 20));
      writer->Write(part);
    }
    pb::PutCheckpointRequest commit;
    commit.mutable_commit()->set_size(bytes.size());
    commit.mutable_commit()->set_crc32c(Crc32c(bytes));
    writer->Write(commit);
    writer->WritesDone();
    return writer->Finish();
  };
  const std::string good =
      testing::ReadFileOrEmpty(testing::FixturesDir() + "/burn/safetensors/multi_layer.safetensors");
  grpc::Status ok = upload("uploads/multi", good);
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(testing::ReadFileOrEmpty(models + "/uploads/multi.safetensors"), good);
  grpc::Status bad = upload("uploads/broken", good.substr(0, good.size() - 10));  // truncated
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad.error_message();
  EXPECT_FALSE(fs::exists(models + "/uploads/broken.safetensors"));
  EXPECT_EQ(upload("../escape", good).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(upload("uploads/multi", good).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  size_t files = 0;
  for ([[maybe_unused]] const auto& e : fs::recursive_directory_iterator(models)) ++files;
  EXPECT_EQ(files, 2u) << "only uploads/ and uploads/multi.safetensors, no temporaries";
  {
    grpc::ClientContext ctx;
    pb::RescanResponse resp;
    ASSERT_TRUE(stub->Rescan(&ctx, pb::RescanRequest(), &resp).ok());
  }
  auto store = Connect(daemon);
  EXPECT_OK(store->GetCheckpoint("uploads/multi"));

  // A file the scan cannot serve is named in the answer, relative to the
  // models folder, with the reason; and logged.
  testing::WriteFileOrDie(
      models + "/uploads/odd.safetensors",
      std::string("\x3e\0\0\0\0\0\0\0", 8) + R"({"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}}  )" + "x");
  grpc::ClientContext ctx;
  pb::RescanResponse resp;
  ASSERT_TRUE(stub->Rescan(&ctx, pb::RescanRequest(), &resp).ok());
  ASSERT_EQ(resp.not_served_size(), 1);
  EXPECT_THAT(resp.not_served(0), ::testing::StartsWith("uploads/odd.safetensors: "));
  EXPECT_THAT(resp.not_served(0), ::testing::HasSubstr("'Q9'"));
  EXPECT_THAT(resp.not_served(0), ::testing::Not(::testing::HasSubstr(models)));
  EXPECT_THAT(daemon.log(), ::testing::HasSubstr("not serving " + models + "/uploads/odd.safetensors"));
  EXPECT_EQ(testing::MetricValue(daemon.metrics_port(), "weightstore_scan_errors"), 1);
}

}  // namespace
}  // namespace weightstore

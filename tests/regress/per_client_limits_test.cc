// Every client gets a share of the daemon's call slots and no more: streams
// whose client stopped reading are cancelled and give their slots back, a
// slot is free as soon as its client sees the call end, and fetches waiting
// on an origin pull wait in a share of their own.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/store.h"
#include "tests/util/checkpoints.h"
#include "tests/util/daemon.h"
#include "tests/util/metrics.h"
#include "tests/util/serving.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "tests/util/wait.h"

namespace weightstore {
namespace {

namespace pb = ::weightstore::v1;
using testing::Daemon;
using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

// A FetchTensors stream that nothing reads until Finish().
struct UnreadFetch {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<pb::TensorChunk>> reader;

  // Reads what is buffered, then returns how the stream ended.
  grpc::Status Finish() {
    pb::TensorChunk chunk;
    while (reader->Read(&chunk)) {
    }
    return reader->Finish();
  }
};

// Opens `count` fetch streams of `name` and reads none of them.
std::vector<std::unique_ptr<UnreadFetch>> OpenUnreadFetches(pb::WeightStore::Stub* stub, const std::string& name,
                                                            int count) {
  std::vector<std::unique_ptr<UnreadFetch>> fetches;
  for (int i = 0; i < count; ++i) {
    auto f = std::make_unique<UnreadFetch>();
    pb::FetchTensorsRequest request;
    request.set_name(name);
    f->reader = stub->FetchTensors(&f->ctx, request);
    fetches.push_back(std::move(f));
  }
  return fetches;
}

TEST(PerClientLimitsTest, StreamsWhoseClientStoppedReadingAreCancelledAndTheirSlotsFreed) {
  // 64 fetch streams that stop reading locked every other client out for as
  // long as that client lived.
  const std::string models = testing::MakeExampleModelsDir();
  testing::WriteFileOrDie(models + "/big.safetensors", testing::SafeTensorsFile(16, 1 << 20, 1.0f));  // 64 MiB
  Daemon daemon(models, {"--max-concurrent-fetches", "6", "--max-fetches-per-peer", "4", "--stream-idle-timeout", "1",
                         "--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = testing::NewStub(daemon.address());
  auto metric = [&](absl::string_view name) { return testing::MetricValue(daemon.metrics_port(), name); };
  auto stalled = OpenUnreadFetches(stub.get(), "big", 4);  // a client that never reads
  // All four are admitted (and, not reading, are a second from being cancelled).
  ASSERT_TRUE(testing::WaitUntil([&] { return metric("weightstore_fetch_streams_active") == 4; })) << daemon.log();
  ASSERT_OK_AND_ASSIGN(auto store, client::ConnectRemoteStore(daemon.address(), {.max_resumes = 0}));
  EXPECT_THAT(store->FetchAll("tiny-mlp", {}),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("--max-fetches-per-peer")));
  // The stalled streams are cancelled after a second of no progress; the
  // share is free again, and the daemon says what it did.
  absl::Status later;
  EXPECT_TRUE(testing::WaitUntil([&] {
    later = store->FetchAll("tiny-mlp", {}).status();
    return later.ok();
  })) << later;
  // One freed slot is enough for that fetch; the stall watchdog may cancel the other
  // stalled streams a sweep later (on a loaded machine, under ASan). Reading
  // them before would be progress that saves them: wait for all four.
  EXPECT_TRUE(testing::WaitUntil([&] { return metric("weightstore_fetch_streams_stalled_total") >= 4; }))
      << daemon.log();
  for (auto& s : stalled) {  // what they had buffered, then the daemon's cancellation
    EXPECT_EQ(s->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  EXPECT_THAT(daemon.log(), HasSubstr("stalled stream cancelled"));
  testing::ExpectStillServes(daemon);
}

TEST(PerClientLimitsTest, ACallsSlotIsFreeOnceItsClientSeesItEnd) {
  // A client at its share that starts its next call when one ends was refused
  // now and then (CI: RESOURCE_EXHAUSTED for an upload right after another):
  // the slot was freed only when the daemon's side of the call wound down.
  const std::string models = testing::MakeExampleModelsDir();
  Daemon daemon(models, {"--max-fetches-per-peer", "1", "--max-uploads-per-peer", "1"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = testing::NewStub(daemon.address());
  pb::FetchTensorsRequest req;
  req.set_name("tiny-mlp");
  for (int i = 0; i < 300; ++i) {
    grpc::Status s = testing::DrainFetch(stub.get(), req);
    ASSERT_TRUE(s.ok()) << "fetch " << i << ": " << s.error_message();
  }
  const std::string good = testing::ReadFileOrEmpty(models + "/tiny-mlp.safetensors");
  ASSERT_FALSE(good.empty());
  for (int i = 0; i < 100; ++i) {
    grpc::ClientContext ctx;
    pb::CheckpointInfo info;
    auto writer = testing::StartUpload(stub.get(), &ctx, &info, absl::StrCat("seq/", i % 2 == 0 ? "ok-" : "bad-", i));
    // Every other one fails its CRC check: an error frees the slot as early.
    grpc::Status s = testing::FinishUpload(writer.get(), good, /*commit=*/true, /*corrupt=*/i % 2 != 0);
    EXPECT_EQ(s.error_code(), i % 2 == 0 ? grpc::StatusCode::OK : grpc::StatusCode::DATA_LOSS)
        << "upload " << i << ": " << s.error_message();
  }
  testing::ExpectStillServes(daemon);
}

// On a node with an origin, fetches of a checkpoint still being pulled held
// every FetchTensors slot for the whole pull, and every other fetch was
// refused. They wait in a share of their own.
TEST(PerClientLimitsTest, FetchesWaitingOnAPullLeaveTheServingSlotsToOthers) {
  const std::string origin_models = testing::MakeScratchDir("origin-models");
  testing::WriteFileOrDie(origin_models + "/far.safetensors", testing::OneTensorFile({1, 2}));
  testing::WriteFileOrDie(origin_models + "/warm.safetensors", testing::OneTensorFile({0}));
  Daemon origin(origin_models, {});
  ASSERT_NE(origin.port(), 0) << origin.log();
  const std::string node_models = testing::MakeScratchDir("node-models");
  testing::WriteFileOrDie(node_models + "/here.safetensors", testing::OneTensorFile({3, 4}));
  std::unique_ptr<Daemon> node = testing::StartNode(
      origin, node_models,
      {"--max-concurrent-fetches", "4", "--max-fetches-per-peer", "4", "--max-fetches-waiting-on-pulls", "6",
       "--max-fetches-waiting-on-pulls-per-peer", "6", "--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(node->port(), 0) << node->log();
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Store> warm, client::ConnectRemoteStore(node->address()));
    ASSERT_OK(warm->FetchAll("warm", {}).status());  // the node's channel to its origin is up
  }
  ASSERT_TRUE(origin.Stop());  // answers nothing more: every pull from now on stalls

  auto stub = testing::NewStub(node->address());
  auto waiting = OpenUnreadFetches(stub.get(), "far", 6);  // more than the serving slots
  // Each waits once the node has admitted it: the node counts them as pulls'
  // waiters. Then a seventh is one too many for the waiting share.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Store> store, client::ConnectRemoteStore(node->address()));
  ASSERT_TRUE(testing::WaitUntil(
      [&] { return testing::MetricValue(node->metrics_port(), "weightstore_fetches_waiting_on_pulls") == 6; },
      absl::Seconds(120)))
      << testing::MetricValue(node->metrics_port(), "weightstore_fetches_waiting_on_pulls");
  grpc::Status extra;
  {
    grpc::ClientContext ctx;  // refused at once; the deadline only keeps a broken gate from hanging the test
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    pb::FetchTensorsRequest request;
    request.set_name("far");
    auto reader = stub->FetchTensors(&ctx, request);
    pb::TensorChunk chunk;
    while (reader->Read(&chunk)) {
    }
    extra = reader->Finish();
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
  for (auto& w : waiting) EXPECT_EQ(w->Finish().error_code(), grpc::StatusCode::CANCELLED);
  origin.Signal(SIGCONT);
}

}  // namespace
}  // namespace weightstore

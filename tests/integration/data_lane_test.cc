// The data lane (weightstored --data-listen): a fetch's bytes over a plain TCP
// connection beside its gRPC stream. What the lane serves is checked fixture by
// fixture in the conformance suite (a store over the lane beside one over gRPC
// alone); here, what it does around that: it is used and counted, a stranger
// on its port reaches nothing and stops nobody, a client that stops reading
// is cut off, and the daemon refuses it beside TLS (ops_test.cc).
#include "proto/codec/data_lane.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/store.h"
#include "core/checkpoint.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "core/shm/unix_socket.h"
#include "tests/util/daemon.h"
#include "tests/util/loopback.h"
#include "tests/util/metrics.h"
#include "tests/util/serving.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "tests/util/wait.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore {
namespace {

using testing::Daemon;
using ::testing::HasSubstr;
using testing::StatusIs;

// `count` F32 tensors of `floats` each, every byte telling where it is.
void WriteModel(const std::string& path, int count, size_t floats) {
  std::vector<SharedTensor> tensors;
  for (int i = 0; i < count; ++i) {
    std::vector<std::byte> data(floats * 4);
    for (size_t k = 0; k < floats; ++k) {
      const float v = static_cast<float>(i * 100000 + k % 100000) * 0.5f;
      std::memcpy(data.data() + 4 * k, &v, 4);
    }
    tensors.push_back({{absl::StrCat("layer.", i), DType::kF32, {floats}}, SharedBytes::FromVector(std::move(data))});
  }
  testing::WriteFileOrDie(path, *SerializeCheckpoint(kSafeTensorsFormat, tensors, {}));
}

double Attached(const Daemon& daemon) {
  return testing::MetricValue(daemon.metrics_port(), "weightstore_data_lane_connections_total",
                              {"outcome=\"attached\""});
}

// FetchTensors calls the daemon ended with status `code` ("Canceled").
double FetchesEnded(const Daemon& daemon, absl::string_view code) {
  return testing::MetricValue(daemon.metrics_port(), "grpc_server_handled_total",
                              {"grpc_method=\"FetchTensors\"", absl::StrCat("grpc_code=\"", code, "\"")});
}

// A models folder serving "big": 64 MiB in 16 tensors, more than the
// sockets hold, so a fetch is still sending when its client acts.
std::string BigModel() {
  const std::string models = testing::MakeScratchDir("models");
  WriteModel(models + "/big.safetensors", 16, 1 << 20);
  return models;
}

// A daemon with the lane and metrics on, and a handshake that a slow
// machine never times out.
const std::vector<std::string> kLaneArgs = {
    "--data-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--data-lane-handshake-timeout", "60"};

void ExpectSameAsTheFile(const std::string& path, const client::Query& query, const std::vector<SharedTensor>& got) {
  ASSERT_OK_AND_ASSIGN(auto local, client::OpenLocalStore(std::filesystem::path(path).parent_path().string()));
  ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> want,
                       local->FetchAll(std::filesystem::path(path).stem().string(), query));
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].spec.name, want[i].spec.name);
    EXPECT_EQ(got[i].spec.dtype, want[i].spec.dtype);
    EXPECT_TRUE(got[i].bytes.view() == want[i].bytes.view()) << want[i].spec.name;
  }
}

TEST(DataLaneTest, AFetchThatAsksGetsItsBytesOverTheLaneWholeAndCounted) {
  const std::string models = testing::MakeScratchDir("models");
  WriteModel(models + "/big.safetensors", 6, (3 << 20) + 5);  // 12 MiB tensors: 3 frames and a bit each
  Daemon daemon(models, {"--data-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                         "--data-lane-handshake-timeout", "60"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  ASSERT_NE(daemon.lane_port(), 0) << daemon.log();
  EXPECT_THAT(daemon.log(), HasSubstr(absl::StrCat("data lane on port ", daemon.lane_port())));
  ASSERT_OK_AND_ASSIGN(auto lane, client::ConnectRemoteStore(daemon.address(), {.parallel_streams = 1}));
  ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> got, lane->FetchAll("big", {}));
  ExpectSameAsTheFile(models + "/big.safetensors", {}, got);
  EXPECT_EQ(Attached(daemon), 1);
  // Produced tensors (a cast) go over it too, in their own pieces.
  client::Query cast;
  cast.selection.dtype = DType::kF16;
  ASSERT_OK_AND_ASSIGN(got, lane->FetchAll("big", cast));
  ExpectSameAsTheFile(models + "/big.safetensors", cast, got);
  EXPECT_EQ(Attached(daemon), 2);
  // Ranges over several connections: one lane each.
  ASSERT_OK_AND_ASSIGN(auto ranges, client::ConnectRemoteStore(daemon.address(), {.parallel_streams = 3}));
  ASSERT_OK_AND_ASSIGN(got, ranges->FetchAll("big", {}));
  ExpectSameAsTheFile(models + "/big.safetensors", {}, got);
  EXPECT_EQ(Attached(daemon), 5);
  // A client that does not ask gets the stream, as from a daemon without one.
  ASSERT_OK_AND_ASSIGN(auto plain, client::ConnectRemoteStore(daemon.address(), {.data_lane = false}));
  ASSERT_OK_AND_ASSIGN(got, plain->FetchAll("big", {}));
  ExpectSameAsTheFile(models + "/big.safetensors", {}, got);
  EXPECT_EQ(Attached(daemon), 5);
}

TEST(DataLaneTest, StrangersOnTheLanesPortReachNoStreamAndStopNobody) {
  const std::string models = testing::MakeScratchDir("models");
  WriteModel(models + "/m.safetensors", 3, 1 << 16);
  // Handshakes wait up to 10 minutes here: strangers hold theirs all test long.
  Daemon daemon(models, {"--data-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                         "--data-lane-handshake-timeout", "600"});
  ASSERT_NE(daemon.lane_port(), 0) << daemon.log();
  // Garbage, a guessed ticket, a flood of raw bytes: each is closed.
  for (const std::string& sent : {std::string("GET / HTTP/1.1\r\nHost: lane\r\n\r\n"),
                                  std::string("WSLANE1") + '\0' + "0123456789abcdef", std::string(1 << 20, '\xff')}) {
    UniqueFd stranger = testing::ConnectLoopback(daemon.lane_port());
    (void)!write(stranger.get(), sent.data(), sent.size());
    char byte;
    EXPECT_LE(read(stranger.get(), &byte, 1), 0);
  }
  // Strangers holding half the handshakes, and so every one this address may
  // have once half are taken: a client's own connection is then closed, and
  // it fetches over gRPC instead, at once.
  std::vector<UniqueFd> holders;
  for (int i = 0; i < 40; ++i) holders.push_back(testing::ConnectLoopback(daemon.lane_port()));
  ASSERT_OK_AND_ASSIGN(auto store, client::ConnectRemoteStore(daemon.address(), {.parallel_streams = 1}));
  ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> got, store->FetchAll("m", {}));
  ExpectSameAsTheFile(models + "/m.safetensors", {}, got);
  EXPECT_EQ(Attached(daemon), 0);
  EXPECT_GE(
      testing::MetricValue(daemon.metrics_port(), "weightstore_data_lane_connections_total", {"outcome=\"refused\""}),
      2);
  EXPECT_GE(testing::MetricValue(daemon.metrics_port(), "weightstore_data_lane_connections_total",
                                 {"outcome=\"overflowed\""}),
            1);
  holders.clear();
  // Once they are gone, a new client uses the lane again (its first tries may
  // still find them: each try is a new client, which has not given up on it).
  ASSERT_TRUE(testing::WaitUntil([&] {
    auto next = client::ConnectRemoteStore(daemon.address(), {.parallel_streams = 1});
    return next.ok() && (*next)->FetchAll("m", {}).ok() && Attached(daemon) >= 1;
  }));
}

TEST(DataLaneTest, AClientThatCannotReachTheLaneFetchesOverGrpcAtOnce) {
  const std::string models = testing::MakeScratchDir("models");
  WriteModel(models + "/m.safetensors", 3, 1 << 16);
  // The lane on another loopback address than the gRPC port's: the client
  // connects to the address its stream reached, where nothing listens on
  // the lane's port.
  Daemon daemon(models, {"--data-listen", "127.0.0.2:0", "--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(daemon.lane_port(), 0) << daemon.log();
  ASSERT_OK_AND_ASSIGN(auto store, client::ConnectRemoteStore(daemon.address(), {.parallel_streams = 1}));
  for (int i = 0; i < 2; ++i) {
    ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> got, store->FetchAll("m", {}));
    ExpectSameAsTheFile(models + "/m.safetensors", {}, got);
  }
  EXPECT_EQ(Attached(daemon), 0);
}

TEST(DataLaneTest, AClientThatStopsReadingItsLaneIsCutOffAndItsSlotFreed) {
  const std::string models = testing::MakeScratchDir("models");
  WriteModel(models + "/big.safetensors", 16, 1 << 20);  // 64 MiB: more than the sockets hold
  Daemon daemon(models, {"--data-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--stream-idle-timeout",
                         "1", "--max-concurrent-fetches", "1"});
  ASSERT_NE(daemon.lane_port(), 0) << daemon.log();
  struct StuckSink : client::CollectingSink {
    absl::Notification stuck, release;
    int begun = 0;
    absl::StatusOr<std::span<std::byte>> Begin(const TensorSpec& spec) override {
      if (++begun == 2) {
        stuck.Notify();
        release.WaitForNotification();
      }
      return CollectingSink::Begin(spec);
    }
  } sink;
  ASSERT_OK_AND_ASSIGN(auto store, client::ConnectRemoteStore(daemon.address(), {.max_resumes = 0}));
  absl::Status fetched;
  std::thread fetch([&] { fetched = store->FetchTensors("big", {}, &sink); });
  sink.stuck.WaitForNotification();
  EXPECT_TRUE(testing::WaitUntil(
      [&] { return testing::MetricValue(daemon.metrics_port(), "weightstore_fetch_streams_stalled_total") >= 1; }));
  // Its slot (the only one) is free again: another client is served.
  ASSERT_OK_AND_ASSIGN(auto other, client::ConnectRemoteStore(daemon.address(), {.parallel_streams = 1}));
  EXPECT_TRUE(testing::WaitUntil([&] { return other->FetchAll("big", {}).ok(); }));
  sink.release.Notify();
  fetch.join();
  EXPECT_FALSE(fetched.ok());
  std::cout << "the stuck client's fetch: " << fetched << "\n";
}

// A client that cancels mid-fetch closes its lane as its call's cancel goes
// out: the daemon counts each such fetch as Canceled, as it does a stream's,
// never as a broken lane (Unavailable), whichever of the two arrives first.
TEST(DataLaneTest, AFetchCancelledMidLaneIsCountedCancelledNotAsABrokenLane) {
  Daemon daemon(BigModel(), kLaneArgs);
  ASSERT_NE(daemon.lane_port(), 0) << daemon.log();
  ASSERT_OK_AND_ASSIGN(auto store,
                       client::ConnectRemoteStore(daemon.address(), {.max_resumes = 0, .parallel_streams = 1}));
  auto handled = [&](absl::string_view code) { return FetchesEnded(daemon, code); };
  constexpr int kTries = 12;
  for (int i = 0; i < kTries; ++i) {
    auto cancel = std::make_shared<std::atomic<bool>>(false);
    struct CancellingSink : client::CollectingSink {
      std::shared_ptr<std::atomic<bool>> cancel;
      int begun = 0;
      absl::StatusOr<std::span<std::byte>> Begin(const TensorSpec& spec) override {
        if (++begun == 2) *cancel = true;  // mid-fetch, with most of it still to come
        return CollectingSink::Begin(spec);
      }
    } sink;
    sink.cancel = cancel;
    client::Query query;
    query.cancel = cancel;
    EXPECT_THAT(store->FetchTensors("big", query, &sink), StatusIs(absl::StatusCode::kCancelled)) << i;
  }
  EXPECT_TRUE(testing::WaitUntil([&] { return handled("Canceled") >= kTries; })) << handled("Canceled");
  EXPECT_EQ(handled("Canceled"), kTries);
  EXPECT_EQ(handled("Unavailable"), 0);
  EXPECT_EQ(Attached(daemon), kTries);
}

// A lane closed by its client, spoken raw: with the call cancelled as well,
// the daemon counts it Canceled; with the call still open (the lane cut on
// the way, by a middlebox), the stream ends Unavailable, which clients resume.
TEST(DataLaneTest, ALaneItsClientClosedEndsCancelledWithItsCallOrElseUnavailable) {
  Daemon daemon(BigModel(), kLaneArgs);
  ASSERT_NE(daemon.lane_port(), 0) << daemon.log();
  auto stub = testing::NewStub(daemon.address());
  auto handled = [&](absl::string_view code) { return FetchesEnded(daemon, code); };
  for (const bool cancel : {false, true}) {
    SCOPED_TRACE(cancel ? "the call cancelled" : "the call left open");
    grpc::ClientContext ctx;
    v1::FetchTensorsRequest request;
    request.set_name("big");
    request.set_data_lane(true);
    std::unique_ptr<grpc::ClientReader<v1::TensorChunk>> reader = stub->FetchTensors(&ctx, request);
    v1::TensorChunk ticket;
    ASSERT_TRUE(reader->Read(&ticket));
    ASSERT_TRUE(ticket.has_lane());
    UniqueFd lane = testing::ConnectLoopback(static_cast<int>(ticket.lane().port()));
    const std::string hello = std::string(wire::kLaneHello.data(), wire::kLaneHello.size()) + ticket.lane().ticket();
    ASSERT_EQ(write(lane.get(), hello.data(), hello.size()), static_cast<ssize_t>(hello.size()));
    std::string got(1 << 20, '\0');  // the proof, then the first frames
    size_t read_bytes = 0;
    while (read_bytes < got.size()) {
      const ssize_t n = read(lane.get(), got.data() + read_bytes, got.size() - read_bytes);
      ASSERT_GT(n, 0);
      read_bytes += static_cast<size_t>(n);
    }
    EXPECT_EQ(got.substr(wire::kLaneHello.size(), wire::kLaneTicketBytes), ticket.lane().proof());
    lane.reset();  // unread bytes behind it: the daemon's next write fails
    if (cancel) ctx.TryCancel();
    const grpc::Status status = reader->Finish();
    if (cancel) {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
    } else {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
      EXPECT_THAT(status.error_message(), HasSubstr("data lane broke"));
    }
  }
  EXPECT_TRUE(testing::WaitUntil([&] { return handled("Canceled") + handled("Unavailable") >= 2; }));
  EXPECT_EQ(handled("Unavailable"), 1);
  EXPECT_EQ(handled("Canceled"), 1);
}

}  // namespace
}  // namespace weightstore

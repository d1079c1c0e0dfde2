// What a selection may cost the daemon: hostile patterns, renames and targets
// are refused quickly and cheaply; costly selections are counted per client
// address and in all, and run on workers of their own so that every other
// call is still answered.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/store.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "server/resolve.h"
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

pb::ListTensorsRequest Listing(const std::string& name) {
  pb::ListTensorsRequest req;
  req.set_name(name);
  return req;
}

grpc::Status List(pb::WeightStore::Stub* stub, const pb::ListTensorsRequest& req) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  pb::ListTensorsResponse resp;
  return stub->ListTensors(&ctx, req, &resp);
}

TEST(SelectionLimitsTest, HostileSelectionsAreRefusedQuicklyAndCheaply) {
  const std::string models = testing::MakeExampleModelsDir();
  Daemon daemon(models);
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = testing::NewStub(daemon.address());
  const auto start = std::chrono::steady_clock::now();
  {  // Ten rules '' -> 'x' * 1000 grew names to ~10 GB.
    pb::ListTensorsRequest req = Listing("tiny-mlp");
    for (int i = 0; i < 10; ++i) {
      pb::RenameRule* rule = req.mutable_selection()->add_renames();
      rule->set_replacement(std::string(1000, 'x'));
    }
    grpc::Status st = List(stub.get(), req);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr("past 4096 bytes"));
  }
  {  // 1000 patterns [^a]{900} (12 KB of request) took 17 s and 2 GB.
    pb::ListTensorsRequest req = Listing("tiny-mlp");
    for (int i = 0; i < 1000; ++i) req.mutable_selection()->add_include("[^a]{900}");
    EXPECT_EQ(List(stub.get(), req).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    pb::ListTensorsRequest within_count = Listing("tiny-mlp");
    for (int i = 0; i < 200; ++i) within_count.mutable_selection()->add_exclude("[^a]{900}");
    grpc::Status st = List(stub.get(), within_count);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr("regex budget"));
  }
  {  // A target parameter path of 800k dots took 43 s of CPU.
    pb::ListTensorsRequest req = Listing("tiny-mlp");
    pb::TargetParameter* p = req.mutable_selection()->mutable_target()->add_parameters();
    p->set_path(std::string(800000, '.'));
    p->add_shape(1);
    req.mutable_selection()->set_allow_partial(true);
    EXPECT_EQ(List(stub.get(), req).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {  // Contiguous indices over names of thousands of numeric segments.
    pb::ListTensorsRequest req = Listing("tiny-mlp");
    std::string digits;
    for (int i = 0; i < 2000; ++i) absl::StrAppend(&digits, i % 10, ".");
    pb::RenameRule* rule = req.mutable_selection()->add_renames();
    rule->set_pattern("^");
    rule->set_replacement(digits);
    req.mutable_selection()->set_contiguous_indices(true);
    EXPECT_TRUE(List(stub.get(), req).ok());
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  testing::ExpectStillServes(daemon);
}

// A SafeTensors file of 50,000 one-byte tensors named "l.<i>." and 150 random
// a's and b's (from `seed`): patterns that cannot run as a DFA cost seconds.
std::string ManyLongNames(unsigned seed) {
  std::vector<SharedTensor> tensors;
  std::mt19937 rng(seed);
  for (int i = 0; i < 50000; ++i) {
    std::string name = absl::StrCat("l.", i, ".");
    for (int k = 0; k < 150; ++k) name.push_back("ab"[rng() % 2]);
    tensors.push_back({{name, DType::kU8, {1}}, SharedBytes::Copy(std::string(1, '\0'))});
  }
  return *SerializeCheckpoint(kSafeTensorsFormat, tensors, {});
}

// A selection whose patterns cannot run as a DFA costs its whole 2 s budget
// on one of gRPC's threads; eight clients sending it took every thread. Such
// selections are counted per client address and in all.
TEST(SelectionLimitsTest, CostlySelectionsFromOneAddressAreCountedAndOthersAreServed) {
  const std::string models = testing::MakeScratchDir("models");
  testing::WriteFileOrDie(models + "/many.safetensors", ManyLongNames(1));
  testing::WriteFileOrDie(models + "/small.safetensors", testing::OneTensorFile({1}));
  Daemon daemon(models, {"--max-selections-per-peer", "1", "--max-concurrent-selections", "2"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = testing::NewStub(daemon.address());
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

// Selections ran on gRPC's threads, so eight of them at once took the threads
// every other call needs. They run on their own workers (here one), and the
// others are answered while all eight wait.
TEST(SelectionLimitsTest, CostlySelectionsRunOnTheirOwnWorkersWhileOtherCallsAreServed) {
  const std::string models = testing::MakeScratchDir("models");
  testing::WriteFileOrDie(models + "/many.safetensors", ManyLongNames(2));
  testing::WriteFileOrDie(models + "/small.safetensors", testing::OneTensorFile(std::vector<float>(1 << 20, 1.0f)));
  constexpr int kSelections = 8;
  const std::string n = std::to_string(kSelections);
  // Each selection may run for a minute: only cancelling ends them early.
  Daemon daemon(models, {"--selection-threads", "1", "--max-concurrent-selections", n, "--max-selections-per-peer", n,
                         "--max-selection-seconds", "60", "--max-selection-scan-bytes", "1TiB", "--metrics-listen",
                         "127.0.0.1:0"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = testing::NewStub(daemon.address());
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
  auto first_ended = [&] {
    for (size_t c = 0; c < statuses.size(); ++c) {
      if (!statuses[c].ok()) return absl::StrCat(c, ": ", statuses[c].error_message());
    }
    return std::string();
  };
  // Once the daemon holds all eight (the gauge says so)...
  ASSERT_TRUE(testing::WaitUntil([&] {
    return finished != 0 || testing::MetricValue(daemon.metrics_port(), "weightstore_selections_active") == kSelections;
  })) << daemon.log();
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

// Scale rules and expert patterns run regexes over every name: they pass the
// --max-concurrent-selections gate and run on the selection workers, as shard
// rules do (they were left out of it).
TEST(SelectionLimitsTest, ScaleRulesAndExpertPatternsAreCostlySelections) {
  v1::Selection experts;
  experts.mutable_shard()->set_world_size(2);
  experts.mutable_shard()->add_experts("experts\\.(\\d+)\\.");
  EXPECT_TRUE(server::IsCostlySelection(experts));
  v1::Selection scales;
  scales.mutable_shard()->set_world_size(2);
  scales.mutable_shard()->add_scales()->set_pattern("scale$");
  EXPECT_TRUE(server::IsCostlySelection(scales));
  v1::Selection plain;
  plain.set_dtype("BF16");
  EXPECT_FALSE(server::IsCostlySelection(plain));
}

}  // namespace
}  // namespace weightstore

// Issue 11: no request, file or client can take weightstored down, blow its
// memory, or get stale bytes served. Each attack the issue lists runs against a
// real daemon on 127.0.0.1 serving the bundled example models; after each one
// the daemon must still serve everyone else, and its peak RSS stay under 1 GiB.
#include <gmock/gmock.h>
#include <grpcpp/create_channel.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/store.h"
#include "core/utf8.h"
#include "tests/util/daemon.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore {
namespace {

namespace fs = std::filesystem;
namespace pb = ::weightstore::v1;
using ::testing::HasSubstr;
using testing::Daemon;
using ::weightstore::testing::StatusIs;

constexpr uint64_t kOneGiB = uint64_t{1} << 30;

// A models folder of links to the bundled example models, plus room for more.
std::string ExampleModels() {
  const std::string dir = testing::MakeScratchDir("models");
  for (const auto& e : fs::directory_iterator(testing::ExampleModelsDir())) {
    if (e.path().extension() != ".py") fs::create_symlink(e.path(), fs::path(dir) / e.path().filename());
  }
  return dir;
}

std::unique_ptr<pb::WeightStore::Stub> Stub(const Daemon& d) {
  return pb::WeightStore::NewStub(grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials()));
}

// The daemon answers, serves the example models, and stayed under 1 GiB.
void ExpectHealthy(Daemon& d) {
  ASSERT_TRUE(d.alive()) << d.log();
  auto store = client::ConnectRemoteStore(d.address());
  ASSERT_OK(store);
  auto tensors = (*store)->FetchAll("tiny-mlp", {});
  ASSERT_OK(tensors);
  EXPECT_FALSE(tensors->empty());
  EXPECT_LT(d.peak_rss_bytes(), kOneGiB);
}

grpc::Status Fetch(pb::WeightStore::Stub* stub, const pb::FetchTensorsRequest& req, size_t* chunks = nullptr) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = stub->FetchTensors(&ctx, req);
  pb::TensorChunk chunk;
  size_t n = 0;
  while (reader->Read(&chunk)) ++n;
  if (chunks != nullptr) *chunks = n;
  return reader->Finish();
}

TEST(Issue11Test, ANonAsciiOrControlCharacterNameIsInvalidArgumentOnEveryCall) {
  // Item 1: the name was echoed into trailing metadata, and gRPC aborted the
  // process on a value that is not printable ASCII.
  const std::string models = ExampleModels();
  const std::string socket = testing::MakeScratchDir("sock") + "/ws.sock";
  Daemon daemon(models, {"--socket", socket});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = Stub(daemon);
  // Names that are not UTF-8 never reach a handler: gRPC cannot parse a proto3
  // string field holding them, and refuses the call itself.
  auto refused = [](const grpc::Status& s, const std::string& name) {
    return IsValidUtf8(name) ? s.error_code() == grpc::StatusCode::INVALID_ARGUMENT : !s.ok();
  };
  for (const std::string& name : {std::string("\xff\xfe"), std::string("a\r\nb"), std::string("tiny\x7f"),
                                  std::string(1 << 20, 'n'), std::string("\0x", 2), std::string("t\xc2\x9b")}) {
    SCOPED_TRACE(name.size());
    {
      grpc::ClientContext ctx;
      pb::GetCheckpointRequest req;
      req.set_name(name);
      pb::CheckpointInfo info;
      grpc::Status st = stub->GetCheckpoint(&ctx, req, &info);
      EXPECT_TRUE(refused(st, name)) << st.error_code() << " " << st.error_message();
    }
    {
      grpc::ClientContext ctx;
      pb::ListTensorsRequest req;
      req.set_name(name);
      pb::ListTensorsResponse resp;
      EXPECT_TRUE(refused(stub->ListTensors(&ctx, req, &resp), name));
    }
    {
      pb::FetchTensorsRequest req;
      req.set_name(name);
      EXPECT_TRUE(refused(Fetch(stub.get(), req), name));
    }
    {
      grpc::ClientContext ctx;
      pb::LoadCheckpointRequest req;
      req.set_path("tiny-mlp.safetensors");
      req.set_name(name);
      pb::CheckpointInfo info;
      grpc::Status st = stub->LoadCheckpoint(&ctx, req, &info);
      EXPECT_TRUE(refused(st, name)) << st.error_code() << " " << st.error_message();
      grpc::ClientContext by_path;
      req.set_path(name);
      req.clear_name();
      EXPECT_NE(stub->LoadCheckpoint(&by_path, req, &info).error_code(), grpc::StatusCode::OK);
    }
    {
      grpc::ClientContext ctx;
      pb::UnloadCheckpointRequest req;
      req.set_name(name);
      pb::UnloadCheckpointResponse resp;
      EXPECT_TRUE(refused(stub->UnloadCheckpoint(&ctx, req, &resp), name));
    }
    {
      grpc::ClientContext ctx;
      pb::CheckpointInfo info;
      auto writer = stub->PutCheckpoint(&ctx, &info);
      pb::PutCheckpointRequest header;
      header.mutable_header()->set_name(name);
      header.mutable_header()->set_extension("safetensors");
      writer->Write(header);
      writer->WritesDone();
      EXPECT_TRUE(refused(writer->Finish(), name));
    }
    ASSERT_OK_AND_ASSIGN(auto shm, client::ConnectSharedMemoryStore(socket));
    EXPECT_THAT(shm->GetCheckpoint(name), StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(shm->ListTensors(name, {}), StatusIs(absl::StatusCode::kInvalidArgument));
    ExpectHealthy(daemon);
  }
}

}  // namespace
}  // namespace weightstore

// Checkpoint names from clients: a name that is not printable UTF-8 is refused
// by every call, over gRPC and the socket, and never reaches anything that
// could abort the daemon (gRPC aborted on such a name echoed into trailing
// metadata). Against a real daemon serving the example models.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "client/store.h"
#include "core/utf8.h"
#include "tests/util/daemon.h"
#include "tests/util/serving.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

namespace pb = ::weightstore::v1;
using testing::Daemon;
using ::weightstore::testing::StatusIs;

TEST(RequestNamesTest, ANonAsciiOrControlCharacterNameIsInvalidArgumentOnEveryCall) {
  const std::string models = testing::MakeExampleModelsDir();
  const std::string socket = testing::MakeScratchDir("sock") + "/ws.sock";
  Daemon daemon(models, {"--socket", socket});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = testing::NewStub(daemon.address());
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
      EXPECT_TRUE(refused(testing::DrainFetch(stub.get(), req), name));
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
      auto writer = testing::StartUpload(stub.get(), &ctx, &info, name);
      writer->WritesDone();
      EXPECT_TRUE(refused(writer->Finish(), name));
    }
    ASSERT_OK_AND_ASSIGN(auto shm, client::ConnectSharedMemoryStore(socket));
    EXPECT_THAT(shm->GetCheckpoint(name), StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(shm->ListTensors(name, {}), StatusIs(absl::StatusCode::kInvalidArgument));
    testing::ExpectStillServes(daemon);
  }
}

}  // namespace
}  // namespace weightstore

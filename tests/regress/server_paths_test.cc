// Paths on the daemon's side stay there: a load reads only under its load
// root, an upload writes only inside the models folder (and a killed one's
// temporary is cleared at the next start), and no answer or error tells a
// client an absolute server path.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "client/store.h"
#include "tests/util/checkpoints.h"
#include "tests/util/daemon.h"
#include "tests/util/serving.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "tests/util/wait.h"

namespace weightstore {
namespace {

namespace fs = std::filesystem;
namespace pb = ::weightstore::v1;
using testing::Daemon;
using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

TEST(ServerPathsTest, ReadClientsSeePathsRelativeToTheModelsFolderOrLoadRoot) {
  // CheckpointInfo.path gave read clients absolute server paths.
  const std::string models = testing::MakeExampleModelsDir();
  const std::string root = testing::MakeScratchDir("root");
  fs::create_directories(root + "/team");
  testing::WriteFileOrDie(root + "/team/extra.safetensors", testing::SafeTensorsFile(1, 16, 1.0f));
  const std::string socket = testing::MakeScratchDir("sock") + "/ws.sock";
  Daemon daemon(models, {"--load-root", root, "--socket", socket});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = testing::NewStub(daemon.address());
  grpc::ClientContext ctx;
  pb::LoadCheckpointRequest load;
  load.set_path(root + "/team/extra.safetensors");
  pb::CheckpointInfo loaded;
  ASSERT_TRUE(stub->LoadCheckpoint(&ctx, load, &loaded).ok());
  EXPECT_EQ(loaded.path(), "team/extra.safetensors");
  ASSERT_OK_AND_ASSIGN(auto store, client::ConnectRemoteStore(daemon.address()));
  ASSERT_OK_AND_ASSIGN(auto list, store->ListCheckpoints());
  ASSERT_OK_AND_ASSIGN(auto shm, client::ConnectSharedMemoryStore(socket));
  ASSERT_OK_AND_ASSIGN(auto shm_list, shm->ListCheckpoints());
  for (const auto& listing : {list, shm_list}) {
    for (const auto& c : listing) {
      EXPECT_FALSE(absl::StartsWith(c.path, "/")) << c.path;
      EXPECT_THAT(c.path, ::testing::Not(HasSubstr(models))) << c.path;
    }
  }
  ASSERT_OK_AND_ASSIGN(auto tiny, store->GetCheckpoint("tiny-mlp"));
  EXPECT_EQ(tiny.path, "tiny-mlp.safetensors");
}

TEST(ServerPathsTest, LoadAndUploadStayInsideTheirFolders) {
  // LoadCheckpoint read any path and quoted its first bytes; uploads could be
  // steered through a symlinked folder; a kill -9 mid-upload left a temporary
  // file forever.
  const std::string models = testing::MakeExampleModelsDir();
  const std::string outside = testing::MakeScratchDir("outside");
  fs::create_directory_symlink(outside, models + "/escape");
  auto daemon = std::make_unique<Daemon>(models);
  ASSERT_NE(daemon->port(), 0) << daemon->log();
  auto stub = testing::NewStub(daemon->address());
  {
    grpc::ClientContext ctx;
    pb::LoadCheckpointRequest req;
    req.set_path("/etc/passwd");
    pb::CheckpointInfo info;
    grpc::Status st = stub->LoadCheckpoint(&ctx, req, &info);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_THAT(st.error_message(), ::testing::Not(HasSubstr("root:")));
  }
  auto begin_upload = [&](grpc::ClientContext* ctx, pb::CheckpointInfo* info, const std::string& name) {
    auto writer = testing::StartUpload(stub.get(), ctx, info, name);
    pb::PutCheckpointRequest part;
    part.set_data(std::string(1 << 20, 'z'));
    writer->Write(part);
    return writer;
  };
  {
    grpc::ClientContext ctx;
    pb::CheckpointInfo info;
    auto writer = begin_upload(&ctx, &info, "escape/x");
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(fs::is_empty(outside));
  }
  {  // killed mid-upload: the temporary stays until a restarted daemon clears it
    grpc::ClientContext ctx;
    pb::CheckpointInfo info;
    auto writer = begin_upload(&ctx, &info, "half");
    EXPECT_TRUE(testing::WaitUntil([&] { return testing::UploadTemporariesIn(models) == 1; })) << "the upload began";
    daemon->Signal(SIGKILL);
    daemon->WaitExit(30000);
    ctx.TryCancel();
  }
  EXPECT_EQ(testing::UploadTemporariesIn(models), 1u);
  daemon = std::make_unique<Daemon>(models, std::vector<std::string>{"--abandoned-upload-seconds", "0"});
  ASSERT_NE(daemon->port(), 0) << daemon->log();
  EXPECT_THAT(daemon->log(), HasSubstr("removed the abandoned upload"));
  EXPECT_EQ(testing::UploadTemporariesIn(models), 0u);
  testing::ExpectStillServes(*daemon);
}

TEST(ServerPathsTest, ErrorsTellClientsNoServerPaths) {
  const std::string models = testing::MakeExampleModelsDir();
  Daemon daemon(models);
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  ASSERT_OK_AND_ASSIGN(auto store, client::ConnectRemoteStore(daemon.address()));
  client::Query query;
  query.selection.top_level_key = "nope";
  absl::Status status = store->ListTensors("tiny-mlp-torch", query).status();
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kNotFound, HasSubstr("'tiny-mlp-torch.pt' has no tensors")));
  EXPECT_THAT(std::string(status.message()), ::testing::Not(HasSubstr(models)));
}

}  // namespace
}  // namespace weightstore

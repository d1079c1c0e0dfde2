// Uploads (PutCheckpoint): only a commit message that matches the bytes
// stores one, never the end of a stream; each client has a share of the
// uploads, and one that stalls is cancelled and its temporary removed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "tests/util/checkpoints.h"
#include "tests/util/daemon.h"
#include "tests/util/serving.h"
#include "tests/util/test_env.h"
#include "tests/util/wait.h"

namespace weightstore {
namespace {

namespace fs = std::filesystem;
namespace pb = ::weightstore::v1;
using testing::Daemon;
using ::testing::HasSubstr;

// Files under `dir`, hidden ones (temporaries) included.
size_t FilesUnder(const std::string& dir) {
  size_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) n += e.is_regular_file() || e.is_symlink();
  return n;
}

TEST(UploadsTest, OnlyACommitMessageStoresAnUploadNeverTheEndOfAStream) {
  // An upload cancelled by the client after its last byte was committed
  // (OnReadDone(false) means both "finished" and "cancelled").
  const std::string models = testing::MakeScratchDir("models");
  Daemon daemon(models);
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = testing::NewStub(daemon.address());
  const std::string bytes = testing::SafeTensorsFile(2, 1000, 1.0f);
  // How each upload ends: cancelled after the last byte, half-closed without a
  // commit, a commit that does not match, and a good one.
  enum class End { kCancel, kNoCommit, kWrongCrc, kCommit };
  auto upload_once = [&](const std::string& name, End end) {
    grpc::ClientContext ctx;
    pb::CheckpointInfo info;
    auto writer = testing::StartUpload(stub.get(), &ctx, &info, name);
    if (end != End::kCancel) {
      return testing::FinishUpload(writer.get(), bytes, end != End::kNoCommit, end == End::kWrongCrc);
    }
    pb::PutCheckpointRequest data;
    data.set_data(bytes);
    writer->Write(data);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // every byte has arrived
    ctx.TryCancel();
    writer->WritesDone();
    return writer->Finish();
  };
  // The daemon frees a cancelled upload's slot (2 per client) on its own
  // threads: on a loaded machine the next upload may find it still taken.
  auto upload = [&](const std::string& name, End end) {
    grpc::Status status;
    testing::WaitUntil([&] {
      status = upload_once(name, end);
      return status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED;
    });
    return status;
  };
  EXPECT_EQ(upload("cancelled", End::kCancel).error_code(), grpc::StatusCode::CANCELLED);
  grpc::Status no_commit = upload("uncommitted", End::kNoCommit);
  EXPECT_EQ(no_commit.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_THAT(no_commit.error_message(), HasSubstr("without a commit message; nothing was stored"));
  EXPECT_EQ(upload("corrupted", End::kWrongCrc).error_code(), grpc::StatusCode::DATA_LOSS);
  // The cancelled calls wind down (and remove their temporaries) on the
  // daemon's threads: wait for that.
  testing::WaitUntil([&] { return FilesUnder(models) == 0; });
  EXPECT_EQ(FilesUnder(models), 0u) << "nothing stored, no temporaries left";
  ASSERT_TRUE(upload("good", End::kCommit).ok());
  EXPECT_EQ(testing::ReadFileOrEmpty(models + "/good.safetensors"), bytes);
  EXPECT_EQ(FilesUnder(models), 1u);
}

TEST(UploadsTest, UploadsAreSharedPerClientAndAStalledOneIsCancelled) {
  // An upload that stalls holds a temporary file and descriptors; without a cap
  // any number of them could.
  const std::string models = testing::MakeExampleModelsDir();
  Daemon daemon(models, {"--max-uploads-per-peer", "2", "--stream-idle-timeout", "1"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = testing::NewStub(daemon.address());
  struct Upload {
    grpc::ClientContext ctx;
    pb::CheckpointInfo info;
    std::unique_ptr<grpc::ClientWriter<pb::PutCheckpointRequest>> writer;
  };
  auto begin = [&](const std::string& name) {
    auto u = std::make_unique<Upload>();
    u->writer = testing::StartUpload(stub.get(), &u->ctx, &u->info, name);
    return u;
  };
  auto first = begin("a"), second = begin("b");
  // Both are admitted: each has its temporary (and, sending nothing, is a
  // second from being cancelled).
  auto temporaries_now = [&] { return testing::UploadTemporariesIn(models); };
  ASSERT_TRUE(testing::WaitUntil([&] { return temporaries_now() == 2; })) << daemon.log();
  auto third = begin("c");
  third->writer->WritesDone();
  grpc::Status refused = third->writer->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error_message(), HasSubstr("--max-uploads-per-peer"));
  // The two that send nothing are cancelled, their temporaries removed (once
  // the daemon's side of the call has wound down).
  for (auto* u : {first.get(), second.get()}) EXPECT_EQ(u->writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(testing::WaitUntil([&] { return temporaries_now() == 0; })) << temporaries_now() << " temporaries left";
  EXPECT_THAT(daemon.log(), HasSubstr("\"what\":\"PutCheckpoint uploads\""));
  testing::ExpectStillServes(daemon);
}

}  // namespace
}  // namespace weightstore

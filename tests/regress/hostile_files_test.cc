// Hostile files in the models folder (a zip bomb, a deeply nested pickle, a
// broadcast tensor, a symlink loop) are reported in the scan and cost the
// daemon nothing, at start, on rescans and when uploaded.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/store.h"
#include "tests/util/daemon.h"
#include "tests/util/pickle_builder.h"
#include "tests/util/serving.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "tests/util/zip_builder.h"

namespace weightstore {
namespace {

namespace fs = std::filesystem;
namespace pb = ::weightstore::v1;
using testing::Daemon;
using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

// Writes a .pt built by hand (pickle + zip) into `path`.
void WriteZip(const std::string& path, const std::vector<testing::ZipBuildEntry>& entries,
              const testing::ZipBuildOptions& options = {}) {
  testing::WriteFileOrDie(path, testing::BuildZip(entries, options));
}

TEST(HostileFilesTest, HostileFilesInTheModelsFolderAreReportedAndCostNothing) {
  const std::string models = testing::MakeExampleModelsDir();
  // A 254-byte zip bomb: a ZIP64 data.pkl declaring 8 GiB.
  testing::ZipBuildOptions bomb;
  bomb.zip64 = true;
  bomb.method = 8;
  bomb.declared_size = uint64_t{8} << 30;
  WriteZip(models + "/bomb.pt", {{"bomb/data.pkl", std::string("\x03\x00", 2)}}, bomb);
  bomb.declared_size = uint64_t{100} << 20;  // under the pickle bound: deflate's ratio refuses it
  WriteZip(models + "/bomb2.pt", {{"bomb2/data.pkl", std::string("\x03\x00", 2)}}, bomb);
  // A 2 MiB memoized key in dicts nested 63 deep.
  testing::PickleBuilder deep;
  deep.Proto(2);
  for (int i = 0; i < 63; ++i) {
    deep.EmptyDict().Mark();
    if (i == 0) {
      deep.Str(std::string(2 << 20, 'k')).Put(0);
    } else {
      deep.Get(0);
    }
  }
  deep.EmptyDict();
  for (int i = 0; i < 63; ++i) deep.SetItems();
  deep.Stop();
  WriteZip(models + "/deep.pt", {{"deep/data.pkl", deep.str()}, {"deep/byteorder", "little"}});
  // torch.ones(1).expand(1 << 29), written by PyTorch itself.
  const std::string script =
      absl::StrCat("import torch; torch.save({'x': torch.ones(1).expand(1 << 29)}, '", models, "/broadcast.pt')");
  const std::string command = absl::StrCat(testing::TorchPython(), " -c ", testing::ShellQuote(script));
  std::string out;
  ASSERT_EQ(testing::RunCommand(command, &out), 0) << out;
  // A symlink loop.
  fs::create_symlink("loop.safetensors", models + "/loop.safetensors");
  Daemon daemon(models);
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  ASSERT_OK_AND_ASSIGN(auto store, client::ConnectRemoteStore(daemon.address()));
  for (const char* name : {"bomb", "bomb2", "deep", "broadcast", "loop"}) {
    EXPECT_THAT(store->GetCheckpoint(name), StatusIs(absl::StatusCode::kNotFound)) << name;
  }
  const std::string log = daemon.log();
  EXPECT_THAT(log, HasSubstr("pickles over 268435456 bytes are not read"));
  EXPECT_THAT(log, HasSubstr("more than deflate can expand"));
  EXPECT_THAT(log, HasSubstr("dict key of 2097152 bytes"));
  EXPECT_THAT(log, HasSubstr("expands 4 stored bytes to 2147483648"));
  EXPECT_THAT(log, HasSubstr("loop.safetensors"));
  // A rescan, by signal and by RPC, finds the same and keeps serving.
  daemon.Signal(SIGHUP);
  auto stub = testing::NewStub(daemon.address());
  grpc::ClientContext ctx;
  pb::RescanResponse rescan;
  EXPECT_TRUE(stub->Rescan(&ctx, pb::RescanRequest(), &rescan).ok());
  // The same bomb uploaded is refused before it is stored.
  grpc::ClientContext put_ctx;
  pb::CheckpointInfo info;
  auto writer = testing::StartUpload(stub.get(), &put_ctx, &info, "uploaded-bomb", "pt");
  EXPECT_EQ(testing::FinishUpload(writer.get(), testing::ReadFileOrEmpty(models + "/bomb.pt")).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_FALSE(fs::exists(models + "/uploaded-bomb.pt"));
  testing::ExpectStillServes(daemon);
}

}  // namespace
}  // namespace weightstore

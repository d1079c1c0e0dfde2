// A served file changed in place (truncated, or rewritten at the same size)
// never crashes the daemon or gets wrong bytes served: the reads that hit it
// fail cleanly, and its next contents are a new version, never mixed with
// the old.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <map>
#include <string>

#include "client/store.h"
#include "tests/util/checkpoints.h"
#include "tests/util/daemon.h"
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

// Writes `bytes` over the file at `path` in place: same inode, no rename.
void OverwriteInPlace(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(bytes.size())), 0);
  ASSERT_EQ(::pwrite(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  ::close(fd);
}

std::string CurrentVersion(client::Store& store, const std::string& name) {
  auto info = store.GetCheckpoint(name);
  return info.ok() ? info->version : "";
}

// Waits until `name` is served under a version other than `old`; returns it
// ("" if that never happens).
std::string AwaitNewVersion(client::Store& store, const std::string& name, const std::string& old) {
  std::string version;
  testing::WaitUntil([&] {
    version = CurrentVersion(store, name);
    return !version.empty() && version != old;
  });
  return version != old ? version : "";
}

// Every tensor of `name` as `store` serves it, name to bytes.
std::map<std::string, std::string> Fetched(client::Store& store, const std::string& name) {
  std::map<std::string, std::string> out;
  auto tensors = store.FetchAll(name, {});
  if (!tensors.ok()) return out;
  for (const SharedTensor& t : *tensors) out[t.spec.name] = std::string(t.bytes.view());
  return out;
}

TEST(ReplacedFilesTest, AServedFileTruncatedInPlaceFailsTheReadsThatHitItAndItsNextContentsAreANewVersion) {
  // The next fetch died with SIGBUS.
  const std::string models = testing::MakeExampleModelsDir();
  const std::string path = models + "/big.safetensors";
  const std::string v1_bytes = testing::SafeTensorsFile(8, 1 << 20, 1.0f);  // 32 MiB, mapped
  testing::WriteFileOrDie(path, v1_bytes);
  const std::string socket = testing::MakeScratchDir("sock") + "/ws.sock";
  Daemon daemon(models, {"--socket", socket});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  ASSERT_OK_AND_ASSIGN(auto store, client::ConnectRemoteStore(daemon.address()));
  const std::string v1 = CurrentVersion(*store, "big");
  ASSERT_FALSE(v1.empty());

  ASSERT_EQ(::truncate(path.c_str(), 4096), 0);
  // Whether the daemon has heard of it yet or not, reads fail cleanly.
  client::Query with_checksums;
  auto listing = store->ListTensors("big", with_checksums);
  auto fetched = store->FetchAll("big", {});
  EXPECT_FALSE(fetched.ok());
  EXPECT_TRUE(daemon.alive()) << daemon.log();

  const std::string v2_bytes = testing::SafeTensorsFile(8, 1 << 20, 2.0f);
  OverwriteInPlace(path, v2_bytes);
  const std::string v2 = AwaitNewVersion(*store, "big", v1);
  ASSERT_FALSE(v2.empty()) << daemon.log();
  EXPECT_EQ(Fetched(*store, "big"), testing::TensorsOf(v2_bytes));
  client::Query pinned;
  pinned.version = v1;
  EXPECT_THAT(store->FetchAll("big", pinned), StatusIs(absl::StatusCode::kAborted));
  ASSERT_OK_AND_ASSIGN(auto shm, client::ConnectSharedMemoryStore(socket));
  ASSERT_OK_AND_ASSIGN(auto mapped, shm->MapTensors("big", {}));
  EXPECT_EQ(mapped.version, v2);
  testing::ExpectStillServes(daemon);
}

TEST(ReplacedFilesTest, ASameSizeRewriteInPlaceIsServedAsANewVersionNeverMixedWithTheOld) {
  // A same-size rewrite kept the old version id, so gRPC clients got
  // DATA_LOSS and a socket mapping changed under one version.
  const std::string models = testing::MakeExampleModelsDir();
  const std::string path = models + "/m.safetensors";
  const std::string v1_bytes = testing::SafeTensorsFile(4, 1 << 18, 1.0f);
  testing::WriteFileOrDie(path, v1_bytes);
  Daemon daemon(models);
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  ASSERT_OK_AND_ASSIGN(auto store, client::ConnectRemoteStore(daemon.address()));
  const std::string v1 = CurrentVersion(*store, "m");
  EXPECT_EQ(Fetched(*store, "m"), testing::TensorsOf(v1_bytes));
  const std::string v2_bytes = testing::SafeTensorsFile(4, 1 << 18, 3.0f);
  ASSERT_EQ(v2_bytes.size(), v1_bytes.size());
  OverwriteInPlace(path, v2_bytes);
  const std::string v2 = AwaitNewVersion(*store, "m", v1);
  ASSERT_FALSE(v2.empty()) << daemon.log();
  EXPECT_EQ(Fetched(*store, "m"), testing::TensorsOf(v2_bytes));
  client::Query pinned;
  pinned.version = v1;
  EXPECT_THAT(store->FetchAll("m", pinned), StatusIs(absl::StatusCode::kAborted, HasSubstr("is gone")));
  testing::ExpectStillServes(daemon);
}

TEST(ReplacedFilesTest, AStreamInFlightWhenItsFileIsTruncatedEndsWithAnErrorNotWithWrongBytes) {
  const std::string models = testing::MakeExampleModelsDir();
  const std::string path = models + "/big.safetensors";
  testing::WriteFileOrDie(path, testing::SafeTensorsFile(16, 1 << 20, 1.0f));  // 64 MiB
  Daemon daemon(models);
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = testing::NewStub(daemon.address());
  grpc::ClientContext ctx;
  pb::FetchTensorsRequest req;
  req.set_name("big");
  req.mutable_selection()->set_dtype("F16");  // every chunk read by the daemon itself
  auto reader = stub->FetchTensors(&ctx, req);
  pb::TensorChunk chunk;
  ASSERT_TRUE(reader->Read(&chunk));
  ASSERT_EQ(::truncate(path.c_str(), 1 << 20), 0);
  size_t last_chunks = 0;
  while (reader->Read(&chunk)) last_chunks += chunk.last();
  grpc::Status status = reader->Finish();
  EXPECT_FALSE(status.ok()) << "a truncated file cannot be streamed whole";
  EXPECT_LT(last_chunks, 16u);
  EXPECT_TRUE(daemon.alive()) << daemon.log();
  testing::ExpectStillServes(daemon);
}

}  // namespace
}  // namespace weightstore

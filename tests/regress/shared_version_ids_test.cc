// Version ids that name content (an origin's release tags, content digests)
// can be shared by other bytes: two checkpoints with one id each get their
// own bytes over the socket, and file reads pinned to a listing are aborted
// once other bytes of the same content replace the file.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/store.h"
#include "tests/util/checkpoints.h"
#include "tests/util/daemon.h"
#include "tests/util/serving.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

namespace pb = ::weightstore::v1;

// The socket's segment cache was keyed by version id and the plans' keys,
// without the checkpoint: two checkpoints with one id (an origin that names
// versions by a release tag, or by content) got each other's bytes.
TEST(SharedVersionIdsTest, TwoCheckpointsWithOneVersionIdGetTheirOwnBytesOverTheSocket) {
  const std::string models = testing::MakeScratchDir("models");
  const std::string socket = testing::MakeScratchDir("sock") + "/ws.sock";
  server::ServerOptions options;
  options.socket.path = socket;
  options.shm_budget_bytes = 64 << 20;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<server::WeightStoreServer> daemon,
                       testing::StartInProcessServer(models, options));
  // Every version is "release-1", as a node cache carries an origin's ids.
  daemon->registry().SetVersionIds(
      [](const std::string&, const std::string&) -> std::optional<std::string> { return "release-1"; });
  testing::WriteFileOrDie(models + "/a.safetensors", testing::OneTensorFile({1, 2, 3, 4}));
  testing::WriteFileOrDie(models + "/b.safetensors", testing::OneTensorFile({5, 6, 7, 8}));
  daemon->registry().Rescan();
  ASSERT_EQ(daemon->registry().Get("a")->version(), daemon->registry().Get("b")->version());

  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::SharedMemoryStore> store, client::ConnectSharedMemoryStore(socket));
  client::Query cast;  // a cast is materialized into a segment, not mapped from the file
  cast.selection.dtype = DType::kF64;
  for (const auto& [name, first] : std::vector<std::pair<std::string, double>>{{"a", 1}, {"b", 5}, {"a", 1}}) {
    ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> got, store->FetchAll(name, cast));
    ASSERT_EQ(got.size(), 1u);
    ASSERT_EQ(got[0].bytes.size(), 32u);
    double value;
    std::memcpy(&value, got[0].bytes.view().data(), 8);
    EXPECT_EQ(value, first) << name;
  }
}

// A SafeTensors file of one F32 tensor, its JSON header padded with `pad`
// spaces (as the format allows): other bytes, the same content.
std::string Padded(size_t pad) {
  const std::string file = testing::OneTensorFile({1, 2, 3, 4});
  uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  std::string header = file.substr(8, n) + std::string(pad, ' ');
  const uint64_t padded = header.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &padded, 8);
  return out + header + file.substr(8 + n);
}

// A version id names content, and other bytes can share it. A node pulling a
// file by ranges could splice two files of one id; the listing's etag pins
// the reads to the bytes it listed.
TEST(SharedVersionIdsTest, FileReadsPinnedToTheirListingAreAbortedWhenOtherBytesOfTheSameContentReplaceIt) {
  const std::string models = testing::MakeScratchDir("etag");
  const std::string path = models + "/m.safetensors";
  testing::WriteFileOrDie(path, Padded(0));
  testing::Daemon daemon(models);
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = testing::NewStub(daemon.address());
  auto list = [&] {
    grpc::ClientContext ctx;
    pb::ListCheckpointFilesRequest request;
    request.set_name("m");
    pb::ListCheckpointFilesResponse files;
    EXPECT_TRUE(stub->ListCheckpointFiles(&ctx, request, &files).ok());
    return files;
  };
  auto read = [&](const pb::ListCheckpointFilesResponse& files, const std::string& etag) {
    grpc::ClientContext ctx;
    pb::ReadCheckpointFileRequest request;
    request.set_name("m");
    request.set_version(files.version());
    request.set_path(files.files(0).path());
    request.set_etag(etag);
    auto reader = stub->ReadCheckpointFile(&ctx, request);
    pb::CheckpointFileChunk chunk;
    std::string bytes;
    while (reader->Read(&chunk)) bytes += chunk.data();
    grpc::Status status = reader->Finish();
    return status.ok() ? bytes : absl::StrCat("status ", status.error_code(), ": ", status.error_message());
  };
  const pb::ListCheckpointFilesResponse before = list();
  ASSERT_EQ(before.files_size(), 1);
  EXPECT_FALSE(before.files(0).etag().empty());
  EXPECT_EQ(read(before, before.files(0).etag()), Padded(0));

  testing::WriteFileOrDie(path + ".next", Padded(8));
  std::filesystem::rename(path + ".next", path);
  {
    grpc::ClientContext ctx;
    pb::RescanResponse resp;
    ASSERT_TRUE(stub->Rescan(&ctx, pb::RescanRequest(), &resp).ok());
  }
  const pb::ListCheckpointFilesResponse after = list();
  EXPECT_EQ(after.version(), before.version());              // the same content...
  EXPECT_NE(after.files(0).etag(), before.files(0).etag());  // ...in other bytes
  EXPECT_THAT(read(before, before.files(0).etag()),
              ::testing::AllOf(::testing::HasSubstr("status 10"), ::testing::HasSubstr("list them again")));
  EXPECT_EQ(read(after, after.files(0).etag()), Padded(8));
  EXPECT_EQ(read(before, ""), Padded(8));  // no etag: any bytes of the version, as before
}

}  // namespace
}  // namespace weightstore

// Issue 28: the findings of an attacker's review of content-named versions and
// element patches, each against a real daemon on 127.0.0.1 port 0.
#include <gmock/gmock.h>
#include <grpcpp/create_channel.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/store.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "tests/util/daemon.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore {
namespace {

namespace pb = ::weightstore::v1;

// A SafeTensors file of one F32 tensor, its JSON header padded with `pad`
// spaces (as the format allows): other bytes, the same content.
std::string Padded(size_t pad) {
  const std::vector<float> values = {1, 2, 3, 4};
  std::string data(16, '\0');
  std::memcpy(data.data(), values.data(), 16);
  const std::string file =
      *SerializeCheckpoint(kSafeTensorsFormat, {SharedTensor{{"w", DType::kF32, {4}}, SharedBytes::Copy(data)}}, {});
  uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  std::string header = file.substr(8, n) + std::string(pad, ' ');
  const uint64_t padded = header.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &padded, 8);
  return out + header + file.substr(8 + n);
}

// Review finding 6: a version id names content, and other bytes can share it.
// A node pulling a file by ranges could splice two files of one id; the
// listing's etag pins the reads to the bytes it listed.
TEST(Issue28Test, FileReadsPinnedToTheirListingAreAbortedWhenOtherBytesOfTheSameContentReplaceIt) {
  const std::string models = testing::MakeScratchDir("issue28-etag");
  const std::string path = models + "/m.safetensors";
  testing::WriteFileOrDie(path, Padded(0));
  testing::Daemon daemon(models);
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = pb::WeightStore::NewStub(grpc::CreateChannel(daemon.address(), grpc::InsecureChannelCredentials()));
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

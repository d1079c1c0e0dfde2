#include "origin/grpc_origin.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "absl/strings/str_format.h"
#include "core/crc32c.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "origin/node_cache.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore::origin {
namespace {

namespace pb = ::weightstore::v1;
using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

// An upstream that serves one file, "m.safetensors", and can misbehave the
// ways a broken or hostile one might: flip a byte after computing the chunk's
// CRC32C, send a chunk at the wrong offset, or end the stream early.
class FakeUpstream final : public pb::WeightStore::Service {
 public:
  explicit FakeUpstream(std::string file) : file_(std::move(file)) {}

  grpc::Status ListCheckpointFiles(grpc::ServerContext*, const pb::ListCheckpointFilesRequest* req,
                                   pb::ListCheckpointFilesResponse* resp) override {
    if (req->name() != "m") return grpc::Status(grpc::StatusCode::NOT_FOUND, "checkpoint 'm' only");
    resp->set_version("v1");
    for (const pb::StoredFile& b : beside) *resp->add_files() = b;
    pb::StoredFile* f = resp->add_files();
    f->set_path(".safetensors");
    f->set_main(true);
    f->set_size(file_.size());
    f->set_crc32c(absl::StrFormat("%08x", Crc32c(file_)));
    return grpc::Status::OK;
  }

  grpc::Status ReadCheckpointFile(grpc::ServerContext*, const pb::ReadCheckpointFileRequest* req,
                                  grpc::ServerWriter<pb::CheckpointFileChunk>* writer) override {
    if (req->version() != "v1") return grpc::Status(grpc::StatusCode::ABORTED, "version v1 only");
    uint64_t at = req->offset();
    const uint64_t end = req->offset() + req->length();
    while (at < end) {
      const uint64_t n = std::min<uint64_t>(64 << 10, end - at);
      if (truncate_at >= 0 && at >= static_cast<uint64_t>(truncate_at)) return grpc::Status::OK;
      pb::CheckpointFileChunk chunk;
      chunk.set_offset(at + (skew ? 1 : 0));
      std::string data = file_.substr(at, n);
      chunk.set_crc32c(Crc32c(data));
      if (corrupt_at >= at && corrupt_at < at + n) data[corrupt_at - at] ^= 0x40;
      chunk.set_data(std::move(data));
      writer->Write(chunk);
      at += n;
    }
    return grpc::Status::OK;
  }

  uint64_t corrupt_at = UINT64_MAX;
  int64_t truncate_at = -1;
  bool skew = false;
  std::vector<pb::StoredFile> beside;  // listed before the main file

 private:
  std::string file_;
};

class GrpcOriginTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::vector<SharedTensor> tensors;
    for (int i = 0; i < 4; ++i) {
      std::vector<std::byte> bytes(100000);
      for (size_t k = 0; k < bytes.size(); ++k) bytes[k] = std::byte((k * 11 + i) & 0xff);
      tensors.push_back(
          {{absl::StrCat("t", i), DType::kU8, {bytes.size()}}, SharedBytes::FromVector(std::move(bytes))});
    }
    file_ = *SerializeCheckpoint(kSafeTensorsFormat, tensors, {});
    upstream_ = std::make_unique<FakeUpstream>(file_);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(upstream_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(port_, 0);
    auto origin = OpenGrpcOrigin(absl::StrCat("grpc://127.0.0.1:", port_), client::RemoteOptions(), 2);
    ASSERT_TRUE(origin.ok()) << origin.status();
    origin_ = *std::move(origin);
  }
  void TearDown() override { server_->Shutdown(); }

  // Reads the whole file through the origin.
  absl::Status ReadAll(std::string* out) {
    auto found = origin_->Find("m");
    if (!found.ok()) return found.status();
    const OriginFile& f = found->files.back();
    return origin_->Read(f, 0, f.size, [&](absl::string_view bytes) {
      out->append(bytes.data(), bytes.size());
      return absl::OkStatus();
    });
  }

  std::string file_;
  std::unique_ptr<FakeUpstream> upstream_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::unique_ptr<Origin> origin_;
};

TEST_F(GrpcOriginTest, FindsTheStoredFilesAndReadsThemByteForByte) {
  auto found = origin_->Find("m");
  ASSERT_TRUE(found.ok()) << found.status();
  ASSERT_EQ(found->files.size(), 1u);
  EXPECT_EQ(found->files[0].path, "m.safetensors");
  EXPECT_EQ(found->files[0].etag, "v1");
  std::string got;
  ASSERT_TRUE(ReadAll(&got).ok());
  EXPECT_EQ(got, file_);
  EXPECT_TRUE(origin_->verifies_reads());
  EXPECT_THAT(origin_->Find("absent").status(), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(GrpcOriginTest, ACorruptedByteIsDataLossAndNeverReachesTheSink) {
  upstream_->corrupt_at = 150000;
  std::string got;
  EXPECT_THAT(ReadAll(&got), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("fails its CRC32C")));
  EXPECT_EQ(got, file_.substr(0, 131072));  // the chunks before the bad one, and nothing of it
}

TEST_F(GrpcOriginTest, AChunkOutOfPlaceOrAShortStreamIsDataLoss) {
  upstream_->skew = true;
  std::string got;
  EXPECT_THAT(ReadAll(&got), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("was due")));
  upstream_->skew = false;
  upstream_->truncate_at = 65536;
  got.clear();
  EXPECT_THAT(ReadAll(&got), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("65536 of")));
}

TEST_F(GrpcOriginTest, ANodeCacheServesNothingOfACorruptedPull) {
  upstream_->corrupt_at = 200000;
  const std::string models = testing::MakeScratchDir("grpc-origin-node");
  RegistryOptions options;
  options.models_dir = models;
  CheckpointRegistry registry(options);
  auto cache = NodeCache::Open(&registry, std::move(origin_), NodeCacheOptions{.part_bytes = 64 << 10});
  ASSERT_TRUE(cache.ok());
  EXPECT_THAT((*cache)->Pull("m").status(), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("CRC32C")));
  EXPECT_EQ(registry.Get("m"), nullptr);
  EXPECT_FALSE(std::filesystem::exists(models + "/m.safetensors"));
  // Sound bytes from the next pull: the parts before the bad one are kept.
  upstream_->corrupt_at = UINT64_MAX;
  auto pulled = (*cache)->Pull("m");
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_LT(pulled->bytes_pulled, file_.size());
  EXPECT_EQ(testing::ReadFileOrEmpty(models + "/m.safetensors"), file_);
}

TEST_F(GrpcOriginTest, OnlyAQuantizationConfigOfBoundedSizeIsTakenBesideACheckpoint) {
  auto listed = [](const std::string& path, uint64_t size, bool main = false) {
    pb::StoredFile f;
    f.set_path(path);
    f.set_size(size);
    f.set_main(main);
    f.set_beside(true);
    return f;
  };
  upstream_->beside = {listed("hf_quant_config.json", 40), listed("config.json", 700)};
  ASSERT_OK_AND_ASSIGN(OriginCheckpoint found, origin_->Find("m"));
  ASSERT_EQ(found.files.size(), 3u);
  EXPECT_TRUE(found.files[0].beside);
  EXPECT_EQ(found.files[1].path, "config.json");
  EXPECT_TRUE(found.files[1].beside);
  EXPECT_FALSE(found.files[2].beside);
  // A file of another name, one past the bound, or one marked main is no
  // config: the listing is refused, naming it.
  for (const pb::StoredFile& bad : {listed("model.safetensors", 40), listed("config.json", (uint64_t{16} << 20) + 1),
                                    listed("../config.json", 40), listed("config.json", 40, /*main=*/true)}) {
    upstream_->beside = {bad};
    EXPECT_THAT(origin_->Find("m").status(), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("beside"))) << bad.path();
  }
  // More than the two configs there are.
  upstream_->beside = {listed("config.json", 40), listed("hf_quant_config.json", 40), listed("config.json", 40)};
  EXPECT_THAT(origin_->Find("m").status(), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("3 files beside")));
}

TEST(GrpcOriginUrlTest, RefusesWhatIsNoGrpcUrlAndTlsWithoutItsCa) {
  EXPECT_THAT(OpenGrpcOrigin("http://host:1", {}).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(OpenGrpcOrigin("grpc://", {}).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(OpenGrpcOrigin("grpc://host:1/path", {}).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(OpenGrpcOrigin("grpcs://host:1", {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--origin-ca-file")));
}

}  // namespace
}  // namespace weightstore::origin

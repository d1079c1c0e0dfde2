// A node following an S3 object whose SafeTensors header states its tensors'
// digests (kDigestsMetadataKey) fetches only the tensors that changed
// (NodeCache::RangeStep), against s3rver on loopback; and falls back to the
// whole object wherever that cannot be trusted or does not pay.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "core/catalog/manifest.h"
#include "core/catalog/registry.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "origin/node_cache.h"
#include "origin/s3_origin.h"
#include "tests/util/moto_s3.h"
#include "tests/util/s3rver.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore::origin {
namespace {

using ::weightstore::testing::MakeScratchDir;
using ::weightstore::testing::ReadFileOrEmpty;
using ::weightstore::testing::S3rver;

constexpr uint64_t kElements = 65536;  // 256 KiB of F32 a tensor: a file of 1 MiB and its header

// A SafeTensors file of tensors "a", "b", "c", ... (in that order), each of
// kElements F32 values equal to `values[i]`. Its header states their digests
// when `digests`, with `claimed` standing in for a tensor's own where given,
// and the entries of `extra`.
std::string FileOf(const std::vector<float>& values, bool digests,
                   const std::map<std::string, TensorDigest>& claimed = {}, const Metadata& extra = {}) {
  std::vector<SharedTensor> tensors;
  std::vector<std::pair<std::string, TensorDigest>> stated;
  for (size_t i = 0; i < values.size(); ++i) {
    std::vector<float> v(kElements, values[i]);
    std::string bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
    const std::string name(1, static_cast<char>('a' + i));
    const TensorDigest own = DigestBytes(std::as_bytes(std::span(bytes.data(), bytes.size())));
    stated.emplace_back(name, claimed.contains(name) ? claimed.at(name) : own);
    tensors.push_back({{name, DType::kF32, {kElements}}, SharedBytes::Copy(bytes)});
  }
  Metadata metadata = extra;
  metadata["format"] = "pt";
  if (digests) metadata[kDigestsMetadataKey] = DigestsMetadataJson(stated);
  absl::StatusOr<std::string> out = SerializeCheckpoint(kSafeTensorsFormat, tensors, metadata);
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : "";
}

TensorDigest DigestOf(float value) {
  std::vector<float> v(kElements, value);
  return DigestBytes(std::as_bytes(std::span(v.data(), v.size())));
}

class S3RangedStepTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new S3rver();
    start_ = new absl::Status(server_->Start());
  }
  static void TearDownTestSuite() {
    delete server_;
    delete start_;
  }
  void SetUp() override {
    ASSERT_TRUE(start_->ok()) << "s3rver is needed for these tests: " << *start_;
    prefix_ = absl::AsciiStrToLower(::testing::UnitTest::GetInstance()->current_test_info()->name());
    S3Config config;
    config.access_key_id = ::weightstore::testing::kS3rverKey;
    config.secret_access_key = ::weightstore::testing::kS3rverKey;
    config.endpoint = server_->endpoint();
    const std::string url = absl::StrCat("s3://", ::weightstore::testing::kS3rverBucket, "/", prefix_, "/");
    absl::StatusOr<std::unique_ptr<Origin>> origin = S3Origin::Create(url, config);
    ASSERT_TRUE(origin.ok()) << origin.status();
    absl::StatusOr<std::unique_ptr<Origin>> lister = S3Origin::Create(url, std::move(config));
    ASSERT_TRUE(lister.ok()) << lister.status();
    lister_ = *std::move(lister);
    registry_ = std::make_unique<CheckpointRegistry>(
        RegistryOptions{.models_dir = MakeScratchDir("s3-ranged"), .tensor_digests = true});
    absl::StatusOr<std::unique_ptr<NodeCache>> cache = NodeCache::Open(registry_.get(), *std::move(origin), {});
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = *std::move(cache);
  }

  absl::Status Put(absl::string_view bytes) { return server_->Put(prefix_ + "/m.safetensors", bytes); }
  std::string Held() const { return ReadFileOrEmpty(registry_->options().models_dir + "/m.safetensors"); }
  // The follower's step to what the origin has now; the bytes it read.
  absl::StatusOr<uint64_t> Step() {
    std::shared_ptr<const CheckpointVersion> base = registry_->Get("m");
    if (base == nullptr) return absl::NotFoundError("m is not served");
    absl::StatusOr<FollowedCache::Repulled> stepped = cache_->Repull("m", *base);
    if (!stepped.ok()) return stepped.status();
    if (stepped->version == nullptr) return absl::InternalError("no version published");
    return stepped->bytes;
  }
  // Bytes a step reads first (the first 64 KiB, which hold the header).
  static uint64_t HeaderBytes(const std::string& file) {
    uint64_t n = 0;
    std::memcpy(&n, file.data(), 8);
    return std::max<uint64_t>(8 + n, std::min<uint64_t>(file.size(), 64 << 10));
  }

  static S3rver* server_;
  static absl::Status* start_;
  std::string prefix_;
  std::unique_ptr<Origin> lister_;  // the origin as a follower's poll sees it
  std::unique_ptr<CheckpointRegistry> registry_;
  std::unique_ptr<NodeCache> cache_;
};
S3rver* S3RangedStepTest::server_ = nullptr;
absl::Status* S3RangedStepTest::start_ = nullptr;

TEST_F(S3RangedStepTest, AStepFetchesOnlyTheTensorsWhoseDigestChanged) {
  ASSERT_OK(Put(FileOf({1, 2, 3, 4, 5, 6, 7, 8}, true)));
  ASSERT_OK(cache_->Pull("m").status());
  constexpr uint64_t kTensor = kElements * 4;

  const std::string v2 = FileOf({1, 2, 30, 4, 5, 6, 7, 8}, true);
  ASSERT_OK(Put(v2));
  ASSERT_OK_AND_ASSIGN(uint64_t read, Step());
  EXPECT_EQ(read, HeaderBytes(v2) + kTensor);  // the header and "c"
  EXPECT_EQ(Sha256Hex(Held()), Sha256Hex(v2));
  std::shared_ptr<const CheckpointVersion> served = registry_->Get("m");
  ASSERT_NE(served, nullptr);
  ASSERT_OK_AND_ASSIGN(OriginCheckpoint now, lister_->Find("m"));
  EXPECT_EQ(served->version(), now.version);  // under the origin's id

  // "b" and "d" changed: "c" between them (under 1 MiB) comes with them, in
  // one request.
  const std::string v3 = FileOf({1, 20, 30, 40, 5, 6, 7, 8}, true);
  ASSERT_OK(Put(v3));
  ASSERT_OK_AND_ASSIGN(read, Step());
  EXPECT_EQ(read, HeaderBytes(v3) + 3 * kTensor);
  EXPECT_EQ(Sha256Hex(Held()), Sha256Hex(v3));

  // A tensor added: the header grows, so every tensor held lies elsewhere in
  // the new file; only the new one is fetched.
  const std::string v4 = FileOf({1, 20, 30, 40, 5, 6, 7, 8, 9}, true);
  ASSERT_OK(Put(v4));
  ASSERT_OK_AND_ASSIGN(read, Step());
  EXPECT_EQ(read, HeaderBytes(v4) + kTensor);
  EXPECT_EQ(Sha256Hex(Held()), Sha256Hex(v4));

  // Every tensor changed: more than half the bytes, so the whole file (after
  // its first read).
  const std::string v5 = FileOf({10, 21, 31, 41, 51, 61, 71, 81, 91}, true);
  ASSERT_OK(Put(v5));
  ASSERT_OK_AND_ASSIGN(read, Step());
  EXPECT_EQ(read, HeaderBytes(v5) + v5.size());
  EXPECT_EQ(Sha256Hex(Held()), Sha256Hex(v5));
}

TEST_F(S3RangedStepTest, AHeaderLongerThanTheFirstReadIsReadWholeInASecond) {
  // 200 KB of the trainer's own metadata: the header runs past the first
  // 64 KiB read, and the rest of it comes in one more.
  const Metadata notes = {{"notes", std::string(200000, 'n')}};
  ASSERT_OK(Put(FileOf({1, 2, 3, 4, 5, 6, 7, 8}, true, {}, notes)));
  ASSERT_OK(cache_->Pull("m").status());
  const std::string v2 = FileOf({1, 2, 3, 4, 5, 60, 7, 8}, true, {}, notes);
  ASSERT_GT(HeaderBytes(v2), uint64_t{64} << 10);
  ASSERT_OK(Put(v2));
  ASSERT_OK_AND_ASSIGN(uint64_t read, Step());
  EXPECT_EQ(read, HeaderBytes(v2) + kElements * 4);  // the header and "f"
  EXPECT_EQ(Sha256Hex(Held()), Sha256Hex(v2));
}

TEST_F(S3RangedStepTest, AFileWhoseHeaderStatesNoDigestsIsFetchedWhole) {
  ASSERT_OK(Put(FileOf({1, 2, 3, 4, 5, 6, 7, 8}, false)));
  ASSERT_OK(cache_->Pull("m").status());
  const std::string v2 = FileOf({1, 2, 30, 4, 5, 6, 7, 8}, false);
  ASSERT_OK(Put(v2));
  ASSERT_OK_AND_ASSIGN(uint64_t read, Step());
  EXPECT_EQ(read, HeaderBytes(v2) + v2.size());  // the header read first, then the whole file
  EXPECT_EQ(Sha256Hex(Held()), Sha256Hex(v2));
}

TEST_F(S3RangedStepTest, AHeaderThatClaimsAChangedTensorUnchangedIsCaughtByTheObjectsMd5) {
  ASSERT_OK(Put(FileOf({1, 2, 3, 4, 5, 6, 7, 8}, true)));
  ASSERT_OK(cache_->Pull("m").status());
  // "b" changed, but the header states its old digest: put together from the
  // file held, it would be the old "b". s3rver's ETag is the object's MD5.
  const std::string v2 = FileOf({1, 20, 3, 4, 5, 6, 7, 80}, true, {{"b", DigestOf(2)}});
  ASSERT_OK(Put(v2));
  ASSERT_OK_AND_ASSIGN(uint64_t read, Step());
  EXPECT_EQ(read, HeaderBytes(v2) + kElements * 4 + v2.size());  // "h" in the ranged attempt, then the whole file
  EXPECT_EQ(Sha256Hex(Held()), Sha256Hex(v2));                   // the origin's bytes, as they are
}

TEST_F(S3RangedStepTest, ADigestsEntryThatCannotBeTakenFallsBackToTheWholeFile) {
  ASSERT_OK(Put(FileOf({1, 2, 3, 4, 5, 6, 7, 8}, true)));
  ASSERT_OK(cache_->Pull("m").status());
  for (const std::string& entry : {std::string("[1,2]"), std::string("{\"a\":\"00\"}"),
                                   DigestsMetadataJson({{"a", DigestOf(1)}})}) {  // b, c, d missing
    SCOPED_TRACE(entry);
    std::vector<SharedTensor> tensors;
    for (float value : {1.0f, 2.0f, 31.0f, 4.0f, 5.0f, 6.0f, 7.0f, 8.0f}) {
      std::vector<float> v(kElements, value);
      tensors.push_back({{std::string(1, static_cast<char>('a' + tensors.size())), DType::kF32, {kElements}},
                         SharedBytes::Copy(std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4))});
    }
    absl::StatusOr<std::string> file =
        SerializeCheckpoint(kSafeTensorsFormat, tensors, {{std::string(kDigestsMetadataKey), entry}});
    ASSERT_OK(file.status());
    ASSERT_OK(Put(*file));
    ASSERT_OK_AND_ASSIGN(uint64_t read, Step());
    EXPECT_EQ(read, HeaderBytes(*file) + file->size());
    EXPECT_EQ(Sha256Hex(Held()), Sha256Hex(*file));
    // Back to a file with digests, for the next round.
    ASSERT_OK(Put(FileOf({1, 2, 3, 4, 5, 6, 7, 8}, true)));
    ASSERT_OK(Step().status());
  }
}

// An object whose ETag is no MD5 (SSE-KMS) and that states no CRC32C: the
// node could not tell a header that calls a changed tensor unchanged, so it
// takes no ranges from it (moto's S3, which keeps the encryption header).
TEST(S3RangedStepKmsTest, AnObjectS3VouchesNothingForIsFetchedWhole) {
  ::weightstore::testing::MotoS3 moto;
  absl::Status started = moto.Start();
  ASSERT_TRUE(started.ok()) << "moto's S3 server is needed for this test: " << started;
  ASSERT_OK(moto.CreateBucket("kms", /*versioned=*/false));
  const std::vector<std::string> kms = {"x-amz-server-side-encryption: aws:kms"};
  ASSERT_OK(moto.Put("kms", "m.safetensors", FileOf({1, 2, 3, 4, 5, 6, 7, 8}, true), kms).status());
  S3Config config;
  config.access_key_id = config.secret_access_key = "moto";
  config.endpoint = moto.endpoint();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Origin> origin, S3Origin::Create("s3://kms", config));
  ASSERT_OK_AND_ASSIGN(OriginCheckpoint listed, origin->Find("m"));
  ASSERT_EQ(listed.files[0].md5, "");  // what the step would check against: nothing
  ASSERT_EQ(listed.files[0].crc32c, "");
  CheckpointRegistry registry(RegistryOptions{.models_dir = MakeScratchDir("s3-ranged-kms"), .tensor_digests = true});
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<NodeCache> cache, NodeCache::Open(&registry, std::move(origin), {}));
  ASSERT_OK(cache->Pull("m").status());
  // The header lies about "b"; with nothing to check the file against, only
  // a whole download gives the object's bytes.
  const std::string v2 = FileOf({1, 20, 3, 4, 5, 6, 7, 8}, true, {{"b", DigestOf(2)}});
  ASSERT_OK(moto.Put("kms", "m.safetensors", v2, kms).status());
  std::shared_ptr<const CheckpointVersion> base = registry.Get("m");
  ASSERT_NE(base, nullptr);
  ASSERT_OK_AND_ASSIGN(FollowedCache::Repulled stepped, cache->Repull("m", *base));
  EXPECT_EQ(stepped.bytes, v2.size());  // not even the header read first
  EXPECT_EQ(Sha256Hex(ReadFileOrEmpty(registry.options().models_dir + "/m.safetensors")), Sha256Hex(v2));
}

}  // namespace
}  // namespace weightstore::origin

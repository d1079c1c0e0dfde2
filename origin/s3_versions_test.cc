// S3Origin against buckets that keep every version of an object (moto's S3
// server on loopback, tests/util/moto_s3.h; s3rver keeps none): a pull reads
// the version it listed, so a trainer overwriting the object mid-pull does not
// end it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "core/catalog/registry.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "origin/node_cache.h"
#include "origin/s3_origin.h"
#include "tests/util/moto_s3.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore::origin {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::weightstore::testing::IsOkAndHolds;
using ::weightstore::testing::MakeScratchDir;
using ::weightstore::testing::MotoS3;
using ::weightstore::testing::ReadFileOrEmpty;
using ::weightstore::testing::StatusIs;

constexpr char kVersioned[] = "versioned";
constexpr char kUnversioned[] = "unversioned";

// A SafeTensors file of one F32 tensor "w" of 4096 elements, each `value`.
std::string CheckpointOf(float value) {
  std::vector<float> values(4096, value);
  std::vector<std::byte> bytes(values.size() * sizeof(float));
  std::memcpy(bytes.data(), values.data(), bytes.size());
  absl::StatusOr<std::string> out = SerializeCheckpoint(
      kSafeTensorsFormat, {{{"w", DType::kF32, {4096}}, SharedBytes::FromVector(std::move(bytes))}}, {});
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : "";
}

// The SHA-256 of every byte of `file` read from `origin` (a digest, so a
// failure prints 64 characters, not the file).
absl::StatusOr<std::string> ReadDigest(Origin& origin, const OriginFile& file) {
  std::string out;
  absl::Status status = origin.Read(file, 0, file.size, [&out](absl::string_view bytes) {
    out.append(bytes.data(), bytes.size());
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return Sha256Hex(out);
}

// An origin that runs `before_first_read` once, before its first Read goes
// to the S3 origin it wraps: a trainer's overwrite landing mid-pull, after the
// listing.
class OverwrittenMidPull : public Origin {
 public:
  OverwrittenMidPull(std::unique_ptr<Origin> s3, std::function<void()> before_first_read)
      : s3_(std::move(s3)), before_first_read_(std::move(before_first_read)) {}
  std::string Describe() const override { return s3_->Describe(); }
  absl::StatusOr<OriginCheckpoint> Find(const std::string& name) override { return s3_->Find(name); }
  absl::StatusOr<std::string> Version(const std::string& name) override { return s3_->Version(name); }
  absl::Status Read(const OriginFile& file, uint64_t offset, uint64_t length, const ByteSink& sink) override {
    if (!overwritten_.exchange(true)) before_first_read_();
    return s3_->Read(file, offset, length, sink);
  }
  int parallel_reads() const override { return s3_->parallel_reads(); }

 private:
  std::unique_ptr<Origin> s3_;
  std::function<void()> before_first_read_;
  std::atomic<bool> overwritten_{false};
};

class S3VersionedBucketTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new MotoS3();
    start_ = new absl::Status(server_->Start());
    if (start_->ok()) *start_ = server_->CreateBucket(kVersioned, /*versioned=*/true);
    if (start_->ok()) *start_ = server_->CreateBucket(kUnversioned, /*versioned=*/false);
  }
  static void TearDownTestSuite() {
    delete server_;
    delete start_;
  }
  void SetUp() override {
    ASSERT_TRUE(start_->ok()) << "moto's S3 server is needed for these tests: " << *start_;
    prefix_ = absl::AsciiStrToLower(::testing::UnitTest::GetInstance()->current_test_info()->name());
  }

  absl::StatusOr<std::string> Put(const std::string& bucket, const std::string& relative_key, absl::string_view data) {
    return server_->Put(bucket, absl::StrCat(prefix_, "/", relative_key), data);
  }
  std::unique_ptr<Origin> MakeOrigin(const std::string& bucket) {
    S3Config config;
    config.access_key_id = "moto";
    config.secret_access_key = "moto";
    config.endpoint = server_->endpoint();
    absl::StatusOr<std::unique_ptr<Origin>> origin =
        S3Origin::Create(absl::StrCat("s3://", bucket, "/", prefix_, "/"), std::move(config));
    EXPECT_TRUE(origin.ok()) << origin.status();
    return origin.ok() ? *std::move(origin) : nullptr;
  }

  static MotoS3* server_;
  static absl::Status* start_;
  std::string prefix_;
};
MotoS3* S3VersionedBucketTest::server_ = nullptr;
absl::Status* S3VersionedBucketTest::start_ = nullptr;

TEST_F(S3VersionedBucketTest, AReadIsOfTheVersionListedThoughTheObjectWasOverwritten) {
  const std::string v1 = CheckpointOf(1), v2 = CheckpointOf(2);
  ASSERT_EQ(v1.size(), v2.size());
  ASSERT_OK_AND_ASSIGN(const std::string id1, Put(kVersioned, "m.safetensors", v1));
  ASSERT_FALSE(id1.empty());
  std::unique_ptr<Origin> origin = MakeOrigin(kVersioned);
  ASSERT_NE(origin, nullptr);
  ASSERT_OK_AND_ASSIGN(OriginCheckpoint listed, origin->Find("m"));
  ASSERT_EQ(listed.files.size(), 1u);
  EXPECT_EQ(listed.files[0].object_version, id1);

  ASSERT_OK_AND_ASSIGN(const std::string id2, Put(kVersioned, "m.safetensors", v2));
  ASSERT_NE(id2, id1);
  EXPECT_THAT(ReadDigest(*origin, listed.files[0]), IsOkAndHolds(Sha256Hex(v1)));

  // The next listing is of the new version, and reads it.
  ASSERT_OK_AND_ASSIGN(OriginCheckpoint next, origin->Find("m"));
  EXPECT_EQ(next.files[0].object_version, id2);
  EXPECT_NE(next.version, listed.version);
  EXPECT_THAT(ReadDigest(*origin, next.files[0]), IsOkAndHolds(Sha256Hex(v2)));
}

TEST_F(S3VersionedBucketTest, AVersionDeletedSinceTheListingIsAborted) {
  ASSERT_OK_AND_ASSIGN(const std::string id1, Put(kVersioned, "m.safetensors", CheckpointOf(1)));
  std::unique_ptr<Origin> origin = MakeOrigin(kVersioned);
  ASSERT_NE(origin, nullptr);
  ASSERT_OK_AND_ASSIGN(OriginCheckpoint listed, origin->Find("m"));
  ASSERT_OK(Put(kVersioned, "m.safetensors", CheckpointOf(2)).status());
  ASSERT_OK(server_->DeleteVersion(kVersioned, absl::StrCat(prefix_, "/m.safetensors"), id1));
  // As a change of the object, not a checkpoint gone from the origin.
  EXPECT_THAT(ReadDigest(*origin, listed.files[0]),
              StatusIs(absl::StatusCode::kAborted,
                       AllOf(HasSubstr(prefix_ + "/m.safetensors"), HasSubstr("changed at the origin"), HasSubstr(id1),
                             HasSubstr("is gone"))));
}

TEST_F(S3VersionedBucketTest, ABucketThatKeepsNoVersionsPinsNothingAndAnOverwriteEndsTheRead) {
  ASSERT_OK_AND_ASSIGN(const std::string id, Put(kUnversioned, "m.safetensors", CheckpointOf(1)));
  EXPECT_EQ(id, "");
  std::unique_ptr<Origin> origin = MakeOrigin(kUnversioned);
  ASSERT_NE(origin, nullptr);
  ASSERT_OK_AND_ASSIGN(OriginCheckpoint listed, origin->Find("m"));
  EXPECT_EQ(listed.files[0].object_version, "");
  ASSERT_OK(Put(kUnversioned, "m.safetensors", CheckpointOf(2)).status());
  EXPECT_THAT(ReadDigest(*origin, listed.files[0]),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("changed at the origin")));
}

TEST_F(S3VersionedBucketTest, ANodeFinishesThePullOfTheVersionItListedWhileATrainerOverwritesIt) {
  const std::string v1 = CheckpointOf(1), v2 = CheckpointOf(2);
  ASSERT_OK(Put(kVersioned, "m.safetensors", v1).status());
  std::unique_ptr<Origin> s3 = MakeOrigin(kVersioned);
  ASSERT_NE(s3, nullptr);
  absl::Status overwrite;
  auto origin = std::make_unique<OverwrittenMidPull>(
      std::move(s3), [&] { overwrite = Put(kVersioned, "m.safetensors", v2).status(); });
  OverwrittenMidPull* seen = origin.get();
  CheckpointRegistry registry(RegistryOptions{.models_dir = MakeScratchDir("s3-versions-node")});
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<NodeCache> cache, NodeCache::Open(&registry, std::move(origin), {}));
  ASSERT_OK_AND_ASSIGN(PullResult pulled, cache->Pull("m"));
  ASSERT_OK(overwrite);
  EXPECT_EQ(pulled.bytes_pulled, v1.size());  // one pass: nothing started over
  EXPECT_EQ(Sha256Hex(ReadFileOrEmpty(registry.options().models_dir + "/m.safetensors")), Sha256Hex(v1));
  // The origin's version is the trainer's now: what a follower's next poll
  // takes.
  ASSERT_OK_AND_ASSIGN(OriginCheckpoint now, seen->Find("m"));
  ASSERT_OK_AND_ASSIGN(std::string polled, seen->Version("m"));
  EXPECT_EQ(polled, now.version);
  EXPECT_THAT(ReadDigest(*seen, now.files[0]), IsOkAndHolds(Sha256Hex(v2)));
}

}  // namespace
}  // namespace weightstore::origin

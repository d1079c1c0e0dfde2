// Pushes to a sharded SafeTensors checkpoint (an index and its shards): only
// the shards of the pushed tensors are written, all of them put in place as
// one step, and a crash between their renames is finished by the next scan.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "core/catalog/push.h"
#include "core/catalog/registry.h"
#include "core/crc32c.h"
#include "core/element_patch.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "core/status_macros.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;
using ::weightstore::testing::StatusIs;

// A tensor of `n` F32 values, each `value`: 1 MiB ones are mapped, not read.
SharedTensor F32(const std::string& name, size_t n, float value) {
  std::vector<float> values(n, value);
  std::string bytes(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  return SharedTensor{{name, DType::kF32, {n}}, SharedBytes::Copy(bytes)};
}

constexpr size_t kBig = 1 << 18;     // 1 MiB of F32
constexpr char kName[] = "m/model";  // m/model.safetensors.index.json

struct Stat {
  ino_t inode;
  int64_t mtime;
  bool operator==(const Stat&) const = default;
};
Stat StatOf(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return {st.st_ino, static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
}

// A publishing record's line: `new_file` (in `folder`) is to replace `shard`
// as they are now.
std::string RecordLine(const std::string& folder, const std::string& new_file, const std::string& shard) {
  struct stat from {
  }, to{};
  EXPECT_EQ(::stat((folder + "/" + new_file).c_str(), &from), 0) << new_file;
  EXPECT_EQ(::stat((folder + "/" + shard).c_str(), &to), 0) << shard;
  return absl::StrCat(new_file, "\t", shard, "\t", from.st_ino, "\t", to.st_ino, "\t", to.st_size, "\t",
                      static_cast<int64_t>(to.st_mtim.tv_sec) * 1000000000 + to.st_mtim.tv_nsec, "\n");
}

// m/model.safetensors.index.json over three shards: s1 {a}, s2 {b, c}, s3 {d},
// each shard with metadata of its own.
class ShardedPushTest : public ::testing::Test {
 protected:
  ShardedPushTest() : models_(testing::MakeScratchDir("sharded-push")) {
    fs::create_directories(folder());
    WriteShard("s1", {F32("a", kBig, 1)});
    WriteShard("s2", {F32("b", kBig, 2), F32("c", 4, 3)});
    WriteShard("s3", {F32("d", kBig, 4)});
    testing::WriteFileOrDie(
        index(),
        R"({"metadata": {"total_size": 3145744}, "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors", )"
        R"("c": "s2.safetensors", "d": "s3.safetensors"}})");
    Open();
  }
  void WriteShard(const std::string& shard, const std::vector<SharedTensor>& tensors) {
    testing::WriteFileOrDie(shard_path(shard),
                            *SerializeCheckpoint(kSafeTensorsFormat, tensors, {{"shard", shard}, {"format", "pt"}}));
  }
  void Open() {
    registry_ = std::make_unique<CheckpointRegistry>(RegistryOptions{.models_dir = models_, .tensor_digests = true});
    report_ = registry_->Rescan();
    base_ = registry_->Get(kName);
    ASSERT_NE(base_, nullptr) << ::testing::PrintToString(report_.errors);
  }
  std::string folder() const { return models_ + "/m"; }
  std::string index() const { return folder() + "/model.safetensors.index.json"; }
  std::string shard_path(const std::string& shard) const { return folder() + "/" + shard + ".safetensors"; }
  std::vector<std::string> FolderFiles() const {
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(folder())) files.push_back(e.path().filename());
    return files;
  }
  absl::StatusOr<std::shared_ptr<const CheckpointVersion>> Push(const std::vector<SharedTensor>& tensors,
                                                                PushOptions options) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto session, registry_->BeginPush(kName, std::move(options)));
    for (const SharedTensor& t : tensors) {
      WEIGHTSTORE_RETURN_IF_ERROR(session->BeginTensor(t.spec, Crc32c(t.bytes.view())));
      WEIGHTSTORE_RETURN_IF_ERROR(session->Append(t.bytes.view()));
    }
    return registry_->FinishPush(std::move(session));
  }

  std::string models_;
  std::unique_ptr<CheckpointRegistry> registry_;
  ScanReport report_;
  std::shared_ptr<const CheckpointVersion> base_;
};

TEST_F(ShardedPushTest, APushRewritesOnlyTheShardsOfItsTensorsAndSharesTheOthersMappings) {
  const Stat s1 = StatOf(shard_path("s1")), s2 = StatOf(shard_path("s2")), s3 = StatOf(shard_path("s3"));
  const Stat index_before = StatOf(index());
  // b as an element patch (as a follower sends it), c whole: both in s2.
  const SharedTensor b = F32("b", kBig, 2);
  std::vector<std::byte> after(b.bytes.data(), b.bytes.data() + b.bytes.size());
  reinterpret_cast<float*>(after.data())[7] = 70;
  ASSERT_OK_AND_ASSIGN(auto session, registry_->BeginPush(kName, {.base_version = base_->version()}));
  ElementPatch patch = *DiffElements(b.bytes.span(), after, 4);
  const std::string body(patch.body.view());
  patch.body = SharedBytes();
  ASSERT_OK(session->BeginPatchedTensor(b.spec, Crc32c(body), patch, body.size(), base_->manifest()->Find("b")->digest,
                                        DigestBytes(after)));
  ASSERT_OK(session->Append(body));
  const SharedTensor c = F32("c", 4, 30);
  ASSERT_OK(session->BeginTensor(c.spec, Crc32c(c.bytes.view())));
  ASSERT_OK(session->Append(c.bytes.view()));
  ASSERT_OK_AND_ASSIGN(auto pushed, registry_->FinishPush(std::move(session)));
  EXPECT_EQ(registry_->Get(kName), pushed);

  // Only s2 was written; the index, s1 and s3 are the same files.
  EXPECT_EQ(StatOf(shard_path("s1")), s1);
  EXPECT_EQ(StatOf(shard_path("s3")), s3);
  EXPECT_EQ(StatOf(index()), index_before);
  EXPECT_NE(StatOf(shard_path("s2")).inode, s2.inode);
  EXPECT_THAT(FolderFiles(), UnorderedElementsAre("model.safetensors.index.json", "s1.safetensors", "s2.safetensors",
                                                  "s3.safetensors"));
  // The unchanged shards are mapped once, for both versions.
  ASSERT_EQ(pushed->checkpoint()->files().size(), 3u);
  EXPECT_EQ(pushed->checkpoint()->files()[0], base_->checkpoint()->files()[0]);
  EXPECT_EQ(pushed->checkpoint()->files()[2], base_->checkpoint()->files()[2]);
  EXPECT_EQ(registry_->PushWriteStats().whole, 1u) << "s2's every tensor changed: written whole";
  EXPECT_NE(pushed->checkpoint()->files()[1], base_->checkpoint()->files()[1]);

  // What is on disk: the new values, s2's own metadata and order kept.
  ASSERT_OK_AND_ASSIGN(auto reopened, Checkpoint::Open(index()));
  EXPECT_EQ(reopened->Read("b")->bytes.view(),
            absl::string_view(reinterpret_cast<const char*>(after.data()), after.size()));
  EXPECT_EQ(reopened->Read("c")->bytes.view(), c.bytes.view());
  EXPECT_EQ(reopened->Read("a")->bytes.view(), base_->checkpoint()->Read("a")->bytes.view());
  EXPECT_EQ(reopened->metadata(), base_->checkpoint()->metadata());
  ASSERT_OK_AND_ASSIGN(auto s2_alone, Checkpoint::Open(shard_path("s2")));
  EXPECT_EQ(s2_alone->metadata().at("shard"), "s2");
  std::vector<std::string> order;
  for (const CheckpointEntry& e : pushed->checkpoint()->entries()) order.push_back(e.spec.name);
  EXPECT_THAT(order, ElementsAre("a", "b", "c", "d"));
  // Its id is its content's, as a rescan would name it; the digests agree
  // with digesting the files from scratch; clients of the base get patches.
  ASSERT_OK_AND_ASSIGN(auto fresh, ComputeManifest(*reopened, ""));
  EXPECT_EQ(pushed->version(), fresh->version());
  EXPECT_THAT(DiffManifests(*base_->manifest(), *pushed->manifest()).changed, ElementsAre("b", "c"));
  // Both versions stay servable: the base from its mappings, the new one is
  // not taken for changed on disk by the renames that put it in place.
  EXPECT_OK(pushed->CheckUnchanged());
  EXPECT_FALSE(pushed->stale());
  EXPECT_OK(base_->CheckUnchanged());
  EXPECT_EQ(base_->checkpoint()->Read("c")->bytes.view(), F32("c", 4, 3).bytes.view());
  // A rescan finds nothing new.
  const ScanReport again = registry_->Rescan();
  EXPECT_THAT(again.replaced, IsEmpty());
  EXPECT_EQ(registry_->Get(kName), pushed);
}

// A shard that keeps most of its bytes is its old file copied, the pushed
// tensor written over the copy: the same bytes as a whole write.
TEST_F(ShardedPushTest, AShardKeepingMostOfItsBytesIsItsOldFileCopiedWithThePushedTensorWrittenOver) {
  ASSERT_OK_AND_ASSIGN(auto session, registry_->BeginPush(kName, {.base_version = base_->version()}));
  const SharedTensor c = F32("c", 4, 30);
  ASSERT_OK(session->BeginTensor(c.spec, Crc32c(c.bytes.view())));
  ASSERT_OK(session->Append(c.bytes.view()));
  ASSERT_OK_AND_ASSIGN(auto pushed, registry_->FinishPush(std::move(session)));
  const CheckpointRegistry::PushWrites writes = registry_->PushWriteStats();
  EXPECT_EQ(writes.cloned + writes.copied, 1u) << "s2: b's 1 MiB kept, c's 16 bytes written over";
  EXPECT_EQ(writes.whole, 0u);
  EXPECT_EQ(testing::ReadFileOrEmpty(shard_path("s2")),
            *SerializeCheckpoint(kSafeTensorsFormat, {F32("b", kBig, 2), c}, {{"shard", "s2"}, {"format", "pt"}}));
  EXPECT_EQ(pushed->checkpoint()->Read("c")->bytes.view(), c.bytes.view());
}

TEST_F(ShardedPushTest, TensorsInSeveralShardsArePutInPlaceTogetherAndTheRecordIsGone) {
  const Stat s2 = StatOf(shard_path("s2"));
  ASSERT_OK_AND_ASSIGN(auto pushed, Push({F32("a", kBig, 10), F32("d", kBig, 40)}, {.base_version = base_->version()}));
  EXPECT_EQ(StatOf(shard_path("s2")), s2);
  EXPECT_THAT(FolderFiles(), UnorderedElementsAre("model.safetensors.index.json", "s1.safetensors", "s2.safetensors",
                                                  "s3.safetensors"));  // no record, no temporary
  ASSERT_OK_AND_ASSIGN(auto reopened, Checkpoint::Open(index()));
  EXPECT_EQ(reopened->Read("a")->bytes.view(), F32("a", kBig, 10).bytes.view());
  EXPECT_EQ(reopened->Read("d")->bytes.view(), F32("d", kBig, 40).bytes.view());
  EXPECT_OK(pushed->CheckUnchanged());
  // A second step from the first.
  ASSERT_OK_AND_ASSIGN(auto second, Push({F32("d", kBig, 41)}, {.base_version = pushed->version()}));
  EXPECT_EQ(second->checkpoint()->Read("d")->bytes.view(), F32("d", kBig, 41).bytes.view());
  EXPECT_EQ(second->checkpoint()->Read("a")->bytes.view(), F32("a", kBig, 10).bytes.view());
}

// A follower's push: the upstream's id, its tensors checked, and the same
// refusal of anything but replacing tensors in their shards.
TEST_F(ShardedPushTest, AFollowersPushTakesTheUpstreamsIdAndWhatAShardedPushCannotDoIsRefused) {
  std::vector<ManifestTensor> expected = base_->manifest()->tensors();
  const SharedTensor d = F32("d", kBig, 44);
  for (ManifestTensor& t : expected) {
    if (t.name == "d") t.digest = DigestBytes(d.bytes.span());
  }
  PushOptions follow{.base_version = base_->version(),
                     .version_id = "upstream-v2",
                     .metadata = base_->checkpoint()->metadata(),
                     .expected = expected};
  EXPECT_THAT(Push({F32("d", kBig, 45)}, follow),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tensor 'd' unlike the version expected")));
  EXPECT_EQ(registry_->Get(kName), base_);
  EXPECT_THAT(FolderFiles(), UnorderedElementsAre("model.safetensors.index.json", "s1.safetensors", "s2.safetensors",
                                                  "s3.safetensors"));

  PushOptions remove{.base_version = base_->version(), .remove = {"c"}};
  EXPECT_THAT(registry_->BeginPush(kName, remove),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("cannot add, remove or redefine")));
  PushOptions add{.base_version = base_->version(), .allow_new_tensors = true};
  EXPECT_THAT(registry_->BeginPush(kName, add), StatusIs(absl::StatusCode::kFailedPrecondition));
  PushOptions metadata{.base_version = base_->version(), .metadata = Metadata{{"total_size", "1"}}};
  EXPECT_THAT(registry_->BeginPush(kName, metadata),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("index's metadata")));
  EXPECT_THAT(Push({F32("b", 4, 1)}, {.base_version = base_->version()}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'b'")));

  // An upstream whose index orders or places the tensors otherwise.
  PushOptions reordered = follow;
  std::swap((*reordered.expected)[0], (*reordered.expected)[3]);
  EXPECT_THAT(registry_->BeginPush(kName, reordered),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("orders or places its tensors otherwise")));
  // A shard another index in the folder names too.
  testing::WriteFileOrDie(folder() + "/other.safetensors.index.json", R"({"weight_map": {"a": "s1.safetensors"}})");
  EXPECT_THAT(registry_->BeginPush(kName, follow),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("also named by the index")));
  fs::remove(folder() + "/other.safetensors.index.json");

  ASSERT_OK_AND_ASSIGN(auto pushed, Push({d}, follow));
  EXPECT_EQ(pushed->version(), "upstream-v2");
  EXPECT_EQ(pushed->checkpoint()->Read("d")->bytes.view(), d.bytes.view());
}

// A follower's step from S3 whose index moved a tensor between the same
// shards (c from s2 to s1): the new shards and the new index are put in place
// as one step, the index last, and served whole.
TEST_F(ShardedPushTest, ReplacingShardsWithANewIndexMovesTensorsBetweenTheSameShards) {
  const Stat s3 = StatOf(shard_path("s3"));
  const std::string staged = testing::MakeScratchDir("sharded-replace-staged");
  testing::WriteFileOrDie(staged + "/s1",
                          *SerializeCheckpoint(kSafeTensorsFormat, {F32("a", kBig, 1), F32("c", 4, 30)}, {}));
  testing::WriteFileOrDie(staged + "/s2", *SerializeCheckpoint(kSafeTensorsFormat, {F32("b", kBig, 2)}, {}));
  const std::string new_index =
      R"({"metadata": {"total_size": 3145744}, "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors", )"
      R"("c": "s1.safetensors", "d": "s3.safetensors"}})";
  testing::WriteFileOrDie(staged + "/index", new_index);
  // The index named first (ReplaceShards renames it after the shards: the
  // record's order, AScanFinishesAStepWhoseNewIndexACrashLeftUnrenamed).
  ASSERT_OK_AND_ASSIGN(auto published, registry_->ReplaceShards(*base_,
                                                                {{staged + "/index", index()},
                                                                 {staged + "/s1", shard_path("s1")},
                                                                 {staged + "/s2", shard_path("s2")}},
                                                                "v2", "a test's step"));
  EXPECT_EQ(registry_->Get(kName), published);
  EXPECT_EQ(published->version(), "v2");
  EXPECT_EQ(testing::ReadFileOrEmpty(index()), new_index);
  EXPECT_EQ(StatOf(shard_path("s3")), s3);
  EXPECT_THAT(FolderFiles(), UnorderedElementsAre("model.safetensors.index.json", "s1.safetensors", "s2.safetensors",
                                                  "s3.safetensors"));
  EXPECT_EQ(published->checkpoint()->Read("c")->bytes.view(), F32("c", 4, 30).bytes.view());
  ASSERT_OK_AND_ASSIGN(auto reopened, Checkpoint::Open(index()));
  EXPECT_EQ(reopened->Read("c")->bytes.view(), F32("c", 4, 30).bytes.view());
  EXPECT_EQ(reopened->Read("d")->bytes.view(), F32("d", kBig, 4).bytes.view());
  // Digests agree with the files from scratch; clients of the base get c.
  ASSERT_OK_AND_ASSIGN(auto fresh, ComputeManifest(*reopened, ""));
  for (const ManifestTensor& t : fresh->tensors()) {
    EXPECT_EQ(published->manifest()->Find(t.name)->digest, t.digest) << t.name;
  }
  EXPECT_THAT(DiffManifests(*base_->manifest(), *published->manifest()).changed, ElementsAre("c"));
  EXPECT_OK(base_->CheckUnchanged());
  EXPECT_THAT(registry_->Rescan().replaced, IsEmpty());
}

// A new index must name the shards it replaces under, no more and no fewer:
// one that drops a shard (d moved into s1) publishes nothing.
TEST_F(ShardedPushTest, ANewIndexNamingOtherShardsReplacesNothing) {
  const std::string index_before = testing::ReadFileOrEmpty(index());
  const Stat s1 = StatOf(shard_path("s1"));
  const std::string staged = testing::MakeScratchDir("sharded-replace-dropped");
  testing::WriteFileOrDie(staged + "/s1",
                          *SerializeCheckpoint(kSafeTensorsFormat, {F32("a", kBig, 1), F32("d", kBig, 4)}, {}));
  testing::WriteFileOrDie(
      staged + "/index",
      R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors", "c": "s2.safetensors", "d": "s1.safetensors"}})");
  EXPECT_THAT(registry_->ReplaceShards(*base_, {{staged + "/s1", shard_path("s1")}, {staged + "/index", index()}}, "v2",
                                       "a test's step"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not the 3 shards it replaces")));
  EXPECT_EQ(registry_->Get(kName), base_);
  EXPECT_EQ(testing::ReadFileOrEmpty(index()), index_before);
  EXPECT_EQ(StatOf(shard_path("s1")), s1);
  EXPECT_THAT(FolderFiles(), UnorderedElementsAre("model.safetensors.index.json", "s1.safetensors", "s2.safetensors",
                                                  "s3.safetensors"));
}

// A crash after the shards of a step with a new index were renamed, before
// the index: the next scan renames the index too, and serves the new version.
TEST_F(ShardedPushTest, AScanFinishesAStepWhoseNewIndexACrashLeftUnrenamed) {
  const std::string new_s1 = ".s1.safetensors.new.999999-5-1.tmp", new_s2 = ".s2.safetensors.new.999999-5-2.tmp",
                    new_index = ".model.safetensors.index.json.new.999999-5-3.tmp";
  testing::WriteFileOrDie(folder() + "/" + new_s1,
                          *SerializeCheckpoint(kSafeTensorsFormat, {F32("a", kBig, 1), F32("c", 4, 30)}, {}));
  testing::WriteFileOrDie(folder() + "/" + new_s2, *SerializeCheckpoint(kSafeTensorsFormat, {F32("b", kBig, 2)}, {}));
  testing::WriteFileOrDie(folder() + "/" + new_index,
                          R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors", )"
                          R"("c": "s1.safetensors", "d": "s3.safetensors"}})");
  testing::WriteFileOrDie(PublishingRecordPath(index()),
                          RecordLine(folder(), new_s1, "s1.safetensors") +
                              RecordLine(folder(), new_s2, "s2.safetensors") +
                              RecordLine(folder(), new_index, "model.safetensors.index.json"));
  ASSERT_EQ(std::rename((folder() + "/" + new_s1).c_str(), shard_path("s1").c_str()), 0);
  ASSERT_EQ(std::rename((folder() + "/" + new_s2).c_str(), shard_path("s2").c_str()), 0);

  Open();  // a daemon started again
  EXPECT_THAT(report_.errors, IsEmpty());
  EXPECT_THAT(report_.rolled_forward, ElementsAre(HasSubstr("1 of 3 files")));
  EXPECT_EQ(base_->checkpoint()->Read("c")->bytes.view(), F32("c", 4, 30).bytes.view());
  EXPECT_FALSE(fs::exists(PublishingRecordPath(index())));
  EXPECT_THAT(FolderFiles(), UnorderedElementsAre("model.safetensors.index.json", "s1.safetensors", "s2.safetensors",
                                                  "s3.safetensors"));
}

// A record whose new index names other shards than the index it replaces
// is no step weightstored wrote: nothing is renamed, and the checkpoint is
// held back until the record is removed.
TEST_F(ShardedPushTest, ARecordWhoseNewIndexNamesOtherShardsRenamesNothing) {
  const std::string new_index = ".model.safetensors.index.json.new.999999-5-3.tmp";
  testing::WriteFileOrDie(folder() + "/" + new_index,
                          R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors", "c": "s2.safetensors", )"
                          R"("d": "s2.safetensors"}})");
  const std::string index_before = testing::ReadFileOrEmpty(index());
  testing::WriteFileOrDie(PublishingRecordPath(index()),
                          RecordLine(folder(), new_index, "model.safetensors.index.json"));
  const ScanReport report = registry_->Rescan();
  EXPECT_THAT(report.errors, ElementsAre(HasSubstr("names other shards")));
  EXPECT_THAT(report.held_back, ElementsAre(index()));
  EXPECT_EQ(testing::ReadFileOrEmpty(index()), index_before);
  EXPECT_TRUE(fs::exists(folder() + "/" + new_index));
}

// A crash between a sharded push's renames: the next scan finishes them from
// the record, and serves the new version whole, never the mix.
TEST_F(ShardedPushTest, AScanFinishesTheRenamesOfAPushACrashInterrupted) {
  // What the push had written, and how far it got: s1 renamed, s3 not.
  const std::string new_s1 = ".s1.safetensors.new.999999-5-1.tmp", new_s3 = ".s3.safetensors.new.999999-5-2.tmp";
  testing::WriteFileOrDie(folder() + "/" + new_s1,
                          *SerializeCheckpoint(kSafeTensorsFormat, {F32("a", kBig, 11)}, {{"shard", "s1"}}));
  testing::WriteFileOrDie(folder() + "/" + new_s3,
                          *SerializeCheckpoint(kSafeTensorsFormat, {F32("d", kBig, 44)}, {{"shard", "s3"}}));
  testing::WriteFileOrDie(PublishingRecordPath(index()), RecordLine(folder(), new_s1, "s1.safetensors") +
                                                             RecordLine(folder(), new_s3, "s3.safetensors"));
  ASSERT_EQ(std::rename((folder() + "/" + new_s1).c_str(), shard_path("s1").c_str()), 0);

  Open();  // a daemon started again
  EXPECT_THAT(report_.errors, IsEmpty());
  EXPECT_THAT(report_.rolled_forward, ElementsAre(HasSubstr("1 of 2 files")));
  EXPECT_EQ(base_->checkpoint()->Read("a")->bytes.view(), F32("a", kBig, 11).bytes.view());
  EXPECT_EQ(base_->checkpoint()->Read("d")->bytes.view(), F32("d", kBig, 44).bytes.view());
  EXPECT_THAT(FolderFiles(), UnorderedElementsAre("model.safetensors.index.json", "s1.safetensors", "s2.safetensors",
                                                  "s3.safetensors"));
}

// A record whose step renamed nothing, over shards replaced since (an
// operator's copy): void. The operator's files are served, and nothing of
// the step is put in place.
TEST_F(ShardedPushTest, ARecordOverShardsReplacedSinceIsDroppedAndRenamesNothing) {
  const std::string new_s1 = ".s1.safetensors.new.999999-5-1.tmp";
  testing::WriteFileOrDie(folder() + "/" + new_s1, *SerializeCheckpoint(kSafeTensorsFormat, {F32("a", kBig, 11)}, {}));
  testing::WriteFileOrDie(PublishingRecordPath(index()), RecordLine(folder(), new_s1, "s1.safetensors"));
  std::this_thread::sleep_for(std::chrono::milliseconds(15));  // coarse timestamps
  WriteShard("s1", {F32("a", kBig, 7)});                       // the operator's, by rename
  Open();
  EXPECT_THAT(report_.errors, ElementsAre(HasSubstr("dropped, nothing was renamed")));
  EXPECT_FALSE(fs::exists(PublishingRecordPath(index())));
  EXPECT_EQ(base_->checkpoint()->Read("a")->bytes.view(), F32("a", kBig, 7).bytes.view());
}

// A record that disagrees with the shards after some were renamed: the
// checkpoint is not reopened from the mix, and the step's files are kept
// for the operator.
TEST_F(ShardedPushTest, ARecordThatDisagreesWithTheShardsHoldsTheCheckpointBack) {
  const std::string new_s1 = ".s1.safetensors.new.999999-5-1.tmp", new_s3 = ".s3.safetensors.new.999999-5-2.tmp";
  testing::WriteFileOrDie(folder() + "/" + new_s1, *SerializeCheckpoint(kSafeTensorsFormat, {F32("a", kBig, 11)}, {}));
  testing::WriteFileOrDie(folder() + "/" + new_s3, *SerializeCheckpoint(kSafeTensorsFormat, {F32("d", kBig, 44)}, {}));
  testing::WriteFileOrDie(PublishingRecordPath(index()), RecordLine(folder(), new_s1, "s1.safetensors") +
                                                             RecordLine(folder(), new_s3, "s3.safetensors"));
  ASSERT_EQ(std::rename((folder() + "/" + new_s1).c_str(), shard_path("s1").c_str()), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(15));
  WriteShard("s3", {F32("d", kBig, 9)});  // someone else's s3
  const std::string served = base_->version();
  const ScanReport report = registry_->Rescan();
  EXPECT_THAT(report.errors, ElementsAre(HasSubstr("neither the push's base nor its new files")));
  EXPECT_THAT(report.held_back, ElementsAre(index()));
  EXPECT_EQ(registry_->LastScan().held_back, 1u);
  EXPECT_EQ(registry_->LastScan().errors, 1u);
  EXPECT_EQ(registry_->Get(kName), base_) << "still the version served before";
  EXPECT_TRUE(fs::exists(PublishingRecordPath(index())));
  EXPECT_TRUE(fs::exists(folder() + "/" + new_s3));
  // A daemon started on it serves nothing of it until the record is gone.
  CheckpointRegistry fresh({.models_dir = models_, .tensor_digests = true});
  fresh.Rescan();
  EXPECT_EQ(fresh.Get(kName), nullptr);
  EXPECT_EQ(fresh.LastScan().held_back, 1u);
  fs::remove(PublishingRecordPath(index()));
  EXPECT_EQ(fresh.LastScan().held_back, 1u) << "until a scan sees the record gone";
  registry_->Rescan();
  EXPECT_EQ(registry_->LastScan().held_back, 0u);
  EXPECT_THAT(fresh.Rescan().held_back, IsEmpty());
  EXPECT_NE(fresh.Get(kName), nullptr);
  EXPECT_EQ(fresh.LastScan().held_back, 0u);
  EXPECT_EQ(fresh.LastScan().errors, 0u);
}

// Where no scan looks (a node's folder apart, loaded by path), the load
// finishes the renames.
TEST(ShardedPushLoadTest, ALoadByPathFinishesTheRenamesOfAPushACrashInterrupted) {
  const std::string models = testing::MakeScratchDir("sharded-push-apart");
  const std::string folder = models + "/.apart/x";
  fs::create_directories(folder);
  testing::WriteFileOrDie(folder + "/s1.safetensors", *SerializeCheckpoint(kSafeTensorsFormat, {F32("a", 4, 1)}, {}));
  testing::WriteFileOrDie(folder + "/s2.safetensors", *SerializeCheckpoint(kSafeTensorsFormat, {F32("b", 4, 2)}, {}));
  const std::string index = folder + "/checkpoint.safetensors.index.json";
  testing::WriteFileOrDie(index, R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})");
  const std::string new_s2 = ".s2.safetensors.new.999999-5-7.tmp";
  testing::WriteFileOrDie(folder + "/" + new_s2, *SerializeCheckpoint(kSafeTensorsFormat, {F32("b", 4, 20)}, {}));
  testing::WriteFileOrDie(PublishingRecordPath(index), RecordLine(folder, new_s2, "s2.safetensors"));

  CheckpointRegistry registry({.models_dir = models, .tensor_digests = true});
  registry.Rescan();
  EXPECT_TRUE(fs::exists(PublishingRecordPath(index))) << "no scan looks in a hidden folder";
  ASSERT_OK_AND_ASSIGN(auto loaded, registry.Load(index, "x"));
  EXPECT_EQ(loaded->checkpoint()->Read("b")->bytes.view(), F32("b", 4, 20).bytes.view());
  EXPECT_FALSE(fs::exists(PublishingRecordPath(index)));
  EXPECT_FALSE(fs::exists(folder + "/" + new_s2));
}

TEST_F(ShardedPushTest, ARecordThatIsNotAPushsIsLeftAloneAndRenamesNothing) {
  const Stat s1 = StatOf(shard_path("s1"));
  const std::string ours = ".s1.safetensors.new.1-1-1.tmp";
  testing::WriteFileOrDie(folder() + "/" + ours, "not a shard");
  testing::WriteFileOrDie(folder() + "/.x.new.1-1-1.tmp", "not a shard");
  testing::WriteFileOrDie(folder() + "/notes.txt", "an operator's file");
  const std::string good = RecordLine(folder(), ours, "s1.safetensors");
  struct Case {
    std::string what, lines;
    mode_t mode = 0644;
  };
  for (const Case& c : std::vector<Case>{
           {"a path out of the folder", absl::StrReplaceAll(good, {{ours, "../" + ours}})},
           {"a new file not named for its shard", RecordLine(folder(), ".x.new.1-1-1.tmp", "s1.safetensors")},
           {"a file the index does not name", RecordLine(folder(), ours, "notes.txt")},
           {"a shard out of the folder", absl::StrReplaceAll(good, {{"\ts1.safetensors", "\t../s1.safetensors"}})},
           {"no identities", ours + "\ts1.safetensors\n"},
           {"a record others may write", good, 0666},
           // Bounded by the index: a line per shard (3 here) of two names and four numbers each.
           {"a record over its bound", good + std::string(4 * (2 * 256 + 4 * 21), '#')},
       }) {
    SCOPED_TRACE(c.what);
    testing::WriteFileOrDie(PublishingRecordPath(index()), c.lines);
    ASSERT_EQ(::chmod(PublishingRecordPath(index()).c_str(), c.mode), 0);
    const std::string served = base_->version();
    const ScanReport report = registry_->Rescan();
    EXPECT_THAT(report.errors, ElementsAre(HasSubstr("nothing was renamed")));
    EXPECT_THAT(report.rolled_forward, IsEmpty());
    EXPECT_EQ(StatOf(shard_path("s1")), s1);
    EXPECT_TRUE(fs::exists(PublishingRecordPath(index())));
    EXPECT_EQ(registry_->Get(kName)->version(), served);
    if (c.what == "a record over its bound") {
      EXPECT_THAT(report.errors, ElementsAre(HasSubstr("is over 2384 bytes")));
    }
  }
}

// A file named only for the suffix is nobody's record: it holds nothing back,
// and abandoned temporaries beside it are still cleaned.
TEST_F(ShardedPushTest, AFileNamedOnlyForTheRecordsSuffixIsNoRecord) {
  testing::WriteFileOrDie(folder() + "/.publishing", "s1.safetensors");
  const std::string abandoned = folder() + "/.s2.safetensors.new.999999-5-9.tmp";
  testing::WriteFileOrDie(abandoned, "left by a crash");
  CheckpointRegistry fresh({.models_dir = models_, .abandoned_temporary_seconds = 0, .tensor_digests = true});
  const ScanReport report = fresh.Rescan();
  EXPECT_THAT(report.errors, IsEmpty());
  EXPECT_NE(fresh.Get(kName), nullptr);
  EXPECT_THAT(report.cleaned, ElementsAre(abandoned));
  EXPECT_TRUE(fs::exists(folder() + "/.publishing")) << "not ours to remove";
}

}  // namespace
}  // namespace weightstore

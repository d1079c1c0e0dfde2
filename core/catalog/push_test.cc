#include "core/catalog/push.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <optional>
#include <thread>

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

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

SharedTensor F32(const std::string& name, std::vector<float> values) {
  std::string bytes(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  return SharedTensor{{name, DType::kF32, {values.size()}}, SharedBytes::Copy(bytes)};
}

class PushTest : public ::testing::Test {
 protected:
  PushTest() : models_(testing::MakeScratchDir("push")), registry_({.models_dir = models_, .tensor_digests = true}) {
    testing::WriteFileOrDie(
        path(), *SerializeCheckpoint(kSafeTensorsFormat, {F32("a", {1, 2}), F32("b", {3, 4}), F32("c", {5, 6})},
                                     {{"trainer", "step-0"}}));
    registry_.Rescan();
    base_ = registry_.Get("m");
  }
  std::string path() const { return models_ + "/m.safetensors"; }
  // Pushes `tensors` in full; returns BeginPush's, BeginTensor's, Append's or
  // FinishPush's first error.
  absl::StatusOr<std::shared_ptr<const CheckpointVersion>> Push(const std::vector<SharedTensor>& tensors,
                                                                PushOptions options) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto session, registry_.BeginPush("m", std::move(options)));
    for (const SharedTensor& t : tensors) {
      WEIGHTSTORE_RETURN_IF_ERROR(session->BeginTensor(t.spec, Crc32c(t.bytes.view())));
      WEIGHTSTORE_RETURN_IF_ERROR(session->Append(t.bytes.view()));
    }
    return registry_.FinishPush(std::move(session));
  }
  // A push of new values for "b", not yet finished.
  std::unique_ptr<PushSession> PushOfB() {
    auto session = registry_.BeginPush("m", {.base_version = base_->version()});
    EXPECT_OK(session.status());
    SharedTensor b = F32("b", {30, 40});
    EXPECT_OK((*session)->BeginTensor(b.spec, Crc32c(b.bytes.view())));
    EXPECT_OK((*session)->Append(b.bytes.view()));
    return *std::move(session);
  }
  // Replaces the checkpoint file the way someone else would (by rename), with
  // a one-tensor checkpoint; returns its bytes.
  std::string ReplaceFromOutside() {
    std::this_thread::sleep_for(std::chrono::milliseconds(15));  // coarse timestamps
    const std::string temporary = path() + ".tmp-other";
    const std::string theirs = *SerializeCheckpoint(kSafeTensorsFormat, {F32("a", {0, 0})}, {});
    testing::WriteFileOrDie(temporary, theirs);
    EXPECT_EQ(std::rename(temporary.c_str(), path().c_str()), 0);
    return theirs;
  }
  // The folder holds the checkpoint alone (no staging or writer temporaries),
  // and it still holds the base's bytes.
  void ExpectNothingChanged() {
    EXPECT_EQ(registry_.Get("m"), base_);
    std::vector<std::string> files;
    for (const auto& e : std::filesystem::directory_iterator(models_)) files.push_back(e.path().filename());
    EXPECT_THAT(files, ElementsAre("m.safetensors"));
    auto reopened = Checkpoint::Open(path());
    ASSERT_OK(reopened.status());
    EXPECT_EQ((*reopened)->Read("b")->bytes.view(), base_->checkpoint()->Read("b")->bytes.view());
  }

  std::string models_;
  CheckpointRegistry registry_;
  std::shared_ptr<const CheckpointVersion> base_;
};

TEST_F(PushTest, APushWritesTheWholeCheckpointWithTheChangedTensorsAndServesIt) {
  ASSERT_OK_AND_ASSIGN(auto pushed, Push({F32("b", {30, 40})}, {.base_version = base_->version()}));
  EXPECT_NE(pushed->version(), base_->version());
  EXPECT_EQ(registry_.Get("m"), pushed);
  ASSERT_OK_AND_ASSIGN(auto reopened, Checkpoint::Open(path()));  // what is on disk
  for (const char* name : {"a", "c"}) {
    EXPECT_EQ(reopened->Read(name)->bytes.view(), base_->checkpoint()->Read(name)->bytes.view()) << name;
  }
  EXPECT_EQ(reopened->Read("b")->bytes.view(), F32("b", {30, 40}).bytes.view());
  EXPECT_EQ(reopened->metadata().at("trainer"), "step-0");
  // Digests: the unchanged ones carried over, the pushed one computed, and
  // both agree with digesting the file from scratch.
  ASSERT_OK_AND_ASSIGN(auto fresh, ComputeManifest(*reopened, ""));
  for (const ManifestTensor& t : fresh->tensors()) {
    EXPECT_EQ(pushed->manifest()->Find(t.name)->digest, t.digest) << t.name;
  }
  ASSERT_NE(registry_.FindManifest("m", base_->version()), nullptr);
  const ManifestDiff diff = DiffManifests(*base_->manifest(), *pushed->manifest());
  EXPECT_THAT(diff.changed, ElementsAre("b"));
  EXPECT_EQ(diff.unchanged, 2u);
}

// A client told of the new version (a listener runs before FinishPush
// returns) finds only the checkpoint in the folder: the push's staging
// temporary and the writer's are gone by then.
TEST_F(PushTest, NoTemporaryOfAPushOutlivesThePublishOfItsVersion) {
  std::vector<std::string> seen;
  bool told = false;
  registry_.AddListener([&](const std::string& name) {
    if (name != "m") return;
    told = true;
    for (const auto& e : std::filesystem::directory_iterator(models_)) seen.push_back(e.path().filename());
  });
  ASSERT_OK_AND_ASSIGN(auto pushed, Push({F32("b", {30, 40})}, {.base_version = base_->version()}));
  EXPECT_NE(pushed->version(), base_->version());
  EXPECT_TRUE(told);
  EXPECT_THAT(seen, ElementsAre("m.safetensors"));
}

// A follower's fetch checks each chunk's CRC32C as it lands, so its push
// gives none; the tensor is still checked against the digest expected. A
// CRC given is checked.
TEST_F(PushTest, ATensorPushedWithoutACrcIsStillCheckedAgainstTheDigestExpected) {
  std::vector<ManifestTensor> expected = base_->manifest()->tensors();
  const SharedTensor b = F32("b", {30, 40});
  expected[1].digest = DigestBytes(std::span<const std::byte>(b.bytes.data(), b.bytes.size()));
  PushOptions follow{.base_version = base_->version(), .version_id = "upstream-v2", .expected = expected};
  auto push = [&](const SharedTensor& t, std::optional<uint32_t> crc) -> absl::Status {
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto session, registry_.BeginPush("m", follow));
    WEIGHTSTORE_RETURN_IF_ERROR(session->BeginTensor(t.spec, crc));
    WEIGHTSTORE_RETURN_IF_ERROR(session->Append(t.bytes.view()));
    return registry_.FinishPush(std::move(session)).status();
  };
  EXPECT_THAT(push(F32("b", {30, 41}), std::nullopt),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tensor 'b' unlike the version expected")));
  EXPECT_THAT(push(b, Crc32c(b.bytes.view()) ^ 1u),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tensor 'b' failed its CRC32C check")));
  ExpectNothingChanged();
  EXPECT_OK(push(b, std::nullopt));
  EXPECT_EQ(registry_.Get("m")->version(), "upstream-v2");
}

// A follower's push copies a version its upstream published: its id, its
// metadata, and exactly its tensors, or nothing.
TEST_F(PushTest, AFollowersPushTakesTheUpstreamsIdAndMetadataAndPublishesOnlyTheTensorsExpected) {
  // What the upstream published: b changed, the metadata too.
  std::vector<ManifestTensor> expected = base_->manifest()->tensors();
  const SharedTensor b = F32("b", {30, 40});
  expected[1].digest = DigestBytes(std::span<const std::byte>(b.bytes.data(), b.bytes.size()));
  PushOptions follow{.base_version = base_->version(),
                     .version_id = "upstream-v2",
                     .metadata = Metadata{{"trainer", "step-1"}},
                     .expected = expected};

  // Other bytes than expected: DataLoss naming the tensor, nothing published.
  EXPECT_THAT(Push({F32("b", {30, 41})}, follow),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tensor 'b' unlike the version expected")));
  ExpectNothingChanged();
  // A tensor fewer or more than expected.
  PushOptions fewer = follow;
  fewer.expected->pop_back();
  EXPECT_THAT(Push({b}, fewer), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("wrote tensor 'c'")));
  PushOptions more = follow;
  more.expected->push_back({"d", DType::kF32, {1}, expected[0].digest});
  EXPECT_THAT(Push({b}, more), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("lacks tensor 'd'")));
  ExpectNothingChanged();
  // An id no version may take.
  PushOptions bad_id = follow;
  bad_id.version_id = "v/../2";
  EXPECT_THAT(Push({b}, bad_id), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("version id")));

  ASSERT_OK_AND_ASSIGN(auto pushed, Push({b}, follow));
  EXPECT_EQ(pushed->version(), "upstream-v2");
  EXPECT_EQ(pushed->manifest()->version(), "upstream-v2");
  EXPECT_EQ(pushed->checkpoint()->metadata().at("trainer"), "step-1");
  ASSERT_OK_AND_ASSIGN(auto reopened, Checkpoint::Open(path()));
  EXPECT_EQ(reopened->metadata().at("trainer"), "step-1");
  EXPECT_EQ(reopened->Read("b")->bytes.view(), b.bytes.view());
  // Clients of the base get the step as a delta from here.
  EXPECT_NE(registry_.FindManifest("m", base_->version()), nullptr);

  // A version that differs upstream by its metadata alone is a push too.
  PushOptions metadata_only{.base_version = pushed->version(),
                            .version_id = "upstream-v3",
                            .metadata = Metadata{{"trainer", "step-2"}},
                            .expected = expected};
  ASSERT_OK_AND_ASSIGN(auto relabelled, Push({}, metadata_only));
  EXPECT_EQ(relabelled->version(), "upstream-v3");
  EXPECT_EQ(relabelled->checkpoint()->metadata().at("trainer"), "step-2");

  // The upstream re-saved the same tensors in another order: the same
  // tensors here, under the upstream's new id, in its order (so contiguous
  // index ranges select alike on both).
  std::vector<ManifestTensor> reordered = {expected[2], expected[0], expected[1]};
  PushOptions twice{.base_version = relabelled->version(),
                    .version_id = "upstream-v4",
                    .metadata = Metadata{{"trainer", "step-2"}},
                    .expected = reordered};
  twice.expected->push_back(expected[0]);
  EXPECT_THAT(Push({}, twice), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("expects tensor 'a' twice")));
  ASSERT_OK_AND_ASSIGN(auto resaved, Push({}, {.base_version = relabelled->version(),
                                               .version_id = "upstream-v4",
                                               .metadata = Metadata{{"trainer", "step-2"}},
                                               .expected = reordered}));
  EXPECT_EQ(resaved->version(), "upstream-v4");
  std::vector<std::string> order;
  for (const auto& e : resaved->checkpoint()->entries()) order.push_back(e.spec.name);
  EXPECT_THAT(order, ElementsAre("c", "a", "b"));
  // Nothing new at all is still refused.
  EXPECT_THAT(Push({}, {.base_version = resaved->version(),
                        .version_id = "upstream-v4",
                        .metadata = Metadata{{"trainer", "step-2"}},
                        .expected = reordered}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("changes nothing")));
}

TEST_F(PushTest, NewTensorsGoLastAndRemovedOnesAreLeftOut) {
  EXPECT_THAT(Push({F32("d", {7})}, {.base_version = base_->version()}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("allow_new_tensors")));
  ASSERT_OK_AND_ASSIGN(
      auto pushed,
      Push({F32("d", {7})}, {.base_version = base_->version(), .remove = {"a"}, .allow_new_tensors = true}));
  std::vector<std::string> names;
  for (const auto& e : pushed->checkpoint()->entries()) names.push_back(e.spec.name);
  EXPECT_THAT(names, ElementsAre("b", "c", "d"));
}

TEST_F(PushTest, BadPushesAreRefusedNamingTheTensorAndChangeNothing) {
  const PushOptions on_base{.base_version = base_->version()};
  SharedTensor f64{{"b", DType::kF64, {2}}, SharedBytes::Copy(std::string(16, '\0'))};
  EXPECT_THAT(Push({f64}, on_base), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'b' is F64 [2]")));
  EXPECT_THAT(Push({F32("b", {1, 2, 3})}, on_base),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("F32 [2] in version")));
  EXPECT_THAT(Push({F32("b", {1, 2}), F32("b", {1, 2})}, on_base),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pushed twice")));
  EXPECT_THAT(Push({}, {.base_version = "not-it"}), StatusIs(absl::StatusCode::kAborted, HasSubstr("not-it")));
  EXPECT_THAT(Push({}, {.base_version = base_->version(), .remove = {"zz"}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'zz'")));
  EXPECT_THAT(Push({F32("a", {1, 2})}, {.base_version = base_->version(), .remove = {"a"}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("also removed")));
  {  // a wrong checksum, and bytes past the tensor
    ASSERT_OK_AND_ASSIGN(auto session, registry_.BeginPush("m", on_base));
    ASSERT_OK(session->BeginTensor(F32("b", {9, 9}).spec, 12345));
    ASSERT_OK(session->Append(F32("b", {9, 9}).bytes.view()));
    EXPECT_THAT(session->Append("x"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has 8 bytes")));
    EXPECT_THAT(registry_.FinishPush(std::move(session)), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("CRC32C")));
  }
  {  // a tensor cut short
    ASSERT_OK_AND_ASSIGN(auto session, registry_.BeginPush("m", on_base));
    ASSERT_OK(session->BeginTensor(F32("b", {9, 9}).spec, 0));
    ASSERT_OK(session->Append("abc"));
    EXPECT_THAT(registry_.FinishPush(std::move(session)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ended after 3 of 8 bytes")));
  }
  {  // abandoned midway
    ASSERT_OK_AND_ASSIGN(auto session, registry_.BeginPush("m", on_base));
    ASSERT_OK(session->BeginTensor(F32("b", {9, 9}).spec, 0));
  }
  ExpectNothingChanged();
}

TEST_F(PushTest, APushWhoseBaseWasReplacedMeanwhilePublishesNothing) {
  std::unique_ptr<PushSession> session = PushOfB();
  const std::string theirs = ReplaceFromOutside();
  registry_.Rescan();
  auto other = registry_.Get("m");
  ASSERT_NE(other, base_);
  EXPECT_THAT(registry_.FinishPush(std::move(session)),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("was replaced or unloaded meanwhile")));
  EXPECT_EQ(registry_.Get("m"), other);
  EXPECT_EQ(testing::ReadFileOrEmpty(path()), theirs);
}

TEST_F(PushTest, AFileReplacedOutsideTheDaemonDuringAPushIsNotOverwritten) {
  // An operator's `mv` the daemon has not rescanned yet: the push must not
  // silently undo it.
  std::unique_ptr<PushSession> session = PushOfB();
  const std::string theirs = ReplaceFromOutside();
  EXPECT_THAT(registry_.FinishPush(std::move(session)),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("replaced outside weightstored")));
  EXPECT_EQ(testing::ReadFileOrEmpty(path()), theirs);
  EXPECT_EQ(registry_.Get("m"), base_);
  std::vector<std::string> files;  // no staged or written file left behind
  for (const auto& e : std::filesystem::directory_iterator(models_)) files.push_back(e.path().filename());
  EXPECT_THAT(files, ElementsAre("m.safetensors"));
}

TEST_F(PushTest, APushToACheckpointUnloadedMeanwhileDoesNotBringItBack) {
  std::unique_ptr<PushSession> session = PushOfB();
  ASSERT_OK(registry_.Unload("m"));
  EXPECT_THAT(registry_.FinishPush(std::move(session)), StatusIs(absl::StatusCode::kAborted, HasSubstr("unloaded")));
  EXPECT_EQ(registry_.Get("m"), nullptr);
}

TEST_F(PushTest, AnEmptyPushIsRefusedAndARemovedTensorCanBeRedefined) {
  EXPECT_THAT(Push({}, {.base_version = base_->version()}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("changes nothing")));
  SharedTensor wider{{"b", DType::kF32, {3}}, F32("b", {7, 8, 9}).bytes};
  ASSERT_OK_AND_ASSIGN(auto pushed,
                       Push({wider}, {.base_version = base_->version(), .remove = {"b"}, .allow_new_tensors = true}));
  std::vector<std::string> names;
  for (const auto& e : pushed->checkpoint()->entries()) names.push_back(e.spec.name);
  EXPECT_THAT(names, ElementsAre("a", "b", "c"));  // in its place
  EXPECT_EQ(pushed->checkpoint()->Find("b")->spec.shape, std::vector<uint64_t>{3});
  EXPECT_THAT(DiffManifests(*base_->manifest(), *pushed->manifest()).changed, ElementsAre("b"));
}

TEST(PushPathTest, ACheckpointReachedThroughASymlinkIsNotRewritten) {
  const std::string models = testing::MakeScratchDir("push-link");
  const std::string elsewhere = testing::MakeScratchDir("push-elsewhere");
  testing::WriteFileOrDie(elsewhere + "/real.safetensors",
                          *SerializeCheckpoint(kSafeTensorsFormat, {F32("a", {1})}, {}));
  std::filesystem::create_symlink(elsewhere + "/real.safetensors", models + "/m.safetensors");
  CheckpointRegistry registry({.models_dir = models});
  registry.Rescan();
  ASSERT_NE(registry.Get("m"), nullptr);
  EXPECT_THAT(registry.BeginPush("m", {.base_version = registry.Get("m")->version()}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("symlink")));
}

TEST(PushFormatTest, APyTorchCheckpointCannotBePushedTo) {
  const std::string models = testing::MakeScratchDir("push-pt");
  std::filesystem::create_symlink(testing::FixturesDir() + "/burn/pytorch-reader/float32.pt", models + "/f.pt");
  CheckpointRegistry registry({.models_dir = models});
  registry.Rescan();
  ASSERT_NE(registry.Get("f"), nullptr);
  EXPECT_THAT(registry.BeginPush("f", {.base_version = registry.Get("f")->version()}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("pytorch")));
}

// A push of "b" as an element patch from the base's {3, 4} to `values`, with
// the fields a test may spoil.
struct PatchedPush {
  TensorSpec spec{"b", DType::kF32, {2}};
  ElementPatch patch;
  std::string body;             // sent through Append
  uint64_t patch_bytes;         // announced
  std::optional<uint32_t> crc;  // announced (none: not checked, as a follower's)
  TensorDigest base, digest;
};

PatchedPush PatchOfB(const CheckpointVersion& base, std::vector<float> values) {
  const SharedTensor after = F32("b", values);
  PatchedPush p;
  p.patch = *DiffElements(base.checkpoint()->Read("b")->bytes.span(), after.bytes.span(), 4);
  p.body = std::string(p.patch.body.view());
  p.patch_bytes = p.body.size();
  p.crc = Crc32c(p.body);
  p.base = base.manifest()->Find("b")->digest;
  p.digest = DigestBytes(after.bytes.span());
  return p;
}

absl::StatusOr<std::shared_ptr<const CheckpointVersion>> Send(CheckpointRegistry& registry,
                                                              const CheckpointVersion& base, const PatchedPush& p) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto session, registry.BeginPush("m", {.base_version = base.version()}));
  ElementPatch header = p.patch;
  header.body = SharedBytes();
  WEIGHTSTORE_RETURN_IF_ERROR(session->BeginPatchedTensor(p.spec, p.crc, header, p.patch_bytes, p.base, p.digest));
  WEIGHTSTORE_RETURN_IF_ERROR(session->Append(p.body));
  return registry.FinishPush(std::move(session));
}

TEST_F(PushTest, APatchedPushStreamsTheBaseThroughThePatchAndServesTheResult) {
  const PatchedPush p = PatchOfB(*base_, {3, 40});
  EXPECT_LT(p.body.size(), 8u);  // smaller than the tensor
  ASSERT_OK_AND_ASSIGN(auto pushed, Send(registry_, *base_, p));
  ASSERT_OK_AND_ASSIGN(auto reopened, Checkpoint::Open(path()));
  EXPECT_EQ(reopened->Read("b")->bytes.view(), F32("b", {3, 40}).bytes.view());
  EXPECT_EQ(reopened->Read("a")->bytes.view(), base_->checkpoint()->Read("a")->bytes.view());
  EXPECT_EQ(pushed->manifest()->Find("b")->digest, p.digest);
  EXPECT_EQ(pushed->version(), ComputeManifest(*reopened, "").value()->version());
}

// A follower's patch comes with no CRC32C (its fetch checked it): applied
// and checked against its digest all the same.
TEST_F(PushTest, APatchedPushWithoutACrcIsAppliedAndCheckedAgainstItsDigest) {
  PatchedPush p = PatchOfB(*base_, {3, 40});
  p.crc = std::nullopt;
  ASSERT_OK_AND_ASSIGN(auto pushed, Send(registry_, *base_, p));
  EXPECT_EQ(pushed->manifest()->Find("b")->digest, p.digest);
  ASSERT_OK_AND_ASSIGN(auto reopened, Checkpoint::Open(path()));
  EXPECT_EQ(reopened->Read("b")->bytes.view(), F32("b", {3, 40}).bytes.view());
}

TEST_F(PushTest, BadPatchedPushesAreRefusedNamingTheTensorAndChangeNothing) {
  struct Case {
    const char* what;
    std::function<void(PatchedPush&)> spoil;
    absl::StatusCode code;
    const char* error;
  };
  const Case cases[] = {
      {"a base that moved", [](PatchedPush& p) { p.base.low ^= 1; }, absl::StatusCode::kAborted,
       "was made against bytes with digest"},
      {"a result unlike its digest", [](PatchedPush& p) { p.digest.low ^= 1; }, absl::StatusCode::kInvalidArgument,
       "makes bytes with digest"},
      {"a position past the tensor",
       [](PatchedPush& p) {
         p.body = std::string("\x01\x05xxxx", 6);
         p.crc = Crc32c(p.body);
       },
       absl::StatusCode::kInvalidArgument, "reaches past the tensor"},
      {"values in excess",
       [](PatchedPush& p) {
         p.body = std::string("\x01\x00xxxx", 6);
         p.patch_bytes = 7;
         p.body += "y";
         p.crc = Crc32c(p.body);
       },
       absl::StatusCode::kInvalidArgument, "5 bytes of values"},
      {"a patch as large as the tensor", [](PatchedPush& p) { p.patch_bytes = 8; },
       absl::StatusCode::kResourceExhausted, "smaller than its tensor (8)"},
      {"another element size", [](PatchedPush& p) { p.patch.element_size = 2; }, absl::StatusCode::kInvalidArgument,
       "elements of 2 bytes"},
      {"another dtype", [](PatchedPush& p) { p.spec.dtype = DType::kI32; }, absl::StatusCode::kInvalidArgument,
       "is I32 [2], but F32 [2]"},
      {"a tensor the base lacks", [](PatchedPush& p) { p.spec.name = "z"; }, absl::StatusCode::kInvalidArgument,
       "has none by that name"},
      {"a bad checksum", [](PatchedPush& p) { p.crc = *p.crc ^ 1u; }, absl::StatusCode::kDataLoss, "CRC32C"},
      {"no checksum, and a result unlike its digest",
       [](PatchedPush& p) {
         p.crc = std::nullopt;
         p.digest.low ^= 1;
       },
       absl::StatusCode::kInvalidArgument, "makes bytes with digest"},
      {"no checksum, and a position past the tensor",
       [](PatchedPush& p) {
         p.body = std::string("\x01\x05xxxx", 6);
         p.crc = std::nullopt;
       },
       absl::StatusCode::kInvalidArgument, "reaches past the tensor"},
      {"bytes past the patch", [](PatchedPush& p) { p.patch_bytes = p.body.size() - 1; },
       absl::StatusCode::kInvalidArgument, "more arrived"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    PatchedPush p = PatchOfB(*base_, {3, 40});
    c.spoil(p);
    absl::StatusOr<std::shared_ptr<const CheckpointVersion>> pushed = Send(registry_, *base_, p);
    EXPECT_THAT(pushed, StatusIs(c.code, HasSubstr(c.error)));
    EXPECT_THAT(pushed.status().message(), HasSubstr("'m'"));
    ExpectNothingChanged();
  }
  // The daemon's bound on a patch's memory, checked from its header.
  CheckpointRegistry tight({.models_dir = models_, .max_push_patch_bytes = 4, .tensor_digests = true});
  tight.Rescan();
  EXPECT_THAT(Send(tight, *tight.Get("m"), PatchOfB(*tight.Get("m"), {3, 40})),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("at most 4")));
}

// A pushed file large enough to be mapped is served as it was opened: the
// rename that puts it in place (which moves its ctime) does not make the
// version just published look changed on disk.
TEST(PushMappedTest, AVersionPublishedFromAMappedFileIsNotStaleOnceInPlace) {
  const std::string models = testing::MakeScratchDir("push-mapped");
  std::vector<float> big(1 << 18, 1.0f);  // 1 MiB: over the mmap threshold
  testing::WriteFileOrDie(models + "/m.safetensors",
                          *SerializeCheckpoint(kSafeTensorsFormat, {F32("a", big), F32("b", {3, 4})}, {}));
  CheckpointRegistry registry({.models_dir = models, .tensor_digests = true});
  registry.Rescan();
  auto base = registry.Get("m");
  ASSERT_TRUE(base->checkpoint()->files()[0]->is_mapped());
  ASSERT_OK_AND_ASSIGN(auto session, registry.BeginPush("m", {.base_version = base->version()}));
  const SharedTensor b = F32("b", {30, 40});
  ASSERT_OK(session->BeginTensor(b.spec, Crc32c(b.bytes.view())));
  ASSERT_OK(session->Append(b.bytes.view()));
  ASSERT_OK_AND_ASSIGN(auto pushed, registry.FinishPush(std::move(session)));
  ASSERT_TRUE(pushed->checkpoint()->files()[0]->is_mapped());
  EXPECT_OK(pushed->CheckUnchanged());
  EXPECT_FALSE(pushed->stale());
  EXPECT_OK(base->CheckUnchanged());  // still served to whoever holds it
  EXPECT_EQ(registry.Get("m"), pushed);
}

}  // namespace
}  // namespace weightstore

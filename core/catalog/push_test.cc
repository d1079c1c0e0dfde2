#include "core/catalog/push.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <thread>

#include "core/catalog/registry.h"
#include "core/crc32c.h"
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
              StatusIs(absl::StatusCode::kAborted, HasSubstr("was replaced or unloaded while the push was sent")));
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

}  // namespace
}  // namespace weightstore

#include "core/catalog/version_patches.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <random>

#include "core/catalog/manifest.h"
#include "core/catalog/push.h"
#include "core/catalog/registry.h"
#include "core/crc32c.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

namespace fs = std::filesystem;

SharedTensor F32(const std::string& name, const std::vector<float>& values) {
  std::string bytes(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  return SharedTensor{{name, DType::kF32, {values.size()}}, SharedBytes::Copy(bytes)};
}

// A step of training: 1% of `values` move.
std::vector<float> Step(std::vector<float> values, uint32_t seed) {
  std::mt19937 rng(seed);
  for (size_t i = 0; i < values.size() / 100; ++i) values[rng() % values.size()] += 1.0f;
  return values;
}

class VersionPatchesTest : public ::testing::Test {
 protected:
  VersionPatchesTest() : models_(testing::MakeScratchDir("patches")) {}

  // Publishes `tensors` as m.safetensors the way a trainer would: a new file
  // renamed over the old one.
  void Publish(const std::vector<SharedTensor>& tensors) {
    const std::string path = models_ + "/m.safetensors";
    testing::WriteFileOrDie(path + ".next", *SerializeCheckpoint(kSafeTensorsFormat, tensors, {}));
    fs::rename(path + ".next", path);
  }
  // The tensors of the served version.
  std::vector<float> Served(const CheckpointRegistry& registry, const std::string& name) {
    auto version = registry.Get("m");
    for (const auto& e : version->checkpoint()->entries()) {
      if (e.spec.name != name) continue;
      auto t = version->checkpoint()->Read(e);
      EXPECT_OK(t.status());
      std::vector<float> out(t->bytes.size() / 4);
      std::memcpy(out.data(), t->bytes.data(), t->bytes.size());
      return out;
    }
    return {};
  }
  // `before` with the chain's patch of `name` applied.
  std::vector<float> Patched(const PatchChain& chain, const std::string& name, std::vector<float> before) {
    absl::StatusOr<std::optional<ElementPatch>> patch = chain.For(name);
    EXPECT_OK(patch.status());
    EXPECT_TRUE(patch.ok() && patch->has_value()) << name;
    if (!patch.ok() || !patch->has_value()) return {};
    EXPECT_OK(ApplyPatch(**patch, std::as_writable_bytes(std::span(before))));
    return before;
  }

  std::string models_;
};

TEST_F(VersionPatchesTest, ARescanDiffsAReplacedFileAndALateJoinerGetsOneComposedPatch) {
  CheckpointRegistry registry({.models_dir = models_, .tensor_digests = true, .kept_patch_bytes = 1 << 20});
  std::vector<float> w0(8192, 0.5f), b0(16, 1.0f);
  Publish({F32("w", w0), F32("b", b0), F32("same", {7, 7})});
  registry.Rescan();
  const std::string v0 = registry.Get("m")->version();
  EXPECT_EQ(registry.FindPatches("m", v0, v0), nullptr);  // nothing to bring

  const std::vector<float> w1 = Step(w0, 1);
  std::vector<float> b1(16, 2.0f);  // changed throughout: sent whole
  Publish({F32("w", w1), F32("b", b1), F32("same", {7, 7}), F32("new", {1})});
  registry.Rescan();
  const std::string v1 = registry.Get("m")->version();
  std::shared_ptr<const PatchChain> chain = registry.FindPatches("m", v0, v1);
  ASSERT_NE(chain, nullptr);
  EXPECT_EQ(chain->steps(), 1u);
  EXPECT_EQ(Patched(*chain, "w", w0), w1);
  EXPECT_EQ(*chain->For("b"), std::nullopt);
  EXPECT_EQ(*chain->For("new"), std::nullopt);
  EXPECT_EQ(*chain->For("same"), std::nullopt);

  const std::vector<float> w2 = Step(w1, 2);
  Publish({F32("w", w2), F32("b", b1), F32("same", {7, 7}), F32("new", {1})});
  registry.Rescan();
  const std::string v2 = registry.Get("m")->version();
  ASSERT_EQ(Served(registry, "w"), w2);
  chain = registry.FindPatches("m", v0, v2);  // two steps behind
  ASSERT_NE(chain, nullptr);
  EXPECT_EQ(chain->steps(), 2u);
  EXPECT_EQ(Patched(*chain, "w", w0), w2);
  // The next late joiner from v0 gets the same chain, with its composition.
  EXPECT_EQ(registry.FindPatches("m", v0, v2), chain);
  EXPECT_EQ(Patched(*chain, "w", w0), w2);
  EXPECT_EQ(*chain->For("b"), std::nullopt);  // whole in a step: whole
  chain = registry.FindPatches("m", v1, v2);
  ASSERT_NE(chain, nullptr);
  EXPECT_EQ(Patched(*chain, "w", w1), w2);
  ASSERT_OK_AND_ASSIGN(std::optional<ElementPatch> b_patch, chain->For("b"));
  EXPECT_EQ(b_patch, std::nullopt);  // unchanged in the step
  // Versions not in the chain, or not current, get none.
  EXPECT_EQ(registry.FindPatches("m", "0123456789abcdef0123456789abcdef", v2), nullptr);
  EXPECT_EQ(registry.FindPatches("m", v0, v1), nullptr);
}

TEST_F(VersionPatchesTest, StepsAreBoundedByVersionsAndBytesAndAVersionWithoutPatchesBreaksTheChain) {
  std::vector<float> w(1 << 17, 0.5f);  // 512 KiB: mapped, not read into memory
  CheckpointRegistry registry(
      {.models_dir = models_, .tensor_digests = true, .kept_versions = 3, .kept_patch_bytes = 1 << 20});
  std::vector<std::string> versions;
  for (uint32_t i = 0; i < 5; ++i) {
    w = Step(w, 10 + i);
    Publish({F32("w", w)});
    registry.Rescan();
    versions.push_back(registry.Get("m")->version());
  }
  // kept_versions = 3: two steps back, not three.
  EXPECT_NE(registry.FindPatches("m", versions[2], versions[4]), nullptr);
  EXPECT_EQ(registry.FindPatches("m", versions[1], versions[4]), nullptr);

  // A mapped file written in place is reopened without patches (its old bytes
  // are gone): no chain reaches the new version.
  {
    w = Step(w, 30);
    const std::string bytes = *SerializeCheckpoint(kSafeTensorsFormat, {F32("w", w)}, {});
    testing::WriteFileOrDie(models_ + "/m.safetensors", bytes);  // same inode
  }
  registry.Get("m")->MarkModified();
  registry.Rescan();
  EXPECT_EQ(registry.FindPatches("m", versions[4], registry.Get("m")->version()), nullptr);

  // A byte bound below one step's patches keeps none.
  CheckpointRegistry tight({.models_dir = models_, .tensor_digests = true, .kept_patch_bytes = 64});
  tight.Rescan();
  const std::string before = tight.Get("m")->version();
  w = Step(w, 40);
  Publish({F32("w", w)});
  tight.Rescan();
  std::shared_ptr<const PatchChain> chain = tight.FindPatches("m", before, tight.Get("m")->version());
  ASSERT_NE(chain, nullptr);  // the step is kept, its patch is not: "w" goes whole
  EXPECT_EQ(*chain->For("w"), std::nullopt);
}

TEST_F(VersionPatchesTest, APushKeepsPatchesOfThePushedTensorsAgainstItsBase) {
  CheckpointRegistry registry({.models_dir = models_, .tensor_digests = true, .kept_patch_bytes = 1 << 20});
  const std::vector<float> w0(4096, 0.25f);
  Publish({F32("w", w0), F32("b", {1, 2})});
  registry.Rescan();
  auto base = registry.Get("m");
  const std::vector<float> w1 = Step(w0, 5);
  ASSERT_OK_AND_ASSIGN(auto session, registry.BeginPush("m", {.base_version = base->version()}));
  const SharedTensor t = F32("w", w1);
  ASSERT_OK(session->BeginTensor(t.spec, Crc32c(t.bytes.view())));
  ASSERT_OK(session->Append(t.bytes.view()));
  ASSERT_OK_AND_ASSIGN(auto pushed, registry.FinishPush(std::move(session)));
  std::shared_ptr<const PatchChain> chain = registry.FindPatches("m", base->version(), pushed->version());
  ASSERT_NE(chain, nullptr);
  EXPECT_EQ(Patched(*chain, "w", w0), w1);
  EXPECT_EQ(*chain->For("b"), std::nullopt);
}

TEST_F(VersionPatchesTest, APatchedPushKeepsThePatchItReceivedInsteadOfDiffingAgain) {
  CheckpointRegistry registry({.models_dir = models_, .tensor_digests = true, .kept_patch_bytes = 1 << 20});
  const std::vector<float> w0(4096, 0.25f);
  Publish({F32("w", w0)});
  registry.Rescan();
  auto base = registry.Get("m");
  std::vector<float> w1 = w0;
  w1[100] = 7.0f;
  // One element as a run: a diff would write it as a position, a byte shorter.
  std::string body("\x01\x64\x00", 3);
  body.append(reinterpret_cast<const char*>(&w1[100]), 4);
  const ElementPatch patch{PatchEncoding::kRuns, 4, 4096, 1, SharedBytes::Copy(body)};
  const SharedTensor after = F32("w", w1);
  ASSERT_OK_AND_ASSIGN(auto session, registry.BeginPush("m", {.base_version = base->version()}));
  ASSERT_OK(session->BeginPatchedTensor(after.spec, Crc32c(body), patch, body.size(),
                                        base->manifest()->Find("w")->digest, DigestBytes(after.bytes.span())));
  ASSERT_OK(session->Append(body));
  ASSERT_OK_AND_ASSIGN(auto pushed, registry.FinishPush(std::move(session)));
  std::shared_ptr<const PatchChain> chain = registry.FindPatches("m", base->version(), pushed->version());
  ASSERT_NE(chain, nullptr);
  ASSERT_OK_AND_ASSIGN(std::optional<ElementPatch> kept, chain->For("w"));
  ASSERT_TRUE(kept.has_value());
  EXPECT_EQ(kept->encoding, PatchEncoding::kRuns);
  EXPECT_EQ(kept->body.view(), body);
  EXPECT_EQ(Patched(*chain, "w", w0), w1);
}

}  // namespace
}  // namespace weightstore

#include "core/catalog/version_patches.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <thread>

#include "absl/synchronization/notification.h"
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
  // The next late joiner from v0 gets the same composition, made once.
  EXPECT_EQ(Patched(*registry.FindPatches("m", v0, v2), "w", w0), w2);
  EXPECT_EQ(registry.CompositionStats().made, 1u);
  EXPECT_EQ(registry.CompositionStats().shared, 1u);
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

// Versions 0..n-1 of tensors "t0".."t{k-1}" (F32), each a training Step of
// the one before, and the steps between them as kept patches.
struct History {
  std::vector<std::vector<std::vector<float>>> values;  // [version][tensor]
  std::vector<std::shared_ptr<const VersionPatches>> steps;

  static History Make(size_t tensors, size_t elements, size_t versions) {
    History h;
    h.values.emplace_back();
    for (size_t t = 0; t < tensors; ++t) h.values[0].push_back(std::vector<float>(elements, 0.5f));
    for (size_t v = 1; v < versions; ++v) {
      auto step = std::make_shared<VersionPatches>();
      step->from = absl::StrCat("v", v - 1);
      step->to = absl::StrCat("v", v);
      h.values.emplace_back();
      for (size_t t = 0; t < tensors; ++t) {
        const std::vector<float>& before = h.values[v - 1][t];
        h.values[v].push_back(Step(before, static_cast<uint32_t>(v * 100 + t)));
        std::optional<ElementPatch> patch =
            DiffElements(std::as_bytes(std::span(before)), std::as_bytes(std::span(h.values[v][t])), 4);
        EXPECT_TRUE(patch.has_value());
        step->memory_bytes += patch->body.size();
        step->patches.emplace(absl::StrCat("t", t), *std::move(patch));
      }
      h.steps.push_back(std::move(step));
    }
    return h;
  }
  // The chain from version `since` to the last, as a registry hands it out.
  PatchChain Chain(size_t since, std::shared_ptr<PatchCompositions> compositions) const {
    return PatchChain({steps.begin() + since, steps.end()}, "m", std::move(compositions));
  }
  // Whether `patch` turns tensor `t` of version `since` into the last one's.
  bool Brings(const ElementPatch& patch, size_t since, size_t t) const {
    std::vector<float> out = values[since][t];
    if (!ApplyPatch(patch, std::as_writable_bytes(std::span(out))).ok()) return false;
    return out == values.back()[t];
  }
};

TEST(PatchCompositionsTest, ManySinceVersionsStayWithinTheBudgetHeldOrNotAndWhatDoesNotFitGoesWhole) {
  const History h = History::Make(/*tensors=*/4, /*elements=*/16384, /*versions=*/8);
  // What every composition (since v0..v5: v6 is one step) takes, measured
  // unbounded; the budget holds a third of it.
  uint64_t all = 0;
  {
    auto unbounded = std::make_shared<PatchCompositions>(uint64_t{1} << 40);
    for (size_t since = 0; since + 2 < h.values.size(); ++since) {
      for (size_t t = 0; t < 4; ++t) {
        ASSERT_OK_AND_ASSIGN(std::optional<ElementPatch> p, h.Chain(since, unbounded).For(absl::StrCat("t", t)));
        ASSERT_TRUE(p.has_value());
        all += p->body.size();
      }
    }
    EXPECT_EQ(unbounded->stats().bytes, all);
  }
  const uint64_t budget = all / 3;
  auto compositions = std::make_shared<PatchCompositions>(budget);
  // Held, as streams that never read further would hold them.
  std::vector<ElementPatch> held;
  size_t whole = 0;
  for (int round = 0; round < 3; ++round) {
    for (size_t since = 0; since + 2 < h.values.size(); ++since) {
      for (size_t t = 0; t < 4; ++t) {
        ASSERT_OK_AND_ASSIGN(std::optional<ElementPatch> p, h.Chain(since, compositions).For(absl::StrCat("t", t)));
        EXPECT_LE(compositions->stats().bytes, budget);
        if (!p) {
          ++whole;
          continue;
        }
        EXPECT_TRUE(h.Brings(*p, since, t)) << since << " " << t;
        held.push_back(*std::move(p));
      }
    }
  }
  EXPECT_GT(whole, 0u);
  EXPECT_EQ(compositions->stats().over_budget, whole);
  EXPECT_GT(compositions->stats().made, 0u);
  // Let go, the room comes back: every ask is answered again, within budget.
  held.clear();
  for (size_t since = 0; since + 2 < h.values.size(); ++since) {
    for (size_t t = 0; t < 4; ++t) {
      ASSERT_OK_AND_ASSIGN(std::optional<ElementPatch> p, h.Chain(since, compositions).For(absl::StrCat("t", t)));
      ASSERT_TRUE(p.has_value()) << since << " " << t;
      EXPECT_TRUE(h.Brings(*p, since, t));
      EXPECT_LE(compositions->stats().bytes, budget);
    }
  }
  compositions->Forget("m");
  EXPECT_EQ(compositions->stats().bytes, 0u);
}

TEST(PatchCompositionsTest, ManyConcurrentAskersOfOneSinceGetOneComposition) {
  const History h = History::Make(/*tensors=*/1, /*elements=*/65536, /*versions=*/6);
  auto compositions = std::make_shared<PatchCompositions>(uint64_t{64} << 20);
  absl::Notification go;
  std::vector<std::optional<ElementPatch>> got(16);
  std::vector<std::thread> askers;
  for (size_t i = 0; i < got.size(); ++i) {
    askers.emplace_back([&, i] {
      const PatchChain chain = h.Chain(0, compositions);  // each its own chain, as FindPatches gives
      go.WaitForNotification();
      absl::StatusOr<std::optional<ElementPatch>> p = chain.For("t0");
      if (p.ok()) got[i] = *std::move(p);
    });
  }
  go.Notify();
  for (std::thread& t : askers) t.join();
  EXPECT_EQ(compositions->stats().made, 1u);
  EXPECT_EQ(compositions->stats().shared, got.size() - 1);
  for (const auto& p : got) {
    ASSERT_TRUE(p.has_value());
    EXPECT_EQ(p->body.data(), got[0]->body.data());  // one body, shared
    EXPECT_TRUE(h.Brings(*p, 0, 0));
  }
  EXPECT_EQ(compositions->stats().bytes, got[0]->body.size());
  // One asking later finds it without composing or waiting.
  absl::StatusOr<std::optional<ElementPatch>> cached;
  ASSERT_TRUE(h.Chain(0, compositions).TryFor("t0", &cached));
  ASSERT_OK(cached.status());
  ASSERT_TRUE(cached->has_value());
  EXPECT_EQ((*cached)->body.data(), got[0]->body.data());
  EXPECT_EQ(compositions->stats().made, 1u);
}

TEST(PatchCompositionsTest, ACompositionThatDoesNotFitIsNotMadeAndOneStepNeedsNone) {
  const History h = History::Make(/*tensors=*/1, /*elements=*/16384, /*versions=*/4);
  auto compositions = std::make_shared<PatchCompositions>(64);
  ASSERT_OK_AND_ASSIGN(std::optional<ElementPatch> p, h.Chain(0, compositions).For("t0"));
  EXPECT_EQ(p, std::nullopt);  // the tensor goes whole
  EXPECT_EQ(compositions->stats().over_budget, 1u);
  EXPECT_EQ(compositions->stats().made, 0u);
  EXPECT_EQ(compositions->stats().bytes, 0u);
  absl::StatusOr<std::optional<ElementPatch>> tried;
  EXPECT_FALSE(h.Chain(0, compositions).TryFor("t0", &tried));  // not cached: it would try again
  // One step behind: the kept step itself, nothing composed.
  ASSERT_OK_AND_ASSIGN(p, h.Chain(2, compositions).For("t0"));
  ASSERT_TRUE(p.has_value());
  EXPECT_TRUE(h.Brings(*p, 2, 0));
  ASSERT_TRUE(h.Chain(2, compositions).TryFor("t0", &tried));
  ASSERT_OK(tried.status());
  ASSERT_TRUE(tried->has_value());
  EXPECT_TRUE(h.Brings(**tried, 2, 0));
  EXPECT_EQ(compositions->stats().bytes, 0u);
}

TEST_F(VersionPatchesTest, AlternatingSinceVersionsComposeEachOnceAndKeepBoth) {
  CheckpointRegistry registry({.models_dir = models_, .tensor_digests = true, .kept_patch_bytes = 4 << 20});
  std::vector<std::vector<float>> w = {std::vector<float>(1 << 16, 0.5f)};
  std::vector<std::string> versions;
  for (uint32_t i = 0; i < 4; ++i) {
    if (i > 0) w.push_back(Step(w.back(), 50 + i));
    Publish({F32("w", w.back())});
    registry.Rescan();
    versions.push_back(registry.Get("m")->version());
  }
  for (int round = 0; round < 10; ++round) {
    const size_t since = round % 2;
    std::shared_ptr<const PatchChain> chain = registry.FindPatches("m", versions[since], versions.back());
    ASSERT_NE(chain, nullptr);
    EXPECT_EQ(Patched(*chain, "w", w[since]), w.back());
  }
  EXPECT_EQ(registry.CompositionStats().made, 2u);
  EXPECT_EQ(registry.CompositionStats().shared, 8u);
  EXPECT_EQ(registry.CompositionStats().over_budget, 0u);
  // A new version: compositions to the old one are dropped.
  w.push_back(Step(w.back(), 60));
  Publish({F32("w", w.back())});
  registry.Rescan();
  EXPECT_EQ(registry.CompositionStats().bytes, 0u);
}

}  // namespace
}  // namespace weightstore

#include "core/element_patch.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "tests/util/status_matchers.h"

namespace weightstore {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

std::vector<std::byte> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(rng());
  return out;
}

// `before` with a fraction of its elements changed at random.
std::vector<std::byte> ChangeAtRandom(const std::vector<std::byte>& before, uint32_t e, double fraction,
                                      uint32_t seed) {
  std::mt19937 rng(seed);
  std::bernoulli_distribution pick(fraction);
  std::vector<std::byte> after = before;
  for (size_t i = 0; i < after.size() / e; ++i) {
    if (pick(rng)) after[i * e] ^= std::byte{0x5a};
  }
  return after;
}

std::vector<std::byte> Applied(std::vector<std::byte> tensor, const ElementPatch& patch) {
  EXPECT_OK(ApplyPatch(patch, tensor));
  return tensor;
}

ElementPatch Patch(PatchEncoding encoding, uint32_t e, uint64_t elements, uint64_t changed, std::string body) {
  return {encoding, e, elements, changed, SharedBytes::Copy(body)};
}

TEST(ElementPatchTest, APatchTurnsTheOldTensorIntoTheNewOneForEveryElementSize) {
  for (uint32_t e : {1u, 2u, 4u, 8u, 3u, 16u}) {
    for (double fraction : {0.0, 0.001, 0.01, 0.2}) {
      SCOPED_TRACE(::testing::Message() << e << " bytes, " << fraction);
      const auto before = RandomBytes(e * 10007, e);
      const auto after = ChangeAtRandom(before, e, fraction, 7);
      std::optional<ElementPatch> patch = DiffElements(before, after, e);
      ASSERT_TRUE(patch.has_value());
      EXPECT_LT(patch->body.size(), after.size());
      EXPECT_OK(CheckPatch(*patch));
      EXPECT_EQ(Applied(before, *patch), after);
    }
  }
}

TEST(ElementPatchTest, ScatteredChangesAreSentAsPositionsAndBlocksAsRunsEachNearTheChangedBytes) {
  const uint32_t e = 2;  // BF16
  const size_t elements = 1 << 20;
  const auto before = RandomBytes(e * elements, 1);
  // 1% and 0.1% of the elements at random: about 3.3 and 4 bytes each.
  for (auto [fraction, most] : {std::pair{0.01, 0.02}, std::pair{0.001, 0.003}}) {
    const auto after = ChangeAtRandom(before, e, fraction, 2);
    std::optional<ElementPatch> patch = DiffElements(before, after, e);
    ASSERT_TRUE(patch.has_value());
    EXPECT_EQ(patch->encoding, PatchEncoding::kPositions);
    EXPECT_LE(patch->body.size(), most * after.size()) << fraction;
    EXPECT_EQ(Applied(before, *patch), after);
  }
  // One block of rows (4096 elements a row, rows 100 to 131): the changed
  // bytes and a few more.
  auto after = before;
  for (size_t i = 100 * 4096; i < 132 * 4096; ++i) after[i * e] ^= std::byte{1};
  std::optional<ElementPatch> patch = DiffElements(before, after, e);
  ASSERT_TRUE(patch.has_value());
  EXPECT_EQ(patch->encoding, PatchEncoding::kRuns);
  EXPECT_EQ(patch->changed, 32u * 4096);
  EXPECT_LE(patch->body.size(), 32u * 4096 * e + 16);
  EXPECT_EQ(Applied(before, *patch), after);
}

TEST(ElementPatchTest, ATensorChangedThroughoutIsNotPatched) {
  const auto before = RandomBytes(2 * 4096, 3);
  const auto after = RandomBytes(2 * 4096, 4);
  EXPECT_FALSE(DiffElements(before, after, 2).has_value());
  const auto every = ChangeAtRandom(before, 2, 1.0, 5);  // the values alone are the tensor
  EXPECT_FALSE(DiffElements(before, every, 2).has_value());
  // Every other byte: a value and a position byte each, the tensor's size.
  auto alternate = before;
  for (size_t i = 0; i < alternate.size(); i += 2) alternate[i] ^= std::byte{1};
  EXPECT_FALSE(DiffElements(before, alternate, 1).has_value());
}

TEST(ElementPatchTest, ComposedPatchesDoWhatBothDoInTurn) {
  for (uint32_t e : {1u, 2u, 4u}) {
    const auto a = RandomBytes(e * 50021, 10 + e);
    const auto b = ChangeAtRandom(a, e, 0.02, 11);
    auto c = ChangeAtRandom(b, e, 0.02, 12);
    for (size_t i = 1000; i < 3000; ++i) c[i * e] ^= std::byte{3};  // a run overlapping scattered changes
    std::optional<ElementPatch> ab = DiffElements(a, b, e), bc = DiffElements(b, c, e);
    ASSERT_TRUE(ab && bc);
    ASSERT_OK_AND_ASSIGN(std::optional<ElementPatch> ac, ComposePatches(*ab, *bc));
    ASSERT_TRUE(ac.has_value());
    EXPECT_EQ(Applied(a, *ac), c) << e;
    // A later change back to the first value is still written.
    ASSERT_OK_AND_ASSIGN(std::optional<ElementPatch> aba, ComposePatches(*ab, *DiffElements(b, a, e)));
    ASSERT_TRUE(aba.has_value());
    EXPECT_EQ(Applied(a, *aba), a);
  }
  const auto x = RandomBytes(64, 1);
  EXPECT_THAT(ComposePatches(*DiffElements(x, x, 2), *DiffElements(x, x, 4)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not of one tensor")));
}

TEST(ElementPatchTest, MalformedPatchesAreRefusedBeforeAnythingIsWritten) {
  const std::vector<std::byte> zeros(8 * 2);
  struct Case {
    const char* what;
    ElementPatch patch;
    const char* error;
  };
  const Case cases[] = {
      {"a position past the end", Patch(PatchEncoding::kPositions, 2, 8, 1, std::string("\x01\x08xx", 4)),
       "past the tensor"},
      {"a gap past the end after another",
       Patch(PatchEncoding::kPositions, 2, 8, 2, std::string("\x02\x06\x01xxxx", 7)), "past the tensor"},
      {"a run past the end", Patch(PatchEncoding::kRuns, 2, 8, 4, std::string("\x01\x06\x03xxxxxxxx", 11)),
       "past the tensor"},
      {"a run adjacent to the last", Patch(PatchEncoding::kRuns, 2, 8, 2, std::string("\x02\x00\x00\x00\x00xxxx", 9)),
       "starts where run 0 ends"},
      {"a varint past 64 bits", Patch(PatchEncoding::kPositions, 2, 8, 1, std::string(11, '\xff')), "before its count"},
      {"a varint cut short", Patch(PatchEncoding::kPositions, 2, 8, 1, std::string("\x01\x80", 2)), "past the body"},
      {"more entries than elements", Patch(PatchEncoding::kPositions, 2, 8, 9, std::string("\x09", 1)),
       "9 entries for a tensor of 8"},
      {"values short", Patch(PatchEncoding::kPositions, 2, 8, 1, std::string("\x01\x00x", 3)), "1 bytes of values"},
      {"values in excess", Patch(PatchEncoding::kPositions, 2, 8, 1, std::string("\x01\x00xxx", 5)),
       "3 bytes of values"},
      {"a changed count that lies", Patch(PatchEncoding::kPositions, 2, 8, 2, std::string("\x01\x00xx", 4)),
       "says 2 elements change but lists 1"},
      {"no element size", Patch(PatchEncoding::kPositions, 0, 8, 0, std::string("\x00", 1)), "describes no tensor"},
      {"a tensor past 64 bits", Patch(PatchEncoding::kPositions, 16, uint64_t{1} << 61, 0, std::string("\x00", 1)),
       "describes no tensor"},
      {"an unknown encoding", Patch(static_cast<PatchEncoding>(9), 2, 8, 0, std::string("\x00", 1)),
       "neither positions nor runs"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    EXPECT_THAT(CheckPatch(c.patch), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.error)));
    std::vector<std::byte> tensor = zeros;
    EXPECT_FALSE(ApplyPatch(c.patch, tensor).ok());
    EXPECT_EQ(tensor, zeros);
  }
  // A good patch into a tensor of another size.
  std::vector<std::byte> small(4);
  EXPECT_THAT(ApplyPatch(Patch(PatchEncoding::kPositions, 2, 8, 1, std::string("\x01\x00xx", 4)), small),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("for 16 bytes, the tensor holds 4")));
}

TEST(ElementPatchTest, ItsRunsWrittenOneByOneGiveWhatApplyingItGives) {
  for (uint32_t e : {1u, 2u, 3u}) {
    SCOPED_TRACE(e);
    const auto before = RandomBytes(e * 4099, e);
    auto after = ChangeAtRandom(before, e, 0.05, 11);
    for (size_t k = 1000 * e; k < 1300 * e; ++k) after[k] ^= std::byte{1};  // a block: one run
    std::optional<ElementPatch> patch = DiffElements(before, after, e);
    ASSERT_TRUE(patch.has_value());
    std::vector<std::byte> written = before;
    uint64_t changed = 0, runs = 0, next = 0;
    ASSERT_OK(ForEachRun(*patch, [&](uint64_t start, uint64_t length, const std::byte* values) {
      EXPECT_GE(start, next);  // in order, never adjacent to the last
      EXPECT_TRUE(runs == 0 || start > next);
      std::memcpy(written.data() + start * e, values, length * e);
      changed += length;
      next = start + length;
      ++runs;
    }));
    EXPECT_EQ(written, after);
    EXPECT_EQ(changed, patch->changed);
    EXPECT_LT(runs, changed);  // the block's positions came joined
  }
  int calls = 0;
  EXPECT_THAT(ForEachRun(Patch(PatchEncoding::kPositions, 2, 8, 2, std::string("\x02\x00\x08xxxx", 7)),
                         [&](uint64_t, uint64_t, const std::byte*) { ++calls; }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("past the tensor")));
  EXPECT_EQ(calls, 0);
}

TEST(ElementPatchTest, OneCallAppliesAnUpdateOnThreadsAndOneBadPatchLeavesEveryTensorAsItWas) {
  std::vector<std::vector<std::byte>> before, after, held;
  std::vector<ElementPatch> patches;
  for (uint32_t t = 0; t < 16; ++t) {
    before.push_back(RandomBytes(2 * 4099, t));
    after.push_back(ChangeAtRandom(before.back(), 2, 0.01, 100 + t));
    patches.push_back(*DiffElements(before.back(), after.back(), 2));
  }
  std::vector<std::string> names;
  for (int t = 0; t < 16; ++t) names.push_back("layers." + std::to_string(t) + ".weight");
  auto targets = [&] {
    std::vector<PatchTarget> out;
    for (size_t t = 0; t < held.size(); ++t) out.push_back({names[t], &patches[t], held[t]});
    return out;
  };
  held = before;
  ASSERT_OK(ApplyPatches(targets(), 4));
  EXPECT_EQ(held, after);

  held = before;
  patches[9] = Patch(PatchEncoding::kPositions, 2, 4099, 1, std::string("\x01\x83\x20xx", 5));  // past the end
  EXPECT_THAT(ApplyPatches(targets(), 4),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor 'layers.9.weight'")));
  EXPECT_EQ(held, before);
}

}  // namespace
}  // namespace weightstore

#include "core/selection.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <re2/re2.h>

#include <random>

#include "core/snapshot.h"
#include "tests/util/status_matchers.h"

namespace weightstore {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

std::shared_ptr<const Selection> Compile(SelectionOptions options) {
  auto s = Selection::Compile(options);
  EXPECT_TRUE(s.ok()) << s.status();
  return *s;
}

std::string Replace(const std::string& pattern, const std::string& text, const std::string& replacement) {
  re2::RE2 re(pattern);
  return ReplaceAll(re, text, replacement);
}

TEST(RenameTest, ExpandsCapturesAsRustRegexDoes) {
  EXPECT_EQ(Replace(R"(conv\.(.*))", "conv.conv1.weight", "$1"), "conv1.weight");
  EXPECT_EQ(Replace(R"(^(\w+)\.(\d+))", "layer.3.w", "${2}_$1"), "3_layer.w");
  EXPECT_EQ(Replace(R"((?P<head>\w+)\.w)", "fc.w", "${head}.weight"), "fc.weight");
  EXPECT_EQ(Replace(R"((\w+))", "ab", "$1x|${1}x"), "|abx");  // "$1x" names group "1x": empty
  EXPECT_EQ(Replace("a", "banana", "$$"), "b$n$n$");
  EXPECT_EQ(Replace(R"(\.)", "a.b.c", "/"), "a/b/c");  // replace-all
}

TEST(RenameTest, HandlesEmptyMatchesLikeRust) {
  EXPECT_EQ(Replace("x*", "abxd", "-"), "-a-b-d-");
  EXPECT_EQ(Replace("^", "fc.weight", "model."), "model.fc.weight");
}

TEST(RenameTest, RulesApplyInOrderToThePreviousOutput) {
  SelectionOptions options;
  options.renames = {{R"(^model\.)", ""}, {R"(^encoder\.)", "enc."}, {R"(enc\.(\d+))", "block$1"}};
  EXPECT_EQ(Compile(options)->Rename("model.encoder.3.w"), "block3.w");
}

TEST(SelectionTest, IncludesAreOredExactPathsAddAndExcludesWin) {
  SelectionOptions options;
  options.include = {R"(^encoder\.)", "attn"};
  options.paths = {"lm_head.weight"};
  options.exclude = {R"(\.bias$)"};
  auto s = Compile(options);
  EXPECT_TRUE(s->Matches("encoder.0.weight"));
  EXPECT_TRUE(s->Matches("decoder.attn.weight"));  // unanchored
  EXPECT_TRUE(s->Matches("lm_head.weight"));
  EXPECT_FALSE(s->Matches("lm_head.weight2"));      // exact means exact
  EXPECT_FALSE(s->Matches("encoder.0.bias"));
  EXPECT_FALSE(s->Matches("decoder.mlp.weight"));
}

TEST(SelectionTest, AnEmptyFilterKeepsEverything) {
  EXPECT_TRUE(Compile({})->Matches("anything"));
  SelectionOptions only_exclude;
  only_exclude.exclude = {"bias"};
  EXPECT_TRUE(Compile(only_exclude)->Matches("w"));
  EXPECT_FALSE(Compile(only_exclude)->Matches("b.bias"));
}

TEST(SelectionTest, BadPatternsAreErrorsThatNameThem) {
  SelectionOptions options;
  options.include = {"fc.("};
  EXPECT_THAT(Selection::Compile(options), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'fc.('")));
  options.include = {};
  options.renames = {{"a)", "b"}};
  EXPECT_THAT(Selection::Compile(options), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rename pattern 'a)'")));
}

TEST(SelectionTest, HostilePatternsAreBounded) {
  SelectionOptions options;
  options.include = {"((a{100}){100}){100}"};
  EXPECT_THAT(Selection::Compile(options), StatusIs(absl::StatusCode::kInvalidArgument));
  options.include = {std::string(50000, 'a')};
  EXPECT_THAT(Selection::Compile(options), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("too large")));
}

TEST(ContiguousIndicesTest, RenumbersPerPrefixAsBurnStoreDoes) {
  EXPECT_THAT(MapIndicesContiguous({"fc.0.weight", "fc.2.weight", "fc.4.bias", "fc.4.weight"}),
              ElementsAre("fc.0.weight", "fc.1.weight", "fc.2.bias", "fc.2.weight"));
  // Nested sequences are numbered within their parent index.
  EXPECT_THAT(MapIndicesContiguous({"layers.2.block.3.w", "layers.2.block.7.w", "layers.5.block.1.w"}),
              ElementsAre("layers.0.block.0.w", "layers.0.block.1.w", "layers.1.block.0.w"));
  EXPECT_THAT(MapIndicesContiguous({"a.007", "a.+9", "b"}), ElementsAre("a.0", "a.1", "b"));
  EXPECT_THAT(MapIndicesContiguous({"10.w", "2.w"}), ElementsAre("1.w", "0.w"));
}

std::shared_ptr<const Checkpoint> Names(const std::vector<std::string>& names, Format format = Format::kPyTorch) {
  auto storage = LazyStorage::Ready(SharedBytes::Copy(std::string(4, '\0')));
  std::vector<CheckpointEntry> entries;
  for (const std::string& n : names) {
    CheckpointEntry e;
    e.spec = {n, DType::kF32, {1}};
    e.layout.storage = storage;
    entries.push_back(e);
  }
  return *Checkpoint::Create(format, "mem", {}, std::move(entries));
}

std::vector<std::string> Selected(const Snapshot& s) {
  std::vector<std::string> out;
  for (const auto& t : s.tensors()) out.push_back(t.spec.name);
  return out;
}

TEST(SnapshotSelectTest, FilterSeesNamesAfterRenameAndContiguousIndices) {
  SelectionOptions options;
  options.contiguous_indices = true;
  options.renames = {{R"(^model\.)", ""}};
  options.include = {R"(^fc\.1\.)"};
  ASSERT_OK_AND_ASSIGN(auto s, Snapshot::Select(Names({"model.fc.0.w", "model.fc.4.w", "other"}), *Compile(options)));
  EXPECT_THAT(Selected(*s), ElementsAre("fc.1.w"));
  EXPECT_EQ(s->tensors()[0].source->spec.name, "model.fc.4.w");
}

TEST(SnapshotSelectTest, PlainReadsKeepNamesUnlessContiguousIndicesAreAskedFor) {
  auto s = Compile({});
  EXPECT_FALSE(s->UsesContiguousIndices(Format::kPyTorch, /*applying_to_target=*/false));
  EXPECT_TRUE(s->UsesContiguousIndices(Format::kPyTorch, /*applying_to_target=*/true));
  EXPECT_FALSE(s->UsesContiguousIndices(Format::kSafeTensors, /*applying_to_target=*/true));
  ASSERT_OK_AND_ASSIGN(auto pt, Snapshot::Select(Names({"fc.2.w"}, Format::kPyTorch), *s));
  EXPECT_THAT(Selected(*pt), ElementsAre("fc.2.w"));
  SelectionOptions on;
  on.contiguous_indices = true;
  ASSERT_OK_AND_ASSIGN(auto st_on, Snapshot::Select(Names({"fc.2.w"}, Format::kSafeTensors), *Compile(on)));
  EXPECT_THAT(Selected(*st_on), ElementsAre("fc.0.w"));
}

TEST(SnapshotSelectTest, TopLevelKeyKeepsOnlyThatSubtreeWithoutItsPrefix) {
  SelectionOptions options;
  options.top_level_key = "model";
  options.contiguous_indices = false;
  ASSERT_OK_AND_ASSIGN(auto s, Snapshot::Select(Names({"model.fc.w", "optim.state.0", "model.b", "modelx.c"}),
                                                *Compile(options)));
  EXPECT_THAT(Selected(*s), ElementsAre("fc.w", "b"));
  options.top_level_key = "nope";
  EXPECT_THAT(Snapshot::Select(Names({"model.fc.w", "optim.state.0"}), *Compile(options)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("keys with tensors: model, optim")));
}

TEST(SnapshotSelectTest, TwoTensorsRenamedToOneNameIsAnErrorNamingBoth) {
  SelectionOptions options;
  options.renames = {{R"(^(enc|encoder)\.)", "e."}};
  EXPECT_THAT(Snapshot::Select(Names({"enc.w", "encoder.w"}), *Compile(options)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'enc.w' and 'encoder.w'")));
}

TEST(SnapshotSelectTest, RenameThenItsInverseIsTheIdentity) {
  std::mt19937 rng(42);
  const char* heads[] = {"enc", "dec", "head"};
  std::vector<std::string> names;
  for (int i = 0; i < 500; ++i) {
    names.push_back(absl::StrCat(heads[rng() % 3], ".", "layer", rng() % 50, ".", (rng() % 2) ? "weight" : "bias", i));
  }
  SelectionOptions forward, inverse;
  forward.contiguous_indices = inverse.contiguous_indices = false;
  forward.renames = {{R"(^enc\.(.*)$)", "encoder.$1"}, {R"(^dec\.)", "decoder."}, {R"(layer(\d+))", "blocks.${1}"}};
  inverse.renames = {{R"(blocks\.(\d+))", "layer$1"}, {R"(^decoder\.)", "dec."}, {R"(^encoder\.(.*)$)", "enc.$1"}};
  ASSERT_OK_AND_ASSIGN(auto there, Snapshot::Select(Names(names), *Compile(forward)));
  std::vector<std::string> renamed = Selected(*there);
  ASSERT_OK_AND_ASSIGN(auto back, Snapshot::Select(Names(renamed), *Compile(inverse)));
  EXPECT_EQ(Selected(*back), names);
}

}  // namespace
}  // namespace weightstore

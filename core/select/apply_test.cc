#include "core/select/apply.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "core/formats/safetensors.h"
#include "tests/util/checkpoints.h"
#include "tests/util/status_matchers.h"

namespace weightstore {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

std::shared_ptr<const Checkpoint> Named(const std::vector<std::string>& names) {
  return testing::NamesOnlyCheckpoint(names, kSafeTensorsFormat);
}

TargetSchema Target(const std::vector<std::string>& paths) {
  TargetSchema target;
  for (const std::string& p : paths) target.parameters.push_back({p, std::nullopt, {1}, ""});
  return target;
}

TEST(ApplyTest, SuggestsThePrefixToStrip) {
  ASSERT_OK_AND_ASSIGN(auto selection, Selection::Compile({}));
  ASSERT_OK_AND_ASSIGN(Applied a, Apply(Named({"model.fc.weight", "model.fc.bias"}), *selection,
                                        Target({"fc.weight", "fc.bias"}), {.allow_partial = true}));
  EXPECT_THAT(a.result.suggestions, ElementsAre(HasSubstr(R"(try --rename '^model\.=')")));
}

TEST(ApplyTest, ATargetPathLongerThanANameMayBeIsRefused) {
  // Issue 11: a target path of 800k dots took 43 s of CPU in the suggestions.
  ASSERT_OK_AND_ASSIGN(auto selection, Selection::Compile({}));
  std::string dots(800000, '.');
  EXPECT_THAT(Apply(Named({"w"}), *selection, Target({dots}), {.allow_partial = true}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("path of 800000 bytes; at most 4096")));
  TargetSchema deep = Target({"w"});
  deep.parameters[0].shape.assign(65, 1);
  EXPECT_THAT(Apply(Named({"w"}), *selection, deep),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 65")));
}

TEST(ApplyTest, SuggestionsForManyDottedNamesTakeLinearTime) {
  // 2,000 missing and 2,000 unused names of 2,000 dots each: every suffix was
  // hashed before (quadratic); only the first few segments are tried now.
  std::vector<std::string> unused, missing;
  for (int i = 0; i < 2000; ++i) {
    std::string tail = absl::StrCat(i, std::string(2000, '.'));
    unused.push_back(absl::StrCat("x.", tail));
    missing.push_back(tail);
  }
  ASSERT_OK_AND_ASSIGN(auto selection, Selection::Compile({}));
  ASSERT_OK_AND_ASSIGN(Applied a, Apply(Named(unused), *selection, Target(missing), {.allow_partial = true}));
  EXPECT_EQ(a.result.missing.size(), 2000u);
  EXPECT_EQ(a.result.unused.size(), 2000u);
  EXPECT_THAT(a.result.suggestions, ::testing::Contains(HasSubstr("2000 unused tensors start with 'x.'")));
  EXPECT_THAT(a.result.Summary(), HasSubstr("... and 1990 more"));
}

TEST(ApplyTest, ATargetOfMoreParametersThanAllowedIsRefused) {
  SelectionLimits limits;
  limits.max_paths = 2;
  ASSERT_OK_AND_ASSIGN(auto selection, Selection::Compile({}, limits));
  EXPECT_THAT(Apply(Named({"a"}), *selection, Target({"a", "b", "c"})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("3 parameters; at most 2")));
}

}  // namespace
}  // namespace weightstore

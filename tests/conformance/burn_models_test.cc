// burn-store's model tests, over ../shared/fixtures/burn/pytorch-models: loading
// PyTorch state dicts into Burn modules (described by target schemas in
// tests/testdata/schemas). Names and values are checked against what real
// PyTorch computes for the same mapping (tests/testdata/burn_model_expected.py).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/select/apply.h"
#include "core/select/dtype_cast.h"
#include "core/select/snapshot.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAreArray;

class BurnModelsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing::MakeScratchDir("burn-models"));
    std::string output;
    int rc = testing::RunCommand(
        absl::StrCat(testing::ShellQuote(testing::TorchPython()), " ",
                     testing::ShellQuote(testing::TestDataDir() + "/burn_model_expected.py"), " ",
                     testing::ShellQuote(testing::FixturesDir()), " ", testing::ShellQuote(*dir_ + "/expected.json")),
        &output);
    if (rc != 0) {  // each test fails in SetUp (a fatal failure here would skip them)
      failure_ = new std::string(output);
      return;
    }
    std::ifstream in(*dir_ + "/expected.json");
    expected_ = new nlohmann::json(nlohmann::json::parse(in));
  }
  void SetUp() override { ASSERT_EQ(failure_, nullptr) << "burn_model_expected.py failed:\n" << *failure_; }
  static std::string* failure_;

  struct Case {
    std::string file;
    std::string schema;
    SelectionOptions selection;
    std::string top_level_key;
  };

  static absl::StatusOr<Applied> Load(const Case& c, ApplyOptions options = {}) {
    OpenOptions open;
    open.top_level_key = c.top_level_key;
    auto checkpoint = Checkpoint::Open(testing::FixturesDir() + "/burn/pytorch-models/" + c.file, open);
    if (!checkpoint.ok()) return checkpoint.status();
    auto selection = Selection::Compile(c.selection);
    if (!selection.ok()) return selection.status();
    auto schema = TargetSchema::Load(testing::TestDataDir() + "/schemas/" + c.schema + ".json");
    if (!schema.ok()) return schema.status();
    return Apply(*checkpoint, **selection, *schema, options);
  }

  // Every applied tensor matches torch's values for `expected_case`.
  static void ExpectValues(const Applied& applied, const std::string& expected_case) {
    const nlohmann::json& want = (*expected_)[expected_case];
    ASSERT_FALSE(want.is_null()) << expected_case;
    std::vector<std::string> names;
    for (const auto& [name, _] : want.items()) names.push_back(name);
    EXPECT_THAT(applied.result.applied, UnorderedElementsAreArray(names));
    for (const SnapshotTensor& t : applied.snapshot->tensors()) {
      SCOPED_TRACE(t.spec.name);
      ASSERT_OK_AND_ASSIGN(SharedTensor tensor, applied.snapshot->Read(t));
      EXPECT_EQ(std::string(DTypeName(t.spec.dtype)), want[t.spec.name]["dtype"]);
      EXPECT_EQ(t.spec.shape, want[t.spec.name]["shape"].get<std::vector<uint64_t>>());
      EXPECT_EQ(testing::Sha256Hex(tensor.bytes.view()), want[t.spec.name]["sha256"]);
    }
  }

  static SelectionOptions WithAdapter(Adapter adapter) {
    SelectionOptions s;
    s.adapter = adapter;
    return s;
  }

  static std::string* dir_;
  static nlohmann::json* expected_;
};
std::string* BurnModelsTest::dir_ = nullptr;
std::string* BurnModelsTest::failure_ = nullptr;
nlohmann::json* BurnModelsTest::expected_ = nullptr;

TEST_F(BurnModelsTest, LinearWeightsAreTransposedByThePyTorchAdapter) {
  for (const char* name : {"linear", "linear_with_bias"}) {
    ASSERT_OK_AND_ASSIGN(Applied a, Load({absl::StrCat(name, ".pt"), name, WithAdapter(Adapter::kPyTorchToBurn)}));
    EXPECT_OK(a.status);
    EXPECT_THAT(a.result.missing, IsEmpty());
    EXPECT_THAT(a.result.unused, IsEmpty());
    ExpectValues(a, name);
  }
}

TEST_F(BurnModelsTest, WithoutTheAdapterLinearWeightsAreShapeMismatches) {
  ASSERT_OK_AND_ASSIGN(Applied a, Load({"linear.pt", "linear", {}}));
  EXPECT_FALSE(a.status.ok());
  ASSERT_EQ(a.result.errors.size(), 2u);
  EXPECT_EQ(a.result.errors[0].kind, ApplyError::Kind::kShapeMismatch);
  EXPECT_THAT(a.result.Summary(), ::testing::HasSubstr("try --adapter pytorch-to-burn"));
  ApplyOptions lenient;
  lenient.validate = false;
  ASSERT_OK_AND_ASSIGN(Applied b, Load({"linear.pt", "linear", {}}, lenient));
  EXPECT_OK(b.status);
  EXPECT_THAT(b.result.applied, ElementsAre("fc1.bias"));
}

TEST_F(BurnModelsTest, TransposeAndCastAreFusedOnRead) {
  SelectionOptions s = WithAdapter(Adapter::kPyTorchToBurn);
  s.dtype = DType::kF16;
  ASSERT_OK_AND_ASSIGN(Applied a, Load({"linear.pt", "linear", s}));
  ExpectValues(a, "linear_f16");
}

TEST_F(BurnModelsTest, NormLayersMapWeightAndBiasToGammaAndBeta) {
  ASSERT_OK_AND_ASSIGN(Applied bn, Load({"batch_norm2d.pt", "batch_norm", WithAdapter(Adapter::kPyTorchToBurn)}));
  EXPECT_OK(bn.status);
  EXPECT_THAT(bn.result.unused, ElementsAre("norm1.num_batches_tracked"));
  ExpectValues(bn, "batch_norm");
  for (const char* name : {"layer_norm", "group_norm"}) {
    ASSERT_OK_AND_ASSIGN(Applied a, Load({absl::StrCat(name, ".pt"), name, WithAdapter(Adapter::kPyTorchToBurn)}));
    EXPECT_OK(a.status);
    EXPECT_THAT(a.result.unused, IsEmpty());
    ExpectValues(a, name);
  }
  ASSERT_OK_AND_ASSIGN(Applied none, Load({"layer_norm.pt", "layer_norm", {}}));
  EXPECT_THAT(none.result.missing, ElementsAre("norm1.beta", "norm1.gamma"));
  EXPECT_THAT(none.result.Summary(), ::testing::HasSubstr("gamma/beta"));
}

TEST_F(BurnModelsTest, KeyRemappingStripsAPrefixWithACapture) {
  SelectionOptions s;
  s.renames = {{R"(conv\.(.*))", "$1"}};
  ASSERT_OK_AND_ASSIGN(Applied a, Load({"key_remap.pt", "conv2d", s}));
  EXPECT_OK(a.status);
  ExpectValues(a, "key_remap");
  ASSERT_OK_AND_ASSIGN(Applied without, Load({"key_remap.pt", "conv2d", {}}));
  EXPECT_THAT(without.result.missing, ElementsAre("conv1.bias", "conv1.weight", "conv2.weight"));
  EXPECT_THAT(without.result.unused, ElementsAre("conv.conv1.bias", "conv.conv1.weight", "conv.conv2.weight"));
  EXPECT_THAT(without.result.Summary(), ::testing::HasSubstr(R"(--rename '^conv\.=')"));
}

TEST_F(BurnModelsTest, NonContiguousIndicesAreRenumberedByDefaultForPyTorch) {
  ASSERT_OK_AND_ASSIGN(Applied a, Load({"non_contiguous_indexes.pt", "non_contiguous_indexes", {}}));
  EXPECT_OK(a.status);
  ExpectValues(a, "non_contiguous_indexes");
  SelectionOptions off;
  off.contiguous_indices = false;
  ASSERT_OK_AND_ASSIGN(Applied b, Load({"non_contiguous_indexes.pt", "non_contiguous_indexes", off}));
  EXPECT_FALSE(b.status.ok());
  EXPECT_THAT(b.result.missing, ElementsAre("fc.1.bias", "fc.1.weight", "fc.3.bias", "fc.3.weight"));
}

TEST_F(BurnModelsTest, TopLevelKeySelectsTheStateDictAndWithoutItLoadingFails) {
  Case with_key{"top_level_key.pt", "conv2d", {}, "my_state_dict"};
  ApplyOptions partial;
  partial.allow_partial = true;
  ASSERT_OK_AND_ASSIGN(Applied a, Load(with_key, partial));
  EXPECT_THAT(a.result.missing, ElementsAre("conv2.weight"));
  ExpectValues(a, "top_level_key");
  ASSERT_OK_AND_ASSIGN(Applied strict, Load(with_key));
  EXPECT_FALSE(strict.status.ok());  // allow_partial is off by default
  ASSERT_OK_AND_ASSIGN(Applied b, Load({"top_level_key.pt", "conv2d", {}}));
  EXPECT_EQ(b.result.applied.size(), 0u);
  EXPECT_THAT(b.result.Summary(), ::testing::HasSubstr("--rename '^my_state_dict\\.='"));
}

TEST_F(BurnModelsTest, FilteredParametersAreSkippedAndAbsentOnesStayMissing) {
  SelectionOptions s = WithAdapter(Adapter::kPyTorchToBurn);
  s.exclude = {R"(running_)"};
  ASSERT_OK_AND_ASSIGN(Applied a, Load({"batch_norm2d.pt", "batch_norm", s}));
  EXPECT_THAT(a.result.skipped, ElementsAre("norm1.running_mean", "norm1.running_var"));
  EXPECT_THAT(a.result.applied, ElementsAre("norm1.gamma", "norm1.beta"));
}

TEST_F(BurnModelsTest, CastsMatchTorchAndNumpyBitForBit) {
  ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Open(*dir_ + "/casts.pt"));
  auto check = [&](const char* from_name, const char* to_name) {
    SCOPED_TRACE(to_name);
    ASSERT_OK_AND_ASSIGN(SharedTensor from, c->Read(from_name));
    ASSERT_OK_AND_ASSIGN(SharedTensor want, c->Read(to_name));
    std::string got(want.bytes.size(), '\0');
    CastElements(from.spec.dtype, from.bytes.data(), want.spec.dtype, reinterpret_cast<std::byte*>(got.data()),
                 from.spec.num_elements());
    EXPECT_TRUE(got == std::string(want.bytes.view())) << "differs from torch";
  };
  check("f32", "f32_to_f16");
  check("f32", "f32_to_bf16");
  check("f32", "f32_to_f64");
  check("f64", "f64_to_f32");
  check("f64", "f64_to_f16_numpy");
  check("f32_to_f16", "f16_to_f32");
  check("f32_to_bf16", "bf16_to_f32");
}

}  // namespace
}  // namespace weightstore

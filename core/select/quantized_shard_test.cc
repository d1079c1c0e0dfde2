// Quantization-aware shards (issue 27): scales follow their weights, and
// experts stored one per tensor go to their rank.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "core/select/apply.h"
#include "core/select/selection.h"
#include "core/select/snapshot.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

// A tensor of `dtype` and `shape` whose bytes count 0, 1, 2, ... (mod 256).
SharedTensor Counting(const std::string& name, DType dtype, std::vector<uint64_t> shape) {
  TensorSpec spec{name, dtype, std::move(shape)};
  std::string bytes(spec.byte_size(), '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i);
  return {spec, SharedBytes::Copy(bytes)};
}

std::shared_ptr<const Checkpoint> Parse(const std::vector<SharedTensor>& tensors) {
  auto file = SerializeCheckpoint(kSafeTensorsFormat, tensors, {});
  EXPECT_OK(file.status());
  auto parsed = ParseSafeTensors(SharedBytes::Copy(*file), "q.safetensors", {});
  EXPECT_OK(parsed.status());
  return *parsed;
}

std::shared_ptr<const Snapshot> Shard(const std::shared_ptr<const Checkpoint>& checkpoint, uint32_t rank,
                                      uint32_t world, std::vector<ShardRule> rules, bool detect = true,
                                      std::vector<ScaleRule> scales = {}, std::vector<std::string> experts = {}) {
  SelectionOptions options;
  options.shard = {rank, world, std::move(rules), std::move(scales), detect, std::move(experts)};
  auto selection = Selection::Compile(options);
  EXPECT_OK(selection.status());
  auto snapshot = Snapshot::Select(checkpoint, **selection);
  EXPECT_OK(snapshot.status());
  return *snapshot;
}

const SnapshotTensor& Get(const Snapshot& s, absl::string_view name) {
  const SnapshotTensor* t = s.Find(name);
  EXPECT_NE(t, nullptr) << name;
  return *t;
}

TEST(QuantizedShardTest, BlockFp8ScalesFollowTheRanksRowsAndAPartialBlockIsShared) {
  // DeepSeek's layout: F8_E4M3 [300, 256] with an F32 scale per 128 x 128.
  auto checkpoint =
      Parse({Counting("l.weight", DType::kF8E4M3, {300, 256}), Counting("l.weight_scale_inv", DType::kF32, {3, 2})});
  for (uint32_t rank : {0u, 1u}) {
    auto s = Shard(checkpoint, rank, 2, {{"\\.weight$", ShardSplit{0}}});
    const SnapshotTensor& scale = Get(*s, "l.weight_scale_inv");
    EXPECT_EQ(scale.scale_of, "l.weight");
    EXPECT_TRUE(scale.shares_scale_blocks);  // rows 150 ends (and starts) inside block 1
    ASSERT_EQ(scale.slice.dims.size(), 2u);
    EXPECT_THAT(scale.slice.dims[0], ElementsAre(rank == 0 ? IndexRange{0, 2} : IndexRange{1, 3}));
    EXPECT_EQ(scale.spec.shape, (std::vector<uint64_t>{2, 2}));
    // The bytes: the scale's rows [first, first + 2) whole.
    std::vector<std::byte> got(scale.spec.byte_size());
    ASSERT_OK(s->ReadInto(scale, got));
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(static_cast<uint8_t>(got[i]), (rank * 8 + i) % 256);
  }
  // Columns: 128 each, on the block boundary: nothing shared.
  auto s = Shard(checkpoint, 1, 2, {{"\\.weight$", ShardSplit{1}}});
  const SnapshotTensor& scale = Get(*s, "l.weight_scale_inv");
  EXPECT_FALSE(scale.shares_scale_blocks);
  EXPECT_THAT(scale.slice.dims[1], ElementsAre(IndexRange{1, 2}));
}

TEST(QuantizedShardTest, Nvfp4PackedWeightsTakeTheirScaleGroupsAndTheGlobalScaleIsReplicated) {
  // ModelOpt NVFP4: U8 [out, in / 2] (two values a byte), F8_E4M3 scales per
  // 16 values ([out, in / 16]: a block of 8 bytes), an F32 global scale.
  auto checkpoint =
      Parse({Counting("p.weight", DType::kU8, {64, 32}), Counting("p.weight_scale", DType::kF8E4M3, {64, 4}),
             Counting("p.weight_scale_2", DType::kF32, {}), Counting("p.input_scale", DType::kF32, {})});
  auto s = Shard(checkpoint, 1, 2, {{"p\\.weight$", ShardSplit{1}}});  // row parallel: the rank's half of `in`
  EXPECT_EQ(Get(*s, "p.weight").spec.shape, (std::vector<uint64_t>{64, 16}));
  const SnapshotTensor& scale = Get(*s, "p.weight_scale");
  EXPECT_EQ(scale.scale_of, "p.weight");
  EXPECT_FALSE(scale.shares_scale_blocks);
  EXPECT_EQ(scale.spec.shape, (std::vector<uint64_t>{64, 2}));
  EXPECT_THAT(scale.slice.dims[1], ElementsAre(IndexRange{2, 4}));
  EXPECT_TRUE(Get(*s, "p.weight_scale_2").slice.empty());
  EXPECT_TRUE(Get(*s, "p.weight_scale_2").scale_of.empty());
}

TEST(QuantizedShardTest, GptOssStackedExpertsShardWithTheirScales) {
  // gpt-oss MXFP4: blocks U8 [E, out, in / 32, 16], scales U8 [E, out, in / 32].
  auto checkpoint = Parse({Counting("mlp.experts.gate_up_proj_blocks", DType::kU8, {4, 8, 2, 16}),
                           Counting("mlp.experts.gate_up_proj_scales", DType::kU8, {4, 8, 2})});
  auto s = Shard(checkpoint, 1, 2, {{"_blocks$", ShardSplit{0}}});
  const SnapshotTensor& scales = Get(*s, "mlp.experts.gate_up_proj_scales");
  EXPECT_EQ(scales.scale_of, "mlp.experts.gate_up_proj_blocks");
  EXPECT_EQ(scales.spec.shape, (std::vector<uint64_t>{2, 8, 2}));
  EXPECT_THAT(scales.slice.dims[0], ElementsAre(IndexRange{2, 4}));
}

TEST(QuantizedShardTest, AnExplicitScaleRuleGivesTheBlockAndASizeItCannotCoverIsRefused) {
  auto checkpoint = Parse({Counting("a.qweight", DType::kI8, {8, 64}), Counting("a.qscale", DType::kF16, {8, 2})});
  auto s = Shard(checkpoint, 0, 4, {{"qweight$", ShardSplit{1}}}, true, {{"qscale$", "qweight", {1, 32}}});
  const SnapshotTensor& scale = Get(*s, "a.qscale");
  EXPECT_EQ(scale.scale_of, "a.qweight");
  EXPECT_TRUE(scale.shares_scale_blocks);  // 16 columns of a 32-column block
  EXPECT_THAT(scale.slice.dims[1], ElementsAre(IndexRange{0, 1}));
  SelectionOptions options;
  options.shard = {0, 4, {{"qweight$", ShardSplit{1}}}, {{"qscale$", "qweight", {1, 16}}}};
  ASSERT_OK_AND_ASSIGN(auto selection, Selection::Compile(options));
  EXPECT_THAT(Snapshot::Select(checkpoint, *selection),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("scale 'a.qscale' [8, 2] of weight 'a.qweight' [8, 64]: dimension 1")));
}

TEST(QuantizedShardTest, AScaleARuleAlsoMatchesFollowsItsWeightUnlessDetectionIsOff) {
  // "proj\\.weight" also matches "proj.weight_scale_inv": split evenly, its
  // 3 rows would be refused (not divisible); followed, it is the rank's blocks.
  auto checkpoint = Parse(
      {Counting("proj.weight", DType::kF8E4M3, {256, 128}), Counting("proj.weight_scale_inv", DType::kF32, {2, 1})});
  auto s = Shard(checkpoint, 1, 2, {{"proj\\.weight", ShardSplit{0}}});
  EXPECT_THAT(Get(*s, "proj.weight_scale_inv").slice.dims[0], ElementsAre(IndexRange{1, 2}));
  auto plain = Shard(checkpoint, 1, 2, {{"proj\\.weight$", ShardSplit{0}}}, /*detect=*/false);
  EXPECT_TRUE(Get(*plain, "proj.weight_scale_inv").scale_of.empty());
  EXPECT_TRUE(Get(*plain, "proj.weight_scale_inv").slice.empty());  // replicated
}

TEST(QuantizedShardTest, ExpertsStoredOnePerTensorGoToTheirRank) {
  std::vector<SharedTensor> tensors;
  for (int layer = 0; layer < 2; ++layer) {
    for (int e = 0; e < 8; ++e) {
      tensors.push_back(Counting(absl::StrCat("l.", layer, ".experts.", e, ".w"), DType::kBF16, {4}));
    }
    tensors.push_back(Counting(absl::StrCat("l.", layer, ".router.weight"), DType::kF32, {8, 4}));
  }
  auto checkpoint = Parse(tensors);
  auto s = Shard(checkpoint, 1, 4, {}, true, {}, {"experts\\.(\\d+)\\."});
  std::vector<std::string> names;
  for (const SnapshotTensor& t : s->tensors()) names.push_back(t.spec.name);
  std::sort(names.begin(), names.end());
  EXPECT_THAT(names, ElementsAre("l.0.experts.2.w", "l.0.experts.3.w", "l.0.router.weight", "l.1.experts.2.w",
                                 "l.1.experts.3.w", "l.1.router.weight"));
  SelectionOptions bad;
  bad.shard = {0, 2, {}, {}, true, {"experts\\.([a-z]+)\\."}};
  auto lettered = Parse({Counting("experts.a.w", DType::kU8, {1})});
  ASSERT_OK_AND_ASSIGN(auto selection, Selection::Compile(bad));
  EXPECT_THAT(Snapshot::Select(lettered, *selection),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'a' is not an expert index")));
  SelectionOptions no_group;
  no_group.shard = {0, 2, {}, {}, true, {"experts"}};
  EXPECT_THAT(Selection::Compile(no_group), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("capture")));
}

TEST(QuantizedShardTest, LoadingARankIntoATargetCutsScalesAndExpertsAsAFetchDoes) {
  // A rank's module: its half of an NVFP4 layer (U8 [64, 32] packed, its
  // F8_E4M3 scale per 16 values) and its two of four experts, with a router.
  std::vector<SharedTensor> tensors = {Counting("p.weight", DType::kU8, {64, 32}),
                                       Counting("p.weight_scale", DType::kF8E4M3, {64, 4}),
                                       Counting("p.weight_scale_2", DType::kF32, {})};
  for (int e = 0; e < 4; ++e) tensors.push_back(Counting(absl::StrCat("experts.", e, ".w"), DType::kBF16, {6}));
  tensors.push_back(Counting("router.weight", DType::kF32, {4, 6}));
  auto checkpoint = Parse(tensors);
  SelectionOptions options;
  options.shard = {1, 2, {{"^p\\.weight$", ShardSplit{1}}}, {}, true, {"experts\\.(\\d+)\\."}};
  ASSERT_OK_AND_ASSIGN(auto selection, Selection::Compile(options));
  TargetSchema target;
  target.parameters = {{"p.weight", std::nullopt, {64, 16}, "Linear"}, {"p.weight_scale", std::nullopt, {64, 2}, ""},
                       {"p.weight_scale_2", std::nullopt, {}, ""},     {"experts.2.w", std::nullopt, {6}, ""},
                       {"experts.3.w", std::nullopt, {6}, ""},         {"router.weight", std::nullopt, {4, 6}, ""}};
  ASSERT_OK_AND_ASSIGN(Applied applied, Apply(checkpoint, *selection, target));
  ASSERT_OK(applied.status);
  EXPECT_EQ(applied.result.applied.size(), 6u);
  EXPECT_TRUE(applied.result.errors.empty());
  EXPECT_TRUE(applied.result.unused.empty());  // experts 0 and 1 are rank 0's, not unused
  // The same bytes as the rank's fetch.
  auto fetched = Shard(checkpoint, 1, 2, {{"^p\\.weight$", ShardSplit{1}}}, true, {}, {"experts\\.(\\d+)\\."});
  for (const TargetParameter& param : target.parameters) {
    const SnapshotTensor& a = Get(*applied.snapshot, param.path);
    const SnapshotTensor& f = Get(*fetched, param.path);
    std::vector<std::byte> got(a.spec.byte_size()), want(f.spec.byte_size());
    ASSERT_OK(applied.snapshot->ReadInto(a, got));
    ASSERT_OK(fetched->ReadInto(f, want));
    EXPECT_EQ(got, want) << param.path;
  }
  EXPECT_EQ(Get(*applied.snapshot, "p.weight_scale").scale_of, "p.weight");
  // A target that lists another rank's expert: skipped, not loaded.
  target.parameters.push_back({"experts.0.w", std::nullopt, {6}, ""});
  ASSERT_OK_AND_ASSIGN(Applied with_other, Apply(checkpoint, *selection, target));
  EXPECT_THAT(with_other.result.skipped, ElementsAre("experts.0.w"));
  EXPECT_EQ(with_other.snapshot->Find("experts.0.w"), nullptr);
  // A target whose scale shape is the whole tensor's is a shape error, named.
  target.parameters[1].shape = {64, 4};
  ASSERT_OK_AND_ASSIGN(Applied wrong, Apply(checkpoint, *selection, target));
  ASSERT_EQ(wrong.result.errors.size(), 1u);
  EXPECT_EQ(wrong.result.errors[0].path, "p.weight_scale");
}

TEST(QuantizedShardTest, ATensorLoadedIntoATargetCarriesItsQuantizationAsAFetchedOneDoes) {
  // An NVFP4 checkpoint as ModelOpt writes it: the config beside the file, a
  // weight of packed values with its scale, and a tensor the config leaves alone
  // (no scale follows it).
  const std::filesystem::path dir(testing::MakeScratchDir("select-quantization"));
  const std::string model = (dir / "model.safetensors").string();
  ASSERT_OK_AND_ASSIGN(std::string file, SerializeCheckpoint(kSafeTensorsFormat,
                                                             {Counting("p.weight", DType::kU8, {4, 16}),
                                                              Counting("p.weight_scale", DType::kF8E4M3, {4, 2}),
                                                              Counting("norm.weight", DType::kF32, {4})},
                                                             {}));
  testing::WriteFileOrDie(model, file);
  testing::WriteFileOrDie((dir / "hf_quant_config.json").string(), R"({"quantization": {"quant_algo": "NVFP4"}})");
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const Checkpoint> checkpoint, Checkpoint::Open(model));
  ASSERT_OK_AND_ASSIGN(auto selection, Selection::Compile({}));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const Snapshot> fetched, Snapshot::Select(checkpoint, *selection));
  EXPECT_EQ(Get(*fetched, "p.weight").quantization, "NVFP4, 4-bit values, blocks of 1x16 (hf_quant_config.json)");
  EXPECT_EQ(Get(*fetched, "norm.weight").quantization, "");
  TargetSchema target;
  target.parameters = {{"p.weight", std::nullopt, {4, 16}, ""},
                       {"p.weight_scale", std::nullopt, {4, 2}, ""},
                       {"norm.weight", std::nullopt, {4}, "LayerNorm"}};
  ASSERT_OK_AND_ASSIGN(Applied applied, Apply(checkpoint, *selection, target));
  ASSERT_OK(applied.status);
  for (const TargetParameter& param : target.parameters) {
    EXPECT_EQ(Get(*applied.snapshot, param.path).quantization, Get(*fetched, param.path).quantization) << param.path;
  }
}

}  // namespace
}  // namespace weightstore

#include "core/select/slice.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "core/checksum_cache.h"
#include "core/formats/safetensors.h"
#include "core/select/dtype_cast.h"
#include "core/select/served.h"
#include "core/select/snapshot.h"
#include "core/status_macros.h"
#include "tests/util/status_matchers.h"

namespace weightstore {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

TEST(ShardSliceTest, ColumnParallelTakesTheRanksRowsAndRowParallelItsColumns) {
  const std::vector<uint64_t> shape = {8, 6};
  ASSERT_OK_AND_ASSIGN(TensorSlice rows, ShardSlice(shape, {0}, 1, 4, "w"));
  EXPECT_EQ(rows.dims, (std::vector<std::vector<IndexRange>>{{{2, 4}}, {{0, 6}}}));
  EXPECT_EQ(rows.Shape(), (std::vector<uint64_t>{2, 6}));
  ASSERT_OK_AND_ASSIGN(TensorSlice cols, ShardSlice(shape, {1}, 2, 3, "w"));
  EXPECT_EQ(cols.dims, (std::vector<std::vector<IndexRange>>{{{0, 8}}, {{4, 6}}}));
}

TEST(ShardSliceTest, FusedPartsGiveTheRankAPieceOfEachPart) {
  // A fused QKV of 3 x 8 rows over 4 ranks: rank 1 gets rows 2-3 of each part.
  ASSERT_OK_AND_ASSIGN(TensorSlice s, ShardSlice(std::vector<uint64_t>{24, 5}, {0, 3}, 1, 4, "qkv"));
  EXPECT_EQ(s.dims[0], (std::vector<IndexRange>{{2, 4}, {10, 12}, {18, 20}}));
  EXPECT_EQ(s.Shape(), (std::vector<uint64_t>{6, 5}));
  EXPECT_EQ(s.ToString(std::vector<uint64_t>{24, 5}), "[2:4+10:12+18:20, :]");
}

TEST(ShardSliceTest, OneRankOrOneWholePartIsNoSlice) {
  ASSERT_OK_AND_ASSIGN(TensorSlice s, ShardSlice(std::vector<uint64_t>{6, 4}, {0, 3}, 0, 1, "w"));
  EXPECT_TRUE(s.empty());
}

TEST(ShardSliceTest, IndivisibleDimensionIsAnErrorNamingTheTensorUnlessUneven) {
  EXPECT_THAT(ShardSlice(std::vector<uint64_t>{10, 4}, {0}, 0, 4, "model.embed.weight").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("model.embed.weight"), HasSubstr("not divisible by the world size 4"))));
  EXPECT_THAT(ShardSlice(std::vector<uint64_t>{10, 4}, {0, 3}, 0, 2, "qkv").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not hold 3 equal fused parts")));
  // torch.tensor_split(arange(10), 4): sizes 3, 3, 2, 2.
  std::vector<IndexRange> got;
  for (uint32_t r = 0; r < 4; ++r) {
    ASSERT_OK_AND_ASSIGN(TensorSlice s, ShardSlice(std::vector<uint64_t>{10}, {0, 1, true}, r, 4, "v"));
    got.push_back(s.dims[0][0]);
  }
  EXPECT_EQ(got, (std::vector<IndexRange>{{0, 3}, {3, 6}, {6, 8}, {8, 10}}));
}

TEST(ShardSliceTest, DimensionPastTheRankIsAnErrorNamingTheTensor) {
  EXPECT_THAT(
      ShardSlice(std::vector<uint64_t>{16}, {1}, 0, 2, "o_proj.bias").status(),
      StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("o_proj.bias"), HasSubstr("no dimension 1"))));
}

TEST(ShardSplitTest, ParsesDimPartsAndUnevenAndRefusesTheRest) {
  ASSERT_OK_AND_ASSIGN(ShardSplit a, ParseShardSplit("1"));
  EXPECT_EQ(a, (ShardSplit{1, 1, false}));
  ASSERT_OK_AND_ASSIGN(ShardSplit b, ParseShardSplit("0x3:uneven"));
  EXPECT_EQ(b, (ShardSplit{0, 3, true}));
  EXPECT_EQ(ShardSplitToString(b), "0x3:uneven");
  for (const char* bad : {"", "x3", "0x", "0x0", "-1", "a", "0:even", "0x3x2", "+1"}) {
    EXPECT_FALSE(ParseShardSplit(bad).ok()) << bad;
  }
}

TEST(SliceBoundsTest, ParsesPythonSlicesWithoutStepsOrNegatives) {
  ASSERT_OK_AND_ASSIGN(std::vector<SliceBound> b, ParseSliceBounds(" [0:512, :, 3:] "));
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0], (SliceBound{0, 512}));
  EXPECT_EQ(b[1], (SliceBound{}));
  EXPECT_EQ(b[2], (SliceBound{3, std::nullopt}));
  EXPECT_EQ(SliceBoundsToString(b), "[0:512, :, 3:]");
  ASSERT_OK_AND_ASSIGN(std::vector<SliceBound> none, ParseSliceBounds("[]"));
  EXPECT_TRUE(none.empty());
  for (const char* bad : {"0:5", "[0:5", "[-1:]", "[0:5:2]", "[5]", "[a:b]", "[0:99999999999999999999]"}) {
    EXPECT_FALSE(ParseSliceBounds(bad).ok()) << bad;
  }
  std::string deep = "[";
  for (int i = 0; i < 65; ++i) deep += i ? ",:" : ":";
  EXPECT_THAT(ParseSliceBounds(deep + "]").status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(SliceBoundsTest, ExplicitSliceChecksEachBoundAgainstTheTensor) {
  ASSERT_OK_AND_ASSIGN(TensorSlice s, ExplicitSlice(std::vector<uint64_t>{4, 6}, std::vector<SliceBound>{{1, 3}}, "w"));
  EXPECT_EQ(s.Shape(), (std::vector<uint64_t>{2, 6}));
  EXPECT_THAT(ExplicitSlice(std::vector<uint64_t>{4, 6}, std::vector<SliceBound>{{}, {2, 7}}, "w").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("'w'"), HasSubstr("2:7 of dimension 1"))));
  EXPECT_THAT(ExplicitSlice(std::vector<uint64_t>{4}, std::vector<SliceBound>{{}, {}}, "b").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'b'")));
  ASSERT_OK_AND_ASSIGN(TensorSlice whole, ExplicitSlice(std::vector<uint64_t>{4, 6}, {}, "w"));
  EXPECT_TRUE(whole.empty());
}

TEST(TensorSliceTest, CheckRefusesRangesOutsideTheTensorOrOutOfOrder) {
  const std::vector<uint64_t> shape = {8, 4};
  auto check = [&](std::vector<std::vector<IndexRange>> dims) {
    return TensorSlice{std::move(dims)}.Check(shape, "t");
  };
  EXPECT_OK(check({{{0, 2}, {4, 6}}, {{0, 4}}}));
  EXPECT_THAT(check({{{0, 9}}, {{0, 4}}}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'t'")));
  EXPECT_THAT(check({{{3, 2}}, {{0, 4}}}), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(check({{{4, 6}, {0, 2}}, {{0, 4}}}), StatusIs(absl::StatusCode::kInvalidArgument));  // descending
  EXPECT_THAT(check({{{0, 5}, {4, 8}}, {{0, 4}}}), StatusIs(absl::StatusCode::kInvalidArgument));  // overlapping
  EXPECT_THAT(check({{{0, 8}}}), StatusIs(absl::StatusCode::kInvalidArgument));                    // a dimension short
  EXPECT_THAT(check({{}, {{0, 4}}}), StatusIs(absl::StatusCode::kInvalidArgument));                // no range
  // Ranges that would add up past 2^64 are out of order first: Shape() cannot wrap.
  const std::vector<uint64_t> huge = {UINT64_MAX};
  const TensorSlice wraps{{{{0, uint64_t{1} << 63}, {0, uint64_t{1} << 63}, {0, 5}}}};
  EXPECT_FALSE(wraps.Check(huge, "t").ok());
}

TEST(TensorSliceTest, ContiguousStartWhenTheServedElementsAreOneRun) {
  const std::vector<uint64_t> shape = {4, 3, 5};
  auto slice = [](std::vector<std::vector<IndexRange>> dims) { return TensorSlice{std::move(dims)}; };
  // Rows 1-2 of dim 0, everything else whole: elements 15..44.
  EXPECT_EQ(slice({{{1, 3}}, {{0, 3}}, {{0, 5}}}).ContiguousStart(shape), 15u);
  // One index of dims 0 and 1, part of the last: a run inside a row.
  EXPECT_EQ(slice({{{2, 3}}, {{1, 2}}, {{1, 4}}}).ContiguousStart(shape), 2 * 15 + 5 + 1u);
  EXPECT_EQ(slice({{{0, 4}}, {{0, 3}}, {{0, 2}}}).ContiguousStart(shape), std::nullopt);          // dim-2 shard
  EXPECT_EQ(slice({{{0, 1}, {2, 3}}, {{0, 3}}, {{0, 5}}}).ContiguousStart(shape), std::nullopt);  // fused
  EXPECT_EQ(TensorSlice{}.ContiguousStart(shape), 0u);
}

// A [4, 6, 8] F32 tensor "t" holding 0, 1, 2, ... in row-major order, "m" a
// [16, 12] matrix likewise, and "s" a strided view: m's transpose, [12, 16].
std::shared_ptr<const Checkpoint> Tensors() {
  auto values = std::make_shared<std::vector<float>>(4 * 6 * 8 + 16 * 12);
  std::iota(values->begin(), values->end(), 0.0f);
  SharedBytes bytes(values, std::span<const std::byte>(reinterpret_cast<const std::byte*>(values->data()),
                                                       values->size() * sizeof(float)));
  auto storage = LazyStorage::Ready(bytes);
  std::vector<CheckpointEntry> entries(3);
  entries[0].spec = {"layers.0.t", DType::kF32, {4, 6, 8}};
  entries[0].layout.storage = storage;
  entries[1].spec = {"layers.0.m", DType::kF32, {16, 12}};
  entries[1].layout = {storage, 4 * 6 * 8 * sizeof(float), {}};
  entries[2].spec = {"layers.0.s", DType::kF32, {12, 16}};
  entries[2].layout = {storage, 4 * 6 * 8 * sizeof(float), {1, 12}};
  auto checkpoint = Checkpoint::Create(kSafeTensorsFormat, "mem", {}, std::move(entries));
  EXPECT_OK(checkpoint.status());
  return *checkpoint;
}

// The served elements of `t` computed the plain way: walk every served index,
// map each dimension through the slice's ranges, read the source element.
std::vector<float> Reference(const SnapshotTensor& t) {
  std::vector<uint64_t> shape = t.source->spec.shape, strides = t.source->layout.strides;
  if (strides.empty()) {
    strides.assign(shape.size(), 1);
    for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  }
  if (t.transpose) {
    std::swap(shape[0], shape[1]);
    std::swap(strides[0], strides[1]);
  }
  auto storage = *t.source->layout.storage->Get();
  const float* base = reinterpret_cast<const float*>(storage.data() + t.source->layout.offset);
  std::vector<std::vector<uint64_t>> indices(shape.size());  // source index of each served index, per dim
  for (size_t d = 0; d < shape.size(); ++d) {
    if (t.slice.empty()) {
      for (uint64_t i = 0; i < shape[d]; ++i) indices[d].push_back(i);
    } else {
      for (const IndexRange& r : t.slice.dims[d]) {
        for (uint64_t i = r.start; i < r.stop; ++i) indices[d].push_back(i);
      }
    }
  }
  std::vector<float> out;
  std::vector<size_t> at(shape.size(), 0);
  const uint64_t n = t.spec.num_elements();
  for (uint64_t e = 0; e < n; ++e) {
    uint64_t offset = 0;
    for (size_t d = 0; d < shape.size(); ++d) offset += indices[d][at[d]] * strides[d];
    out.push_back(base[offset]);
    for (size_t d = shape.size(); d-- > 0;) {
      if (++at[d] < indices[d].size()) break;
      at[d] = 0;
    }
  }
  return out;
}

std::vector<float> AsFloats(const Snapshot& snapshot, const SnapshotTensor& t) {
  std::vector<float> out(t.spec.num_elements());
  if (t.spec.dtype == DType::kF32) {
    EXPECT_OK(snapshot.ReadInto(t, std::as_writable_bytes(std::span(out))));
    return out;
  }
  std::vector<std::byte> raw(t.spec.byte_size());
  EXPECT_OK(snapshot.ReadInto(t, raw));
  CastElementsReference(t.spec.dtype, raw.data(), DType::kF32, reinterpret_cast<std::byte*>(out.data()), out.size());
  return out;
}

std::shared_ptr<const Snapshot> Shard(uint32_t rank, uint32_t world, std::vector<ShardRule> rules,
                                      std::optional<DType> dtype = std::nullopt) {
  SelectionOptions options;
  options.shard = {rank, world, std::move(rules)};
  options.dtype = dtype;
  auto selection = Selection::Compile(options);
  EXPECT_OK(selection.status());
  auto snapshot = Snapshot::Select(Tensors(), **selection);
  EXPECT_OK(snapshot.status());
  return *snapshot;
}

TEST(SnapshotSliceTest, EveryShardOfEveryDimensionReadsAsTheReferenceGather) {
  for (uint32_t world : {2u, 4u}) {
    for (uint32_t dim : {0u, 1u, 2u}) {
      for (uint32_t rank = 0; rank < world; ++rank) {
        SCOPED_TRACE(absl::StrCat("dim ", dim, " rank ", rank, "/", world));
        // "s" is sharded along dim 0 or 1 too (a strided source); dim 2 is past its rank, so it is left out.
        std::vector<ShardRule> rules = {{"\\.t$", {dim, 1, /*uneven=*/true}}};
        if (dim < 2) rules.push_back({"\\.[ms]$", {dim}});
        auto snapshot = Shard(rank, world, rules);
        for (const SnapshotTensor& t : snapshot->tensors()) {
          SCOPED_TRACE(t.spec.name);
          EXPECT_EQ(AsFloats(*snapshot, t), Reference(t));
          // Any element-aligned chunking of the served bytes gives the same.
          const uint64_t total = t.spec.byte_size();
          std::vector<std::byte> whole(total), chunked(total);
          ASSERT_OK(snapshot->ReadInto(t, whole));
          for (uint64_t at = 0; at < total;) {
            const uint64_t n = std::min<uint64_t>(total - at, 4 * 7);
            ASSERT_OK(snapshot->ReadRange(t, at, std::span(chunked).subspan(at, n)));
            at += n;
          }
          EXPECT_EQ(whole, chunked);
        }
      }
    }
  }
}

TEST(SnapshotSliceTest, FusedShardsConcatenateThePiecesOfEachPart) {
  auto snapshot = Shard(1, 2, {{"\\.m$", {0, 2}}, {"\\.t$", {2, 4}}});
  const SnapshotTensor* m = snapshot->Find("layers.0.m");
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->slice.dims[0], (std::vector<IndexRange>{{4, 8}, {12, 16}}));
  EXPECT_EQ(AsFloats(*snapshot, *m), Reference(*m));
  const SnapshotTensor* t = snapshot->Find("layers.0.t");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->spec.shape, (std::vector<uint64_t>{4, 6, 4}));
  EXPECT_EQ(AsFloats(*snapshot, *t), Reference(*t));
}

TEST(SnapshotSliceTest, CastShardsMatchTheCastOfTheReference) {
  auto snapshot = Shard(1, 2, {{"\\.[tms]$", {1}}}, DType::kBF16);
  for (const SnapshotTensor& t : snapshot->tensors()) {
    std::vector<float> want = Reference(t);
    std::vector<std::byte> bf16(want.size() * 2);
    CastElementsReference(DType::kF32, reinterpret_cast<const std::byte*>(want.data()), DType::kBF16, bf16.data(),
                          want.size());
    std::vector<std::byte> got(t.spec.byte_size());
    ASSERT_OK(snapshot->ReadInto(t, got));
    EXPECT_EQ(got, bf16) << t.spec.name;
  }
}

TEST(SnapshotSliceTest, TransposedTensorsAreSlicedInTheirServedLayout) {
  auto c = Tensors();
  const CheckpointEntry& m = c->entries()[1];  // [16, 12], served [12, 16]
  SnapshotTensor t{{"mT", DType::kF32, {12, 4}}, &m, true, TensorSlice{{{{0, 12}}, {{8, 12}}}}};
  // A block of both dimensions, read whole and a served row or two at a time
  // (the tiled transpose of a block).
  SnapshotTensor block{{"block", DType::kF16, {7, 12}}, &m, true, TensorSlice{{{{2, 9}}, {{3, 15}}}}};
  ASSERT_OK_AND_ASSIGN(auto snapshot, Snapshot::Create(c, {t, block}));
  EXPECT_EQ(AsFloats(*snapshot, snapshot->tensors()[0]), Reference(snapshot->tensors()[0]));
  const SnapshotTensor& b = snapshot->tensors()[1];
  std::vector<float> want = Reference(b);
  std::vector<std::byte> f16(want.size() * 2), rows(want.size() * 2);
  CastElementsReference(DType::kF32, reinterpret_cast<const std::byte*>(want.data()), DType::kF16, f16.data(),
                        want.size());
  const uint64_t row = 12 * 2;
  for (uint64_t at = 0; at < rows.size(); at += 2 * row) {
    ASSERT_OK(snapshot->ReadRange(b, at, std::span(rows).subspan(at, std::min<uint64_t>(2 * row, rows.size() - at))));
  }
  EXPECT_EQ(rows, f16);
  // A slice that does not give the served shape is refused.
  SnapshotTensor wrong = t;
  wrong.spec.shape = {12, 5};
  EXPECT_THAT(Snapshot::Create(c, {wrong}).status(), StatusIs(absl::StatusCode::kInternal));
}

TEST(SnapshotSliceTest, DimZeroShardOfAContiguousTensorIsAViewIntoItsStorage) {
  auto snapshot = Shard(1, 2, {{"\\.[tm]$", {0}}});
  const SnapshotTensor* t = snapshot->Find("layers.0.t");
  ASSERT_NE(t, nullptr);
  ASSERT_OK_AND_ASSIGN(SharedTensor read, snapshot->Read(*t));
  ASSERT_OK_AND_ASSIGN(SharedBytes storage, t->source->layout.storage->Get());
  EXPECT_EQ(read.bytes.data(), storage.data() + 2 * 6 * 8 * sizeof(float));  // rows 2-3 of 4, no copy
  const ServedTensorPlan plan = PlanServedTensor(*snapshot, *t);
  EXPECT_TRUE(plan.is_byte_range());
  EXPECT_EQ(plan.key, "0:F32:[2:4, :, :]");
  // A dim-1 shard is gathered, under a key of its own.
  auto cols = Shard(0, 2, {{"\\.t$", {1}}});
  const ServedTensorPlan gathered = PlanServedTensor(*cols, *cols->Find("layers.0.t"));
  EXPECT_TRUE(gathered.gather);
  EXPECT_EQ(gathered.key, "0:F32:[:, 0:3, :]");
}

TEST(SelectionShardTest, ErrorsNameTheTensorOrTheField) {
  auto select = [](SelectionOptions options) -> absl::Status {
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto selection, Selection::Compile(options));
    return Snapshot::Select(Tensors(), *selection).status();
  };
  SelectionOptions options;
  options.shard = {4, 4, {{"t$", {0}}}};
  EXPECT_THAT(select(options), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shard.rank 4 is out of range")));
  options.shard = {0, 0, {{"t$", {0}}}};
  EXPECT_THAT(select(options), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("world size")));
  options.shard = {0, 4, {{"t$", {0}}, {"layers", {1}}}};
  EXPECT_THAT(select(options), StatusIs(absl::StatusCode::kInvalidArgument,
                                        AllOf(HasSubstr("'layers.0.t'"), HasSubstr("which disagree"))));
  options.shard = {0, 4, {{"t$", {0}}, {"\\.t", {0}}}};  // two rules that agree are fine
  EXPECT_OK(select(options));
  options.shard = {0, 4, {{"m$", {2}}}};
  EXPECT_THAT(select(options), StatusIs(absl::StatusCode::kInvalidArgument,
                                        AllOf(HasSubstr("'layers.0.m'"), HasSubstr("no dimension 2"))));
  options.shard = {0, 5, {{"m$", {0}}}};
  EXPECT_THAT(select(options), StatusIs(absl::StatusCode::kInvalidArgument,
                                        AllOf(HasSubstr("'layers.0.m'"), HasSubstr("not divisible"))));
  options.shard = {0, 2, {{"m$", {0, 1000}}}};
  EXPECT_THAT(select(options), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("fused parts")));
  options.shard = {0, 2, {{"m$", {0}}}};
  options.slices = {{"layers.0.m", {{0, 2}}}};
  EXPECT_THAT(select(options), StatusIs(absl::StatusCode::kInvalidArgument,
                                        AllOf(HasSubstr("'layers.0.m'"), HasSubstr("explicit slice"))));
  options.shard = {};
  options.slices = {{"layers.0.typo", {{0, 2}}}};
  EXPECT_THAT(select(options), StatusIs(absl::StatusCode::kNotFound, HasSubstr("'layers.0.typo'")));
  options.slices = {{"layers.0.m", {{3, 2}}}};
  EXPECT_THAT(select(options), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("past its stop")));
  options.slices = {{"layers.0.m", {{0, 2}}}, {"layers.0.m", {{0, 3}}}};
  EXPECT_THAT(select(options), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("two explicit slices")));
  options.slices = {{"layers.0.m", {{0, 2}, {5, 9}}}};
  EXPECT_OK(select(options));
}

TEST(SelectionShardTest, ShardsFollowRenamesAndFilters) {
  SelectionOptions options;
  options.renames = {{"^layers\\.0\\.", "h."}};
  options.include = {"^h\\.[tm]$"};
  options.shard = {1, 4, {{"^h\\.m$", {0}}}};
  ASSERT_OK_AND_ASSIGN(auto selection, Selection::Compile(options));
  ASSERT_OK_AND_ASSIGN(auto snapshot, Snapshot::Select(Tensors(), *selection));
  ASSERT_EQ(snapshot->size(), 2u);
  EXPECT_TRUE(snapshot->Find("h.t")->slice.empty());  // replicated
  EXPECT_EQ(snapshot->Find("h.m")->spec.shape, (std::vector<uint64_t>{4, 12}));
}

TEST(ChecksumCacheTest, KeysPastEitherBoundEmptyTheCacheFirst) {
  ChecksumCache cache({}, /*max_entries=*/2, /*max_key_bytes=*/8);
  ASSERT_OK(cache.Store("a", 1));
  ASSERT_OK(cache.Store("b", 2));
  ASSERT_OK(cache.Store("a", 4));  // a kept key is updated
  EXPECT_EQ(cache.Find("a"), 4u);
  ASSERT_OK(cache.Store("c", 3));  // a third key: the cache starts over
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_EQ(cache.Find("a"), std::nullopt);
  EXPECT_EQ(cache.Find("c"), 3u);
  ASSERT_OK(cache.Store("12345678", 5));  // 1 + 8 key bytes pass 8: starts over
  EXPECT_EQ(cache.size(), 1u);
  ASSERT_OK(cache.Store("123456789", 6));  // longer than the bound: not kept at all
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_EQ(cache.Find("123456789"), std::nullopt);
}

}  // namespace
}  // namespace weightstore

// Conformance over ../shared/fixtures/burn: files written by PyTorch, Hugging
// Face's safetensors and Burn, compared with what real PyTorch reads from them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/checkpoint.h"
#include "core/formats/burnpack.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "tests/util/expectations.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

std::string Burn(const std::string& rel) { return testing::FixturesDir() + "/burn/" + rel; }

nlohmann::json ExpectedByTorch() {
  std::ifstream in(Burn("expected-by-torch.json"));
  return nlohmann::json::parse(in);
}

TEST(FixturesTest, EveryPyTorchFixtureYieldsExactlyWhatTorchReads) {
  nlohmann::json expected = ExpectedByTorch();
  ASSERT_GE(expected.size(), 40u);
  for (const auto& [rel, want] : expected.items()) {
    SCOPED_TRACE(rel);
    absl::StatusOr<std::shared_ptr<const Checkpoint>> c = Checkpoint::Open(Burn(rel));
    if (want.contains("error")) {
      EXPECT_FALSE(c.ok()) << rel << " must be refused, as torch refuses it";
      continue;
    }
    ASSERT_TRUE(c.ok()) << c.status();
    testing::ExpectMatchesTorch(**c, want, rel);
  }
}

TEST(FixturesTest, BrokenFixtureIsRefusedWithAMessageNamingTheFile) {
  EXPECT_THAT(Checkpoint::Open(Burn("pytorch-reader/broken.pt")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("broken.pt")));
}

TEST(FixturesTest, LegacyViewsOfOneStorageReadTheirOwnWindows) {
  ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Open(Burn("pytorch-reader/legacy_uncloned_views.pt")));
  ASSERT_OK_AND_ASSIGN(SharedTensor t1, c->Read("tensor1"));
  ASSERT_OK_AND_ASSIGN(SharedTensor t2, c->Read("tensor2"));
  for (int i = 0; i < 10; ++i) {  // legacy files do not align tensors: copy, do not cast
    float a, b;
    std::memcpy(&a, t1.bytes.data() + 4 * i, 4);
    std::memcpy(&b, t2.bytes.data() + 4 * i, 4);
    EXPECT_EQ(a, static_cast<float>(10 + i));
    EXPECT_EQ(b, static_cast<float>(50 + i));
  }
}

TEST(FixturesTest, TopLevelKeySelectsTheNestedStateDict) {
  OpenOptions options;
  options.top_level_key = "model_state_dict";
  ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Open(Burn("pytorch-reader/checkpoint.pt"), options));
  EXPECT_NE(c->Find("fc1.weight"), nullptr);
  EXPECT_EQ(c->Find("optimizer_state_dict.state.0.momentum_buffer"), nullptr);
  options.top_level_key = "my_state_dict";
  EXPECT_THAT(Checkpoint::Open(Burn("pytorch-models/top_level_key.pt"), options),
              ::testing::Not(StatusIs(absl::StatusCode::kNotFound)));
}

TEST(FixturesTest, HuggingFaceSafeTensorsFixtureKeepsItsHeaderOrder) {
  ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Open(Burn("safetensors/multi_layer.safetensors")));
  ASSERT_FALSE(c->entries().empty());
  EXPECT_EQ(c->entries()[0].spec.name, "norm1.num_batches_tracked");  // I64 sorts first
  EXPECT_EQ(c->entries()[0].spec.dtype, DType::kI64);
  EXPECT_EQ(c->Find("fc1.weight")->spec.shape, (std::vector<uint64_t>{16, 256}));
}

// .pt -> SafeTensors -> Burnpack -> SafeTensors keeps every byte, and each step
// still matches what torch reads from the original.
TEST(FixturesTest, RoundTripsThroughBothWritableFormatsKeepEveryByte) {
  nlohmann::json expected = ExpectedByTorch();
  const std::string dir = testing::MakeScratchDir("roundtrip");
  int converted = 0;
  for (const auto& [rel, want] : expected.items()) {
    if (want.contains("error")) continue;
    SCOPED_TRACE(rel);
    const std::string stem = dir + "/" + std::filesystem::path(rel).stem().string();
    ASSERT_OK_AND_ASSIGN(auto pt, Checkpoint::Open(Burn(rel)));
    ASSERT_OK(WriteCheckpoint(*pt, stem + ".1.safetensors", kSafeTensorsFormat, {}, {}));
    ASSERT_OK_AND_ASSIGN(auto st1, Checkpoint::Open(stem + ".1.safetensors"));
    testing::ExpectMatchesTorch(*st1, want, rel + " as SafeTensors");
    ASSERT_OK(WriteCheckpoint(*st1, stem + ".bpk", kBurnpackFormat, {}, {}));
    ASSERT_OK_AND_ASSIGN(auto bpk, Checkpoint::Open(stem + ".bpk"));
    testing::ExpectMatchesTorch(*bpk, want, rel + " as Burnpack");
    ASSERT_OK(WriteCheckpoint(*bpk, stem + ".2.safetensors", kSafeTensorsFormat, {}, {}));
    EXPECT_EQ(testing::ReadFileOrEmpty(stem + ".1.safetensors"), testing::ReadFileOrEmpty(stem + ".2.safetensors"));
    ++converted;
  }
  EXPECT_GE(converted, 40);
}

TEST(FixturesTest, ShardedSafeTensorsOpenAsOneCheckpoint) {
  const std::string dir = testing::MakeScratchDir("sharded");
  ASSERT_OK_AND_ASSIGN(auto src, Checkpoint::Open(Burn("pytorch-models/batch_norm2d.pt")));
  // Split the five tensors over two shards, and write the index.
  std::vector<SharedTensor> first, second;
  nlohmann::json map;
  for (size_t i = 0; i < src->size(); ++i) {
    ASSERT_OK_AND_ASSIGN(SharedTensor t, src->Read(src->entries()[i]));
    (i < 2 ? first : second).push_back(t);
    map[t.spec.name] = i < 2 ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  testing::WriteFileOrDie(dir + "/model-00001-of-00002.safetensors",
                          *SerializeCheckpoint(kSafeTensorsFormat, first, {}));
  testing::WriteFileOrDie(dir + "/model-00002-of-00002.safetensors",
                          *SerializeCheckpoint(kSafeTensorsFormat, second, {}));
  nlohmann::json index = {{"metadata", {{"total_size", 1234}}}, {"weight_map", map}};
  testing::WriteFileOrDie(dir + "/model.safetensors.index.json", index.dump());
  ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Open(dir));
  EXPECT_EQ(c->size(), src->size());
  EXPECT_EQ(c->metadata().at("total_size"), "1234");
  testing::ExpectMatchesTorch(*c, ExpectedByTorch()["pytorch-models/batch_norm2d.pt"], "sharded");

  map.erase(map.begin());  // a shard tensor the index does not list
  testing::WriteFileOrDie(dir + "/model.safetensors.index.json", nlohmann::json({{"weight_map", map}}).dump());
  EXPECT_THAT(Checkpoint::Open(dir + "/model.safetensors.index.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not list")));
}

}  // namespace
}  // namespace weightstore

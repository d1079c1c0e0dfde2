// Runs the real `weightstore` binary as a user would.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/checkpoint.h"
#include "core/formats/burnpack.h"
#include "core/formats/safetensors.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using ::testing::HasSubstr;
using testing::ShellQuote;

std::string Burn(const std::string& rel) { return testing::FixturesDir() + "/burn/" + rel; }

int Cli(const std::string& args, std::string* output, bool merge_stderr = true) {
  return testing::RunCommand(absl::StrCat(ShellQuote(testing::CliPath()), " ", args), output, merge_stderr);
}

size_t CountFiles(const std::string& dir) {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++n;
  return n;
}

TEST(CliTest, InspectPrintsATableOfEveryTensor) {
  std::string out;
  ASSERT_EQ(Cli("inspect " + ShellQuote(Burn("pytorch-models/batch_norm2d.pt")), &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("pytorch (zip"));
  EXPECT_THAT(out, HasSubstr("norm1.running_var"));
  EXPECT_THAT(out, HasSubstr("I64"));
}

TEST(CliTest, InspectJsonHasFormatMetadataAndTensors) {
  std::string out;
  ASSERT_EQ(Cli("inspect --json " + ShellQuote(Burn("burnpack/mnist.bpk")), &out, false), 0) << out;
  nlohmann::json doc = nlohmann::json::parse(out);
  EXPECT_EQ(doc["format"], "burnpack");
  EXPECT_TRUE(doc["metadata"].is_object());
  ASSERT_EQ(doc["tensors"].size(), 18u);
  EXPECT_EQ(doc["tensors"][0]["name"], "conv1.conv.weight");
  EXPECT_EQ(doc["tensors"][0]["shape"], nlohmann::json({64, 1, 3, 3}));
  EXPECT_EQ(doc["tensors"][0]["bytes"], 2304);
  EXPECT_EQ(doc["tensors"][0]["dtype"], "F32");
}

TEST(CliTest, InspectWithTopLevelKeyShowsTheSelectedDict) {
  std::string out;
  ASSERT_EQ(Cli("inspect --json --top-level-key my_state_dict " + ShellQuote(Burn("pytorch-models/top_level_key.pt")),
                &out, false),
            0);
  EXPECT_THAT(out, HasSubstr("\"conv1.weight\""));
  EXPECT_EQ(Cli("inspect --top-level-key nope " + ShellQuote(Burn("pytorch-models/top_level_key.pt")), &out), 1);
  EXPECT_THAT(out, HasSubstr("my_state_dict"));
}

TEST(CliTest, ConvertFollowsTheExtensionAndAddsMetadata) {
  const std::string dir = testing::MakeScratchDir("cli");
  std::string out;
  ASSERT_EQ(Cli(absl::StrCat("convert ", ShellQuote(Burn("pytorch-models/linear.pt")), " ", dir,
                             "/linear.bpk --metadata producer=test --metadata a=b=c"),
                &out),
            0)
      << out;
  EXPECT_EQ(out, "") << "quiet when stderr is not a terminal";
  ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Open(dir + "/linear.bpk"));
  EXPECT_EQ(c->format(), kBurnpackFormat);
  EXPECT_EQ(c->metadata().at("producer"), "test");
  EXPECT_EQ(c->metadata().at("a"), "b=c");
  ASSERT_EQ(Cli(absl::StrCat("convert --format safetensors ", dir, "/linear.bpk ", dir, "/linear.weights"), &out), 0)
      << out;
  ASSERT_OK_AND_ASSIGN(auto st, Checkpoint::Open(dir + "/linear.weights"));
  EXPECT_EQ(st->format(), kSafeTensorsFormat);
  ASSERT_EQ(
      Cli(absl::StrCat("diff --exit-code ", ShellQuote(Burn("pytorch-models/linear.pt")), " ", dir, "/linear.weights"),
          &out),
      0)
      << out;
}

TEST(CliTest, ConvertNeverReplacesAnExistingFileUnlessAsked) {
  const std::string dir = testing::MakeScratchDir("cli");
  testing::WriteFileOrDie(dir + "/out.safetensors", "precious");
  std::string out;
  EXPECT_EQ(
      Cli(absl::StrCat("convert ", ShellQuote(Burn("pytorch-models/linear.pt")), " ", dir, "/out.safetensors"), &out),
      1);
  EXPECT_THAT(out, HasSubstr("already exists"));
  EXPECT_EQ(testing::ReadFileOrEmpty(dir + "/out.safetensors"), "precious");
  EXPECT_EQ(Cli(absl::StrCat("convert --overwrite ", ShellQuote(Burn("pytorch-models/linear.pt")), " ", dir,
                             "/out.safetensors"),
                &out),
            0);
  EXPECT_OK(Checkpoint::Open(dir + "/out.safetensors"));
}

TEST(CliTest, FailedConversionLeavesNoFileBehind) {
  const std::string dir = testing::MakeScratchDir("cli");
  std::string out;
  EXPECT_EQ(
      Cli(absl::StrCat("convert ", ShellQuote(Burn("pytorch-reader/broken.pt")), " ", dir, "/out.safetensors"), &out),
      1);
  EXPECT_THAT(out, HasSubstr("broken.pt"));
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << "one message: " << out;
  EXPECT_EQ(CountFiles(dir), 0u);
  EXPECT_EQ(Cli(absl::StrCat("convert ", ShellQuote(Burn("pytorch-models/linear.pt")), " ", dir, "/out.pt"), &out), 1);
  EXPECT_THAT(out, HasSubstr("read-only"));
  EXPECT_EQ(CountFiles(dir), 0u);
}

TEST(CliTest, UsageErrorsExitWithStatus2) {
  std::string out;
  EXPECT_EQ(Cli("", &out), 2);
  EXPECT_EQ(Cli("inspect", &out), 2);
  EXPECT_EQ(Cli("convert a.pt", &out), 2);
  EXPECT_EQ(Cli("inspect --no-such-flag x", &out), 2);
  EXPECT_EQ(Cli("convert --format onnx a b", &out), 2);
  EXPECT_EQ(Cli("--help", &out), 0);
  EXPECT_THAT(out, HasSubstr("convert"));
}

TEST(CliTest, MissingFilesExitWithStatus1AndNameTheFile) {
  std::string out;
  EXPECT_EQ(Cli("inspect /nonexistent/model.pt", &out), 1);
  EXPECT_THAT(out, HasSubstr("/nonexistent/model.pt"));
}

TEST(CliTest, DiffListsEachKindOfDifference) {
  std::string out;
  EXPECT_EQ(Cli(absl::StrCat("diff ", ShellQuote(Burn("pytorch-models/linear.pt")), " ",
                             ShellQuote(Burn("pytorch-models/linear_with_bias.pt"))),
                &out),
            0);
  EXPECT_THAT(out, HasSubstr("different"));
  EXPECT_EQ(Cli(absl::StrCat("diff --exit-code ", ShellQuote(Burn("pytorch-models/conv2d.pt")), " ",
                             ShellQuote(Burn("pytorch-models/key_remap.pt"))),
                &out),
            1);
  EXPECT_THAT(out, HasSubstr("only in"));
  EXPECT_EQ(Cli(absl::StrCat("diff --exit-code ", ShellQuote(Burn("pytorch-models/conv2d.pt")), " ",
                             ShellQuote(Burn("pytorch-models/conv2d.pt"))),
                &out),
            0);
  EXPECT_THAT(out, HasSubstr("3 identical, 0 different"));
}

std::string Schema(const std::string& name) { return testing::TestDataDir() + "/schemas/" + name + ".json"; }

TEST(CliSelectionTest, InspectShowsNamesAfterRenameAndFilter) {
  std::string out;
  ASSERT_EQ(Cli("inspect --json --rename 'conv\\.(.*)=$1' --include '^conv1\\.' " +
                    ShellQuote(Burn("pytorch-models/key_remap.pt")),
                &out, false),
            0)
      << out;
  nlohmann::json doc = nlohmann::json::parse(out);
  ASSERT_EQ(doc["tensors"].size(), 2u);
  EXPECT_EQ(doc["tensors"][0]["name"], "conv1.weight");
  EXPECT_EQ(doc["tensors"][0]["source"], "conv.conv1.weight");
}

TEST(CliSelectionTest, ConvertAppliesRenameExcludeAndDTypeOnEveryFormat) {
  const std::string dir = testing::MakeScratchDir("cli-select");
  std::string out;
  for (const char* in :
       {"pytorch-models/batch_norm2d.pt", "safetensors/multi_layer.safetensors", "burnpack/mnist.bpk"}) {
    SCOPED_TRACE(in);
    std::string dst = dir + "/" + std::filesystem::path(in).stem().string() + ".safetensors";
    ASSERT_EQ(
        Cli(absl::StrCat("convert --dtype bf16 --exclude 'running_' --rename '^=m.' ", ShellQuote(Burn(in)), " ", dst),
            &out),
        0)
        << out;
    ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Open(dst));
    ASSERT_OK_AND_ASSIGN(auto src, Checkpoint::Open(Burn(in)));
    for (const auto& e : c->entries()) {
      EXPECT_EQ(e.spec.name.rfind("m.", 0), 0u) << e.spec.name;
      EXPECT_EQ(e.spec.name.find("running_"), std::string::npos);
      if (IsFloatingPoint(src->Find(e.spec.name.substr(2))->spec.dtype)) {
        EXPECT_EQ(e.spec.dtype, DType::kBF16);
      }
    }
  }
}

TEST(CliSelectionTest, ConvertWithATargetWritesTheTargetsNames) {
  const std::string dir = testing::MakeScratchDir("cli-select");
  std::string out;
  ASSERT_EQ(Cli(absl::StrCat("convert --adapter pytorch-to-burn --target ", Schema("batch_norm"), " ",
                             ShellQuote(Burn("pytorch-models/batch_norm2d.pt")), " ", dir, "/bn.bpk"),
                &out),
            0)
      << out;
  ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Open(dir + "/bn.bpk"));
  EXPECT_NE(c->Find("norm1.gamma"), nullptr);
  EXPECT_EQ(c->Find("norm1.num_batches_tracked"), nullptr);
  // A failing load writes nothing and prints the summary.
  EXPECT_EQ(Cli(absl::StrCat("convert --target ", Schema("batch_norm"), " ",
                             ShellQuote(Burn("pytorch-models/batch_norm2d.pt")), " ", dir, "/bad.bpk"),
                &out),
            1);
  EXPECT_THAT(out, HasSubstr("missing"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/bad.bpk"));
}

TEST(CliSelectionTest, ApplyPrintsTheResultAndFailsWhenTensorsAreMissing) {
  std::string out;
  EXPECT_EQ(Cli(absl::StrCat("apply --json --target ", Schema("conv2d"), " ",
                             ShellQuote(Burn("pytorch-models/key_remap.pt"))),
                &out, false),
            1);
  nlohmann::json doc = nlohmann::json::parse(out);
  EXPECT_EQ(doc["missing"].size(), 3u);
  EXPECT_EQ(doc["unused"].size(), 3u);
  EXPECT_EQ(doc["ok"], false);
  EXPECT_EQ(Cli(absl::StrCat("apply --allow-partial --target ", Schema("conv2d"), " ",
                             ShellQuote(Burn("pytorch-models/key_remap.pt"))),
                &out),
            0);
  EXPECT_THAT(out, HasSubstr("did you mean 'conv.conv1.weight'"));
}

TEST(CliShardTest, InspectShowsEachShardAndSliceWithItsSourceRanges) {
  std::string out;
  ASSERT_EQ(Cli("inspect --json --shard 1/4 --shard-dim 'fc1\\.weight$=0' --shard-dim 'conv1\\.(weight|bias)$=0' "
                "--slice 'fc1.bias=[4:12]' " +
                    ShellQuote(Burn("safetensors/multi_layer.safetensors")),
                &out, false),
            0)
      << out;
  nlohmann::json doc = nlohmann::json::parse(out);
  std::map<std::string, nlohmann::json> by_name;
  for (const auto& t : doc["tensors"]) by_name[t["name"]] = t;
  EXPECT_EQ(by_name["fc1.weight"]["shape"], nlohmann::json({4, 256}));
  EXPECT_EQ(by_name["fc1.weight"]["slice"], "[4:8, :]");
  EXPECT_EQ(by_name["fc1.weight"]["unsliced_shape"], nlohmann::json({16, 256}));
  EXPECT_EQ(by_name["conv1.weight"]["shape"], nlohmann::json({1, 3, 3, 3}));
  EXPECT_EQ(by_name["fc1.bias"]["shape"], nlohmann::json({8}));
  EXPECT_FALSE(by_name["norm1.weight"].contains("slice"));  // replicated
  // The table says it too.
  ASSERT_EQ(Cli("inspect --shard 1/4 --shard-dim 'fc1\\.weight$=0' " +
                    ShellQuote(Burn("safetensors/multi_layer.safetensors")),
                &out),
            0);
  EXPECT_THAT(out, HasSubstr("[4:8, :] of [16, 256]"));
}

TEST(CliShardTest, ConvertWritesTheRanksShardAndApplyLoadsItIntoAShardedTarget) {
  const std::string dir = testing::MakeScratchDir("cli-shard");
  const std::string in = Burn("safetensors/multi_layer.safetensors");
  std::string out;
  ASSERT_EQ(Cli(absl::StrCat("convert --shard 1/2 --shard-dim 'fc1\\.weight$=1' --dtype bf16 ", ShellQuote(in), " ",
                             dir, "/rank1.safetensors"),
                &out),
            0)
      << out;
  ASSERT_OK_AND_ASSIGN(auto shard, Checkpoint::Open(dir + "/rank1.safetensors"));
  ASSERT_NE(shard->Find("fc1.weight"), nullptr);
  EXPECT_EQ(shard->Find("fc1.weight")->spec.shape, (std::vector<uint64_t>{16, 128}));
  EXPECT_EQ(shard->Find("fc1.weight")->spec.dtype, DType::kBF16);
  EXPECT_EQ(shard->Find("fc1.bias")->spec.shape, (std::vector<uint64_t>{16}));
  // A rank's model describes its shards: the target's shapes are the shards'.
  const std::string schema = dir + "/rank1.json";
  {
    std::ofstream f(schema);
    f << R"({"parameters": [{"path": "fc1.weight", "shape": [8, 256], "module": "Linear"},
                            {"path": "fc1.bias", "shape": [16]}]})";
  }
  ASSERT_EQ(Cli(absl::StrCat("apply --json --allow-partial --shard 1/2 --shard-dim 'fc1\\.weight$=0' --target ", schema,
                             " ", ShellQuote(in)),
                &out, false),
            0)
      << out;
  nlohmann::json doc = nlohmann::json::parse(out);
  EXPECT_EQ(doc["applied"], nlohmann::json({"fc1.weight", "fc1.bias"}));
  EXPECT_EQ(doc["ok"], true);
}

TEST(CliShardTest, BadShardsAndSlicesAreClearErrors) {
  const std::string in = ShellQuote(Burn("safetensors/multi_layer.safetensors"));
  std::string out;
  EXPECT_EQ(Cli("inspect --shard 4/4 --shard-dim 'fc1=0' " + in, &out), 1);
  EXPECT_THAT(out, HasSubstr("shard.rank 4 is out of range for world size 4"));
  EXPECT_EQ(Cli("inspect --shard 1 --shard-dim 'fc1=0' " + in, &out), 1);
  EXPECT_THAT(out, HasSubstr("RANK/WORLD"));
  EXPECT_EQ(Cli("inspect --shard 0/2 " + in, &out), 1);
  EXPECT_THAT(out, HasSubstr("--shard-dim"));
  EXPECT_EQ(Cli("inspect --shard 0/2 --shard-dim 'fc1=zero' " + in, &out), 1);
  EXPECT_THAT(out, HasSubstr("'zero' is not a shard split"));
  EXPECT_EQ(Cli("inspect --shard 0/3 --shard-dim 'fc1\\.weight=0' " + in, &out), 1);
  EXPECT_THAT(out, HasSubstr("tensor 'fc1.weight': dimension 0 (16) is not divisible by the world size 3"));
  EXPECT_EQ(Cli("inspect --slice 'fc1.bias=4:12' " + in, &out), 1);
  EXPECT_THAT(out, HasSubstr("NAME=[a:b, :]"));
  EXPECT_EQ(Cli("inspect --slice 'fc1.bias=[4:99]' " + in, &out), 1);
  EXPECT_THAT(out, HasSubstr("tensor 'fc1.bias' of shape [16]"));
}

TEST(CliSelectionTest, BadSelectionsAreClearErrors) {
  std::string out;
  EXPECT_EQ(Cli("inspect --include 'fc.(' " + ShellQuote(Burn("pytorch-models/linear.pt")), &out), 1);
  EXPECT_THAT(out, HasSubstr("'fc.('"));
  EXPECT_EQ(Cli("inspect --adapter pytorch-to-burn " + ShellQuote(Burn("pytorch-models/linear.pt")), &out), 1);
  EXPECT_THAT(out, HasSubstr("--target"));
  EXPECT_EQ(Cli("inspect --rename nope " + ShellQuote(Burn("pytorch-models/linear.pt")), &out), 1);
  EXPECT_THAT(out, HasSubstr("FROM=TO"));
  EXPECT_EQ(Cli("inspect --dtype int8 " + ShellQuote(Burn("pytorch-models/linear.pt")), &out), 2);
  EXPECT_EQ(Cli("apply " + ShellQuote(Burn("pytorch-models/linear.pt")), &out), 1);
  EXPECT_EQ(Cli(absl::StrCat("apply --target ", Schema("linear"), " --rename '^(.*)=x' ",
                             ShellQuote(Burn("pytorch-models/linear.pt"))),
                &out),
            1);
  EXPECT_THAT(out, HasSubstr("both renamed to 'x'"));
}

TEST(CliTest, ConvertWritesABurnRecordLaidOutAsATemplateTheApplicationSaved) {
  // A Burn application's record (Burn 0.16, a nil constant among its fields),
  // taken apart into SafeTensors and put back: the same bytes, constants and
  // ParamIds included, which a plain .mpk conversion would leave out.
  const std::string record = testing::FixturesDir() + "/burn-records/connect4_0.16.1.mpk";
  const std::string dir = testing::MakeScratchDir("cli-template");
  std::string out;
  ASSERT_EQ(Cli(absl::StrCat("convert ", ShellQuote(record), " ", dir, "/weights.safetensors"), &out), 0) << out;
  ASSERT_EQ(Cli(absl::StrCat("convert ", dir, "/weights.safetensors ", dir, "/model.mpk --record-template ",
                             ShellQuote(record)),
                &out),
            0)
      << out;
  EXPECT_TRUE(testing::ReadFileOrEmpty(dir + "/model.mpk") == testing::ReadFileOrEmpty(record));
  // Another output format, and tensors that do not fit, are refused, and no file is left.
  EXPECT_EQ(Cli(absl::StrCat("convert ", dir, "/weights.safetensors ", dir, "/model.bpk --record-template ",
                             ShellQuote(record)),
                &out),
            1);
  EXPECT_THAT(out, HasSubstr("a record template lays out a Burn record (.mpk), not burnpack"));
  EXPECT_EQ(Cli(absl::StrCat("convert --dtype f16 ", dir, "/weights.safetensors ", dir, "/half.mpk --record-template ",
                             ShellQuote(record)),
                &out),
            1);
  EXPECT_THAT(out, HasSubstr("is F32"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/half.mpk"));
}

}  // namespace
}  // namespace weightstore

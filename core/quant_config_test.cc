#include "core/quant_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using ::testing::HasSubstr;

std::shared_ptr<const QuantizationConfig> ParseOk(absl::string_view file, absl::string_view json) {
  absl::StatusOr<std::optional<std::shared_ptr<const QuantizationConfig>>> config =
      QuantizationConfig::Parse(file, json);
  EXPECT_TRUE(config.ok()) << config.status();
  if (!config.ok() || !config->has_value()) return nullptr;
  return **config;
}

std::string ErrorOf(absl::string_view file, absl::string_view json) {
  absl::StatusOr<std::optional<std::shared_ptr<const QuantizationConfig>>> config =
      QuantizationConfig::Parse(file, json);
  EXPECT_FALSE(config.ok());
  if (config.ok()) return "";
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(config.status().message());
}

TEST(QuantizationConfigTest, ModelOptNvfp4GivesPackedFourBitValuesInBlocksOfSixteen) {
  auto c = ParseOk("hf_quant_config.json", R"({"producer": {"name": "modelopt", "version": "0.40"},
      "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": null, "group_size": 16,
                       "exclude_modules": ["lm_head", "model.layers.*.self_attn*"]}})");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->method(), "modelopt");
  EXPECT_EQ(c->scheme(), (QuantScheme{"NVFP4", 4, {1, 16}}));
  EXPECT_EQ(c->Describe(), "NVFP4, 4-bit values, blocks of 1x16 (hf_quant_config.json; 2 modules excluded)");
  EXPECT_EQ(c->SchemeOf("model.layers.3.mlp.down_proj.weight"), &c->scheme());
  EXPECT_EQ(c->SchemeOf("lm_head.weight"), nullptr);
  EXPECT_EQ(c->SchemeOf("model.lm_head.weight"), nullptr);                    // a plain name under another root
  EXPECT_EQ(c->SchemeOf("model.layers.3.self_attn.q_proj.weight"), nullptr);  // the glob
  EXPECT_EQ(c->SchemeOf("model.layers.3.self_attn_gate.weight"), nullptr);
}

TEST(QuantizationConfigTest, ModelOptMixedPrecisionGivesEachNamedLayerItsOwnScheme) {
  auto c = ParseOk("hf_quant_config.json", R"({"quantization": {"quant_algo": "MIXED_PRECISION",
      "quantized_layers": {"model.layers.0.mlp.down_proj": {"quant_algo": "NVFP4", "group_size": 16},
                           "model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"}}}})");
  ASSERT_NE(c, nullptr);
  const QuantScheme* mlp = c->SchemeOf("model.layers.0.mlp.down_proj.weight");
  ASSERT_NE(mlp, nullptr);
  EXPECT_EQ(*mlp, (QuantScheme{"NVFP4", 4, {1, 16}}));
  const QuantScheme* attn = c->SchemeOf("model.layers.0.self_attn.q_proj.weight_scale");
  ASSERT_NE(attn, nullptr);
  EXPECT_EQ(*attn, (QuantScheme{"FP8", 8, {}}));
  EXPECT_EQ(c->SchemeOf("model.layers.1.mlp.down_proj.weight")->algo, "MIXED_PRECISION");
}

TEST(QuantizationConfigTest, TransformersFp8BlocksMxfp4AndModelOptComeFromConfigJson) {
  auto fp8 = ParseOk("config.json", R"({"architectures": ["DeepseekV3ForCausalLM"], "quantization_config": {
      "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}})");
  ASSERT_NE(fp8, nullptr);
  EXPECT_EQ(fp8->scheme(), (QuantScheme{"FP8_BLOCK", 8, {128, 128}}));
  auto per_tensor = ParseOk("config.json", R"({"quantization_config": {"quant_method": "fp8"}})");
  EXPECT_EQ(per_tensor->scheme(), (QuantScheme{"FP8", 8, {}}));
  auto gpt_oss = ParseOk("config.json", R"({"quantization_config": {"quant_method": "mxfp4",
      "modules_to_not_convert": ["model.layers.*.self_attn", "model.embed_tokens", "lm_head"]}})");
  EXPECT_EQ(gpt_oss->scheme(), (QuantScheme{"MXFP4", 4, {1, 32}}));
  EXPECT_EQ(gpt_oss->SchemeOf("model.layers.0.self_attn.q_proj.weight"), nullptr);
  EXPECT_NE(gpt_oss->SchemeOf("model.layers.0.mlp.experts.down_proj_blocks"), nullptr);
  auto modelopt = ParseOk("config.json", R"({"quantization_config": {"quant_method": "modelopt",
      "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}})");
  EXPECT_EQ(modelopt->scheme(), (QuantScheme{"NVFP4", 4, {1, 16}}));
  EXPECT_EQ(modelopt->SchemeOf("lm_head.weight"), nullptr);
}

TEST(QuantizationConfigTest, CompressedTensorsGroupsGiveTheDefaultAndRegexTargets) {
  auto c = ParseOk("config.json", R"({"quantization_config": {"quant_method": "compressed-tensors",
      "format": "nvfp4-pack-quantized", "ignore": ["lm_head", "re:.*gate$"],
      "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                    "strategy": "tensor_group", "group_size": 16}},
        "group_1": {"targets": ["re:.*self_attn\\..*_proj"], "weights": {"num_bits": 8, "type": "float",
                    "strategy": "block", "block_structure": [128, 128]}}}}})");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->scheme(), (QuantScheme{"NVFP4", 4, {1, 16}}));
  EXPECT_EQ(*c->SchemeOf("model.layers.0.self_attn.k_proj.weight_packed"), (QuantScheme{"FP8_BLOCK", 8, {128, 128}}));
  EXPECT_EQ(c->SchemeOf("model.layers.0.mlp.gate.weight"), nullptr);
  EXPECT_EQ(*c->SchemeOf("model.layers.0.mlp.up_proj.weight_packed"), c->scheme());
}

TEST(QuantizationConfigTest, AMethodWhoseLayoutIsNotKnownKeepsItsNameAndNoBlock) {
  auto c = ParseOk("config.json", R"({"quantization_config": {"quant_method": "gptq", "bits": 4,
      "group_size": 128}})");
  EXPECT_EQ(c->scheme(), (QuantScheme{"GPTQ", 0, {}}));
}

TEST(QuantizationConfigTest, AConfigJsonWithoutQuantizationIsNoConfig) {
  auto none = QuantizationConfig::Parse("config.json", R"({"architectures": ["LlamaForCausalLM"]})");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
}

TEST(QuantizationConfigTest, MalformedConfigsAreRefusedNamingTheFileAndTheField) {
  EXPECT_THAT(ErrorOf("config.json", "{"), HasSubstr("'config.json': not valid JSON"));
  EXPECT_THAT(ErrorOf("config.json", "[1]"), HasSubstr("not a JSON object"));
  EXPECT_THAT(ErrorOf("hf_quant_config.json", R"({"producer": {}})"), HasSubstr("no \"quantization\" object"));
  EXPECT_THAT(ErrorOf("hf_quant_config.json", R"({"quantization": {"quant_algo": "NVFP4", "group_size": "16"}})"),
              HasSubstr("quantization.group_size must be a whole number"));
  EXPECT_THAT(ErrorOf("hf_quant_config.json", R"({"quantization": {"quant_algo": "NVFP4", "group_size": 0}})"),
              HasSubstr("quantization.group_size must be a whole number from 1"));
  EXPECT_THAT(ErrorOf("config.json", R"({"quantization_config": {"quant_method": "fp8",
      "weight_block_size": [128]}})"),
              HasSubstr("quantization_config.weight_block_size must be a list of two block sizes"));
  EXPECT_THAT(ErrorOf("config.json", R"({"quantization_config": {"quant_method": "fp8",
      "weight_block_size": [128, 1e300]}})"),
              HasSubstr("weight_block_size must be a list of two whole numbers"));
  EXPECT_THAT(ErrorOf("config.json", R"({"quantization_config": {"ignore": ["re:("]}})"),
              HasSubstr("pattern 're:(' is not a valid regular expression"));
  EXPECT_THAT(ErrorOf("config.json", R"({"quantization_config": {"quant_method": "compressed-tensors",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": 4}}}}})"),
              HasSubstr("quantization_config.config_groups.g.weights.type must be a string"));
  EXPECT_THAT(ErrorOf("hf_quant_config.json", R"({"quantization": {"quantized_layers": {"x": 1}}})"),
              HasSubstr("quantization.quantized_layers.x must be an object"));
}

TEST(QuantizationConfigTest, EveryBoundOnAConfigIsChecked) {
  std::string deep = std::string(40, '[') + std::string(40, ']');
  EXPECT_THAT(ErrorOf("config.json", absl::StrCat(R"({"quantization_config": {"x": )", deep, "}}")),
              HasSubstr("nested deeper than 32"));
  std::string globs;
  for (size_t i = 0; i <= QuantizationConfig::kMaxWildcards; ++i)
    absl::StrAppend(&globs, i ? "," : "", "\"a", i, "*\"");
  EXPECT_THAT(ErrorOf("config.json", absl::StrCat(R"({"quantization_config": {"ignore": [)", globs, "]}}")),
              HasSubstr("more than 16 wildcard patterns"));
  EXPECT_THAT(
      ErrorOf("config.json", absl::StrCat(R"({"quantization_config": {"ignore": [")", std::string(257, 'm'), "\"]}}")),
      HasSubstr("is 257 bytes; at most 256"));
  EXPECT_THAT(ErrorOf("config.json", R"({"quantization_config": {"ignore": ["a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q"]}})"),
              HasSubstr("has 17 dotted parts; at most 16"));
  // A counted repetition would leave RE2's DFA for the NFA on every module.
  EXPECT_THAT(ErrorOf("config.json", R"j({"quantization_config": {"ignore": ["re:(?:.*a.{600}z)"]}})j"),
              HasSubstr("RE2 instructions; at most 500"));
  // The body of a "re:" pattern must stand alone: this one would widen the anchor.
  EXPECT_THAT(ErrorOf("config.json", R"j({"quantization_config": {"ignore": ["re:zzz)|(.*"]}})j"),
              HasSubstr("is not a valid regular expression"));
  std::string names;
  for (size_t i = 0; i <= QuantizationConfig::kMaxPatterns; ++i) absl::StrAppend(&names, i ? "," : "", "\"m", i, "\"");
  EXPECT_THAT(ErrorOf("config.json", absl::StrCat(R"({"quantization_config": {"ignore": [)", names, "]}}")),
              HasSubstr("lists 4097 entries; at most 4096"));
  EXPECT_THAT(ErrorOf("config.json", std::string(QuantizationConfig::kMaxFileBytes + 1, ' ')),
              HasSubstr("at most 16777216 are read"));
}

TEST(QuantizationConfigTest, ALongArrayOfObjectsParsesInOnePass) {
  // nlohmann's parse callback rescanned siblings at each object's end: 16 MiB
  // of "{}" took hours. The depth is now checked by a scan before parsing.
  std::string many = R"({"junk": [)";
  for (int i = 0; i < 1000000; ++i) many += i ? ",{}" : "{}";
  many += R"(], "quantization_config": {"quant_method": "fp8"}})";
  auto c = ParseOk("config.json", many);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->scheme().algo, "FP8");
  EXPECT_THAT(ErrorOf("config.json", R"({"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[", "b": )" + std::string(33, '[') +
                                         std::string(33, ']') + "}"),
              HasSubstr("nested deeper than 32"));
}

TEST(QuantizationConfigTest, AModuleNameOfManyPartsCostsBoundedLookups) {
  auto c = ParseOk("config.json", R"({"quantization_config": {"quant_method": "fp8",
      "modules_to_not_convert": ["zzz", "model.lm_head"]}})");
  std::string name;
  for (int i = 0; i < 2000; ++i) name += "a.";
  EXPECT_EQ(c->SchemeOf(name + "m.weight"), &c->scheme());
  EXPECT_EQ(c->SchemeOf(name + "zzz.weight"), nullptr);            // a suffix of whole parts
  EXPECT_EQ(c->SchemeOf("model.lm_head.x.weight"), nullptr);       // under a prefix
  EXPECT_EQ(c->SchemeOf("other.model.lm_head.weight"), nullptr);   // under another root
  EXPECT_EQ(c->SchemeOf("model.lm_head_2.weight"), &c->scheme());  // whole parts only
}

TEST(QuantizationConfigTest, ReadBesidePrefersHfQuantConfigAndNamesTheFileOnError) {
  const std::filesystem::path dir(testing::MakeScratchDir("quant-config"));
  const std::string model = (dir / "model.safetensors").string();
  auto none = QuantizationConfig::ReadBeside(model);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  std::ofstream(dir / "config.json") << R"({"quantization_config": {"quant_method": "fp8"}})";
  auto from_config = QuantizationConfig::ReadBeside(model);
  ASSERT_TRUE(from_config.ok() && from_config->has_value());
  EXPECT_EQ((**from_config)->source(), "config.json");
  std::ofstream(dir / "hf_quant_config.json") << R"({"quantization": {"quant_algo": "NVFP4"}})";
  auto preferred = QuantizationConfig::ReadBeside(dir.string());  // a folder reads its own
  ASSERT_TRUE(preferred.ok() && preferred->has_value());
  EXPECT_EQ((**preferred)->source(), "hf_quant_config.json");
  std::ofstream(dir / "hf_quant_config.json", std::ios::trunc) << "not json";
  auto broken = QuantizationConfig::ReadBeside(model);
  ASSERT_FALSE(broken.ok());
  EXPECT_THAT(broken.status().message(), HasSubstr((dir / "hf_quant_config.json").string()));
}

}  // namespace
}  // namespace weightstore

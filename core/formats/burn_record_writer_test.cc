// The NamedMpk writer (kBurnRecordFormat's plan): byte layout against the
// reference's example and an independent MessagePack encoder, round trips
// through the reader, and what it refuses.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/formats/burn_record.h"
#include "core/formats/burn_record_internal.h"
#include "core/formats/checkpoint_writer.h"
#include "core/status_macros.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using namespace std::string_literals;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::weightstore::burn_record_internal::DeriveParamId;
using ::weightstore::testing::StatusIs;

std::string RecordsDir() { return testing::FixturesDir() + "/burn-records"; }

std::string Floats(std::initializer_list<float> values) {
  std::string out(values.size() * 4, '\0');
  std::memcpy(out.data(), values.begin(), out.size());
  return out;
}

SharedTensor Tensor(std::string name, DType dtype, std::vector<uint64_t> shape, std::optional<uint64_t> id = {},
                    std::string bytes = "") {
  TensorSpec spec{.name = std::move(name), .dtype = dtype, .shape = std::move(shape), .param_id = id};
  if (bytes.empty()) {
    bytes.resize(spec.byte_size());
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(dtype == DType::kBool ? i % 2 : i * 7);
  }
  return SharedTensor{std::move(spec), SharedBytes::Copy(bytes)};
}

TensorSpec Spec(std::string name, DType dtype, std::vector<uint64_t> shape) {
  return TensorSpec{.name = std::move(name), .dtype = dtype, .shape = std::move(shape)};
}

absl::StatusOr<std::string> Write(const std::vector<SharedTensor>& tensors, const Metadata& metadata = {}) {
  return SerializeCheckpoint(kBurnRecordFormat, tensors, metadata);
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> ReadBack(const std::string& bytes) {
  return ParseBurnRecord(SharedBytes::Copy(bytes), "w.mpk", OpenOptions{});
}

absl::StatusOr<WritePlan> Plan(const std::vector<TensorSpec>& specs) {
  return PlanCheckpoint(kBurnRecordFormat, specs, {});
}

std::vector<SharedTensor> ReadAll(const Checkpoint& c) {
  std::vector<SharedTensor> out;
  for (const CheckpointEntry& e : c.entries()) {
    absl::StatusOr<SharedTensor> t = c.Read(e);
    EXPECT_OK(t.status()) << e.spec.name;
    if (t.ok()) out.push_back(*std::move(t));
  }
  return out;
}

// Same names (in order), dtypes, shapes, ParamIds and bytes.
void ExpectSameTensors(const std::vector<SharedTensor>& got, const std::vector<SharedTensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].spec, want[i].spec) << want[i].spec.name;
    EXPECT_TRUE(got[i].bytes.view() == want[i].bytes.view()) << want[i].spec.name;
  }
}

// nlohmann's MessagePack encoder, independent of ours, also picks the most
// compact form of every length and integer.
std::string Reencode(const std::string& mpk) {
  std::string out;
  nlohmann::ordered_json::to_msgpack(nlohmann::ordered_json::from_msgpack(mpk), out);
  return out;
}

// `mpk` without the map entries whose value is nil (the constants the reader
// drops), re-encoded by nlohmann.
std::string WithoutNilEntries(const std::string& mpk) {
  nlohmann::ordered_json doc = nlohmann::ordered_json::from_msgpack(mpk);
  auto drop = [](auto& self, nlohmann::ordered_json& j) -> void {
    if (j.is_object()) {
      std::vector<std::string> nils;
      for (auto& [key, value] : j.items()) {
        if (value.is_null()) nils.push_back(key);
      }
      for (const std::string& key : nils) j.erase(key);
    }
    if (j.is_structured()) {
      for (nlohmann::ordered_json& v : j) self(self, v);
    }
  };
  drop(drop, doc);
  std::string out;
  nlohmann::ordered_json::to_msgpack(doc, out);
  return out;
}

TEST(BurnRecordWriterTest, EncodesParamIdsAsBurnDoes) {
  EXPECT_EQ(EncodeBurnParamId(1), "0400000000000");  // ParamId::from(1), the reference's example
  EXPECT_EQ(EncodeBurnParamId(2), "0800000000000");
  EXPECT_EQ(EncodeBurnParamId(0), "0000000000000");
  EXPECT_EQ(EncodeBurnParamId(10337348971143725002u), "p9vkb80ukhqou");  // connect4's layer_0.weight
  for (uint64_t id :
       {uint64_t{0}, uint64_t{1}, uint64_t{255}, uint64_t{1} << 63, UINT64_MAX, uint64_t{0x0123456789abcdef}}) {
    EXPECT_EQ(DecodeBurnParamId(EncodeBurnParamId(id)), id) << id;
  }
}

TEST(BurnRecordWriterTest, WritesTheReferenceLinearExampleByteForByte) {
  // burn-records.md §8: Linear weight [2, 3] = 1..6, bias [3] = (0.5, -1, 2).
  const std::vector<SharedTensor> linear = {
      Tensor("weight", DType::kF32, {2, 3}, 1, Floats({1, 2, 3, 4, 5, 6})),
      Tensor("bias", DType::kF32, {3}, 2, Floats({0.5f, -1, 2})),
  };
  const std::string item =
      "\x82\xa6"
      "weight"
      "\x82\xa2"
      "id"
      "\xad"
      "0400000000000"
      "\xa5"
      "param"
      "\x83\xa5"
      "bytes"
      "\xc4\x18\x00\x00\x80\x3f\x00\x00\x00\x40\x00\x00\x40\x40\x00\x00\x80\x40\x00\x00\xa0\x40\x00\x00\xc0\x40"
      "\xa5"
      "shape"
      "\x92\x02\x03\xa5"
      "dtype"
      "\xa3"
      "F32"
      "\xa4"
      "bias"
      "\x82\xa2"
      "id"
      "\xad"
      "0800000000000"
      "\xa5"
      "param"
      "\x83\xa5"
      "bytes"
      "\xc4\x0c\x00\x00\x00\x3f\x00\x00\x80\xbf\x00\x00\x00\x40"
      "\xa5"
      "shape"
      "\x91\x03\xa5"
      "dtype"
      "\xa3"
      "F32"s;
  ASSERT_EQ(item.size(), 152u);  // as the reference counts it
  const std::string expected =
      "\x83\xa8"
      "metadata"
      "\x85\xa5"
      "float"
      "\xa3"
      "f32"
      "\xa3"
      "int"
      "\xa3"
      "i32"
      "\xa6"
      "format"
      "\xd9\x61"
      "burn_core::record::file::NamedMpkFileRecorder<burn_core::record::settings::FullPrecisionSettings>"
      "\xa7"
      "version"
      "\xa6"
      "0.21.0"
      "\xa8"
      "settings"
      "\xb5"
      "FullPrecisionSettings"
      "\xa4"
      "item"s +
      item +
      "\xa2"
      "_b"
      "\x90"s;
  ASSERT_OK_AND_ASSIGN(std::string written, Write(linear));
  EXPECT_EQ(written, expected);

  // The plan: MessagePack up to the first bin's payload, then after each tensor.
  ASSERT_OK_AND_ASSIGN(WritePlan plan, Plan({linear[0].spec, linear[1].spec}));
  EXPECT_EQ(plan.order, (std::vector<size_t>{0, 1}));
  ASSERT_EQ(plan.after.size(), 2u);
  EXPECT_EQ(plan.header, expected.substr(0, plan.offsets[0]));
  EXPECT_TRUE(absl::EndsWith(plan.header, "\xc4\x18"));
  EXPECT_EQ(plan.offsets[1], plan.offsets[0] + 24 + plan.after[0].size());
  EXPECT_TRUE(absl::EndsWith(plan.after[1], "\xa2_b\x90"));
  EXPECT_EQ(plan.file_size, expected.size());

  ASSERT_OK_AND_ASSIGN(auto back, ReadBack(written));
  ExpectSameTensors(ReadAll(*back), linear);
}

TEST(BurnRecordWriterTest, RewritesARecordWithoutConstantsByteForByte) {
  std::vector<SharedTensor> tensors = {
      Tensor("encoder.layers.1.w", DType::kF32, {2}, 7),  // index order on disk, not input order
      Tensor("encoder.layers.0.w", DType::kF32, {2}),
      Tensor("encoder.norm.gamma", DType::kF16, {3}),
      Tensor("head.bias", DType::kI64, {}),
      Tensor("encoder.mask", DType::kBool, {2, 2}),
      Tensor("embed", DType::kU8, {300}),   // bin16
      Tensor("big", DType::kF32, {16400}),  // bin32
      Tensor("empty", DType::kF32, {0}),    // an empty bin
      Tensor("x.01", DType::kI8, {1}),      // not an index: a map key
      // A str8 key, and a dimension past 65535 (uint32).
      Tensor("a_rather_long_field_name_over_31_chars.w", DType::kBF16, {70000, 0}),
  };
  for (int i = 0; i < 17; ++i) tensors.push_back(Tensor(absl::StrCat("blocks.", i, ".w"), DType::kU16, {1}));
  for (int i = 0; i < 17; ++i) tensors.push_back(Tensor(absl::StrCat("wide.f", i), DType::kI32, {1}));

  ASSERT_OK_AND_ASSIGN(const std::string written, Write(tensors));
  EXPECT_EQ(Reencode(written), written);  // every head in its most compact form
  for (const std::string& head : {"\xdc\x00\x11"s, "\xde\x00\x11"s, "\xc5\x01\x2c"s, "\xc6\x00\x01\x00\x40"s,
                                  "\xd9\x26"s, "\xce\x00\x01\x11\x70"s, "\xc4\x00"s}) {
    EXPECT_NE(written.find(head), std::string::npos) << absl::CHexEscape(head);
  }

  ASSERT_OK_AND_ASSIGN(auto back, ReadBack(written));
  const std::vector<SharedTensor> read = ReadAll(*back);
  ASSERT_EQ(read.size(), tensors.size());
  EXPECT_EQ(read[0].spec.name, "encoder.layers.0.w");
  EXPECT_EQ(read[1].spec.name, "encoder.layers.1.w");
  EXPECT_EQ(read[2].spec.name, "encoder.norm.gamma");
  EXPECT_EQ(read[3].spec.name, "encoder.mask");
  std::map<std::string, SharedTensor> by_name;
  for (const SharedTensor& t : read) by_name.emplace(t.spec.name, t);
  for (SharedTensor want : tensors) {
    if (!want.spec.param_id) want.spec.param_id = DeriveParamId(want.spec.name);
    ExpectSameTensors({by_name.at(want.spec.name)}, {want});
  }
  EXPECT_EQ(back->metadata().at("settings"), "FullPrecisionSettings");

  // Read back and written again: the same bytes.
  ASSERT_OK_AND_ASSIGN(const std::string again, Write(read, back->metadata()));
  EXPECT_EQ(again, written);
}

TEST(BurnRecordWriterTest, WritesEachMessagePackFixtureAsBurnWouldWithoutItsConstants) {
  for (const char* file : {"connect4_0.16.1.mpk", "modern-lstm_0.17-half.mpk"}) {
    SCOPED_TRACE(file);
    const std::string fixture = testing::ReadFileOrEmpty(absl::StrCat(RecordsDir(), "/", file));
    ASSERT_FALSE(fixture.empty());
    // nlohmann re-encodes the real file to its own bytes, so the expectation
    // below is exactly the file less its nil entries.
    ASSERT_EQ(Reencode(fixture), fixture);

    ASSERT_OK_AND_ASSIGN(auto original, ParseBurnRecord(SharedBytes::Copy(fixture), file, OpenOptions{}));
    const std::vector<SharedTensor> tensors = ReadAll(*original);
    ASSERT_OK_AND_ASSIGN(const std::string written, Write(tensors, original->metadata()));
    const std::string expected = WithoutNilEntries(fixture);
    EXPECT_LT(expected.size(), fixture.size());  // the fixture has constants
    EXPECT_TRUE(written == expected);            // not EXPECT_EQ: no dump of 58 KB

    ASSERT_OK_AND_ASSIGN(auto back, ReadBack(written));
    EXPECT_EQ(back->metadata(), original->metadata());
    ExpectSameTensors(ReadAll(*back), tensors);
    ASSERT_OK_AND_ASSIGN(const std::string again, Write(ReadAll(*back), back->metadata()));
    EXPECT_TRUE(again == written);
  }
}

// Writes `tensors` laid out as the record `template_file` (a fixture).
absl::StatusOr<std::string> WriteFromTemplate(const std::string& template_file,
                                              const std::vector<SharedTensor>& tensors) {
  const std::string bytes = testing::ReadFileOrEmpty(absl::StrCat(RecordsDir(), "/", template_file));
  const SharedBytes record = SharedBytes::Copy(bytes);
  WriteOptions options;
  options.plan = [&](const std::vector<TensorSpec>& specs, const Metadata&) {
    return PlanFromRecordTemplate(record, template_file, specs);
  };
  const std::string path = testing::MakeScratchDir("record-template") + "/out.mpk";
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto writer, CheckpointWriter::Create(path, kBurnRecordFormat, options));
  for (const SharedTensor& t : tensors) {
    WEIGHTSTORE_RETURN_IF_ERROR(writer->Add(t.spec, [t] { return absl::StatusOr<SharedBytes>(t.bytes); }));
  }
  WEIGHTSTORE_RETURN_IF_ERROR(writer->Finish());
  return testing::ReadFileOrEmpty(path);
}

TEST(BurnRecordWriterTest, ATemplateKeepsEveryByteOfTheRecordButTheTensorsIncludingItsConstants) {
  for (const char* file : {"connect4_0.16.1.mpk", "modern-lstm_0.17-half.mpk"}) {
    SCOPED_TRACE(file);
    const std::string fixture = testing::ReadFileOrEmpty(absl::StrCat(RecordsDir(), "/", file));
    ASSERT_OK_AND_ASSIGN(auto original, ParseBurnRecord(SharedBytes::Copy(fixture), file, OpenOptions{}));
    std::vector<SharedTensor> tensors = ReadAll(*original);
    // Its own tensors, in another order: the record itself, byte for byte
    // (the nil constants the reader drops among them).
    std::reverse(tensors.begin(), tensors.end());
    ASSERT_OK_AND_ASSIGN(std::string written, WriteFromTemplate(file, tensors));
    EXPECT_TRUE(written == fixture);
    // New values: only the tensors' bytes differ, and they read back.
    for (SharedTensor& t : tensors) {
      std::string bytes(t.bytes.view());
      for (char& c : bytes) c = static_cast<char>(c ^ 0x11);
      t.bytes = SharedBytes::Copy(bytes);
    }
    ASSERT_OK_AND_ASSIGN(written, WriteFromTemplate(file, tensors));
    ASSERT_EQ(written.size(), fixture.size());
    EXPECT_EQ(WithoutNilEntries(written).size(), WithoutNilEntries(fixture).size());
    ASSERT_OK_AND_ASSIGN(auto back, ReadBack(written));
    EXPECT_EQ(back->metadata(), original->metadata());
    std::vector<SharedTensor> got = ReadAll(*back);
    std::reverse(got.begin(), got.end());
    ExpectSameTensors(got, tensors);
    size_t differing = 0;
    for (size_t i = 0; i < fixture.size(); ++i) differing += fixture[i] != written[i] ? 1 : 0;
    uint64_t tensor_bytes = 0;
    for (const SharedTensor& t : tensors) tensor_bytes += t.bytes.size();
    EXPECT_EQ(differing, tensor_bytes);  // every tensor byte was flipped; nothing else moved
  }
}

TEST(BurnRecordWriterTest, ATemplateRefusesTensorsThatDoNotFitItAndTemplatesOfOtherKinds) {
  ASSERT_OK_AND_ASSIGN(auto original, Checkpoint::Open(RecordsDir() + "/connect4_0.16.1.mpk"));
  const std::vector<SharedTensor> tensors = ReadAll(*original);
  ASSERT_GE(tensors.size(), 2u);
  const std::string first = tensors[0].spec.name;
  auto without_first = std::vector<SharedTensor>(tensors.begin() + 1, tensors.end());
  EXPECT_THAT(WriteFromTemplate("connect4_0.16.1.mpk", without_first),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("record template 'connect4_0.16.1.mpk'"),
                             HasSubstr(absl::StrCat("tensor '", first, "'")), HasSubstr("is not among"))));
  std::vector<SharedTensor> extra = tensors;
  extra.push_back(Tensor("head.weight", DType::kF32, {2, 2}));
  EXPECT_THAT(WriteFromTemplate("connect4_0.16.1.mpk", extra),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has no tensor 'head.weight'")));
  std::vector<SharedTensor> half = tensors;
  half[0] = Tensor(first, DType::kF16, half[0].spec.shape);
  EXPECT_THAT(WriteFromTemplate("connect4_0.16.1.mpk", half),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr(absl::StrCat("tensor '", first, "' is F32")),
                                                                 HasSubstr("and F16"), HasSubstr("--dtype"))));
  std::vector<SharedTensor> reshaped = tensors;
  reshaped[0] = Tensor(first, DType::kF32, {reshaped[0].spec.num_elements()});
  EXPECT_THAT(WriteFromTemplate("connect4_0.16.1.mpk", reshaped),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(absl::StrCat("tensor '", first, "' is F32 ["))));
  // Burn 0.13's {value, shape} records and bincode ones cannot be laid out anew.
  ASSERT_OK_AND_ASSIGN(auto old, Checkpoint::Open(RecordsDir() + "/customimage_0.13-half-old-layout.mpk"));
  EXPECT_THAT(WriteFromTemplate("customimage_0.13-half-old-layout.mpk", ReadAll(*old)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Burn 0.14 or later")));
  EXPECT_THAT(WriteFromTemplate("mnistweb_0.21.bin", tensors),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is not a MessagePack record")));
}

TEST(BurnRecordWriterTest, WritesTheOldLayoutFixtureInTheNewLayoutKeepingItsMetadata) {
  // Burn 0.13: {value, shape} tensors, UUID ids and constant arrays; it comes
  // back as TensorData with derived ids and the same metadata (version 0.13.0:
  // Burn never reads it).
  ASSERT_OK_AND_ASSIGN(auto original, Checkpoint::Open(RecordsDir() + "/customimage_0.13-half-old-layout.mpk"));
  std::vector<SharedTensor> tensors = ReadAll(*original);
  ASSERT_OK_AND_ASSIGN(const std::string written, Write(tensors, original->metadata()));
  ASSERT_OK_AND_ASSIGN(auto back, ReadBack(written));
  EXPECT_EQ(back->metadata(), original->metadata());
  EXPECT_EQ(back->metadata().at("version"), "0.13.0");
  for (SharedTensor& t : tensors) {
    EXPECT_EQ(t.spec.param_id, std::nullopt);
    t.spec.param_id = DeriveParamId(t.spec.name);
  }
  ExpectSameTensors(ReadAll(*back), tensors);
  EXPECT_EQ(written.find("\xa5value"), std::string::npos);
}

TEST(BurnRecordWriterTest, WritesAFileAsItSerializes) {
  ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Open(RecordsDir() + "/connect4_0.16.1.mpk"));
  const std::string path = testing::MakeScratchDir("burn_record_writer") + "/model.mpk";
  uint64_t last = 0, total = 0;
  WriteOptions options;
  options.progress = [&](uint64_t done, uint64_t all) { last = done, total = all; };
  ASSERT_OK(WriteCheckpoint(*c, path, kBurnRecordFormat, c->metadata(), options));
  ASSERT_OK_AND_ASSIGN(const std::string serialized, Write(ReadAll(*c), c->metadata()));
  EXPECT_TRUE(testing::ReadFileOrEmpty(path) == serialized);
  EXPECT_EQ(last, serialized.size());
  EXPECT_EQ(total, serialized.size());
  ASSERT_OK_AND_ASSIGN(auto back, Checkpoint::Open(path));
  EXPECT_EQ(back->format(), kBurnRecordFormat);
  ExpectSameTensors(ReadAll(*back), ReadAll(*c));
}

TEST(BurnRecordWriterTest, ChoosesThePrecisionSettingsFromTheFloatTensors) {
  auto metadata = [](std::vector<SharedTensor> tensors) -> Metadata {
    absl::StatusOr<std::string> written = Write(tensors);
    EXPECT_OK(written.status());
    absl::StatusOr<std::shared_ptr<const Checkpoint>> back = ReadBack(written.value_or(""));
    EXPECT_OK(back.status());
    return back.ok() ? (*back)->metadata() : Metadata{};
  };
  const Metadata half = metadata({Tensor("w", DType::kF16, {2}), Tensor("steps", DType::kI64, {1})});
  EXPECT_EQ(half, (Metadata{{"float", "half::binary16::f16"},
                            {"int", "i16"},
                            {"format",
                             "burn_core::record::file::NamedMpkFileRecorder<burn_core::record::settings::"
                             "HalfPrecisionSettings>"},
                            {"version", "0.21.0"},
                            {"settings", "HalfPrecisionSettings"}}));
  const Metadata dbl = metadata({Tensor("w", DType::kF64, {2})});
  EXPECT_EQ(dbl.at("float"), "f64");
  EXPECT_EQ(dbl.at("int"), "i64");
  EXPECT_EQ(dbl.at("settings"), "DoublePrecisionSettings");
  EXPECT_THAT(dbl.at("format"), HasSubstr("<burn_core::record::settings::DoublePrecisionSettings>"));
  EXPECT_EQ(metadata({Tensor("a", DType::kF16, {1}), Tensor("b", DType::kF32, {1})}).at("settings"),
            "FullPrecisionSettings");
  EXPECT_EQ(metadata({Tensor("a", DType::kBF16, {1})}).at("float"), "f32");
  EXPECT_EQ(metadata({Tensor("ids", DType::kI64, {1})}).at("int"), "i32");

  // Another format's metadata (no BurnMetadata keys, or only some) is replaced.
  ASSERT_OK_AND_ASSIGN(std::string written, Write({Tensor("w", DType::kF32, {1})}, {{"format", "pt"}}));
  ASSERT_OK_AND_ASSIGN(auto back, ReadBack(written));
  EXPECT_THAT(back->metadata().at("format"), HasSubstr("NamedMpkFileRecorder"));

  ASSERT_OK_AND_ASSIGN(written, Write({}));  // no tensors: an empty item
  EXPECT_TRUE(absl::EndsWith(written, "\xa4item\x80\xa2_b\x90"));
  EXPECT_OK(ReadBack(written));
}

TEST(BurnRecordWriterTest, RefusesDTypesBurnCannotHoldNamingTheTensor) {
  EXPECT_THAT(Plan({Spec("ok", DType::kF32, {1}), Spec("q.w", DType::kF8E4M3, {4})}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tensor 'q.w'"), HasSubstr("F8_E4M3"), HasSubstr("--dtype"))));
  EXPECT_THAT(Plan({Spec("c", DType::kC64, {1})}),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("tensor 'c'"), HasSubstr("C64"))));

  // Before anything is written: no file appears.
  const std::string path = testing::MakeScratchDir("burn_record_writer_refuses") + "/model.mpk";
  ASSERT_OK_AND_ASSIGN(auto writer, CheckpointWriter::Create(path, kBurnRecordFormat));
  ASSERT_OK(writer->Add(Spec("q", DType::kF8E5M2, {1}),
                        []() -> absl::StatusOr<SharedBytes> { return SharedBytes::Copy("x"); }));
  EXPECT_THAT(writer->Finish(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("F8_E5M2")));
  EXPECT_EQ(testing::ReadFileOrEmpty(path), "");
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(BurnRecordWriterTest, RefusesIndicesThatAreNotZeroToNMinusOne) {
  EXPECT_THAT(Plan({Spec("layers.0.w", DType::kF32, {1}), Spec("layers.2.w", DType::kF32, {1})}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tensor 'layers.2.w'"), HasSubstr("index 1 is missing"),
                             HasSubstr("--contiguous-indices"))));
  EXPECT_THAT(Plan({Spec("layers.1.w", DType::kF32, {1})}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("index 0 is missing")));
  EXPECT_OK(Plan({Spec("layers.1.w", DType::kF32, {1}), Spec("layers.0.w", DType::kF32, {1})}));
}

TEST(BurnRecordWriterTest, NamesTheMissingIndexAmong100kEntriesInOnePass) {
  // Indices 0..99998 and 100000: the gap is found at the last child, and
  // counting each candidate index over all of them took 10^10 steps.
  std::vector<TensorSpec> specs;
  for (uint64_t i = 0; i <= 100000; ++i) {
    if (i != 99999) specs.push_back(Spec(absl::StrCat("layers.", i, ".w"), DType::kF32, {1}));
  }
  EXPECT_THAT(Plan(specs), StatusIs(absl::StatusCode::kInvalidArgument,
                                    AllOf(HasSubstr("tensor 'layers.100000.w'"), HasSubstr("among 100000 entries"),
                                          HasSubstr("index 99999 is missing"))));
}

TEST(BurnRecordWriterTest, RefusesAPathThatIsBothATensorAndAModule) {
  EXPECT_THAT(Plan({Spec("fc", DType::kF32, {1}), Spec("fc.bias", DType::kF32, {1})}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tensor 'fc.bias' lies under tensor 'fc'"), HasSubstr("not both"))));
  EXPECT_THAT(Plan({Spec("fc.bias", DType::kF32, {1}), Spec("fc", DType::kF32, {1})}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tensor 'fc' is also the path of a module holding tensor 'fc.bias'"))));
  EXPECT_THAT(Plan({Spec("a..b", DType::kF32, {1})}),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("'a..b'"), HasSubstr("empty"))));
}

TEST(BurnRecordWriterTest, RefusesATensorOf4GiBWithoutAllocatingIt) {
  EXPECT_THAT(Plan({Spec("small", DType::kF32, {1}), Spec("embed.weight", DType::kF32, {uint64_t{1} << 30})}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tensor 'embed.weight'"), HasSubstr("4294967296 bytes"), HasSubstr("4 GiB"))));
  // One byte less fits a bin32.
  ASSERT_OK_AND_ASSIGN(WritePlan plan, Plan({Spec("w", DType::kU8, {0xFFFFFFFF})}));
  EXPECT_TRUE(absl::EndsWith(plan.header, "\xc6\xff\xff\xff\xff"));
  ASSERT_EQ(plan.after.size(), 1u);
  EXPECT_TRUE(absl::StartsWith(plan.after[0], "\xa5shape\x91\xce\xff\xff\xff\xff\xa5"));
  EXPECT_EQ(plan.file_size, plan.header.size() + 0xFFFFFFFFu + plan.after[0].size());
}

}  // namespace
}  // namespace weightstore

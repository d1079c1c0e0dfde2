#include "core/formats/burn_record.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <zlib.h>

#include <bit>
#include <cstring>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

constexpr const char* kMpkFixtures[] = {"connect4_0.16.1.mpk", "modern-lstm_0.17-half.mpk",
                                        "customimage_0.13-half-old-layout.mpk"};

std::string RecordsDir() { return testing::FixturesDir() + "/burn-records"; }
std::string LayoutPath(absl::string_view bin) {
  return absl::StrCat(RecordsDir(), "/", absl::StrReplaceAll(bin, {{".bin", ".layout.json"}}));
}
std::string ReadFixture(absl::string_view file) {
  return testing::ReadFileOrEmpty(absl::StrCat(RecordsDir(), "/", file));
}

// expected.json: per file, its tensors in file order (name, dtype, shape,
// sha256 of the bytes) and, for MessagePack files, the metadata.
const nlohmann::ordered_json& Expected() {
  static const nlohmann::ordered_json* expected =
      new nlohmann::ordered_json(nlohmann::ordered_json::parse(ReadFixture("expected.json")));
  return *expected;
}

void ExpectTensors(const Checkpoint& c, const nlohmann::ordered_json& expected) {
  const nlohmann::ordered_json& tensors = expected["tensors"];
  ASSERT_EQ(c.size(), tensors.size());
  size_t i = 0;
  for (const auto& item : tensors.items()) {
    const CheckpointEntry& e = c.entries()[i++];
    const nlohmann::ordered_json& t = item.value();
    EXPECT_EQ(e.spec.name, item.key());
    EXPECT_EQ(std::string(DTypeName(e.spec.dtype)), t["dtype"].get<std::string>()) << item.key();
    EXPECT_EQ(e.spec.shape, t["shape"].get<std::vector<uint64_t>>()) << item.key();
    ASSERT_OK_AND_ASSIGN(SharedTensor read, c.Read(e));
    EXPECT_EQ(testing::Sha256Hex(read.bytes.view()), t["sha256"].get<std::string>()) << item.key();
  }
  if (expected.contains("metadata")) {
    for (const auto& item : expected["metadata"].items()) {
      EXPECT_EQ(c.metadata().at(item.key()), item.value().get<std::string>()) << item.key();
    }
  }
}

// gzip as flate2's GzEncoder at Compression::default() (level 6) writes it.
std::string Gzip(const std::string& data) {
  z_stream zs{};
  EXPECT_EQ(deflateInit2(&zs, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY), Z_OK);
  std::string out(deflateBound(&zs, data.size()), '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  zs.avail_in = static_cast<uInt>(data.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&zs, Z_FINISH), Z_STREAM_END);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

// A MessagePack record re-encoded as Burn's JSON recorders write it: the same
// keys in the same order, bins as arrays of byte values.
void BinariesToArrays(nlohmann::ordered_json& j) {
  if (j.is_binary()) {
    nlohmann::ordered_json bytes = nlohmann::ordered_json::array();
    for (uint8_t b : j.get_binary()) bytes.push_back(b);
    j = std::move(bytes);
  } else if (j.is_structured()) {
    for (nlohmann::ordered_json& v : j) BinariesToArrays(v);
  }
}
std::string ToJson(const std::string& mpk, bool pretty) {
  nlohmann::ordered_json doc = nlohmann::ordered_json::from_msgpack(mpk);
  BinariesToArrays(doc);
  return doc.dump(pretty ? 2 : -1);
}

std::string Floats(std::initializer_list<float> values) {
  std::string out(values.size() * 4, '\0');
  std::memcpy(out.data(), values.begin(), out.size());
  return out;
}

// A MessagePack writer for hand-made (often hostile) records.
struct Mpk {
  std::string out;
  Mpk& Byte(uint8_t b) {
    out.push_back(static_cast<char>(b));
    return *this;
  }
  Mpk& BE(uint64_t v, int bytes) {
    for (int i = bytes - 1; i >= 0; --i) Byte(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  Mpk& Raw(absl::string_view s) {
    out.append(s.data(), s.size());
    return *this;
  }
  Mpk& Map(uint32_t n) { return n < 16 ? Byte(0x80 | n) : Byte(0xde).BE(n, 2); }
  Mpk& Arr(uint32_t n) { return n < 16 ? Byte(0x90 | n) : Byte(0xdc).BE(n, 2); }
  Mpk& Str(absl::string_view s) { return (s.size() < 32 ? Byte(0xa0 | s.size()) : Byte(0xd9).Byte(s.size())).Raw(s); }
  Mpk& Bin(absl::string_view b) {
    return (b.size() < 256 ? Byte(0xc4).Byte(b.size()) : Byte(0xc6).BE(b.size(), 4)).Raw(b);
  }
  Mpk& U(uint64_t v) { return v < 128 ? Byte(v) : v < 256 ? Byte(0xcc).Byte(v) : Byte(0xce).BE(v, 4); }
  Mpk& F32(float f) { return Byte(0xca).BE(std::bit_cast<uint32_t>(f), 4); }
  Mpk& Nil() { return Byte(0xc0); }
  Mpk& Shape(std::vector<uint64_t> shape) {
    Arr(shape.size());
    for (uint64_t d : shape) U(d);
    return *this;
  }
  // A Param {"id", "param": TensorData}, whose dtype is one MessagePack value.
  Mpk& ParamWith(absl::string_view bytes, std::vector<uint64_t> shape, const std::string& dtype,
                 absl::string_view id = "0400000000000") {
    Map(2).Str("id").Str(id).Str("param").Map(3).Str("bytes").Bin(bytes).Str("shape").Shape(shape);
    return Str("dtype").Raw(dtype);
  }
  Mpk& Param(absl::string_view bytes, std::vector<uint64_t> shape, absl::string_view dtype = "F32") {
    return ParamWith(bytes, shape, Mpk().Str(dtype).out);
  }
};

// A BurnRecord {metadata, item, _b} around `item` (one MessagePack value).
std::string Record(const std::string& item, absl::string_view float_type = "f32", absl::string_view int_type = "i32") {
  Mpk m;
  m.Map(3).Str("metadata").Map(5).Str("float").Str(float_type).Str("int").Str(int_type);
  m.Str("format").Str("test").Str("version").Str("0.16.0").Str("settings").Str("FullPrecisionSettings");
  return m.Str("item").Raw(item).Str("_b").Arr(0).out;
}

absl::StatusOr<std::shared_ptr<const Checkpoint>> Parse(const std::string& bytes, const OpenOptions& options = {},
                                                        const RecordLayout* layout = nullptr) {
  return ParseBurnRecord(SharedBytes::Copy(bytes), "r.mpk", options, layout);
}

absl::StatusOr<RecordLayout> Layout(absl::string_view bin) { return RecordLayout::Load(LayoutPath(bin)); }

TEST(BurnRecordTest, OpensEveryFixtureWithExactlyTheExpectedTensors) {
  ASSERT_EQ(Expected().size(), 5u);
  for (const auto& item : Expected().items()) {
    SCOPED_TRACE(item.key());
    OpenOptions options;
    if (absl::EndsWith(item.key(), ".bin")) options.record_layout = LayoutPath(item.key());
    ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Open(absl::StrCat(RecordsDir(), "/", item.key()), options));
    EXPECT_EQ(c->format(), kBurnRecordFormat);
    ExpectTensors(*c, item.value());
  }
}

TEST(BurnRecordTest, ServesMessagePackTensorBytesStraightFromTheFile) {
  ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Open(RecordsDir() + "/connect4_0.16.1.mpk"));
  EXPECT_EQ(c->detail(), "mpk");
  for (const CheckpointEntry& e : c->entries()) {
    ASSERT_OK_AND_ASSIGN(SharedTensor t, c->Read(e));
    EXPECT_TRUE(c->Locate(t.bytes).has_value()) << e.spec.name;
  }
}

TEST(BurnRecordTest, ReadsBincodeMetadataAndTensorBytesFromTheFile) {
  OpenOptions options;
  options.record_layout = LayoutPath("mnistweb_0.21.bin");
  ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Open(RecordsDir() + "/mnistweb_0.21.bin", options));
  EXPECT_EQ(c->detail(), "bin");
  EXPECT_EQ(c->metadata().at("version"), "0.21.0");
  EXPECT_EQ(c->metadata().at("settings"), "FullPrecisionSettings");
  ASSERT_OK_AND_ASSIGN(SharedTensor t, c->Read("fc1.weight"));
  EXPECT_TRUE(c->Locate(t.bytes).has_value());
  EXPECT_EQ(c->Find("fc1.weight")->spec.param_id, DecodeBurnParamId("upnangdogj99m"));
}

TEST(BurnRecordTest, CarriesParamIdsThatDecodeToBurnsU64) {
  EXPECT_EQ(DecodeBurnParamId("0400000000000"), 1u);  // ParamId::from(1), Burn >= 0.15
  EXPECT_EQ(DecodeBurnParamId("0800000000000"), 2u);
  EXPECT_EQ(DecodeBurnParamId("0400000000"), 1u);  // 6 bytes, Burn 0.14
  EXPECT_EQ(DecodeBurnParamId("p9vkb80ukhqou"), 10337348971143725002u);
  EXPECT_EQ(DecodeBurnParamId("30b82c23-788d-4d63-a743-ada258d5f13c"), std::nullopt);  // a UUID
  EXPECT_EQ(DecodeBurnParamId("0400000000001"), std::nullopt);                         // a stray trailing bit
  EXPECT_EQ(DecodeBurnParamId("04000000000w0"), std::nullopt);                         // not base32hex
  EXPECT_EQ(DecodeBurnParamId("04000000000000"), std::nullopt);                        // 14 characters

  ASSERT_OK_AND_ASSIGN(auto modern, Checkpoint::Open(RecordsDir() + "/connect4_0.16.1.mpk"));
  EXPECT_EQ(modern->Find("layer_0.weight")->spec.param_id, 10337348971143725002u);
  ASSERT_OK_AND_ASSIGN(auto old, Checkpoint::Open(RecordsDir() + "/customimage_0.13-half-old-layout.mpk"));
  for (const CheckpointEntry& e : old->entries()) EXPECT_EQ(e.spec.param_id, std::nullopt) << e.spec.name;
}

TEST(BurnRecordTest, ReadsTheGzipAndJsonFormsOfEachMessagePackFixtureAlike) {
  for (const char* file : kMpkFixtures) {
    SCOPED_TRACE(file);
    const std::string mpk = ReadFixture(file);
    ASSERT_FALSE(mpk.empty());
    const std::vector<std::pair<std::string, std::string>> forms = {
        {Gzip(mpk), "mpk.gz"}, {ToJson(mpk, /*pretty=*/true), "json"}, {Gzip(ToJson(mpk, false)), "json.gz"}};
    for (const auto& [bytes, detail] : forms) {
      SCOPED_TRACE(detail);
      ASSERT_OK_AND_ASSIGN(auto c, Parse(bytes));
      EXPECT_EQ(c->detail(), detail);
      ExpectTensors(*c, Expected()[file]);
    }
  }
}

TEST(BurnRecordTest, ReadsGzippedBincodeWithALayoutGivenInMemory) {
  ASSERT_OK_AND_ASSIGN(RecordLayout layout, Layout("mnistweb_0.14-uuid.bin"));
  ASSERT_OK_AND_ASSIGN(auto c, Parse(Gzip(ReadFixture("mnistweb_0.14-uuid.bin")), {}, &layout));
  EXPECT_EQ(c->detail(), "bin.gz");
  ExpectTensors(*c, Expected()["mnistweb_0.14-uuid.bin"]);
}

TEST(BurnRecordTest, DetectsRecordsByContentAndNeverClaimsPyTorch) {
  for (const auto& item : Expected().items()) {
    const std::string bytes = ReadFixture(item.key());
    EXPECT_TRUE(IsBurnRecord(bytes)) << item.key();
    EXPECT_TRUE(IsBurnRecord(Gzip(bytes))) << item.key();
  }
  EXPECT_TRUE(IsBurnRecord(ToJson(ReadFixture("connect4_0.16.1.mpk"), /*pretty=*/true)));
  for (const char* pt : {"pytorch-reader/float32.pt", "pytorch-reader/simple_legacy.pt", "pytorch-models/linear.pt"}) {
    EXPECT_FALSE(IsBurnRecord(testing::ReadFileOrEmpty(absl::StrCat(testing::FixturesDir(), "/burn/", pt)))) << pt;
  }
  EXPECT_FALSE(IsBurnRecord(Gzip("not a record")));
  EXPECT_FALSE(IsBurnRecord("{\"weight_map\": {}}"));

  // ".bin" stays PyTorch's, ".json" is named only: models folders hold config.json.
  const std::string scratch = testing::MakeScratchDir("burn_record");
  testing::WriteFileOrDie(scratch + "/pytorch_model.bin",
                          testing::ReadFileOrEmpty(testing::FixturesDir() + "/burn/pytorch-reader/float32.pt"));
  ASSERT_OK_AND_ASSIGN(auto torch, Checkpoint::Open(scratch + "/pytorch_model.bin"));
  EXPECT_EQ(torch->format(), *FindFormat("pytorch"));
  EXPECT_EQ(FormatForPath("pytorch_model.bin"), FindFormat("pytorch"));
  EXPECT_EQ(FormatForPath("m/model.MPK.GZ", /*named=*/false), &kBurnRecordFormat);
  EXPECT_EQ(FormatForPath("m/model.bin.gz", /*named=*/false), &kBurnRecordFormat);
  EXPECT_EQ(FormatForPath("record.json"), &kBurnRecordFormat);
  EXPECT_EQ(FormatForPath("config.json", /*named=*/false), nullptr);
  EXPECT_EQ(StripFormatExtension("a/model.mpk.gz"), "a/model");
}

TEST(BurnRecordTest, NamesTensorsByModulePathsAndSkipsConstants) {
  Mpk item;
  item.Map(4).Str("layers").Arr(2);
  item.Map(2).Str("w").Param(Floats({1}), {1}).Str("dropout").Nil();
  item.Map(1).Str("w").Param(Floats({2}), {1});
  item.Str("block").Map(1).Str("Conv").Map(1).Str("w").Param(Floats({3}), {1});  // an enum module's variant
  item.Str("stride").Arr(2).Nil().Nil();
  item.Str("unit").Arr(0);
  ASSERT_OK_AND_ASSIGN(auto c, Parse(Record(item.out)));
  ASSERT_EQ(c->size(), 3u);
  EXPECT_EQ(c->entries()[0].spec.name, "layers.0.w");
  EXPECT_EQ(c->entries()[1].spec.name, "layers.1.w");
  EXPECT_EQ(c->entries()[2].spec.name, "block.Conv.w");
  EXPECT_EQ(c->metadata().at("format"), "test");
}

TEST(BurnRecordTest, ReadsTheOldValueLayoutWithItsDTypeFromTheMetadata) {
  // <= 0.13 Full: f32 values.
  Mpk full;
  full.Map(1).Str("w").Map(2).Str("id").Str("d").Str("param").Map(2);
  full.Str("value").Arr(2).F32(1.5f).F32(-2).Str("shape").Shape({2});
  ASSERT_OK_AND_ASSIGN(auto c, Parse(Record(full.out)));
  EXPECT_EQ(c->entries()[0].spec.dtype, DType::kF32);
  ASSERT_OK_AND_ASSIGN(SharedTensor t, c->Read("w"));
  EXPECT_EQ(t.bytes.view(), Floats({1.5f, -2}));

  // Half: f16 as its bits.
  Mpk half;
  half.Map(1).Str("w").Map(2).Str("id").Str("d").Str("param").Map(2);
  half.Str("value").Arr(2).U(0x3C00).U(0).Str("shape").Shape({2});
  ASSERT_OK_AND_ASSIGN(c, Parse(Record(half.out, "half::binary16::f16", "i16")));
  EXPECT_EQ(c->entries()[0].spec.dtype, DType::kF16);
  ASSERT_OK_AND_ASSIGN(t, c->Read("w"));
  EXPECT_EQ(t.bytes.view(), std::string("\x00\x3c\x00\x00", 4));

  // Double, as JSON: floats take the metadata's width.
  const std::string json = R"({"metadata":{"float":"f64","int":"i64","format":"t","version":"0.13.0","settings":"s"},)"
                           R"("item":{"w":{"id":"d","param":{"value":[0.5,2.0],"shape":[2]}}},"_b":null})";
  ASSERT_OK_AND_ASSIGN(c, Parse(json));
  EXPECT_EQ(c->entries()[0].spec.dtype, DType::kF64);

  Mpk miscounted;
  miscounted.Map(1).Str("w").Map(2).Str("id").Str("d").Str("param").Map(2);
  miscounted.Str("value").Arr(2).F32(1).F32(2).Str("shape").Shape({3});
  EXPECT_THAT(Parse(Record(miscounted.out)),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("item.w.param"), HasSubstr("2 values"))));
  Mpk mixed;
  mixed.Map(1).Str("w").Map(2).Str("id").Str("d").Str("param").Map(2);
  mixed.Str("value").Arr(2).F32(1).U(2).Str("shape").Shape({2});
  EXPECT_THAT(Parse(Record(mixed.out)), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("mixes element types")));
}

TEST(BurnRecordTest, ReadsBurn021BoolStoresAsOneByteBools) {
  const std::string u32 = Mpk().Map(1).Str("Bool").Str("U32").out;
  ASSERT_OK_AND_ASSIGN(
      auto c, Parse(Record(Mpk().Map(1).Str("m").ParamWith(std::string("\1\0\0\0\0\0\0\0", 8), {2}, u32).out)));
  EXPECT_EQ(c->entries()[0].spec.dtype, DType::kBool);
  ASSERT_OK_AND_ASSIGN(SharedTensor t, c->Read("m"));
  EXPECT_EQ(t.bytes.view(), std::string("\1\0", 2));
  EXPECT_THAT(Parse(Record(Mpk().Map(1).Str("m").ParamWith(std::string("\2\0\0\0", 4), {1}, u32).out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is 2, not 0 or 1")));
  ASSERT_OK_AND_ASSIGN(c, Parse(Record(Mpk().Map(1).Str("m").Param(std::string("\1\0", 2), {2}, "Bool").out)));
  EXPECT_EQ(c->entries()[0].spec.dtype, DType::kBool);
}

TEST(BurnRecordTest, RefusesAGzipStreamThatInflatesPastTheBound) {
  const std::string record = Record(Mpk().Map(1).Str("w").Param(std::string(2 << 20, '\0'), {1 << 19}).out);
  OpenOptions options;
  options.max_record_inflated_bytes = 1 << 20;
  EXPECT_THAT(Parse(Gzip(record), options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("'r.mpk'"), HasSubstr("inflates past 1048576 bytes"))));
  EXPECT_OK(Parse(Gzip(record)));
  std::string truncated = Gzip(record);
  truncated.resize(truncated.size() / 2);
  EXPECT_THAT(Parse(truncated), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("truncated")));
}

TEST(BurnRecordTest, RefusesLengthsPastTheEnd) {
  Mpk item;  // a bin that claims 200 bytes where fewer remain
  item.Map(1).Str("w").Map(2).Str("id").Str("0400000000000").Str("param").Map(3).Str("bytes");
  item.Byte(0xc4).Byte(200).Raw(Floats({1, 2, 3}));
  EXPECT_THAT(Parse(Record(item.out)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("'r.mpk'"), HasSubstr("item.w.param.bytes"), HasSubstr("ends inside"))));
  Mpk huge;  // a string of 4 GiB
  huge.Map(3).Str("metadata").Byte(0xdb).BE(0xFFFFFFFF, 4).Raw("f32");
  EXPECT_THAT(Parse(huge.out), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ends inside")));
}

TEST(BurnRecordTest, RefusesNestingDeeperThan64Levels) {
  auto nested = [](int arrays) {  // the root map is the first level
    Mpk m;
    for (int i = 0; i < arrays; ++i) m.Arr(1);
    return m.Nil().out;
  };
  EXPECT_OK(Parse(Record(nested(63))));
  EXPECT_THAT(Parse(Record(nested(64))), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("deeper than 64")));
  std::string json = R"({"metadata":{"float":"f32"},"item":)" + std::string(64, '[') + std::string(64, ']') + "}";
  EXPECT_THAT(Parse(json), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("deeper than 64")));
}

TEST(BurnRecordTest, RefusesAByteCountThatIsNotShapeTimesDType) {
  EXPECT_THAT(Parse(Record(Mpk().Map(1).Str("w").Param(Floats({1, 2, 3}).substr(0, 11), {3}).out)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("item.w.param"), HasSubstr("holds 11 bytes, but F32 [3] needs 12"))));
  EXPECT_THAT(Parse(Record(Mpk().Map(1).Str("w").Param("", {UINT32_MAX, UINT32_MAX, 16}).out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows")));
}

TEST(BurnRecordTest, RefusesDuplicateKeysInvalidUtf8AndNonStringKeys) {
  const std::string w = Mpk().Param(Floats({1}), {1}).out;
  EXPECT_THAT(Parse(Record(Mpk().Map(2).Str("w").Raw(w).Str("w").Raw(w).out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'w' appears twice")));
  EXPECT_THAT(Parse(Record(Mpk().Map(1).Str("w\xff").Nil().out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not valid UTF-8")));
  EXPECT_THAT(Parse(Record("\xc0", "f\xc3\x28")),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("metadata.float"), HasSubstr("UTF-8"))));
  EXPECT_THAT(Parse(Record(Mpk().Map(1).U(7).Nil().out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("key is not a string")));
  EXPECT_THAT(Parse(R"({"metadata":{"float":"f32","float":"f64"},"item":null})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'float' appears twice")));
}

TEST(BurnRecordTest, RefusesExtTypesAndTheReservedMarker) {
  EXPECT_THAT(Parse(Record(Mpk().Map(1).Str("x").Raw("\xd4\x01\x00").out)),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("item.x"), HasSubstr("ext"))));
  EXPECT_THAT(Parse(Record(Mpk().Map(1).Str("x").Byte(0xc1).out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("0xc1")));
}

TEST(BurnRecordTest, RefusesQuantizedTensorsNamingThem) {
  const std::string qfloat = Mpk().Map(1).Str("QFloat").Map(1).Str("value").Str("Q8S").out;
  EXPECT_THAT(Parse(Record(Mpk().Map(1).Str("w").ParamWith("\1\2", {2}, qfloat).out)),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("tensor 'w'"), HasSubstr("QFloat"))));
}

TEST(BurnRecordTest, RefusesJsonBytesOutsideAByteAndNullValues) {
  const std::string head = R"({"metadata":{"float":"f32","int":"i32","format":"t","version":"v","settings":"s"},)";
  ASSERT_OK_AND_ASSIGN(auto c, Parse(head + R"("item":{"w":{"id":"0400000000000","param":)"
                                            R"({"bytes":[0,0,128,63],"shape":[1],"dtype":"F32"}}},"_b":null})"));
  ASSERT_OK_AND_ASSIGN(SharedTensor t, c->Read("w"));
  EXPECT_EQ(t.bytes.view(), Floats({1}));
  EXPECT_EQ(c->entries()[0].spec.param_id, 1u);
  EXPECT_THAT(
      Parse(head + R"("item":{"w":{"id":"i","param":{"bytes":[0,0,128,256],"shape":[1],"dtype":"F32"}}}})"),
      StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("item.w.param.bytes.3"), HasSubstr("not a byte"))));
  EXPECT_THAT(Parse(head + R"("item":{"w":{"id":"i","param":{"value":[1.0,null],"shape":[2]}}}})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is null")));
  EXPECT_THAT(Parse(head + R"("item":{}} trailing)"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("JSON")));
}

TEST(BurnRecordTest, RefusesTrailingBytesAndTooManyOrTooLongTensors) {
  EXPECT_THAT(Parse(Record(Mpk().Nil().out) + "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1 bytes follow the record")));
  OpenOptions few;
  few.max_tensors = 5;
  EXPECT_THAT(Checkpoint::Open(RecordsDir() + "/connect4_0.16.1.mpk", few),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more than 5 tensors")));
  OpenOptions short_names;
  short_names.max_name_bytes = 10;
  EXPECT_THAT(Checkpoint::Open(RecordsDir() + "/connect4_0.16.1.mpk", short_names),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("name is 14 bytes")));
}

TEST(BurnRecordTest, RefusesABincodeRecordWithoutALayout) {
  const std::string path = RecordsDir() + "/mnistweb_0.21.bin";
  EXPECT_THAT(Checkpoint::Open(path),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(path), HasSubstr("bincode record"), HasSubstr("--record-layout"))));
}

TEST(BurnRecordTest, RefusesBincodeTagsOtherThanZeroAndOne) {
  std::string bin = ReadFixture("mnistweb_0.21.bin");
  const size_t id = bin.find(
      "\x0d"
      "eodjo3s0ctnoe");  // conv1.conv.bias, after its Option tag
  ASSERT_NE(id, std::string::npos);
  ASSERT_EQ(bin[id - 1], '\x01');
  bin[id - 1] = '\x02';
  ASSERT_OK_AND_ASSIGN(RecordLayout layout, Layout("mnistweb_0.21.bin"));
  EXPECT_THAT(Parse(bin, {}, &layout),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("'conv1.conv.bias'"), HasSubstr(absl::StrCat("byte 2 at offset ", id - 1)),
                             HasSubstr("tags are 0 or 1"))));
}

TEST(BurnRecordTest, RefusesALayoutThatDoesNotFitNamingItsFirstUnmatchedParameter) {
  const std::string bin = ReadFixture("mnistweb_0.21.bin");
  ASSERT_OK_AND_ASSIGN(const RecordLayout original, Layout("mnistweb_0.21.bin"));
  RecordLayout wrong_shape = original;
  wrong_shape.parameters[1].shape = {65};
  EXPECT_THAT(Parse(bin, {}, &wrong_shape),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("parameter 'conv1.conv.bias'"), HasSubstr("shape is [64]"))));
  RecordLayout too_few = original;
  too_few.parameters.resize(3);
  EXPECT_THAT(Parse(bin, {}, &too_few),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("another parameter at offset")));

  // Burn 0.14's fc1 has no bias: a layout that lists one names it.
  ASSERT_OK_AND_ASSIGN(RecordLayout with_bias, Layout("mnistweb_0.14-uuid.bin"));
  ASSERT_EQ(with_bias.parameters[18].path, "fc1.weight");
  with_bias.parameters.insert(with_bias.parameters.begin() + 19, {.path = "fc1.bias", .shape = {32}});
  EXPECT_THAT(Parse(ReadFixture("mnistweb_0.14-uuid.bin"), {}, &with_bias),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("parameter 'fc1.bias'")));

  OpenOptions few;
  few.max_tensors = 2;
  EXPECT_THAT(Parse(bin, few, &original), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("limit of 2")));
  EXPECT_THAT(RecordLayout::FromJson(R"({"parameters": [{"path": "a"}]})", "l.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("parameters[0].shape")));
}

}  // namespace
}  // namespace weightstore

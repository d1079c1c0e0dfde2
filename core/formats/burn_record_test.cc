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
#include "core/formats/burn_record_internal.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
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

// A bincode record as Burn's BinFileRecorder writes it (bincode 2 standard()).
struct Bincode {
  std::string out;
  Bincode& Varint(uint64_t v) {
    const int bytes = v < 251 ? 0 : v <= 0xFFFF ? 2 : 4;
    if (bytes == 0) {
      out.push_back(static_cast<char>(v));
      return *this;
    }
    out.push_back(bytes == 2 ? '\xfb' : '\xfc');
    for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
    return *this;
  }
  Bincode& Str(absl::string_view s) {
    Varint(s.size());
    out.append(s.data(), s.size());
    return *this;
  }
  Bincode& Metadata(absl::string_view float_type = "f32", absl::string_view int_type = "i32") {
    return Str(float_type).Str(int_type).Str("burn_core::record::file::BinFileRecorder<FullPrecisionSettings>");
  }
  Bincode& Shape(const std::vector<uint64_t>& shape) {
    Varint(shape.size());
    for (uint64_t d : shape) Varint(d);
    return *this;
  }
  // A >= 0.14 Param: its id, then TensorData {bytes, shape, dtype's variant index}.
  Bincode& Param(absl::string_view bytes, const std::vector<uint64_t>& shape, uint64_t dtype_index) {
    Str("0400000000000").Varint(bytes.size());
    out.append(bytes.data(), bytes.size());
    return Shape(shape).Varint(dtype_index);
  }
};

std::string BincodeRecord(const Bincode& params, absl::string_view float_type = "f32",
                          absl::string_view int_type = "i32") {
  Bincode b;
  b.Metadata(float_type, int_type).Str("0.16.0").Str("FullPrecisionSettings");
  return b.out + params.out;
}

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

TEST(BurnRecordTest, RefusesOldLayoutValuesThatConvertPastTheRecordsBudget) {
  // 1000 one-byte ints of an i64 record convert to 8000 bytes.
  Mpk item;
  item.Map(1).Str("w").Map(2).Str("id").Str("d").Str("param").Map(2).Str("value").Arr(1000);
  for (int i = 0; i < 1000; ++i) item.U(1);
  item.Str("shape").Shape({1000});
  const std::string record = Record(item.out, "f32", "i64");
  OpenOptions small;
  small.max_record_inflated_bytes = 4096;
  for (const std::string& bytes : {record, Gzip(record)}) {
    EXPECT_THAT(Parse(bytes, small), StatusIs(absl::StatusCode::kInvalidArgument,
                                              AllOf(HasSubstr("'r.mpk'"), HasSubstr("item.w.param.value:"),
                                                    HasSubstr("more than the 4096 bytes"))));
  }
  OpenOptions enough;
  enough.max_record_inflated_bytes = 8000;
  ASSERT_OK_AND_ASSIGN(auto c, Parse(Gzip(record), enough));
  EXPECT_EQ(c->entries()[0].spec.dtype, DType::kI64);

  // The budget counts every converted tensor of the record together.
  Mpk two;
  two.Map(2);
  for (const char* name : {"a", "b"}) {
    two.Str(name).Map(2).Str("id").Str("d").Str("param").Map(2).Str("value").Arr(300);
    for (int i = 0; i < 300; ++i) two.U(1);
    two.Str("shape").Shape({300});
  }
  EXPECT_THAT(Parse(Record(two.out, "f32", "i64"), small),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("item.b.param.value:")));

  // The budget: 2 x the (inflated) record + 64 MiB, at most the option.
  EXPECT_EQ(burn_record_internal::ConvertedBudget(1000, OpenOptions{}), 2000 + (uint64_t{64} << 20));
  EXPECT_EQ(burn_record_internal::ConvertedBudget(1000, small), 4096u);
  EXPECT_EQ(burn_record_internal::ConvertedBudget(UINT64_MAX, OpenOptions{}), OpenOptions{}.max_record_inflated_bytes);
  EXPECT_EQ(OpenOptions{}.max_record_inflated_bytes, uint64_t{8} << 30);

  // bincode's <= 0.13 varint values likewise, naming the parameter.
  Bincode values;
  values.Str("30b82c23-788d-4d63-a743-ada258d5f13c").Varint(1000);
  for (int i = 0; i < 1000; ++i) values.Varint(2);  // zigzag 1
  values.Shape({1000});
  const RecordLayout layout{.parameters = {{.path = "w", .shape = {1000}}}};
  EXPECT_THAT(Parse(BincodeRecord(values, "f32", "i64"), small, &layout),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("parameter 'w'"), HasSubstr("8000 bytes"), HasSubstr("4096"))));
  ASSERT_OK_AND_ASSIGN(c, Parse(BincodeRecord(values, "f32", "i64"), enough, &layout));
  ASSERT_OK_AND_ASSIGN(SharedTensor t, c->Read("w"));
  EXPECT_EQ(t.bytes.view().substr(0, 16), std::string("\1\0\0\0\0\0\0\0\1\0\0\0\0\0\0\0", 16));
}

TEST(BurnRecordTest, RecognisesAParamWhateverTheOrderOfItsKeysIgnoringUnknownOnes) {
  const std::string tensor =
      Mpk().Map(3).Str("bytes").Bin(Floats({1})).Str("shape").Shape({1}).Str("dtype").Str("F32").out;
  Mpk item;
  item.Map(3);
  item.Str("reversed").Map(2).Str("param").Raw(tensor).Str("id").Str("0400000000000");
  item.Str("extra").Map(3).Str("id").Str("0800000000000").Str("x").Nil().Str("param").Raw(tensor);
  item.Str("last").Map(3).Str("param").Raw(tensor).Str("note").Arr(0).Str("id").Str("0c00000000000");
  ASSERT_OK_AND_ASSIGN(auto c, Parse(Record(item.out)));
  ASSERT_EQ(c->size(), 3u);
  EXPECT_EQ(c->entries()[0].spec.name, "reversed");
  EXPECT_EQ(c->entries()[0].spec.param_id, 1u);
  EXPECT_EQ(c->entries()[1].spec.name, "extra");
  EXPECT_EQ(c->entries()[1].spec.param_id, 2u);
  EXPECT_EQ(c->entries()[2].spec.name, "last");
  EXPECT_EQ(c->entries()[2].spec.param_id, 3u);
  ASSERT_OK_AND_ASSIGN(SharedTensor t, c->Read("reversed"));
  EXPECT_EQ(t.bytes.view(), Floats({1}));

  const std::string json = R"({"metadata":{"float":"f32","int":"i32","format":"t","version":"0.13.0","settings":"s"},)"
                           R"("item":{"w":{"param":{"shape":[2],"value":[0.5,2.0]},"x":[1,2],"id":"u"}},"_b":null})";
  ASSERT_OK_AND_ASSIGN(c, Parse(json));
  ASSERT_EQ(c->size(), 1u);
  EXPECT_EQ(c->entries()[0].spec.name, "w");
  EXPECT_EQ(c->entries()[0].spec.param_id, std::nullopt);  // "u" is no ParamId

  // A module whose fields are named id and param is still a module.
  Mpk module;
  module.Map(1).Str("m").Map(2).Str("id").Nil().Str("param").Map(1).Str("w").Param(Floats({2}), {1});
  ASSERT_OK_AND_ASSIGN(c, Parse(Record(module.out)));
  ASSERT_EQ(c->size(), 1u);
  EXPECT_EQ(c->entries()[0].spec.name, "m.param.w");
}

TEST(BurnRecordTest, RefusesAParamTensorWithoutAStringIdNamingTheField) {
  const std::string tensor =
      Mpk().Map(3).Str("bytes").Bin(Floats({1})).Str("shape").Shape({1}).Str("dtype").Str("F32").out;
  EXPECT_THAT(Parse(Record(Mpk().Map(1).Str("w").Map(2).Str("id").Nil().Str("param").Raw(tensor).out)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("'r.mpk'"), HasSubstr("item.w.id: is null, not a string"))));
  EXPECT_THAT(Parse(Record(Mpk().Map(1).Str("w").Map(2).Str("param").Raw(tensor).Str("id").U(7).out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("item.w.id: is an integer, not a string")));
  EXPECT_THAT(Parse(Record(Mpk().Map(1).Str("w").Map(2).Str("param").Raw(tensor).Str("x").Nil().out)),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("item.w: "), HasSubstr("has no 'id'"))));
  EXPECT_THAT(Parse(Record(Mpk().Map(1).Str("w").Map(2).Str("param").Nil().Str("id").Str("0400000000000").out)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("item.w.param: is null beside a string id")));
  const std::string json = R"({"metadata":{"float":"f32"},"item":{"w":{"param":{"value":[1.0],"shape":[1]}}}})";
  EXPECT_THAT(Parse(json), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has no 'id'")));
}

TEST(BurnRecordTest, KeepsOldLayoutF32BitsExactlySignallingNaNsIncluded) {
  Mpk item;  // two signalling NaNs, which a trip through double would quiet
  item.Map(1).Str("w").Map(2).Str("id").Str("d").Str("param").Map(2).Str("value").Arr(3);
  item.Byte(0xca).BE(0x7f800001, 4).Byte(0xca).BE(0xffa00000, 4).F32(-0.0f).Str("shape").Shape({3});
  ASSERT_OK_AND_ASSIGN(auto c, Parse(Record(item.out)));
  EXPECT_EQ(c->entries()[0].spec.dtype, DType::kF32);
  ASSERT_OK_AND_ASSIGN(SharedTensor t, c->Read("w"));
  EXPECT_EQ(t.bytes.view(), std::string("\x01\x00\x80\x7f\x00\x00\xa0\xff\x00\x00\x00\x80", 12));
}

TEST(BurnRecordTest, RefusesLayoutPathsTooLongOrWithTooManyPartsQuotingThemShortly) {
  // Layout JSON of `paths` (plain ASCII), each of shape [1].
  auto layout = [](std::vector<std::string> paths) {
    std::string json = R"({"parameters": [)";
    for (size_t i = 0; i < paths.size(); ++i) {
      absl::StrAppend(&json, i == 0 ? "" : ", ", R"({"path": ")", paths[i], R"(", "shape": [1]})");
    }
    return RecordLayout::FromJson(json + "]}", "l.json");
  };
  EXPECT_OK(layout({std::string(4096, 'a')}));
  const absl::Status too_long = layout({std::string(40000, 'a')}).status();
  EXPECT_THAT(too_long, StatusIs(absl::StatusCode::kInvalidArgument,
                                 AllOf(HasSubstr("parameters[0].path"), HasSubstr("40000 bytes; at most 4096"),
                                       HasSubstr(std::string(200, 'a') + "..."))));
  EXPECT_LT(too_long.message().size(), 400u);

  std::string parts = "0";
  for (int i = 1; i < 64; ++i) parts += ".0";
  EXPECT_OK(layout({parts}));
  EXPECT_THAT(layout({parts + ".w"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has 65 '.'-separated parts; at most 64")));

  const std::string twice = std::string(3000, 'b');
  const absl::Status duplicate = layout({twice, twice}).status();
  EXPECT_THAT(duplicate, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("appears twice")));
  EXPECT_LT(duplicate.message().size(), 400u);

  // The bincode reader's errors quote a long path shortly too.
  const RecordLayout unfit{.parameters = {{.path = std::string(4000, 'p'), .shape = {65}}}};
  const absl::Status read = Parse(ReadFixture("mnistweb_0.21.bin"), {}, &unfit).status();
  EXPECT_THAT(read, StatusIs(absl::StatusCode::kInvalidArgument,
                             AllOf(HasSubstr(std::string(200, 'p') + "..."), Not(HasSubstr(std::string(201, 'p'))))));
}

TEST(BurnRecordTest, ResolvesBincodeDTypeIndexTiesWithOneTablePerFile) {
  const RecordLayout one{.parameters = {{.path = "a", .shape = {4}}}};
  const RecordLayout two{.parameters = {{.path = "a", .shape = {4}}, {.path = "b", .shape = {2}}}};
  auto dtypes = [](const absl::StatusOr<std::shared_ptr<const Checkpoint>>& c) {
    std::vector<DType> out;
    if (c.ok()) {
      for (const CheckpointEntry& e : (*c)->entries()) out.push_back(e.spec.dtype);
    }
    return out;
  };
  const std::string flags("\0\1\1\0", 4), bytes("\0\2\1\0", 4);
  // Index 11: Bool in 0.14-0.15, U8 in 0.16. Nothing else fixes the table:
  // Bool when every byte is 0 or 1, else U8.
  EXPECT_EQ(dtypes(Parse(BincodeRecord(Bincode().Param(flags, {4}, 11)), {}, &one)), std::vector{DType::kBool});
  EXPECT_EQ(dtypes(Parse(BincodeRecord(Bincode().Param(bytes, {4}, 11)), {}, &one)), std::vector{DType::kU8});
  // Index 12: Bool in 0.16, U8 in 0.17+.
  EXPECT_EQ(dtypes(Parse(BincodeRecord(Bincode().Param(flags, {4}, 12)), {}, &one)), std::vector{DType::kBool});

  // Another tensor fixes the table, before or after the tie: index 10 of one
  // byte an element is 0.14-0.15's U8; of two, 0.16's U16.
  EXPECT_EQ(dtypes(Parse(BincodeRecord(Bincode().Param(flags, {4}, 11).Param("\7\10", {2}, 10)), {}, &two)),
            (std::vector{DType::kBool, DType::kU8}));
  EXPECT_EQ(dtypes(Parse(BincodeRecord(Bincode().Param(flags, {4}, 11).Param(std::string("\7\0\10\0", 4), {2}, 10)), {},
                         &two)),
            (std::vector{DType::kU8, DType::kU16}));
  // Index 13 of one byte an element is 0.17+'s Bool: index 12 is then U8.
  EXPECT_EQ(
      dtypes(Parse(BincodeRecord(Bincode().Param(flags, {4}, 12).Param(std::string("\1\0", 2), {2}, 13)), {}, &two)),
      (std::vector{DType::kU8, DType::kBool}));
  // With the table fixed at 0.14-0.15, an index-11 byte of 2 is a bad Bool.
  EXPECT_THAT(Parse(BincodeRecord(Bincode().Param(bytes, {4}, 11).Param("\7\10", {2}, 10)), {}, &two),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("parameter 'a'"), HasSubstr("not 0 or 1"))));
}

}  // namespace
}  // namespace weightstore

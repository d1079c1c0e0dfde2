#include "core/catalog/manifest.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

SharedTensor F32(const std::string& name, std::vector<float> values, std::vector<uint64_t> shape = {}) {
  if (shape.empty()) shape = {values.size()};
  std::string bytes(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  return SharedTensor{{name, DType::kF32, shape}, SharedBytes::Copy(bytes)};
}

std::shared_ptr<const Checkpoint> Open(const std::vector<SharedTensor>& tensors) {
  const std::string path = testing::MakeScratchDir("manifest") + "/m.safetensors";
  testing::WriteFileOrDie(path, *SerializeCheckpoint(kSafeTensorsFormat, tensors, {}));
  auto checkpoint = Checkpoint::Open(path);
  EXPECT_OK(checkpoint.status());
  return *checkpoint;
}

TEST(TensorDigestTest, IsXxh3128InCanonicalHex) {
  // XXH3-128 of no bytes, as published with xxHash.
  EXPECT_EQ(DigestBytes({}).Hex(), "99aa06d3014798d86001c324468d497f");
  const TensorDigest d = DigestBytes(std::as_bytes(std::span<const char>("weights", 7)));
  EXPECT_EQ(TensorDigest::FromHex(d.Hex()), d);
}

TEST(TensorDigestTest, FromHexRefusesAnythingButThirtyTwoLowercaseDigits) {
  EXPECT_EQ(TensorDigest::FromHex(""), std::nullopt);
  EXPECT_EQ(TensorDigest::FromHex(std::string(31, '0')), std::nullopt);
  EXPECT_EQ(TensorDigest::FromHex(std::string(33, '0')), std::nullopt);
  EXPECT_EQ(TensorDigest::FromHex("99AA06D3014798D86001C324468D497F"), std::nullopt);
  EXPECT_EQ(TensorDigest::FromHex("99aa06d3014798d86001c324468d497g"), std::nullopt);
}

TEST(DigestsMetadataTest, RoundTripsAndRefusesAnythingButOneObjectOfNamesToDigests) {
  const TensorDigest a = DigestBytes(std::as_bytes(std::span("a", 1)));
  const TensorDigest b = DigestBytes(std::as_bytes(std::span("b", 1)));
  const std::string json = DigestsMetadataJson({{"w.a", a}, {"w\"b", b}});
  ASSERT_OK_AND_ASSIGN(auto parsed, ParseDigestsMetadata(json, 2));
  ASSERT_EQ(parsed.size(), 2u);
  EXPECT_EQ(parsed.at("w.a"), a);
  EXPECT_EQ(parsed.at("w\"b"), b);
  EXPECT_THAT(ParseDigestsMetadata(json, 1), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more than 1")));
  const std::string hex = a.Hex();
  for (const auto& [bad, why] : std::vector<std::pair<std::string, std::string>>{
           {"", "not JSON"},
           {"[]", "array"},
           {"\"x\"", "not an object"},
           {"{\"w\":1}", "not a string"},
           {"{\"w\":null}", "not a string"},
           {"{\"w\":{\"x\":\"" + hex + "\"}}", "nests"},
           {"{\"w\":\"" + absl::AsciiStrToUpper(hex) + "\"}", "not 32 hex digits"},
           {"{\"w\":\"" + hex + "\",\"w\":\"" + hex + "\"}", "twice"},
           {"{\"w\":\"" + hex + "\"} x", "not JSON"},
           {std::string(100000, '[') + std::string(100000, ']'), "array"},
       }) {
    SCOPED_TRACE(bad.substr(0, 40));
    EXPECT_THAT(ParseDigestsMetadata(bad, 10),
                StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("weightstore.digests"), HasSubstr(why))));
  }
}

TEST(ManifestTest, EqualTensorsHaveEqualDigestsAndOneChangedByteDoesNot) {
  auto a = Open({F32("w", {1, 2, 3, 4}), F32("b", {5})});
  auto b = Open({F32("w", {1, 2, 3, 4.5f}), F32("b", {5})});
  ASSERT_OK_AND_ASSIGN(auto ma, ComputeManifest(*a, "va"));
  ASSERT_OK_AND_ASSIGN(auto mb, ComputeManifest(*b, "vb"));
  EXPECT_EQ(ma->version(), "va");
  ASSERT_EQ(ma->tensors().size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(ma->tensors()[i].name, a->entries()[i].spec.name);  // entry order
  EXPECT_FALSE(ma->Find("w")->SameContentAs(*mb->Find("w")));
  EXPECT_TRUE(ma->Find("b")->SameContentAs(*mb->Find("b")));
  EXPECT_EQ(ma->Find("missing"), nullptr);
}

TEST(ManifestTest, AnEmptyVersionNamesTheManifestByItsContent) {
  auto a = Open({F32("w", {1, 2, 3, 4}), F32("b", {5})});
  ASSERT_OK_AND_ASSIGN(auto m, ComputeManifest(*a, ""));
  EXPECT_EQ(m->version(), ContentVersion(m->tensors(), a->metadata()));
  EXPECT_TRUE(TensorDigest::FromHex(m->version()).has_value());  // 32 hex digits
  // Each part of the content moves the id: a name, a dtype, a shape, a digest,
  // the metadata, the order of the tensors.
  const std::vector<ManifestTensor> base = m->tensors();
  const std::string id = ContentVersion(base, {});
  auto changed = [&](auto edit) {
    std::vector<ManifestTensor> t = base;
    edit(t);
    return ContentVersion(t, {});
  };
  EXPECT_EQ(changed([](auto&) {}), id);
  EXPECT_NE(changed([](auto& t) { t[0].name = "v"; }), id);
  EXPECT_NE(changed([](auto& t) { t[0].dtype = DType::kI32; }), id);
  EXPECT_NE(changed([](auto& t) { t[0].shape = {2, 2}; }), id);
  EXPECT_NE(changed([](auto& t) { t[1].digest.low ^= 1; }), id);
  EXPECT_NE(changed([](auto& t) { std::swap(t[0], t[1]); }), id);
  EXPECT_NE(ContentVersion(base, {{"step", "1"}}), id);
  EXPECT_NE(ContentVersion(base, {{"step", "1"}}), ContentVersion(base, {{"step", "2"}}));
  // So is what a quantization config makes of the tensors.
  EXPECT_NE(ContentVersion(base, {}, "w=NVFP4, 4-bit values, blocks of 1x16\n"), id);
  // Lengths are framed: moving a byte from a key to its value is a change.
  EXPECT_NE(ContentVersion(base, {{"ab", "c"}}), ContentVersion(base, {{"a", "bc"}}));
}

TEST(ManifestTest, TheSameBytesUnderAnotherShapeOrDtypeAreAChange) {
  auto a = Open({F32("w", {1, 2, 3, 4}, {2, 2})});
  auto b = Open({F32("w", {1, 2, 3, 4}, {4})});
  ASSERT_OK_AND_ASSIGN(auto ma, ComputeManifest(*a, "a"));
  ASSERT_OK_AND_ASSIGN(auto mb, ComputeManifest(*b, "b"));
  EXPECT_EQ(ma->Find("w")->digest, mb->Find("w")->digest);
  EXPECT_FALSE(ma->Find("w")->SameContentAs(*mb->Find("w")));
}

TEST(ManifestTest, DiffListsChangedAddedAndRemovedTensorsByFileName) {
  auto base = Open({F32("keep", {1}), F32("change", {2}), F32("drop", {3})});
  auto next = Open({F32("keep", {1}), F32("change", {2.5f}), F32("new", {4})});
  ASSERT_OK_AND_ASSIGN(auto mb, ComputeManifest(*base, "1"));
  ASSERT_OK_AND_ASSIGN(auto mn, ComputeManifest(*next, "2"));
  const ManifestDiff diff = DiffManifests(*mb, *mn);
  EXPECT_THAT(diff.changed, ElementsAre("change"));
  EXPECT_THAT(diff.added, ElementsAre("new"));
  EXPECT_THAT(diff.removed, ElementsAre("drop"));
  EXPECT_EQ(diff.unchanged, 1u);
  const ManifestDiff none = DiffManifests(*mn, *mn);
  EXPECT_TRUE(none.changed.empty() && none.added.empty() && none.removed.empty());
  EXPECT_EQ(none.unchanged, 3u);
}

TEST(ManifestTest, ViewsOfOneStorageAreDigestedAsTheirOwnElements) {
  // A PyTorch file whose tensors are windows of one shared storage.
  ASSERT_OK_AND_ASSIGN(auto checkpoint,
                       Checkpoint::Open(testing::FixturesDir() + "/burn/pytorch-reader/legacy_uncloned_views.pt"));
  ASSERT_OK_AND_ASSIGN(auto manifest, ComputeManifest(*checkpoint, "v"));
  ASSERT_EQ(manifest->tensors().size(), checkpoint->size());
  for (const CheckpointEntry& entry : checkpoint->entries()) {
    ASSERT_OK_AND_ASSIGN(SharedTensor copy, checkpoint->ReadCopy(entry));
    EXPECT_EQ(manifest->Find(entry.spec.name)->digest, DigestBytes(copy.bytes.span())) << entry.spec.name;
  }
  EXPECT_NE(manifest->Find("tensor1")->digest, manifest->Find("tensor2")->digest);
}

}  // namespace
}  // namespace weightstore

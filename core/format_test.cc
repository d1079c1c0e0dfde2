#include "core/format.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"

namespace weightstore {
namespace {

TEST(FormatTableTest, EveryEntryKeepsTheTablesInvariants) {
  std::set<absl::string_view> names, endings;
  ASSERT_FALSE(Formats().empty());
  for (const FormatSpec* f : Formats()) {
    SCOPED_TRACE(f->name);
    EXPECT_TRUE(names.insert(f->name).second) << "two formats share a name";
    EXPECT_NE(f->detect, nullptr);
    EXPECT_NE(f->open, nullptr);
    EXPECT_FALSE(f->extensions.empty());
    // An index comes with both of its functions, or with neither.
    EXPECT_EQ(f->index_suffix.empty(), f->open_index == nullptr);
    EXPECT_EQ(f->index_suffix.empty(), f->index_files == nullptr);
    for (const auto* list : {&f->extensions, &f->named_extensions}) {
      for (absl::string_view ext : *list) {
        EXPECT_TRUE(absl::StartsWith(ext, ".")) << ext;
        EXPECT_EQ(absl::AsciiStrToLower(ext), ext);
        EXPECT_TRUE(endings.insert(ext).second) << ext << " belongs to two formats";
      }
    }
  }
  // Only the last format may take any file: it names the fault itself.
  for (size_t i = 0; i + 1 < Formats().size(); ++i) EXPECT_FALSE(Formats()[i]->detect("not a checkpoint at all"));
}

TEST(FormatTableTest, LooksFormatsUpByNameAndByPathIgnoringCase) {
  ASSERT_NE(FindFormat("safetensors"), nullptr);
  EXPECT_EQ(FindFormat("SafeTensors"), nullptr);  // names are exact
  EXPECT_EQ(FindFormat("onnx"), nullptr);
  EXPECT_EQ(FormatForPath("m/model.SAFETENSORS"), FindFormat("safetensors"));
  EXPECT_EQ(FormatForPath("x.bpk"), FindFormat("burnpack"));
  EXPECT_EQ(FormatForPath("x.pth"), FindFormat("pytorch"));
  // ".bin" only when a path names the file, never in a scan.
  EXPECT_EQ(FormatForPath("pytorch_model.bin"), FindFormat("pytorch"));
  EXPECT_EQ(FormatForPath("pytorch_model.bin", /*named=*/false), nullptr);
  EXPECT_EQ(FormatForPath("notes.txt"), nullptr);
  EXPECT_EQ(IndexFormatForPath("a/Model.SafeTensors.Index.Json"), FindFormat("safetensors"));
  EXPECT_EQ(IndexFormatForPath("a/model.safetensors"), nullptr);
}

TEST(FormatTableTest, StripsTheScannedExtensionOrIndexSuffix) {
  EXPECT_EQ(StripFormatExtension("llama/7b.safetensors"), "llama/7b");
  EXPECT_EQ(StripFormatExtension("llama/7b/model.safetensors.index.json"), "llama/7b/model");
  EXPECT_EQ(StripFormatExtension("Mixed.PT"), "Mixed");
  EXPECT_EQ(StripFormatExtension("pytorch_model.bin"), std::nullopt);
  EXPECT_EQ(StripFormatExtension("README.md"), std::nullopt);
}

TEST(FormatTableTest, ListsWritableFormatsForHelpAndErrors) {
  EXPECT_EQ(FormatNames(/*writable_only=*/true), "burnpack, safetensors, burn-record");
  EXPECT_THAT(FormatNames(), ::testing::HasSubstr("pytorch"));
  EXPECT_EQ(FormatExtensions(/*writable_only=*/true), ".bpk, .safetensors, .mpk");
}

TEST(FormatTableTest, AFormatThatReadsSeveralEncodingsWritesOnlyItsOwnEndings) {
  const FormatSpec* record = FindFormat("burn-record");
  ASSERT_NE(record, nullptr);
  EXPECT_TRUE(CanWrite(*record, "model.mpk"));
  EXPECT_TRUE(CanWrite(*record, "MODEL.MPK"));
  EXPECT_FALSE(CanWrite(*record, "model.weights"));  // not even with --format
  EXPECT_FALSE(CanWrite(*record, "model.bin"));      // a bincode record pushed to in place
  EXPECT_FALSE(CanWrite(*record, "model.mpk.gz"));
  EXPECT_FALSE(CanWrite(*record, "model.json.gz"));
  EXPECT_FALSE(CanWrite(*record, "model.json"));
  EXPECT_TRUE(CanWrite(*FindFormat("safetensors"), "x.safetensors"));
  EXPECT_FALSE(CanWrite(*FindFormat("pytorch"), "x.pt"));  // read-only
}

}  // namespace
}  // namespace weightstore

#include "client/updates.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "core/catalog/manifest.h"
#include "tests/util/status_matchers.h"

namespace weightstore::client {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

// A patch of a U8 [8] tensor from `before` to `after`, as received.
ReceivedPatch PatchOf(const std::string& name, const std::string& before, const std::string& after) {
  auto bytes = [](const std::string& s) { return std::as_bytes(std::span(s.data(), s.size())); };
  return {{name, DType::kU8, {before.size()}},
          DigestBytes(bytes(after)).Hex(),
          *DiffElements(bytes(before), bytes(after), 1)};
}

TEST(ApplyReceivedPatchesTest, AppliesEveryPatchAndChecksEachResultsDigest) {
  std::string a = "abcdefgh", b = "ABCDEFGH";
  const std::vector<ReceivedPatch> patches = {PatchOf("a", a, "abcXefgh"), PatchOf("b", b, "ABCDEFGY")};
  std::vector<std::span<std::byte>> destinations = {std::as_writable_bytes(std::span(a.data(), a.size())),
                                                    std::as_writable_bytes(std::span(b.data(), b.size()))};
  ASSERT_OK(ApplyReceivedPatches(patches, destinations));
  EXPECT_EQ(a, "abcXefgh");
  EXPECT_EQ(b, "ABCDEFGY");
  // Held bytes that are not the since version's: written, and the digest says so.
  std::string c = "zbcdefgh";
  std::vector<std::span<std::byte>> other = {std::as_writable_bytes(std::span(c.data(), c.size()))};
  EXPECT_THAT(ApplyReceivedPatches(std::span(patches).first(1), other),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tensor 'a' patched has digest")));
}

TEST(ApplyReceivedPatchesTest, PatchesIntoSharedMemoryAreRefusedBeforeAnythingIsWritten) {
  std::string tied = "abcdefgh";  // one storage held under two names
  const std::vector<ReceivedPatch> patches = {PatchOf("wte", tied, "abcXefgh"), PatchOf("lm_head", tied, "abcYefgh")};
  auto whole = std::as_writable_bytes(std::span(tied.data(), tied.size()));
  std::vector<std::span<std::byte>> destinations = {whole, whole};
  EXPECT_THAT(ApplyReceivedPatches(patches, destinations),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("share memory")));
  EXPECT_EQ(tied, "abcdefgh");
}

}  // namespace
}  // namespace weightstore::client

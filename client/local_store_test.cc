// The `file:` store's fetch into owned memory: large tensors are copied in
// pieces on several threads (client/local_store.cc); the bytes must be the
// same as the file's, cast or not, whatever the piece boundaries.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/store.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "core/select/dtype_cast.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore::client {
namespace {

// F32 values that no cast rounds the same way twice in a row.
std::vector<std::byte> Values(size_t elements, int seed) {
  std::vector<std::byte> bytes(elements * 4);
  for (size_t k = 0; k < elements; ++k) {
    const float v = static_cast<float>(static_cast<int>((k * 2654435761u + seed) % 20011) - 10005) * 1.37e-3f;
    std::memcpy(bytes.data() + 4 * k, &v, 4);
  }
  return bytes;
}

TEST(LocalStoreCopyTest, LargeTensorsComeByteForByteOnSeveralThreadsCastOrNot) {
  // Several copying threads whatever this machine has (read once, at the
  // first fetch of the process).
  ::setenv("WEIGHTSTORE_COPY_THREADS", "3", /*overwrite=*/1);
  const std::string dir = testing::MakeScratchDir("local-store-copy");
  // 9 MiB + 12 bytes (pieces of 4 MiB and a short last one), 24 MiB, and a
  // small one copied whole.
  const std::vector<size_t> elements = {(9u << 18) + 3, 6u << 20, 1000};
  std::vector<SharedTensor> tensors;
  for (size_t i = 0; i < elements.size(); ++i) {
    tensors.push_back({{absl::StrCat("t", i), DType::kF32, {elements[i]}},
                       SharedBytes::FromVector(Values(elements[i], static_cast<int>(i)))});
  }
  testing::WriteFileOrDie(dir + "/m.safetensors", *SerializeCheckpoint(kSafeTensorsFormat, tensors, {}));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Store> store, OpenLocalStore(dir));

  ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> same, store->FetchAll("m", {}));
  ASSERT_EQ(same.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(same[i].spec.name, tensors[i].spec.name);
    EXPECT_TRUE(same[i].bytes.view() == tensors[i].bytes.view()) << tensors[i].spec.name;
  }

  Query cast;
  cast.selection.dtype = DType::kBF16;
  ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> halves, store->FetchAll("m", cast));
  ASSERT_EQ(halves.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::vector<std::byte> want(elements[i] * 2);
    CastElements(DType::kF32, tensors[i].bytes.data(), DType::kBF16, want.data(), elements[i]);
    EXPECT_EQ(halves[i].spec.dtype, DType::kBF16);
    ASSERT_EQ(halves[i].bytes.size(), want.size());
    EXPECT_EQ(std::memcmp(halves[i].bytes.data(), want.data(), want.size()), 0) << tensors[i].spec.name;
  }

  // A cancelled fetch stops, naming where.
  auto cancel = std::make_shared<std::atomic<bool>>(true);
  Query cancelled;
  cancelled.cancel = cancel;
  EXPECT_THAT(store->FetchAll("m", cancelled).status(), testing::StatusIs(absl::StatusCode::kCancelled));
}

}  // namespace
}  // namespace weightstore::client

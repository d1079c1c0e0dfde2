// Compares a checkpoint with what real PyTorch read from the same file
// (expected-by-torch.json and the generated cases share one shape:
// {"tensors": {name: {"dtype", "shape", "sha256"}}}).
#ifndef WEIGHTSTORE_TESTS_UTIL_EXPECTATIONS_H_
#define WEIGHTSTORE_TESTS_UTIL_EXPECTATIONS_H_

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "core/checkpoint.h"
#include "tests/util/test_env.h"

namespace weightstore::testing {

// Adds a test failure for every name, dtype, shape or byte difference.
inline void ExpectMatchesTorch(const Checkpoint& checkpoint, const nlohmann::json& expected, const std::string& what) {
  const nlohmann::json& tensors = expected.at("tensors");
  std::set<std::string> want, got;
  for (const auto& [name, _] : tensors.items()) want.insert(name);
  for (const CheckpointEntry& e : checkpoint.entries()) got.insert(e.spec.name);
  EXPECT_EQ(got, want) << what << ": tensor names differ from torch's";
  for (const auto& [name, t] : tensors.items()) {
    const CheckpointEntry* entry = checkpoint.Find(name);
    if (entry == nullptr) continue;
    EXPECT_EQ(std::string(DTypeName(entry->spec.dtype)), t.at("dtype").get<std::string>()) << what << " " << name;
    EXPECT_EQ(entry->spec.shape, t.at("shape").get<std::vector<uint64_t>>()) << what << " " << name;
    absl::StatusOr<SharedTensor> tensor = checkpoint.Read(*entry);
    ASSERT_TRUE(tensor.ok()) << what << " " << name << ": " << tensor.status();
    EXPECT_EQ(Sha256Hex(tensor->bytes.view()), t.at("sha256").get<std::string>()) << what << " " << name << " bytes";
  }
}

}  // namespace weightstore::testing

#endif  // WEIGHTSTORE_TESTS_UTIL_EXPECTATIONS_H_

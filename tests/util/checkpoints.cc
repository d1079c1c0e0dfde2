#include "tests/util/checkpoints.h"

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"

namespace weightstore::testing {

std::shared_ptr<const Checkpoint> NamesOnlyCheckpoint(const std::vector<std::string>& names, const FormatSpec& format) {
  auto storage = LazyStorage::Ready(SharedBytes::Copy(std::string(4, '\0')));
  std::vector<CheckpointEntry> entries;
  for (const std::string& n : names) {
    CheckpointEntry e;
    e.spec = {n, DType::kF32, {1}};
    e.layout.storage = storage;
    entries.push_back(e);
  }
  auto checkpoint = Checkpoint::Create(format, "mem", {}, std::move(entries));
  if (!checkpoint.ok()) std::abort();
  return *checkpoint;
}

std::string SafeTensorsFile(int count, size_t floats, float seed) {
  std::vector<SharedTensor> tensors;
  for (int i = 0; i < count; ++i) {
    std::vector<std::byte> data(floats * 4);
    for (size_t k = 0; k < floats; ++k) {
      const float v = seed + static_cast<float>(i) * 0.5f + static_cast<float>(k % 977);
      std::memcpy(data.data() + 4 * k, &v, 4);
    }
    tensors.push_back({{absl::StrCat("t.", i), DType::kF32, {floats}}, SharedBytes::FromVector(std::move(data))});
  }
  absl::StatusOr<std::string> file = SerializeCheckpoint(kSafeTensorsFormat, tensors, {});
  if (!file.ok()) std::abort();
  return *std::move(file);
}

std::string OneTensorFile(const std::vector<float>& values) {
  std::string bytes(values.size() * 4, '\0');
  std::memcpy(bytes.data(), values.data(), bytes.size());
  SharedTensor t{{"w", DType::kF32, {values.size()}}, SharedBytes::Copy(bytes)};
  absl::StatusOr<std::string> file = SerializeCheckpoint(kSafeTensorsFormat, {t}, {});
  if (!file.ok()) std::abort();
  return *std::move(file);
}

std::map<std::string, std::string> TensorsOf(const std::string& bytes) {
  auto checkpoint = ParseSafeTensors(SharedBytes::Copy(bytes), "expected", {});
  std::map<std::string, std::string> out;
  if (!checkpoint.ok()) return out;
  for (const CheckpointEntry& e : (*checkpoint)->entries()) {
    out[e.spec.name] = std::string((*checkpoint)->Read(e)->bytes.view());
  }
  return out;
}

}  // namespace weightstore::testing

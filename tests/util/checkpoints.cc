#include "tests/util/checkpoints.h"

#include <cstdlib>

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

}  // namespace weightstore::testing

// Shared by the fuzz targets: reading every tensor of an accepted checkpoint
// exercises the bounds the parser promised.
#ifndef WEIGHTSTORE_TESTS_FUZZ_FUZZ_UTIL_H_
#define WEIGHTSTORE_TESTS_FUZZ_FUZZ_UTIL_H_

#include <cstdlib>

#include "core/checkpoint.h"

namespace weightstore {

inline void ReadEverything(const absl::StatusOr<std::shared_ptr<const Checkpoint>>& checkpoint) {
  if (!checkpoint.ok()) return;
  volatile uint8_t sink = 0;
  for (const CheckpointEntry& entry : (*checkpoint)->entries()) {
    absl::StatusOr<SharedTensor> tensor = (*checkpoint)->Read(entry);
    if (!tensor.ok()) continue;
    if (tensor->bytes.size() != entry.spec.byte_size()) std::abort();
    for (size_t i = 0; i < tensor->bytes.size(); i += 4096) sink = sink + static_cast<uint8_t>(tensor->bytes.data()[i]);
  }
}

}  // namespace weightstore

#endif  // WEIGHTSTORE_TESTS_FUZZ_FUZZ_UTIL_H_

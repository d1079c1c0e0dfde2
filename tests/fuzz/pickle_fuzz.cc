// Fuzzes the data-only pickle machine on its own.
#include <cstddef>
#include <cstdint>

#include "core/formats/pickle.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  weightstore::PickleLimits limits;
  limits.max_values = 100000;
  (void)weightstore::Unpickle(absl::string_view(reinterpret_cast<const char*>(data), size), "fuzz", limits);
  return 0;
}

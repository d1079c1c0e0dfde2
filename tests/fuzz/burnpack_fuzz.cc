// Fuzzes the whole burnpack reader: header or container, then every tensor read.
#include <cstddef>
#include <cstdint>

#include "core/formats/burnpack.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weightstore;
  OpenOptions options;
  options.max_tensors = 10000;
  ReadEverything(
      ParseBurnpack(SharedBytes::Copy(absl::string_view(reinterpret_cast<const char*>(data), size)), "fuzz", options));
  return 0;
}

// Fuzzes the strict zip directory reader, then reads every entry.
#include <cstddef>
#include <cstdint>

#include "core/formats/zip_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace weightstore;
  ZipLimits limits;
  limits.max_inflated_size = 1 << 24;
  auto zip =
      ZipArchive::Open(SharedBytes::Copy(absl::string_view(reinterpret_cast<const char*>(data), size)), "fuzz", limits);
  if (!zip.ok()) return 0;
  for (const ZipEntry& entry : zip->entries()) (void)zip->Read(entry, true);
  return 0;
}

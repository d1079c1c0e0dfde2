// Builds small ZIP archives (stored entries) for tests, with knobs that break
// them in the ways hostile archives do.
#ifndef WEIGHTSTORE_TESTS_UTIL_ZIP_BUILDER_H_
#define WEIGHTSTORE_TESTS_UTIL_ZIP_BUILDER_H_

#include <string>
#include <vector>

namespace weightstore::testing {

struct ZipBuildEntry {
  std::string name;
  std::string data;
  // Store `data` deflated (method 8, with its true CRC and sizes), whatever
  // the options say.
  bool deflate = false;
};

struct ZipBuildOptions {
  // Write ZIP64 records (as torch.save does).
  bool zip64 = false;
  // If >= 1, the central directory points entry N at entry N-1's local header,
  // so the two overlap.
  int overlap_entry = -1;
  // If >= 0, that entry's CRC-32 in both headers is corrupted.
  int bad_crc_entry = -1;
  // Compression method written in both headers (0 stored).
  int method = 0;
  // If nonzero, every entry declares this uncompressed size (with zip64, in
  // the ZIP64 extra fields): a zip bomb's claim.
  uint64_t declared_size = 0;
};

// Raw deflate (no zlib header), as zip stores an entry.
std::string Deflate(const std::string& plain);

std::string BuildZip(const std::vector<ZipBuildEntry>& entries, const ZipBuildOptions& options = {});

}  // namespace weightstore::testing

#endif  // WEIGHTSTORE_TESTS_UTIL_ZIP_BUILDER_H_

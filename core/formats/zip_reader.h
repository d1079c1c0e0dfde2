// ZipArchive: a strict, read-only reader of ZIP archives held in memory (a
// mapping), written for the containers torch.save produces.
//
// Every offset is treated as hostile: the central directory must sit inside the
// file and end at the end-of-central-directory record, entries may not overlap
// each other or the directory, names may not be duplicated or escape the archive
// ("../", absolute, backslashes, NUL), encrypted entries and methods other than
// stored (0) and deflate (8) are refused. ZIP64 is supported. Stored entries are
// returned zero-copy; deflated ones are inflated into owned memory, bounded by
// their declared size, and CRC-checked. Thread-safe: immutable after Open().
#ifndef WEIGHTSTORE_CORE_FORMATS_ZIP_READER_H_
#define WEIGHTSTORE_CORE_FORMATS_ZIP_READER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/shared_bytes.h"

namespace weightstore {

struct ZipEntry {
  std::string name;
  uint16_t method = 0;  // 0 stored, 8 deflate
  uint32_t crc32 = 0;
  uint64_t compressed_size = 0;
  uint64_t uncompressed_size = 0;
  uint64_t data_offset = 0;  // of the (compressed) data within the archive
};

struct ZipLimits {
  // Default: 1,000,000 entries.
  uint64_t max_entries = 1000000;
  // Largest entry inflated into memory. Default: 64 GiB.
  uint64_t max_inflated_size = uint64_t{64} << 30;
};

class ZipArchive {
 public:
  // Parses the directory of `archive`. `path` is used in error messages only.
  // Returns InvalidArgument, naming the file and the fault, for a malformed archive.
  static absl::StatusOr<ZipArchive> Open(SharedBytes archive, absl::string_view path, const ZipLimits& limits = {});

  const std::vector<ZipEntry>& entries() const { return entries_; }
  // Returns the entry named exactly `name`, or nullptr.
  const ZipEntry* Find(absl::string_view name) const;

  // Returns the entry's uncompressed bytes: a view into the archive for stored
  // entries, an owned buffer for deflated ones. The CRC-32 is verified for
  // deflated entries always, and for stored ones when `verify_crc` is true.
  // Returns DataLoss on a CRC mismatch or corrupt deflate stream.
  absl::StatusOr<SharedBytes> Read(const ZipEntry& entry, bool verify_crc) const;

 private:
  SharedBytes archive_;
  std::string path_;
  ZipLimits limits_;
  std::vector<ZipEntry> entries_;
  absl::flat_hash_map<std::string, size_t> by_name_;
};

// Returns the CRC-32 (ISO-HDLC, as ZIP uses) of `data`.
uint32_t Crc32(absl::string_view data);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_FORMATS_ZIP_READER_H_

// The origin API a node tier pulls through (ListCheckpointFiles,
// ReadCheckpointFile): a checkpoint's files exactly as stored, with CRC32C.
#ifndef WEIGHTSTORE_SERVER_STORED_FILES_H_
#define WEIGHTSTORE_SERVER_STORED_FILES_H_

#include <functional>

#include "absl/status/status.h"
#include "core/catalog/registry.h"
#include "weightstore/v1/weight_store.pb.h"

namespace weightstore::server {

// Fills `out` with the stored files of `version` and the CRC32C of each,
// computed once per version (kept in its checksum cache while its files are
// unchanged). Cancelled once `cancelled` (asked every 8 MiB read; may be
// empty) says so.
absl::Status DescribeStoredFiles(const CheckpointVersion& version, v1::ListCheckpointFilesResponse* out,
                                 const std::function<bool()>& cancelled = {});
// True when DescribeStoredFiles of `version` would read nothing: every file's
// CRC32C is kept.
bool StoredCrcsKnown(const CheckpointVersion& version);

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_STORED_FILES_H_

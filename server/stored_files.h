// The origin API a node tier pulls through (ListCheckpointFiles,
// ReadCheckpointFile): a checkpoint's files exactly as stored, with CRC32C.
#ifndef WEIGHTSTORE_SERVER_STORED_FILES_H_
#define WEIGHTSTORE_SERVER_STORED_FILES_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>

#include <functional>

#include "absl/status/status.h"
#include "core/catalog/registry.h"
#include "server/serving.h"
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

// Streams one ReadCheckpointFile response (`request`, raw) as a fetch stream:
// admitted, watched for stalling and its bytes sent as slices of the mapping.
grpc::ServerWriteReactor<grpc::ByteBuffer>* ReadStoredFile(const Serving& serving, grpc::CallbackServerContext* ctx,
                                                           const grpc::ByteBuffer* request);

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_STORED_FILES_H_

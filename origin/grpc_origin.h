// GrpcOrigin: an upstream weightstored as a node's origin (a rack or regional
// tier). It copies a checkpoint's files exactly as stored, through
// ListCheckpointFiles and ReadCheckpointFile, every chunk checked against its
// CRC32C and every read pinned to the version listed.
#ifndef WEIGHTSTORE_ORIGIN_GRPC_ORIGIN_H_
#define WEIGHTSTORE_ORIGIN_GRPC_ORIGIN_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "client/store.h"
#include "origin/origin.h"

namespace weightstore::origin {

// `url`: "grpc://host:port" (plaintext) or "grpcs://host:port" (TLS; the CA
// from options.tls_ca_file, else the system's roots are not used: it is
// required). options.token (read scope) is sent on every call;
// options.deadline bounds each call. InvalidArgument naming the url otherwise.
absl::StatusOr<std::unique_ptr<Origin>> OpenGrpcOrigin(const std::string& url, client::RemoteOptions options,
                                                       int parallel_reads = 4);

// The upstream daemon at `url` as a remote store, for following it
// (origin/follower.h): the url and options OpenGrpcOrigin takes.
absl::StatusOr<std::unique_ptr<client::Store>> OpenGrpcUpstream(const std::string& url, client::RemoteOptions options);

}  // namespace weightstore::origin

#endif  // WEIGHTSTORE_ORIGIN_GRPC_ORIGIN_H_

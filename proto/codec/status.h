// The one conversion between absl::Status and grpc::Status (STYLE.md §12),
// used by the server and the C++ client alike.
#ifndef WEIGHTSTORE_PROTO_CODEC_STATUS_H_
#define WEIGHTSTORE_PROTO_CODEC_STATUS_H_

#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace weightstore {

// Messages longer than this are cut (they may quote a request, and a client
// drops a status whose trailers pass its metadata limit, 8 KiB by default).
inline constexpr size_t kMaxStatusMessageBytes = 2048;

// Returns `message`, cut to kMaxStatusMessageBytes and marked where it was cut.
std::string BoundedMessage(absl::string_view message);

// The status with a BoundedMessage; the code is the same number.
grpc::Status ToGrpcStatus(const absl::Status& status);
// The status as received; the code is the same number.
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace weightstore

#endif  // WEIGHTSTORE_PROTO_CODEC_STATUS_H_

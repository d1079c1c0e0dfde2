// The one conversion from absl::Status to grpc::Status (STYLE.md §12).
#ifndef WEIGHTSTORE_SERVER_GRPC_STATUS_H_
#define WEIGHTSTORE_SERVER_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace weightstore {

// Messages longer than this are cut (they may quote a request, and a client
// drops a status whose trailers pass its metadata limit, 8 KiB by default).
inline constexpr size_t kMaxStatusMessageBytes = 2048;

// Returns `message`, cut to kMaxStatusMessageBytes and marked where it was cut.
std::string BoundedMessage(absl::string_view message);

// The status with a BoundedMessage.
grpc::Status ToGrpcStatus(const absl::Status& status);

// The status with every "<folder>/" of `folders` taken out of its message:
// core names files by their full path, and clients are told paths relative to
// the models folder or load root only.
absl::Status WithoutPaths(const absl::Status& status, const std::vector<std::string>& folders);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace weightstore

#endif  // WEIGHTSTORE_SERVER_GRPC_STATUS_H_

// What a client is told of a status: the conversion itself is
// proto/codec/status.h, shared with the client.
#ifndef WEIGHTSTORE_SERVER_GRPC_STATUS_H_
#define WEIGHTSTORE_SERVER_GRPC_STATUS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "proto/codec/status.h"

namespace weightstore {

// The status with every "<folder>/" of `folders` taken out of its message:
// core names files by their full path, and clients are told paths relative to
// the models folder or load root only.
absl::Status WithoutPaths(const absl::Status& status, const std::vector<std::string>& folders);

}  // namespace weightstore

#endif  // WEIGHTSTORE_SERVER_GRPC_STATUS_H_

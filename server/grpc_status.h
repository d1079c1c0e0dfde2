// The one conversion from absl::Status to grpc::Status (STYLE.md §12).
#ifndef WEIGHTSTORE_SERVER_GRPC_STATUS_H_
#define WEIGHTSTORE_SERVER_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace weightstore {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace weightstore

#endif  // WEIGHTSTORE_SERVER_GRPC_STATUS_H_

#include "proto/codec/status.h"

#include "absl/strings/str_cat.h"

namespace weightstore {

// The conversion is a cast: both enums use gRPC's numbering.
#define WEIGHTSTORE_SAME_CODE(grpc_code, absl_code) \
  static_assert(static_cast<int>(grpc::StatusCode::grpc_code) == static_cast<int>(absl::StatusCode::absl_code))
WEIGHTSTORE_SAME_CODE(CANCELLED, kCancelled);
WEIGHTSTORE_SAME_CODE(UNKNOWN, kUnknown);
WEIGHTSTORE_SAME_CODE(INVALID_ARGUMENT, kInvalidArgument);
WEIGHTSTORE_SAME_CODE(DEADLINE_EXCEEDED, kDeadlineExceeded);
WEIGHTSTORE_SAME_CODE(NOT_FOUND, kNotFound);
WEIGHTSTORE_SAME_CODE(ALREADY_EXISTS, kAlreadyExists);
WEIGHTSTORE_SAME_CODE(PERMISSION_DENIED, kPermissionDenied);
WEIGHTSTORE_SAME_CODE(RESOURCE_EXHAUSTED, kResourceExhausted);
WEIGHTSTORE_SAME_CODE(FAILED_PRECONDITION, kFailedPrecondition);
WEIGHTSTORE_SAME_CODE(ABORTED, kAborted);
WEIGHTSTORE_SAME_CODE(OUT_OF_RANGE, kOutOfRange);
WEIGHTSTORE_SAME_CODE(UNIMPLEMENTED, kUnimplemented);
WEIGHTSTORE_SAME_CODE(INTERNAL, kInternal);
WEIGHTSTORE_SAME_CODE(UNAVAILABLE, kUnavailable);
WEIGHTSTORE_SAME_CODE(DATA_LOSS, kDataLoss);
WEIGHTSTORE_SAME_CODE(UNAUTHENTICATED, kUnauthenticated);
#undef WEIGHTSTORE_SAME_CODE

std::string BoundedMessage(absl::string_view message) {
  if (message.size() <= kMaxStatusMessageBytes) return std::string(message);
  return absl::StrCat(message.substr(0, kMaxStatusMessageBytes), "... (", message.size(), " bytes in all)");
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), BoundedMessage(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace weightstore

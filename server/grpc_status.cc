#include "server/grpc_status.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace weightstore {

// The conversion is a cast: both enums use gRPC's numbering.
static_assert(static_cast<int>(grpc::StatusCode::CANCELLED) == static_cast<int>(absl::StatusCode::kCancelled));
static_assert(static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT) == static_cast<int>(absl::StatusCode::kInvalidArgument));
static_assert(static_cast<int>(grpc::StatusCode::DEADLINE_EXCEEDED) == static_cast<int>(absl::StatusCode::kDeadlineExceeded));
static_assert(static_cast<int>(grpc::StatusCode::NOT_FOUND) == static_cast<int>(absl::StatusCode::kNotFound));
static_assert(static_cast<int>(grpc::StatusCode::ALREADY_EXISTS) == static_cast<int>(absl::StatusCode::kAlreadyExists));
static_assert(static_cast<int>(grpc::StatusCode::PERMISSION_DENIED) == static_cast<int>(absl::StatusCode::kPermissionDenied));
static_assert(static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED) == static_cast<int>(absl::StatusCode::kResourceExhausted));
static_assert(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION) == static_cast<int>(absl::StatusCode::kFailedPrecondition));
static_assert(static_cast<int>(grpc::StatusCode::ABORTED) == static_cast<int>(absl::StatusCode::kAborted));
static_assert(static_cast<int>(grpc::StatusCode::OUT_OF_RANGE) == static_cast<int>(absl::StatusCode::kOutOfRange));
static_assert(static_cast<int>(grpc::StatusCode::UNIMPLEMENTED) == static_cast<int>(absl::StatusCode::kUnimplemented));
static_assert(static_cast<int>(grpc::StatusCode::INTERNAL) == static_cast<int>(absl::StatusCode::kInternal));
static_assert(static_cast<int>(grpc::StatusCode::UNAVAILABLE) == static_cast<int>(absl::StatusCode::kUnavailable));
static_assert(static_cast<int>(grpc::StatusCode::DATA_LOSS) == static_cast<int>(absl::StatusCode::kDataLoss));
static_assert(static_cast<int>(grpc::StatusCode::UNAUTHENTICATED) == static_cast<int>(absl::StatusCode::kUnauthenticated));

std::string BoundedMessage(absl::string_view message) {
  if (message.size() <= kMaxStatusMessageBytes) return std::string(message);
  return absl::StrCat(message.substr(0, kMaxStatusMessageBytes), "... (", message.size(), " bytes in all)");
}

absl::Status WithoutPaths(const absl::Status& status, const std::vector<std::string>& folders) {
  if (status.ok() || folders.empty()) return status;
  std::string message(status.message());
  for (const std::string& folder : folders) {
    if (folder.size() <= 1) continue;  // "" or "/": nothing to take out
    message = absl::StrReplaceAll(message, {{folder.back() == '/' ? folder : folder + "/", ""}});
  }
  return absl::Status(status.code(), message);
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

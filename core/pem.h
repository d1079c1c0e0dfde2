// Reads PEM files (TLS certificates and keys) for the server and clients.
#ifndef WEIGHTSTORE_CORE_PEM_H_
#define WEIGHTSTORE_CORE_PEM_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightstore {

// Returns the contents of the PEM file at `path`. NotFound if it cannot be read,
// InvalidArgument if it holds no "-----BEGIN" block; both name `what` and the path.
absl::StatusOr<std::string> ReadPemFile(const std::string& path, absl::string_view what);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_PEM_H_

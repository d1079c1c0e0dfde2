// Bearer tokens with read and admin scopes, checked per call by the handlers.
//
// Tokens file: one token per line, "<scope> <token>", scope "read" (list,
// inspect, fetch) or "admin" (also load, unload, put, rescan); blank lines and
// lines starting with '#' are skipped. Clients send "authorization: Bearer
// <token>". Tokens are compared in constant time and never logged; errors name
// line numbers, not tokens.
//
// Checked in the handlers rather than by an AuthMetadataProcessor, which gRPC
// 1.51 only allows on TLS credentials (it aborts on insecure ones), so tokens
// work with and without TLS. Thread-safe: immutable once loaded.
#ifndef WEIGHTSTORE_SERVER_AUTH_H_
#define WEIGHTSTORE_SERVER_AUTH_H_

#include <grpcpp/server_context.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace weightstore::server {

enum class Scope { kRead, kAdmin };

class Authenticator {
 public:
  // No tokens: every call is allowed (keep the port private).
  Authenticator() = default;
  // InvalidArgument naming the file and line for a malformed line or an unknown
  // scope; NotFound if the file is missing.
  static absl::StatusOr<Authenticator> FromFile(const std::string& path);

  bool enabled() const { return !tokens_.empty(); }
  // OK, Unauthenticated (no or unknown token) or PermissionDenied (read token on
  // an admin call).
  absl::Status Check(const grpc::ServerContextBase& context, Scope needed) const;

 private:
  struct Token {
    std::string value;
    Scope scope;
  };
  std::vector<Token> tokens_;
};

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_AUTH_H_

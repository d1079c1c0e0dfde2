// TLS for both ends of the gRPC API, from PEM files: the daemon's server
// credentials and the clients' channel credentials (plaintext when no file is
// given). Every error names the file and what it was for.
#ifndef WEIGHTSTORE_PROTO_CODEC_TLS_H_
#define WEIGHTSTORE_PROTO_CODEC_TLS_H_

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightstore::wire {

// The contents of the PEM file at `path`. NotFound if it cannot be read,
// InvalidArgument if it holds no "-----BEGIN" block; both name `what` and the
// path.
absl::StatusOr<std::string> ReadPemFile(const std::string& path, absl::string_view what);

// Plaintext with no files; TLS with a certificate and its key; mutual TLS
// (client certificates required and verified) with `client_ca_file` too.
// InvalidArgument for a key or client CA without a certificate, or a
// certificate without its key.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromPem(const std::string& cert_file,
                                                                                  const std::string& key_file,
                                                                                  const std::string& client_ca_file);

// Plaintext without `ca_file`; else TLS verifying the server by it, and with
// `cert_file` and `key_file` a client certificate too. InvalidArgument for a
// client certificate without a CA.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFromPem(const std::string& ca_file,
                                                                                    const std::string& cert_file = "",
                                                                                    const std::string& key_file = "");

}  // namespace weightstore::wire

#endif  // WEIGHTSTORE_PROTO_CODEC_TLS_H_

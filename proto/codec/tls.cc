#include "proto/codec/tls.h"

#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace weightstore::wire {

absl::StatusOr<std::string> ReadPemFile(const std::string& path, absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read the ", what, " '", path, "'"));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("the ", what, " '", path, "' is not a PEM file"));
  }
  return text;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromPem(const std::string& cert_file,
                                                                                  const std::string& key_file,
                                                                                  const std::string& client_ca_file) {
  if (cert_file.empty()) {
    if (!key_file.empty() || !client_ca_file.empty()) {
      return absl::InvalidArgumentError("tls: a key or client CA was given without a certificate (tls-cert)");
    }
    return grpc::InsecureServerCredentials();
  }
  if (key_file.empty()) return absl::InvalidArgumentError("tls: a certificate was given without its key (tls-key)");
  grpc::SslServerCredentialsOptions options;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  WEIGHTSTORE_ASSIGN_OR_RETURN(pair.cert_chain, ReadPemFile(cert_file, "TLS certificate"));
  WEIGHTSTORE_ASSIGN_OR_RETURN(pair.private_key, ReadPemFile(key_file, "TLS key"));
  options.pem_key_cert_pairs.push_back(std::move(pair));
  if (!client_ca_file.empty()) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(options.pem_root_certs, ReadPemFile(client_ca_file, "client CA"));
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFromPem(const std::string& ca_file,
                                                                                    const std::string& cert_file,
                                                                                    const std::string& key_file) {
  if (ca_file.empty()) {
    if (!cert_file.empty()) return absl::InvalidArgumentError("a client certificate needs --tls-ca too");
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions ssl;
  WEIGHTSTORE_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPemFile(ca_file, "CA certificate"));
  if (!cert_file.empty()) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadPemFile(cert_file, "client certificate"));
    WEIGHTSTORE_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadPemFile(key_file, "client key"));
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace weightstore::wire

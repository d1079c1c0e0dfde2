#include "origin/origin.h"

#include <openssl/evp.h>

#include "absl/strings/escaping.h"
#include "core/status_macros.h"

namespace weightstore::origin {

absl::StatusOr<std::string> Origin::Version(const std::string& name) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(OriginCheckpoint checkpoint, Find(name));
  return checkpoint.version;
}

std::string Sha256Hex(absl::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_Digest(data.data(), data.size(), digest, &size, EVP_sha256(), nullptr);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), size));
}

}  // namespace weightstore::origin

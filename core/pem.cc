#include "core/pem.h"

#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"

namespace weightstore {

absl::StatusOr<std::string> ReadPemFile(const std::string& path, absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read the ", what, " '", path, "'"));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("the ", what, " '", path, "' is not a PEM file"));
  }
  return text;
}

}  // namespace weightstore

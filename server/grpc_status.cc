#include "server/grpc_status.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace weightstore {

absl::Status WithoutPaths(const absl::Status& status, const std::vector<std::string>& folders) {
  if (status.ok() || folders.empty()) return status;
  std::string message(status.message());
  for (const std::string& folder : folders) {
    if (folder.size() <= 1) continue;  // "" or "/": nothing to take out
    message = absl::StrReplaceAll(message, {{folder.back() == '/' ? folder : folder + "/", ""}});
  }
  return absl::Status(status.code(), message);
}

}  // namespace weightstore

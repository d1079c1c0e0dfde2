#include "tests/util/s3rver.h"

#include <unistd.h>

#include <cstdlib>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "tests/util/s3_http.h"
#include "tests/util/test_env.h"

namespace weightstore::testing {

std::string S3rverPath() {
  const char* env = std::getenv("WEIGHTSTORE_S3RVER");
  return env != nullptr ? env : WEIGHTSTORE_S3RVER;
}

std::string S3rver::endpoint() const { return absl::StrCat("http://127.0.0.1:", port_); }

absl::Status S3rver::Start() {
  const std::string binary = S3rverPath();
  if (::access(binary.c_str(), X_OK) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("s3rver not found at ", binary,
                                                      ": run scripts/install-deps.sh (it installs s3rver@3.7.1 into "
                                                      "build-tools/), or set WEIGHTSTORE_S3RVER"));
  }
  dir_ = MakeScratchDir("s3rver");
  absl::StatusOr<ListeningChild> child =
      StartListeningChild({binary, "--directory", dir_ + "/data", "--address", "127.0.0.1", "--port", "0", "--silent",
                           "--configure-bucket", kS3rverBucket},
                          dir_ + "/stdout", "S3rver listening on 127.0.0.1:");
  if (!child.ok()) return child.status();
  pid_ = child->pid;
  port_ = child->port;
  return absl::OkStatus();
}

void S3rver::Stop() {
  StopChild(pid_);
  pid_ = -1;
}

absl::Status S3rver::Put(const std::string& key, absl::string_view data) const {
  absl::StatusOr<S3HttpReply> reply =
      SignedRequest("PUT", absl::StrCat(endpoint(), "/", kS3rverBucket, "/", key), data, kS3rverKey, kS3rverKey);
  if (!reply.ok()) return reply.status();
  if (reply->http != 200) return absl::UnknownError(absl::StrCat("PUT ", key, ": HTTP ", reply->http));
  return absl::OkStatus();
}

}  // namespace weightstore::testing

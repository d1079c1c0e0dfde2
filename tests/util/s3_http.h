// What the S3 servers of tests (util/s3rver.h, util/moto_s3.h) share: a
// signed request as a trainer's upload sends one, and starting a server as a
// child process that says its port on its output.
#ifndef WEIGHTSTORE_TESTS_UTIL_S3_HTTP_H_
#define WEIGHTSTORE_TESTS_UTIL_S3_HTTP_H_

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightstore::testing {

struct S3HttpReply {
  long http = 0;
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;
};

// One SigV4-signed request (region us-east-1, an unsigned payload) of
// `method` to `url`, with `body` sent when not empty (a PUT or POST) and
// `service` the signing scope ("s3", "iam"). Unavailable when nothing
// answers; any HTTP status is returned as the reply.
absl::StatusOr<S3HttpReply> SignedRequest(const std::string& method, const std::string& url, absl::string_view body,
                                          const std::string& access_key, const std::string& secret,
                                          const std::string& service = "s3",
                                          const std::vector<std::string>& headers = {});

// A child process running `argv` (its output into `log`), killed with the test
// binary. Waits up to 15 s for a line of its output that begins with `banner`
// followed by a port number.
struct ListeningChild {
  pid_t pid = -1;
  int port = 0;
};
absl::StatusOr<ListeningChild> StartListeningChild(std::vector<std::string> argv, const std::string& log,
                                                   absl::string_view banner);
// SIGTERM, then waits for it.
void StopChild(pid_t pid);

}  // namespace weightstore::testing

#endif  // WEIGHTSTORE_TESTS_UTIL_S3_HTTP_H_

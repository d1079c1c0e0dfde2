// s3rver (npm's S3-protocol server, 3.7.1, which scripts/install-deps.sh puts
// in build-tools/) as a child process on 127.0.0.1, on a port the kernel
// picks, with one bucket; and a signed PUT of an object, as a trainer
// uploads one. What s3rver checks and does not: origin/s3_origin_test.cc.
#ifndef WEIGHTSTORE_TESTS_UTIL_S3RVER_H_
#define WEIGHTSTORE_TESTS_UTIL_S3RVER_H_

#include <sys/types.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace weightstore::testing {

// The bucket it serves, and its one account (access key id and secret).
inline constexpr char kS3rverBucket[] = "models";
inline constexpr char kS3rverKey[] = "S3RVER";

// $WEIGHTSTORE_S3RVER, else build-tools/node_modules/.bin/s3rver.
std::string S3rverPath();

class S3rver {
 public:
  S3rver() = default;
  ~S3rver() { Stop(); }
  S3rver(const S3rver&) = delete;
  S3rver& operator=(const S3rver&) = delete;

  // Starts it, and waits (15 s at most) for it to say its port.
  // FailedPrecondition when it is not installed.
  absl::Status Start();
  void Stop();

  int port() const { return port_; }
  std::string endpoint() const;  // "http://127.0.0.1:PORT"

  // A signed PUT of object `key` of the bucket.
  absl::Status Put(const std::string& key, absl::string_view data) const;

 private:
  pid_t pid_ = -1;
  int port_ = 0;
  std::string dir_;
};

}  // namespace weightstore::testing

#endif  // WEIGHTSTORE_TESTS_UTIL_S3RVER_H_

// moto's S3 server (PyPI's moto, in the test venv that scripts/python-env.sh
// makes) as a child process on 127.0.0.1, on a port the kernel picks: for what
// s3rver lacks, buckets that keep every version of an object. It checks no
// signature.
#ifndef WEIGHTSTORE_TESTS_UTIL_MOTO_S3_H_
#define WEIGHTSTORE_TESTS_UTIL_MOTO_S3_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightstore::testing {

class MotoS3 {
 public:
  MotoS3() = default;
  ~MotoS3() { Stop(); }
  MotoS3(const MotoS3&) = delete;
  MotoS3& operator=(const MotoS3&) = delete;

  // Starts it on the test environment's Python (TorchPython()), and waits (15 s
  // at most) for it to say its port. FailedPrecondition when moto is not
  // installed there.
  absl::Status Start();
  void Stop();

  std::string endpoint() const;  // "http://127.0.0.1:PORT"

  // Creates `bucket`, keeping object versions when `versioned`.
  absl::Status CreateBucket(const std::string& bucket, bool versioned);
  // Uploads object `key`, with `headers` ("x-amz-server-side-encryption:
  // aws:kms"); returns its version id ("" when the bucket keeps none).
  absl::StatusOr<std::string> Put(const std::string& bucket, const std::string& key, absl::string_view data,
                                  const std::vector<std::string>& headers = {}) const;
  // Deletes one version of `key` for good, as a lifecycle rule expiring it
  // does.
  absl::Status DeleteVersion(const std::string& bucket, const std::string& key, const std::string& version) const;

 private:
  pid_t pid_ = -1;
  int port_ = 0;
};

}  // namespace weightstore::testing

#endif  // WEIGHTSTORE_TESTS_UTIL_MOTO_S3_H_

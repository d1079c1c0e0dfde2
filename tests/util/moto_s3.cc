#include "tests/util/moto_s3.h"

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "tests/util/s3_http.h"
#include "tests/util/test_env.h"

namespace weightstore::testing {
namespace {

constexpr char kKey[] = "moto";  // any key: moto checks no signature

absl::Status Expect(const absl::StatusOr<S3HttpReply>& reply, long http, const std::string& what) {
  if (!reply.ok()) return reply.status();
  if (reply->http != http) return absl::UnknownError(absl::StrCat(what, ": HTTP ", reply->http, ": ", reply->body));
  return absl::OkStatus();
}

}  // namespace

std::string MotoS3::endpoint() const { return absl::StrCat("http://127.0.0.1:", port_); }

absl::Status MotoS3::Start() {
  const std::string python = TorchPython();
  std::string output;
  if (RunCommand(absl::StrCat(ShellQuote(python), " -c 'import moto.server, flask'"), &output) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("moto's server is not installed for ", python,
                                                      ": run scripts/python-env.sh (tests/python/requirements.txt)"));
  }
  const std::string dir = MakeScratchDir("moto");
  absl::StatusOr<ListeningChild> child = StartListeningChild(
      {python, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"}, dir + "/stdout", "Running on http://127.0.0.1:");
  if (!child.ok()) return child.status();
  pid_ = child->pid;
  port_ = child->port;
  return absl::OkStatus();
}

void MotoS3::Stop() {
  StopChild(pid_);
  pid_ = -1;
}

absl::Status MotoS3::CreateBucket(const std::string& bucket, bool versioned) {
  const std::string url = absl::StrCat(endpoint(), "/", bucket);
  WEIGHTSTORE_RETURN_IF_ERROR(Expect(SignedRequest("PUT", url, "", kKey, kKey), 200, "create " + bucket));
  if (!versioned) return absl::OkStatus();
  return Expect(SignedRequest("PUT", url + "?versioning",
                              "<VersioningConfiguration xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"
                              "<Status>Enabled</Status></VersioningConfiguration>",
                              kKey, kKey),
                200, "versioning of " + bucket);
}

absl::StatusOr<std::string> MotoS3::Put(const std::string& bucket, const std::string& key, absl::string_view data,
                                        const std::vector<std::string>& headers) const {
  absl::StatusOr<S3HttpReply> reply =
      SignedRequest("PUT", absl::StrCat(endpoint(), "/", bucket, "/", key), data, kKey, kKey, "s3", headers);
  WEIGHTSTORE_RETURN_IF_ERROR(Expect(reply, 200, "PUT " + key));
  auto it = reply->headers.find("x-amz-version-id");
  return it == reply->headers.end() ? "" : it->second;
}

absl::Status MotoS3::DeleteVersion(const std::string& bucket, const std::string& key,
                                   const std::string& version) const {
  return Expect(
      SignedRequest("DELETE", absl::StrCat(endpoint(), "/", bucket, "/", key, "?versionId=", version), "", kKey, kKey),
      204, "DELETE " + key);
}

}  // namespace weightstore::testing

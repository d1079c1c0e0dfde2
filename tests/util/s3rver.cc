#include "tests/util/s3rver.h"

#include <curl/curl.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
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
  const std::string log = dir_ + "/stdout";
  std::vector<std::string> args = {binary,   "--directory", dir_ + "/data", "--address",          "127.0.0.1",
                                   "--port", "0",           "--silent",     "--configure-bucket", kS3rverBucket};
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  pid_ = ::fork();
  if (pid_ == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  if (pid_ < 0) return absl::InternalError("fork failed");
  const std::string kBanner = "S3rver listening on 127.0.0.1:";
  for (int i = 0; i < 300; ++i) {
    const std::string out = ReadFileOrEmpty(log);
    const size_t at = out.find(kBanner);
    if (at != std::string::npos) {
      const size_t end = out.find('\n', at);
      if (end != std::string::npos &&
          absl::SimpleAtoi(out.substr(at + kBanner.size(), end - at - kBanner.size()), &port_)) {
        return absl::OkStatus();
      }
    }
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::InternalError(absl::StrCat("s3rver exited: ", out));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return absl::DeadlineExceededError(absl::StrCat("s3rver did not start in 15 s: ", ReadFileOrEmpty(log)));
}

void S3rver::Stop() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGTERM);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
}

absl::Status S3rver::Put(const std::string& key, absl::string_view data) const {
  CURL* curl = curl_easy_init();
  struct Source {
    absl::string_view data;
    size_t at = 0;
  } source{data};
  auto read = +[](char* buffer, size_t size, size_t n, void* user) -> size_t {
    auto* s = static_cast<Source*>(user);
    const size_t take = std::min(size * n, s->data.size() - s->at);
    std::memcpy(buffer, s->data.data() + s->at, take);
    s->at += take;
    return take;
  };
  auto discard = +[](char*, size_t size, size_t n, void*) -> size_t { return size * n; };
  const std::string url = absl::StrCat(endpoint(), "/", kS3rverBucket, "/", key);
  curl_slist* headers = curl_slist_append(nullptr, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
  headers = curl_slist_append(headers, "Expect:");
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_UPLOAD, 1L);
  curl_easy_setopt(curl, CURLOPT_READFUNCTION, read);
  curl_easy_setopt(curl, CURLOPT_READDATA, &source);
  curl_easy_setopt(curl, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(data.size()));
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, discard);
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(curl, CURLOPT_AWS_SIGV4, "aws:amz:us-east-1:s3");
  curl_easy_setopt(curl, CURLOPT_USERNAME, kS3rverKey);
  curl_easy_setopt(curl, CURLOPT_PASSWORD, kS3rverKey);
  CURLcode rc = curl_easy_perform(curl);
  long http = 0;
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &http);
  curl_slist_free_all(headers);
  curl_easy_cleanup(curl);
  if (rc != CURLE_OK) return absl::UnavailableError(absl::StrCat("PUT ", key, ": ", curl_easy_strerror(rc)));
  if (http != 200) return absl::UnknownError(absl::StrCat("PUT ", key, ": HTTP ", http));
  return absl::OkStatus();
}

}  // namespace weightstore::testing

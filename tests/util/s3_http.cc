#include "tests/util/s3_http.h"

#include <curl/curl.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "tests/util/test_env.h"

namespace weightstore::testing {

absl::StatusOr<S3HttpReply> SignedRequest(const std::string& method, const std::string& url, absl::string_view body,
                                          const std::string& access_key, const std::string& secret,
                                          const std::string& service, const std::vector<std::string>& headers) {
  struct Source {
    absl::string_view data;
    size_t at = 0;
  } source{body};
  auto read = +[](char* buffer, size_t size, size_t n, void* user) -> size_t {
    auto* s = static_cast<Source*>(user);
    const size_t take = std::min(size * n, s->data.size() - s->at);
    std::memcpy(buffer, s->data.data() + s->at, take);
    s->at += take;
    return take;
  };
  auto write = +[](char* data, size_t size, size_t n, void* user) -> size_t {
    static_cast<std::string*>(user)->append(data, size * n);
    return size * n;
  };
  auto header = +[](char* data, size_t size, size_t n, void* user) -> size_t {
    absl::string_view line(data, size * n);
    const size_t colon = line.find(':');
    if (colon != absl::string_view::npos) {
      (*static_cast<std::map<std::string, std::string>*>(user))[absl::AsciiStrToLower(line.substr(0, colon))] =
          std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
    }
    return size * n;
  };
  S3HttpReply reply;
  CURL* curl = curl_easy_init();
  if (curl == nullptr) return absl::InternalError("curl_easy_init failed");
  curl_slist* list = curl_slist_append(nullptr, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
  list = curl_slist_append(list, "Expect:");
  for (const std::string& h : headers) list = curl_slist_append(list, h.c_str());
  const std::string sigv4 = absl::StrCat("aws:amz:us-east-1:", service);
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  if (method == "PUT" || method == "POST") {
    curl_easy_setopt(curl, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(curl, CURLOPT_READFUNCTION, read);
    curl_easy_setopt(curl, CURLOPT_READDATA, &source);
    curl_easy_setopt(curl, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(body.size()));
  }
  curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, method.c_str());
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, write);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &reply.body);
  curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, header);
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, &reply.headers);
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, list);
  curl_easy_setopt(curl, CURLOPT_AWS_SIGV4, sigv4.c_str());
  curl_easy_setopt(curl, CURLOPT_USERNAME, access_key.c_str());
  curl_easy_setopt(curl, CURLOPT_PASSWORD, secret.c_str());
  const CURLcode rc = curl_easy_perform(curl);
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &reply.http);
  curl_slist_free_all(list);
  curl_easy_cleanup(curl);
  if (rc != CURLE_OK) return absl::UnavailableError(absl::StrCat(method, " ", url, ": ", curl_easy_strerror(rc)));
  return reply;
}

absl::StatusOr<ListeningChild> StartListeningChild(std::vector<std::string> args, const std::string& log,
                                                   absl::string_view banner) {
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  ListeningChild child;
  const pid_t parent = ::getpid();
  child.pid = ::fork();
  if (child.pid == 0) {
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
  if (child.pid < 0) return absl::InternalError("fork failed");
  for (int i = 0; i < 300; ++i) {
    const std::string out = ReadFileOrEmpty(log);
    const size_t at = out.find(std::string(banner));
    if (at != std::string::npos) {
      absl::string_view rest = absl::string_view(out).substr(at + banner.size());
      const size_t digits = std::min(rest.find_first_not_of("0123456789"), rest.size());
      if (digits < rest.size() && absl::SimpleAtoi(rest.substr(0, digits), &child.port)) return child;
    }
    int status = 0;
    if (::waitpid(child.pid, &status, WNOHANG) == child.pid) {
      return absl::InternalError(absl::StrCat(args[0], " exited: ", out));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  StopChild(child.pid);
  return absl::DeadlineExceededError(absl::StrCat(args[0], " did not start in 15 s: ", ReadFileOrEmpty(log)));
}

void StopChild(pid_t pid) {
  if (pid <= 0) return;
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
}

}  // namespace weightstore::testing

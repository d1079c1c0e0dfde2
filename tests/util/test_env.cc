#include "tests/util/test_env.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/evp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace weightstore::testing {
namespace {

std::string EnvOr(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : fallback;
}

std::vector<std::string>& ScratchDirs() {
  static auto* dirs = new std::vector<std::string>();
  return *dirs;
}

void RemoveScratchDirs() {
  if (std::getenv("WEIGHTSTORE_KEEP_SCRATCH") != nullptr) return;
  for (const std::string& d : ScratchDirs()) {
    std::error_code ec;
    std::filesystem::remove_all(d, ec);
  }
}

}  // namespace

std::string FixturesDir() { return EnvOr("WEIGHTSTORE_FIXTURES_DIR", WEIGHTSTORE_FIXTURES_DIR); }
std::string TestDataDir() { return WEIGHTSTORE_TESTDATA_DIR; }
std::string ExampleModelsDir() { return WEIGHTSTORE_EXAMPLE_MODELS_DIR; }
std::string ToolsDir() { return WEIGHTSTORE_TOOLS_DIR; }
std::string CliPath() { return EnvOr("WEIGHTSTORE_CLI", WEIGHTSTORE_CLI_PATH); }
std::string TorchPython() { return EnvOr("WEIGHTSTORE_TORCH_PYTHON", WEIGHTSTORE_TORCH_PYTHON); }

std::string MakeScratchDir(absl::string_view tag) {
  static std::once_flag once;
  std::call_once(once, [] { std::atexit(RemoveScratchDirs); });
  std::string pattern =
      (std::filesystem::temp_directory_path() / absl::StrCat("weightstore-", tag, "-XXXXXX")).string();
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) {
    std::perror("mkdtemp");
    std::abort();
  }
  ScratchDirs().emplace_back(buf.data());
  return buf.data();
}

std::string Sha256Hex(absl::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data.data(), data.size(), digest, &len, EVP_sha256(), nullptr);
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < len; ++i) {
    out.push_back(kHex[digest[i] >> 4]);
    out.push_back(kHex[digest[i] & 15]);
  }
  return out;
}

std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFileOrDie(const std::string& path, absl::string_view data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::abort();
  }
}

int RunCommand(const std::string& command, std::string* output, bool merge_stderr) {
  std::string full = merge_stderr ? absl::StrCat(command, " 2>&1") : command;
  FILE* pipe = ::popen(full.c_str(), "r");
  if (pipe == nullptr) return -1;
  output->clear();
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) output->append(buf, n);
  int status = ::pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string ShellQuote(absl::string_view s) { return absl::StrCat("'", absl::StrReplaceAll(s, {{"'", "'\\''"}}), "'"); }

std::string HttpGet(int port, const std::string& path) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return "";
  }
  std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  (void)!::write(fd, request.data(), request.size());
  std::string response;
  char buf[65536];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) response.append(buf, static_cast<size_t>(n));
  ::close(fd);
  size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

std::string InstallPackageOver(const std::string& base_python, const std::string& dir,
                               const std::string& package_source, const std::string& cmake_build_dir,
                               std::string* output) {
  const std::string venv = dir + "/venv";
  const std::string purelib = " -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'";
  // The wheel is built by the test environment's pip (setuptools and wheel
  // are there), reusing the build folder: pip only packages the extension.
  const std::string steps[] = {
      absl::StrCat(ShellQuote(base_python), " -m venv ", ShellQuote(venv)),
      absl::StrCat(ShellQuote(base_python), purelib, " > \"$(", ShellQuote(venv + "/bin/python"), purelib,
                   ")/base-env.pth\""),
      absl::StrCat("WEIGHTSTORE_CMAKE_BUILD_DIR=", ShellQuote(cmake_build_dir),
                   " WEIGHTSTORE_PY_SCRATCH=", ShellQuote(dir + "/scratch"), " ", ShellQuote(TorchPython()),
                   " -m pip wheel --no-index --no-build-isolation --no-deps --quiet -w ", ShellQuote(dir + "/dist"),
                   " ", ShellQuote(package_source)),
      absl::StrCat(ShellQuote(venv + "/bin/pip"), " install --no-index --no-deps --quiet ", ShellQuote(dir),
                   "/dist/weightstore-*.whl"),
  };
  for (const std::string& step : steps) {
    if (RunCommand(step, output) != 0) {
      *output = absl::StrCat("failed: ", step, "\n", *output);
      return "";
    }
  }
  return venv + "/bin/python";
}

}  // namespace weightstore::testing

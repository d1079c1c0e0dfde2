#include "tests/util/daemon.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "tests/util/test_env.h"

namespace weightstore::testing {

std::string DaemonPath() {
  const char* env = std::getenv("WEIGHTSTORED");
  return env != nullptr ? env : WEIGHTSTORED_PATH;
}

std::string MakeFixtureModelsDir() {
  namespace fs = std::filesystem;
  const std::string dir = MakeScratchDir("models");
  for (const char* sub : {"pytorch-models", "pytorch-reader", "safetensors", "burnpack"}) {
    fs::create_directories(fs::path(dir) / sub);
    for (const auto& e : fs::directory_iterator(fs::path(FixturesDir()) / "burn" / sub)) {
      fs::create_symlink(e.path(), fs::path(dir) / sub / e.path().filename());
    }
  }
  return dir;
}

std::string MakeExampleModelsDir() {
  namespace fs = std::filesystem;
  const std::string dir = MakeScratchDir("models");
  for (const auto& e : fs::directory_iterator(ExampleModelsDir())) {
    if (e.path().extension() != ".py") fs::create_symlink(e.path(), fs::path(dir) / e.path().filename());
  }
  return dir;
}

std::unique_ptr<Daemon> StartNode(const Daemon& origin, const std::string& models_dir,
                                  std::vector<std::string> extra_args) {
  std::vector<std::string> args = {"--origin", "grpc://" + origin.address()};
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  return std::make_unique<Daemon>(models_dir, std::move(args));
}

Daemon::Daemon(const std::string& models_dir, std::vector<std::string> extra_args, const std::string& listen) {
  dir_ = MakeScratchDir("daemon");
  log_path_ = dir_ + "/stderr.log";
  const std::string port_file = dir_ + "/port";
  std::vector<std::string> args = {DaemonPath(), "--models", models_dir, "--listen", listen, "--port-file", port_file};
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  pid_ = ::fork();
  if (pid_ == 0) {
    // Holds none of the test's output pipes: ctest waits for them to close, so
    // a daemon outliving a test that a sanitizer ended (without destructors)
    // would hang the suite until its timeout. (Not PR_SET_PDEATHSIG: it fires
    // when the forking thread exits, and some tests restart daemons from
    // threads of their own.)
    int fd = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int null = ::open("/dev/null", O_RDONLY);
    ::dup2(null, 0);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  for (int i = 0; i < 600; ++i) {  // up to 30 s: only a daemon that never starts takes that long
    std::string port = ReadFileOrEmpty(port_file);
    if (!port.empty()) {
      port_ = std::atoi(port.c_str());
      metrics_port_ = std::atoi(ReadFileOrEmpty(port_file + ".metrics").c_str());
      health_port_ = std::atoi(ReadFileOrEmpty(port_file + ".health").c_str());
      lane_port_ = std::atoi(ReadFileOrEmpty(port_file + ".lane").c_str());
      return;
    }
    int status;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

Daemon::~Daemon() {
  if (!exited_ && pid_ > 0) {
    ::kill(pid_, SIGCONT);  // a test may have left it stopped
    ::kill(pid_, SIGTERM);
    if (WaitExit(10000) == -1) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
}

void Daemon::Signal(int signal) { ::kill(pid_, signal); }

bool Daemon::Stop() {
  Signal(SIGSTOP);
  // The parent hears of the stop once the whole thread group has stopped.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    const pid_t got = ::waitpid(pid_, &status, WNOHANG | WUNTRACED);
    if (got == pid_ && WIFSTOPPED(status)) return true;
    if (got == pid_) {  // it exited instead
      exited_ = true;
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

bool Daemon::alive() {
  if (exited_ || pid_ <= 0) return false;
  int status;
  if (::waitpid(pid_, &status, WNOHANG) == pid_) exited_ = true;
  return !exited_;
}

uint64_t Daemon::peak_rss_bytes() const {
  std::string status = ReadFileOrEmpty("/proc/" + std::to_string(pid_) + "/status");
  const size_t at = status.find("VmHWM:");
  if (at == std::string::npos) return 0;
  return std::strtoull(status.c_str() + at + 6, nullptr, 10) * 1024;
}

int Daemon::WaitExit(int timeout_ms) {
  for (int waited = 0; waited <= timeout_ms; waited += 20) {
    int status;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return -1;
}

std::string Daemon::log() const { return ReadFileOrEmpty(log_path_); }

}  // namespace weightstore::testing

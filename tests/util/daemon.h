// Runs a real weightstored process for a test: 127.0.0.1, port 0, its own models
// folder; stopped with SIGTERM when the Daemon is destroyed.
#ifndef WEIGHTSTORE_TESTS_UTIL_DAEMON_H_
#define WEIGHTSTORE_TESTS_UTIL_DAEMON_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace weightstore::testing {

class Daemon {
 public:
  // Starts weightstored on `models_dir` with `extra_args`; waits until it serves.
  // port() is 0 if it did not start (see log()).
  Daemon(const std::string& models_dir, std::vector<std::string> extra_args = {},
         const std::string& listen = "127.0.0.1:0");
  ~Daemon();

  int port() const { return port_; }
  // With --metrics-listen / --health-listen: the bound ports (else 0).
  int metrics_port() const { return metrics_port_; }
  int health_port() const { return health_port_; }
  // With --data-listen: the data lane's bound port (else 0).
  int lane_port() const { return lane_port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  pid_t pid() const { return pid_; }
  // True while the process runs.
  bool alive();
  // Its peak resident set size (VmHWM), in bytes; 0 once it has exited.
  uint64_t peak_rss_bytes() const;
  // Sends `signal`.
  void Signal(int signal);
  // Stops the process (SIGSTOP) and returns true once every thread has
  // stopped: until then, a thread the stop has not reached yet may still
  // answer. False if it exited instead, or did not stop within 30 s. Resume
  // with Signal(SIGCONT).
  [[nodiscard]] bool Stop();
  // Waits for the process to exit; returns its exit status (-1 on timeout).
  int WaitExit(int timeout_ms);
  // What the daemon printed to stderr so far.
  std::string log() const;

 private:
  pid_t pid_ = -1;
  int port_ = 0, metrics_port_ = 0, health_port_ = 0, lane_port_ = 0;
  std::string dir_, log_path_;
  bool exited_ = false;
};

// Returns a new models folder of symlinks to every fixture (never copies):
// <dir>/{pytorch-models,pytorch-reader,safetensors,burnpack}/<file>.
std::string MakeFixtureModelsDir();

// Returns a new models folder of symlinks to the bundled example models
// (deploy/models, its scripts left out), for tests that add files of their own.
std::string MakeExampleModelsDir();

// Starts a node: a Daemon on `models_dir` with `extra_args` that pulls what it
// lacks from `origin` (--origin grpc://<origin's address>). Check its port().
std::unique_ptr<Daemon> StartNode(const Daemon& origin, const std::string& models_dir,
                                  std::vector<std::string> extra_args = {});

// Path of the weightstored binary.
std::string DaemonPath();

}  // namespace weightstore::testing

#endif  // WEIGHTSTORE_TESTS_UTIL_DAEMON_H_

// A client's fetch survives a daemon that is killed mid-stream and takes
// seconds to come back on the same address: it resumes and gets every byte
// (clients gave up on a daemon that restarted in more than ~3 s).
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "client/store.h"
#include "tests/util/checkpoints.h"
#include "tests/util/daemon.h"
#include "tests/util/serving.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using testing::Daemon;

TEST(DaemonRestartTest, AFetchSurvivesADaemonThatTakesSecondsToRestart) {
  const std::string models = testing::MakeExampleModelsDir();
  const std::string bytes = testing::SafeTensorsFile(32, 1 << 19, 4.0f);  // 64 MiB: more than any window holds
  testing::WriteFileOrDie(models + "/big.safetensors", bytes);
  std::string address;
  {  // a free port, then the daemon on it
    Daemon probe(models);
    ASSERT_NE(probe.port(), 0) << probe.log();
    address = probe.address();
  }
  auto daemon = std::make_unique<Daemon>(models, std::vector<std::string>{}, address);
  ASSERT_EQ(daemon->address(), address) << daemon->log();
  struct KillingSink : client::CollectingSink {
    std::function<void()> after_third;
    int ended = 0;
    absl::Status End(const TensorSpec& spec) override {
      if (++ended == 3) after_third();
      return CollectingSink::End(spec);
    }
  } sink;
  std::thread restart;
  sink.after_third = [&] {
    daemon->Signal(SIGKILL);
    daemon->WaitExit(30000);
    restart = std::thread([&] {
      std::this_thread::sleep_for(std::chrono::seconds(4));
      daemon = std::make_unique<Daemon>(models, std::vector<std::string>{}, address);
    });
  };
  ASSERT_OK_AND_ASSIGN(auto store, client::ConnectRemoteStore(address));
  absl::Status fetched = store->FetchTensors("big", {}, &sink);
  restart.join();
  ASSERT_OK(fetched);
  std::map<std::string, std::string> got;
  for (const SharedTensor& t : sink.tensors()) got[t.spec.name] = std::string(t.bytes.view());
  EXPECT_EQ(got, testing::TensorsOf(bytes));
  testing::ExpectStillServes(*daemon);
}

}  // namespace
}  // namespace weightstore

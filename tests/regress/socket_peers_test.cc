// Peers of the shared-memory socket: one that could write a checkpoint gets
// a sealed copy (filled a tensor at a time), never the file; no process or uid holds every connection.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/store.h"
#include "core/shm/filled_memfd.h"
#include "core/shm/unix_socket.h"
#include "tests/util/checkpoints.h"
#include "tests/util/daemon.h"
#include "tests/util/metrics.h"
#include "tests/util/serving.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "tests/util/wait.h"
#include "weightstore/v1/shm.pb.h"

namespace weightstore {
namespace {

namespace pb = ::weightstore::v1;
using testing::Daemon;
using ::testing::HasSubstr;

TEST(SocketPeersTest, ASocketPeerThatCouldWriteACheckpointGetsASealedCopyNotTheFile) {
  // A peer with the daemon's uid (the default allowed peer) could reopen a
  // FILE segment's descriptor through /proc/self/fd with O_RDWR and change
  // the checkpoint on disk.
  const std::string models = testing::MakeExampleModelsDir();
  const std::string bytes = testing::SafeTensorsFile(2, 4096, 1.0f);
  testing::WriteFileOrDie(models + "/m.safetensors", bytes);  // ours, mode 0644
  const std::string dir = testing::MakeScratchDir("sock");
  ASSERT_EQ(::chmod(dir.c_str(), 0755), 0);
  const std::string socket = dir + "/ws.sock";
  Daemon daemon(models,
                {"--socket", socket, "--socket-allow-uid", std::to_string(::geteuid()), "--socket-allow-uid", "65534"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  ASSERT_OK_AND_ASSIGN(auto shm, client::ConnectSharedMemoryStore(socket));
  ASSERT_OK_AND_ASSIGN(auto mapped, shm->MapTensors("m", {}));
  ASSERT_FALSE(mapped.segments.empty());
  for (const auto& segment : mapped.segments) {
    // We own the file: a copy, filled with the tensors asked for and sealed
    // against every writer but the daemon's own mapping.
    EXPECT_OK(CheckFilledSeals(segment->fd(), "segment"));
    const int rw = ::open(absl::StrCat("/proc/self/fd/", segment->fd()).c_str(), O_RDWR | O_CLOEXEC);
    if (rw >= 0) {
      EXPECT_EQ(::pwrite(rw, "x", 1, 0), -1);
      EXPECT_EQ(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, rw, 0), MAP_FAILED);
      ::close(rw);
    }
  }
  EXPECT_EQ(testing::ReadFileOrEmpty(models + "/m.safetensors"), bytes);
  EXPECT_OK(mapped.Verify());
  // A peer that cannot write the file (uid 65534, no write bit for it) gets
  // the file itself: nothing copied.
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run the probe as another uid";
  std::string out;
  const std::string probe =
      absl::StrCat("setpriv --reuid 65534 --regid 0 --clear-groups ", WEIGHTSTORE_SHM_PROBE_PATH, " ", socket, " m");
  EXPECT_EQ(testing::RunCommand(probe, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr(" file\n"));
  EXPECT_THAT(out, ::testing::Not(HasSubstr(" sealed\n")));
  EXPECT_THAT(out, ::testing::Not(HasSubstr(" filled\n")));
  testing::ExpectStillServes(daemon);
}

TEST(SocketPeersTest, OneProcessCannotHoldEverySocketConnection) {
  // One peer could hold all 256 socket connections (a thread each).
  const std::string models = testing::MakeExampleModelsDir();
  const std::string socket = testing::MakeScratchDir("sock") + "/ws.sock";
  Daemon daemon(models,
                {"--socket", socket, "--socket-max-connections-per-peer", "4", "--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto connections = [](const Daemon& d) {
    return testing::MetricValue(d.metrics_port(), "weightstore_socket_connections");
  };
  std::vector<UniqueFd> held;
  for (int i = 0; i < 4; ++i) {
    ASSERT_OK_AND_ASSIGN(UniqueFd fd, ConnectUnixSocket(socket));
    held.push_back(std::move(fd));
  }
  // The daemon has taken all four (and counted them as this process's).
  ASSERT_TRUE(testing::WaitUntil([&] { return connections(daemon) == 4; })) << daemon.log();
  ASSERT_OK_AND_ASSIGN(UniqueFd extra, ConnectUnixSocket(socket));
  std::string frame;
  std::vector<UniqueFd> fds;
  ASSERT_OK(RecvFrame(extra.get(), 1 << 20, &frame, &fds));
  pb::ShmResponse refused;
  ASSERT_TRUE(refused.ParseFromString(frame));
  EXPECT_EQ(refused.code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(refused.message(), HasSubstr(absl::StrCat("pid ", ::getpid(), " has 4 connections")));
  // Another process is served meanwhile.
  std::string out;
  EXPECT_EQ(testing::RunCommand(absl::StrCat(WEIGHTSTORE_SHM_PROBE_PATH, " ", socket, " tiny-mlp"), &out), 0) << out;
  held.clear();  // and ours come back once we let go
  // Forked processes share their uid's quota.
  Daemon by_uid(models,
                {"--socket", socket + "2", "--socket-max-connections-per-uid", "3", "--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(by_uid.port(), 0) << by_uid.log();
  std::vector<UniqueFd> three;
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK_AND_ASSIGN(UniqueFd fd, ConnectUnixSocket(socket + "2"));
    three.push_back(std::move(fd));
  }
  ASSERT_TRUE(testing::WaitUntil([&] { return connections(by_uid) == 3; })) << by_uid.log();
  EXPECT_NE(testing::RunCommand(absl::StrCat(WEIGHTSTORE_SHM_PROBE_PATH, " ", socket, "2 tiny-mlp"), &out), 0);
  EXPECT_THAT(out, HasSubstr(absl::StrCat("uid ", ::geteuid(), " has 3 connections")));
  // The first daemon has seen ours close.
  ASSERT_TRUE(testing::WaitUntil([&] { return connections(daemon) == 0; })) << daemon.log();
  ASSERT_OK_AND_ASSIGN(auto shm, client::ConnectSharedMemoryStore(socket));
  EXPECT_OK(shm->ListCheckpoints().status());
  testing::ExpectStillServes(daemon);
}

}  // namespace
}  // namespace weightstore

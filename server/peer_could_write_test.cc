// PeerCouldWrite: which socket peers get a checkpoint file itself (it cannot
// write it) rather than a sealed copy.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/fs.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/shm_server.h"
#include "tests/util/test_env.h"
#include "tests/util/wait.h"

namespace weightstore::server {
namespace {

// A process's command name, from /proc (empty once it is gone).
std::string CommandName(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/comm"));
  std::string name;
  std::getline(in, name);
  return name;
}

// Root in a container holds none of the capabilities that clear an immutable
// flag: such a peer gets the file itself, one that holds them (or whose
// capabilities the daemon cannot see) a sealed copy.
TEST(PeerCouldWriteTest, AnImmutableFileIsWritableOnlyByAPeerThatCanClearTheFlag) {
  const std::string path = testing::MakeScratchDir("immutable") + "/model.safetensors";
  testing::WriteFileOrDie(path, "weights");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  absl::Cleanup close_fd = [fd] { ::close(fd); };

  // Root, without CAP_LINUX_IMMUTABLE, CAP_SYS_RAWIO and CAP_SYS_ADMIN.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::execl("/usr/bin/setpriv", "setpriv", "--bounding-set", "-linux_immutable,-sys_rawio,-sys_admin", "sleep", "600",
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  bool reaped = false;
  absl::Cleanup reap = [child, &reaped] {
    if (reaped) return;
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
  };
  bool exited = false;
  ASSERT_TRUE(testing::WaitUntil(
      [&] {
        exited = reaped = ::waitpid(child, nullptr, WNOHANG) == child;
        return exited || CommandName(child) == "sleep";
      },
      absl::Seconds(60)));
  if (exited) GTEST_SKIP() << "util-linux's setpriv is not installed here";
  const ShmPeer confined{.pid = child, .uid = 0, .gids = {0}};
  const ShmPeer unseen{.pid = 0, .uid = 0, .gids = {0}};  // in another pid namespace
  EXPECT_TRUE(PeerCouldWrite(fd, confined));              // root may write an ordinary file

  int flags = 0;
  ASSERT_EQ(::ioctl(fd, FS_IOC_GETFLAGS, &flags), 0) << std::strerror(errno);
  const int immutable = flags | FS_IMMUTABLE_FL;
  if (::ioctl(fd, FS_IOC_SETFLAGS, &immutable) != 0) {
    GTEST_SKIP() << "cannot make a file immutable here: " << std::strerror(errno);
  }
  // Cleared again, whatever happens, so that the scratch folder can go.
  absl::Cleanup mutable_again = [fd, flags] { ::ioctl(fd, FS_IOC_SETFLAGS, &flags); };
  EXPECT_FALSE(PeerCouldWrite(fd, confined));
  EXPECT_TRUE(PeerCouldWrite(fd, unseen));
  // This test's own process set the flag, so it holds CAP_LINUX_IMMUTABLE.
  EXPECT_TRUE(PeerCouldWrite(fd, {.pid = ::getpid(), .uid = 0, .gids = {0}}));
}

}  // namespace
}  // namespace weightstore::server

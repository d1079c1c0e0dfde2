#include "core/mapped_file.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

constexpr size_t kSize = 1 << 20;  // mapped, not read into memory

std::string WriteFile(const std::string& name, char fill) {
  const std::string path = testing::MakeScratchDir("mapped") + "/" + name;
  testing::WriteFileOrDie(path, std::string(kSize, fill));
  return path;
}

TEST(MappedFileTest, AReadPastATruncationGetsZerosAndMarksTheFileFaulted) {
  // Issue 11 item 5: a served file truncated in place killed the daemon with
  // SIGBUS on its next read.
  InstallMappedFileGuard();
  const std::string path = WriteFile("w.bin", 'x');
  ASSERT_OK_AND_ASSIGN(auto file, MappedFile::Open(path));
  ASSERT_TRUE(file->is_mapped());
  EXPECT_FALSE(file->faulted());
  EXPECT_FALSE(file->ChangedOnDisk());
  ASSERT_EQ(::truncate(path.c_str(), 4096), 0);
  const std::byte* data = file->bytes().data();
  EXPECT_EQ(data[100], std::byte{'x'}) << "the pages the file kept";
  EXPECT_EQ(data[kSize / 2], std::byte{0});
  EXPECT_TRUE(file->faulted());
  EXPECT_TRUE(file->ChangedOnDisk());
}

TEST(MappedFileTest, ARewriteInPlaceIsAChangeOnDisk) {
  const std::string path = WriteFile("w.bin", 'x');
  ASSERT_OK_AND_ASSIGN(auto file, MappedFile::Open(path));
  std::this_thread::sleep_for(std::chrono::milliseconds(30));  // past the timestamp granularity
  const int fd = ::open(path.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, "y", 1, 10), 1);
  ::close(fd);
  EXPECT_TRUE(file->ChangedOnDisk());
  EXPECT_FALSE(file->faulted());
  EXPECT_EQ(file->bytes().data()[10], std::byte{'y'}) << "a shared mapping sees the write: hence the check";
}

TEST(MappedFileTest, AFileReplacedByARenameIsNotAChangeOnDisk) {
  // A new version published by rename leaves the old file's bytes as they
  // were: streams on the old version must finish, not fail as if it had been
  // written in place (its ctime changes as it loses its last link).
  const std::string path = WriteFile("w.bin", 'x');
  ASSERT_OK_AND_ASSIGN(auto file, MappedFile::Open(path));
  std::this_thread::sleep_for(std::chrono::milliseconds(30));  // past the timestamp granularity
  const std::string next = path + ".next";
  testing::WriteFileOrDie(next, std::string(kSize, 'y'));
  ASSERT_EQ(::rename(next.c_str(), path.c_str()), 0);
  EXPECT_FALSE(file->ChangedOnDisk());
  EXPECT_EQ(file->bytes().data()[10], std::byte{'x'});
}

TEST(MappedFileTest, AFileItsOwnerRenamedIntoPlaceIsUnchangedOnceItSaysSo) {
  // A push maps the file it wrote, then renames it over the checkpoint's:
  // the rename moves its ctime, which alone would read as a write in place.
  const std::string path = WriteFile("w.bin", 'x');
  ASSERT_OK_AND_ASSIGN(auto file, MappedFile::Open(path));
  std::this_thread::sleep_for(std::chrono::milliseconds(30));  // past the timestamp granularity
  ASSERT_EQ(::rename(path.c_str(), (path + ".in-place").c_str()), 0);
  EXPECT_TRUE(file->ChangedOnDisk()) << "the rename moved its ctime";
  file->Renamed();
  EXPECT_FALSE(file->ChangedOnDisk());
  // A write after it is still one.
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  const int fd = ::open((path + ".in-place").c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, "y", 1, 10), 1);
  ::close(fd);
  file->Renamed();  // says nothing about a file whose mtime moved
  EXPECT_TRUE(file->ChangedOnDisk());
}

TEST(MappedFileTest, ASigbusOutsideOurMappingsStillEndsTheProcess) {
  const std::string path = WriteFile("other.bin", 'z');
  const pid_t child = ::fork();
  if (child == 0) {
    InstallMappedFileGuard();
    const int fd = ::open(path.c_str(), O_RDONLY);
    auto* p = static_cast<volatile char*>(::mmap(nullptr, kSize, PROT_READ, MAP_SHARED, fd, 0));
    (void)!::truncate(path.c_str(), 0);
    const char c = p[kSize / 2];  // not a MappedFile: the default action
    ::_exit(c == 0 ? 3 : 4);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  // Killed by SIGBUS, or (under AddressSanitizer, whose handler we chain to)
  // ended by its report: never back in the code after the faulting read.
  const bool by_signal = WIFSIGNALED(status) && WTERMSIG(status) == SIGBUS;
  const bool by_report =
      WIFEXITED(status) && WEXITSTATUS(status) != 3 && WEXITSTATUS(status) != 4 && WEXITSTATUS(status) != 0;
  EXPECT_TRUE(by_signal || by_report) << status;
}

}  // namespace
}  // namespace weightstore

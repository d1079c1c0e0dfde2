#include "core/atomic_file.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using ::weightstore::testing::StatusIs;

size_t CountFiles(const std::string& dir) {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++n;
  return n;
}

TEST(AtomicFileTest, CommitMakesTheWholeFileAppear) {
  std::string dir = testing::MakeScratchDir("atomic");
  std::string path = dir + "/out.bin";
  ASSERT_OK_AND_ASSIGN(auto file, AtomicFile::Create(path, false));
  ASSERT_OK(file->Append("hello "));
  EXPECT_FALSE(std::filesystem::exists(path));
  ASSERT_OK(file->AppendZeros(3));
  ASSERT_OK(file->Commit());
  EXPECT_EQ(testing::ReadFileOrEmpty(path), std::string("hello \0\0\0", 9));
  EXPECT_EQ(CountFiles(dir), 1u);
}

// A clone is the source's bytes; one that cannot be made leaves the file
// empty for a whole write; a source shorter than asked is an error, and a
// file already written to is not cloned over.
TEST(AtomicFileTest, CloneFromCopiesTheSourceOrLeavesTheFileEmpty) {
  const std::string dir = testing::MakeScratchDir("atomic-clone");
  const std::string bytes(3 << 20, 'x');
  testing::WriteFileOrDie(dir + "/source", bytes);
  const int source = ::open((dir + "/source").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(source, 0);
  {
    ASSERT_OK_AND_ASSIGN(auto file, AtomicFile::Create(dir + "/copy", false));
    ASSERT_OK_AND_ASSIGN(AtomicFile::CloneResult how, file->CloneFrom(source, bytes.size()));
    EXPECT_NE(how, AtomicFile::CloneResult::kUnsupported) << "one filesystem: a clone or a copy in the kernel";
    ASSERT_OK(file->Commit());
    EXPECT_TRUE(testing::ReadFileOrEmpty(dir + "/copy") == bytes);
  }
  {
    ASSERT_OK_AND_ASSIGN(auto file, AtomicFile::Create(dir + "/short", false));
    EXPECT_THAT(file->CloneFrom(source, bytes.size() + 1).status(), StatusIs(absl::StatusCode::kDataLoss));
  }
  {
    ASSERT_OK_AND_ASSIGN(auto file, AtomicFile::Create(dir + "/written", false));
    ASSERT_OK(file->Append("a"));
    EXPECT_THAT(file->CloneFrom(source, bytes.size()).status(), StatusIs(absl::StatusCode::kFailedPrecondition));
  }
  // Across filesystems (tmpfs to this folder's) a kernel may refuse: the file
  // is then still empty.
  if (std::filesystem::is_directory("/dev/shm")) {
    const std::string shm = "/dev/shm/weightstore-clone-" + std::to_string(::getpid());
    testing::WriteFileOrDie(shm, bytes);
    const int other = ::open(shm.c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(other, 0);
    ASSERT_OK_AND_ASSIGN(auto file, AtomicFile::Create(dir + "/across", false));
    ASSERT_OK_AND_ASSIGN(AtomicFile::CloneResult how, file->CloneFrom(other, bytes.size()));
    ASSERT_OK(file->Commit());
    EXPECT_EQ(testing::ReadFileOrEmpty(dir + "/across"), how == AtomicFile::CloneResult::kUnsupported ? "" : bytes);
    ::close(other);
    std::filesystem::remove(shm);
  }
  ::close(source);
}

TEST(AtomicFileTest, AnAbandonedFileLeavesNothingBehind) {
  std::string dir = testing::MakeScratchDir("atomic");
  {
    ASSERT_OK_AND_ASSIGN(auto file, AtomicFile::Create(dir + "/out.bin", false));
    ASSERT_OK(file->Append("partial"));
  }
  EXPECT_EQ(CountFiles(dir), 0u);
}

TEST(AtomicFileTest, NeverReplacesAnExistingFileUnlessAsked) {
  std::string dir = testing::MakeScratchDir("atomic");
  std::string path = dir + "/out.bin";
  testing::WriteFileOrDie(path, "old");
  EXPECT_THAT(AtomicFile::Create(path, false), StatusIs(absl::StatusCode::kAlreadyExists));

  // A file that appears between Create and Commit is not replaced either.
  std::string racy = dir + "/racy.bin";
  ASSERT_OK_AND_ASSIGN(auto file, AtomicFile::Create(racy, false));
  ASSERT_OK(file->Append("new"));
  testing::WriteFileOrDie(racy, "other");
  EXPECT_THAT(file->Commit(), StatusIs(absl::StatusCode::kAlreadyExists));
  EXPECT_EQ(testing::ReadFileOrEmpty(racy), "other");

  ASSERT_OK_AND_ASSIGN(auto replace, AtomicFile::Create(path, true));
  ASSERT_OK(replace->Append("new"));
  ASSERT_OK(replace->Commit());
  EXPECT_EQ(testing::ReadFileOrEmpty(path), "new");
}

TEST(AtomicFileTest, RefusesAFolderAsTarget) {
  std::string dir = testing::MakeScratchDir("atomic");
  EXPECT_THAT(AtomicFile::Create(dir, true), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(AtomicFileTest, ATemporaryIsAbandonedOnlyOnceItsWriterIsGone) {
  std::string dir = testing::MakeScratchDir("atomic");
  int folder = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  ASSERT_GE(folder, 0);
  ASSERT_OK_AND_ASSIGN(auto file, AtomicFile::Create(dir + "/model.safetensors", false));
  const std::string temp = std::filesystem::path(file->temp_path()).filename().string();
  EXPECT_TRUE(IsAtomicFileTemporary(temp)) << temp;
  EXPECT_FALSE(IsAbandonedTemporary(folder, temp, 0)) << "its writer holds it";
  // A writer killed mid-write leaves the file with nobody holding its lock.
  testing::WriteFileOrDie(dir + "/.model.pt.4242-7.tmp", "partial");
  EXPECT_TRUE(IsAbandonedTemporary(folder, ".model.pt.4242-7.tmp", 0));
  EXPECT_FALSE(IsAbandonedTemporary(folder, ".model.pt.4242-7.tmp", 3600)) << "too recent";
  for (const char* other : {".model.tmp", "model.1-2.tmp", ".x.1-.tmp", ".x.a-1.tmp", ".x.12.tmp"}) {
    EXPECT_FALSE(IsAtomicFileTemporary(other)) << other;
  }
  ::close(folder);
}

TEST(AtomicFileTest, CommitsIntoTheFolderItOpenedEvenIfThePathIsSwappedForASymlink) {
  std::string dir = testing::MakeScratchDir("atomic");
  std::string elsewhere = testing::MakeScratchDir("elsewhere");
  std::filesystem::create_directory(dir + "/sub");
  ASSERT_OK_AND_ASSIGN(auto file, AtomicFile::Create(dir + "/sub/out.bin", false));
  ASSERT_OK(file->Append("data"));
  std::filesystem::rename(dir + "/sub", dir + "/moved");
  std::filesystem::create_directory_symlink(elsewhere, dir + "/sub");
  ASSERT_OK(file->Commit());
  EXPECT_EQ(testing::ReadFileOrEmpty(dir + "/moved/out.bin"), "data");
  EXPECT_EQ(CountFiles(elsewhere), 0u);
}

}  // namespace
}  // namespace weightstore

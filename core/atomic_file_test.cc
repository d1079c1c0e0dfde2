#include "core/atomic_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace weightstore

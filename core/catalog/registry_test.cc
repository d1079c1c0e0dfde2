#include "core/catalog/registry.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

namespace fs = std::filesystem;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

void WriteTiny(const std::string& path) {
  SharedTensor t{{"w", DType::kF32, {1}}, SharedBytes::Copy(std::string(4, '\0'))};
  testing::WriteFileOrDie(path, *SerializeCheckpoint(kSafeTensorsFormat, {t}, {}));
}

std::vector<std::string> Names(const CheckpointRegistry& registry) {
  std::vector<std::string> names;
  for (const auto& v : registry.List()) names.push_back(v->name());
  return names;
}

TEST(RegistryTest, ASymlinkLoopInTheModelsFolderIsReportedNotThrown) {
  // Issue 11: the throwing std::filesystem overloads aborted the daemon at
  // startup and on every rescan while such a link existed.
  const std::string models = testing::MakeScratchDir("models");
  WriteTiny(models + "/good.safetensors");
  fs::create_symlink("loop.safetensors", models + "/loop.safetensors");
  fs::create_symlink("a", models + "/b");
  fs::create_symlink("b", models + "/a");
  fs::create_directory(models + "/sub");
  fs::create_directory_symlink("..", models + "/sub/up");
  CheckpointRegistry registry({.models_dir = models});
  ScanReport report = registry.Rescan();
  EXPECT_THAT(Names(registry), ElementsAre("good"));
  EXPECT_THAT(report.errors, Contains(HasSubstr("loop.safetensors")));
  report = registry.Rescan();  // and again, as SIGHUP would
  EXPECT_THAT(Names(registry), ElementsAre("good"));
}

TEST(RegistryTest, NamesThatNoRequestCouldCarryAreNotServed) {
  const std::string models = testing::MakeScratchDir("models");
  WriteTiny(models + "/ok-é.safetensors");
  WriteTiny(models + "/bad\x01name.safetensors");
  WriteTiny(models + "/bad\xff.safetensors");
  const std::string deep = std::string(100, 'x') + "/" + std::string(100, 'y') + "/" + std::string(98, 'z');
  fs::create_directories(models + "/" + deep.substr(0, 201));
  WriteTiny(models + "/" + deep + ".safetensors");
  CheckpointRegistry registry({.models_dir = models, .max_name_bytes = 200});
  ScanReport report = registry.Rescan();
  EXPECT_THAT(Names(registry), ElementsAre("ok-é"));
  EXPECT_EQ(report.errors.size(), 3u);
  EXPECT_THAT(report.errors, Contains(HasSubstr("control character")));
  EXPECT_THAT(report.errors, Contains(HasSubstr("not UTF-8")));
  EXPECT_THAT(report.errors, Contains(HasSubstr("300 bytes; at most 200")));
}

TEST(RegistryTest, FindRefusesInvalidNamesBeforeLookingThemUp) {
  CheckpointRegistry registry({.models_dir = testing::MakeScratchDir("models")});
  EXPECT_THAT(registry.Find("\xff\xfe"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not UTF-8")));
  EXPECT_THAT(registry.Find("a\nb"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("control character")));
  EXPECT_THAT(registry.Find("a\xc2\x85"
                            "b"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("control")));
  EXPECT_THAT(registry.Find(""), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  const std::string huge(1 << 20, 'n');
  absl::Status status = registry.Find(huge).status();
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1048576 bytes; at most 512")));
  EXPECT_LT(status.message().size(), 200u) << "the name is shortened in the error";
  EXPECT_THAT(registry.Find("mödel"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(registry.Find("x", std::string(100, 'v')), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(RegistryTest, LoadReadsOnlyTheModelsFolderAndTheLoadRoots) {
  // Issue 11 item 13: LoadCheckpoint read any path, and its error quoted the
  // file's first bytes (/etc/passwd -> "root:x:").
  const std::string models = testing::MakeScratchDir("models");
  const std::string root = testing::MakeScratchDir("root");
  const std::string outside = testing::MakeScratchDir("outside");
  WriteTiny(root + "/a.safetensors");
  WriteTiny(outside + "/b.safetensors");
  testing::WriteFileOrDie(models + "/notes.pt", "root:x:0:0:root:/root:/bin/bash\n");
  fs::create_symlink(root + "/a.safetensors", models + "/linked.safetensors");
  CheckpointRegistry registry({.models_dir = models, .load_roots = {root}});
  EXPECT_OK(registry.Load(root + "/a.safetensors", "a"));
  EXPECT_OK(registry.Load("linked.safetensors", "linked")) << "symlinks the operator placed are followed";
  EXPECT_THAT(registry.Load(outside + "/b.safetensors", "b"),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("outside the models folder")));
  EXPECT_THAT(registry.Load("/etc/passwd", "p"), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(registry.Load(models + "/../" + fs::path(outside).filename().string() + "/b.safetensors", "b"),
              StatusIs(absl::StatusCode::kPermissionDenied));
  absl::Status notes = registry.Load("notes.pt", "notes").status();
  EXPECT_THAT(notes, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(notes.message()), ::testing::Not(HasSubstr("72 6f 6f 74")));
  EXPECT_THAT(std::string(notes.message()), ::testing::Not(HasSubstr("root:")));
}

TEST(RegistryTest, AFileLoadedFromAHiddenFolderKeepsItsNameAcrossRescansAndTakesPushes) {
  const std::string models = testing::MakeScratchDir("models");
  fs::create_directories(models + "/.apart/x");
  WriteTiny(models + "/.apart/x/checkpoint.safetensors");
  CheckpointRegistry registry({.models_dir = models});
  // A hub revision's name, which no file name serves, may be given.
  ASSERT_OK_AND_ASSIGN(auto loaded, registry.Load(models + "/.apart/x/checkpoint.safetensors", "acme/tiny@v1.0"));
  EXPECT_THAT(registry.Rescan().removed, ::testing::IsEmpty());
  EXPECT_NE(registry.Get("acme/tiny@v1.0"), nullptr);
  // It lies in the models folder, so a push may write it.
  EXPECT_OK(registry.BeginPush("acme/tiny@v1.0", {.base_version = loaded->version()}).status());
  // Names that are not two placeable names joined by one '@' are refused.
  for (const std::string bad : {"a@", "@b", "a@b@c", "a@../b", "a@.b", "a@b/"}) {
    EXPECT_THAT(registry.Load(models + "/.apart/x/checkpoint.safetensors", bad),
                StatusIs(absl::StatusCode::kInvalidArgument))
        << bad;
  }
  // A load that must not replace what is served is refused.
  EXPECT_THAT(registry.LoadIfAbsent(models + "/.apart/x/checkpoint.safetensors", "acme/tiny@v1.0"),
              StatusIs(absl::StatusCode::kAlreadyExists));
  EXPECT_TRUE(IsLoadableName("acme/tiny@refs/pr/1", 4096));
  EXPECT_FALSE(IsLoadableName("acme/tiny@v1", 11));
}

TEST(RegistryTest, AnUploadCannotBeSteeredOutThroughASymlinkedFolder) {
  const std::string models = testing::MakeScratchDir("models");
  const std::string outside = testing::MakeScratchDir("outside");
  fs::create_directory_symlink(outside, models + "/escape");
  CheckpointRegistry registry({.models_dir = models});
  EXPECT_THAT(registry.BeginPut("escape/model", "safetensors", false, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'escape' in the models folder is a symlink")));
  ASSERT_OK_AND_ASSIGN(auto session, registry.BeginPut("a/b/model", "safetensors", false, 0));
  EXPECT_TRUE(fs::is_directory(models + "/a/b"));
  EXPECT_TRUE(fs::is_empty(outside));
}

TEST(RegistryTest, ARescanRemovesUploadsAKilledDaemonLeftBehind) {
  const std::string models = testing::MakeScratchDir("models");
  fs::create_directory(models + "/x");
  testing::WriteFileOrDie(models + "/x/.big.safetensors.999-3.tmp", std::string(1000, 'z'));
  testing::WriteFileOrDie(models + "/.mine.tmp", "not ours: kept");
  CheckpointRegistry registry({.models_dir = models, .abandoned_temporary_seconds = 0});
  ASSERT_OK_AND_ASSIGN(auto live, registry.BeginPut("x/live", "safetensors", false, 0));
  ScanReport report = registry.Rescan();
  EXPECT_THAT(report.cleaned, ElementsAre(HasSubstr(".big.safetensors.999-3.tmp")));
  EXPECT_FALSE(fs::exists(models + "/x/.big.safetensors.999-3.tmp"));
  EXPECT_TRUE(fs::exists(models + "/.mine.tmp"));
  size_t temporaries = 0;
  for (const auto& e : fs::directory_iterator(models + "/x"))
    temporaries += IsAtomicFileTemporary(e.path().filename().string());
  EXPECT_EQ(temporaries, 1u) << "the upload in progress is kept";
}

TEST(RegistryTest, AFileVersionIdIsNeverIssuedTwiceForOneName) {
  // Without digests an id names the files. A rewrite in place that puts back size and mtime (touch -r, rsync -t)
  // still changes ctime; one that keeps even ctime (inside one timestamp tick)
  // gets a reissued id, and a later rescan must not go back to the old one.
  const std::string models = testing::MakeScratchDir("models");
  const std::string path = models + "/m.safetensors";
  WriteTiny(path);
  CheckpointRegistry registry({.models_dir = models, .tensor_digests = false});
  registry.Rescan();
  ASSERT_OK_AND_ASSIGN(auto v1, registry.Find("m"));
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  {  // same bytes written again, then mtime put back
    const std::string bytes = testing::ReadFileOrEmpty(path);
    const int fd = ::open(path.c_str(), O_WRONLY);
    ASSERT_EQ(::pwrite(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
    const timespec times[2] = {st.st_atim, st.st_mtim};
    ASSERT_EQ(::futimens(fd, times), 0);
    ::close(fd);
  }
  v1->MarkModified();  // as the file watcher would
  registry.Rescan();
  ASSERT_OK_AND_ASSIGN(auto v2, registry.Find("m"));
  EXPECT_NE(v2->version(), v1->version());
  // Inside one tick nothing of the stat changes: the id is reissued...
  v2->MarkModified();
  registry.Rescan();
  ASSERT_OK_AND_ASSIGN(auto v3, registry.Find("m"));
  EXPECT_NE(v3->version(), v2->version());
  EXPECT_EQ(v3->file_version(), v2->file_version());
  // ...and stays: the next scan compares the file, not the id.
  registry.Rescan();
  ASSERT_OK_AND_ASSIGN(auto v4, registry.Find("m"));
  EXPECT_EQ(v4, v3);
}

TEST(RegistryTest, AVersionTakesTheIdItsFilesAreGivenButNeverTwiceForOneName) {
  const std::string models = testing::MakeScratchDir("models");
  WriteTiny(models + "/m.safetensors");
  WriteTiny(models + "/bad.safetensors");
  CheckpointRegistry registry({.models_dir = models, .tensor_digests = false});
  std::string given;  // the file version the id is given for
  registry.SetVersionIds([&](const std::string& name, const std::string& file_version) -> std::optional<std::string> {
    if (name == "bad") return std::string("not an id");
    if (file_version != given) return std::nullopt;
    return std::string("origin-id.1");
  });
  given = *FileVersion(models + "/m.safetensors");
  registry.Rescan();
  ASSERT_OK_AND_ASSIGN(auto v1, registry.Find("m"));
  EXPECT_EQ(v1->version(), "origin-id.1");
  ASSERT_OK_AND_ASSIGN(auto bad, registry.Find("bad"));
  EXPECT_EQ(bad->version(), bad->file_version());  // an invalid id is ignored
  // Written in place within a tick (the same file version): the given id
  // would name two contents, so the registry issues its own.
  v1->MarkModified();
  registry.Rescan();
  ASSERT_OK_AND_ASSIGN(auto v2, registry.Find("m"));
  EXPECT_EQ(v2->file_version(), v1->file_version());
  EXPECT_NE(v2->version(), "origin-id.1");
  // Cleared: versions opened from now on take the registry's own ids.
  registry.SetVersionIds(nullptr);
  ASSERT_OK(registry.Unload("m"));
  registry.Rescan();
  ASSERT_OK_AND_ASSIGN(auto v3, registry.Find("m"));
  EXPECT_EQ(v3->version(), v3->file_version());
}

void WriteTensor(const std::string& path, float value, Metadata metadata = {}) {
  SharedTensor t{{"w", DType::kF32, {1}}, SharedBytes::Copy(std::string(reinterpret_cast<const char*>(&value), 4))};
  testing::WriteFileOrDie(path, *SerializeCheckpoint(kSafeTensorsFormat, {t}, metadata));
}

TEST(RegistryTest, WithDigestsAVersionIdNamesTheContentOnEveryDaemonAndAcrossATouchOrACopy) {
  const std::string a = testing::MakeScratchDir("models-a");
  const std::string b = testing::MakeScratchDir("models-b");
  WriteTensor(a + "/m.safetensors", 1.0f);
  CheckpointRegistry first({.models_dir = a, .tensor_digests = true});
  first.Rescan();
  ASSERT_OK_AND_ASSIGN(auto v1, first.Find("m"));
  EXPECT_EQ(v1->version().size(), 32u);
  EXPECT_EQ(v1->version(), v1->manifest()->version());
  // Another daemon, another path, another inode and time: the same id.
  fs::copy_file(a + "/m.safetensors", b + "/copy.safetensors");
  CheckpointRegistry second({.models_dir = b, .tensor_digests = true});
  second.Rescan();
  ASSERT_OK_AND_ASSIGN(auto copy, second.Find("copy"));
  EXPECT_EQ(copy->version(), v1->version());
  // A touch reopens the file (its stat changed) under the same id, and a call
  // pinned to that id goes on.
  fs::last_write_time(a + "/m.safetensors", fs::last_write_time(a + "/m.safetensors") + std::chrono::seconds(5));
  first.Rescan();
  ASSERT_OK_AND_ASSIGN(auto touched, first.Find("m"));
  EXPECT_NE(touched->file_version(), v1->file_version());
  EXPECT_EQ(touched->version(), v1->version());
  EXPECT_OK(first.Find("m", v1->version()).status());
  // Other bytes, or other metadata, are another version; the old id is gone.
  WriteTensor(a + "/m.safetensors", 2.0f);
  first.Rescan();
  ASSERT_OK_AND_ASSIGN(auto v2, first.Find("m"));
  EXPECT_NE(v2->version(), v1->version());
  EXPECT_THAT(first.Find("m", v1->version()), StatusIs(absl::StatusCode::kAborted, HasSubstr("was replaced")));
  WriteTensor(a + "/m.safetensors", 2.0f, {{"step", "7"}});
  first.Rescan();
  ASSERT_OK_AND_ASSIGN(auto v3, first.Find("m"));
  EXPECT_NE(v3->version(), v2->version());
  // Written back, the first content takes its first id again.
  WriteTensor(a + "/m.safetensors", 1.0f);
  first.Rescan();
  ASSERT_OK_AND_ASSIGN(auto v4, first.Find("m"));
  EXPECT_EQ(v4->version(), v1->version());
}

TEST(RegistryTest, AWalkCutShortRemovesNothing) {
  // Out of descriptors mid-walk (or a network error), a scan sees part of the
  // folder: what it did not see is not gone.
  const std::string models = testing::MakeScratchDir("models");
  WriteTiny(models + "/keep.safetensors");
  std::string deep = models;
  for (int i = 0; i < 12; ++i) fs::create_directory(deep += "/d");
  WriteTiny(deep + "/bottom.safetensors");
  CheckpointRegistry registry({.models_dir = models});
  registry.Rescan();
  ASSERT_EQ(registry.List().size(), 2u);
  size_t open_fds = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator("/proc/self/fd")) ++open_fds;
  rlimit saved;
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit tight = saved;
  tight.rlim_cur = open_fds + 4;  // the walk runs out partway down
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &tight), 0);
  ScanReport report = registry.Rescan();
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
  EXPECT_THAT(report.errors, Contains(HasSubstr("nothing is removed")));
  EXPECT_TRUE(report.removed.empty());
  EXPECT_EQ(registry.List().size(), 2u);
}

}  // namespace
}  // namespace weightstore

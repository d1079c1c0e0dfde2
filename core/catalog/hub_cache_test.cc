#include "core/catalog/hub_cache.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>

#include "core/catalog/registry.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

namespace fs = std::filesystem;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::UnorderedElementsAre;

constexpr char kC1[] = "1111111111111111111111111111111111111111";
constexpr char kC2[] = "2222222222222222222222222222222222222222";

std::string Tiny(float value, const std::string& name = "w") {
  std::string bytes(4, '\0');
  std::memcpy(bytes.data(), &value, 4);
  SharedTensor t{{name, DType::kF32, {1}}, SharedBytes::Copy(bytes)};
  return *SerializeCheckpoint(kSafeTensorsFormat, {t}, {});
}

// A repo folder as huggingface_hub lays it out: blobs hold the bytes, a
// snapshot holds relative links to them, refs hold commit ids.
class HubRepo {
 public:
  HubRepo(const std::string& cache, const std::string& folder) : dir_(cache + "/" + folder) {
    fs::create_directories(dir_ + "/blobs");
    fs::create_directories(dir_ + "/snapshots");
    fs::create_directories(dir_ + "/refs");
  }
  const std::string& dir() const { return dir_; }
  // snapshots/<commit>/<file> -> ../../blobs/<blob>, holding `bytes`.
  void Add(const std::string& commit, const std::string& file, const std::string& blob, const std::string& bytes) {
    testing::WriteFileOrDie(dir_ + "/blobs/" + blob, bytes);
    Link(commit, file, blob);
  }
  void Link(const std::string& commit, const std::string& file, const std::string& blob) {
    const fs::path link = fs::path(dir_) / "snapshots" / commit / file;
    fs::create_directories(link.parent_path());
    std::string up = "../../";
    for (const auto& part : fs::path(file).parent_path()) up += part.empty() ? "" : "../";
    fs::create_symlink(up + "blobs/" + blob, link);
  }
  void LinkTo(const std::string& commit, const std::string& file, const std::string& target) {
    const fs::path link = fs::path(dir_) / "snapshots" / commit / file;
    fs::create_directories(link.parent_path());
    fs::create_symlink(target, link);
  }
  void Ref(const std::string& ref, const std::string& content) {
    const fs::path path = fs::path(dir_) / "refs" / ref;
    fs::create_directories(path.parent_path());
    testing::WriteFileOrDie(path.string(), content);
  }

 private:
  std::string dir_;
};

std::string Index(const std::map<std::string, std::string>& weight_map) {
  std::string out = R"({"metadata": {}, "weight_map": {)";
  bool first = true;
  for (const auto& [tensor, file] : weight_map) {
    out += (first ? "" : ", ") + ("\"" + tensor + "\": \"" + file + "\"");
    first = false;
  }
  return out + "}}";
}

std::vector<std::string> Names(const HubRepoScan& scan) {
  std::vector<std::string> names;
  for (const auto& c : scan.checkpoints) names.push_back(c.name);
  return names;
}

std::vector<std::string> Names(const CheckpointRegistry& registry) {
  std::vector<std::string> names;
  for (const auto& v : registry.List()) names.push_back(v->name());
  return names;
}

float ValueOf(const CheckpointRegistry& registry, const std::string& name, const std::string& tensor = "w") {
  auto version = registry.Get(name);
  if (version == nullptr) return -1;
  absl::StatusOr<SharedTensor> t = version->checkpoint()->Read(tensor);
  if (!t.ok()) return -2;
  float value;
  std::memcpy(&value, t->bytes.view().data(), 4);
  return value;
}

TEST(HubCacheTest, RepoFolderNamesGiveRepoIds) {
  EXPECT_EQ(HubRepoId("models--acme--tiny-llm"), "acme/tiny-llm");
  EXPECT_EQ(HubRepoId("models--gpt2"), "gpt2");
  EXPECT_EQ(HubRepoId("models--Org_1--Name.v2"), "Org_1/Name.v2");
  EXPECT_EQ(HubRepoId("models--a--b--c"), std::nullopt);
  EXPECT_EQ(HubRepoId("models--"), std::nullopt);
  EXPECT_EQ(HubRepoId("models--acme--"), std::nullopt);
  EXPECT_EQ(HubRepoId("models--..--x"), std::nullopt);
  EXPECT_EQ(HubRepoId("models--a/b"), std::nullopt);
  EXPECT_EQ(HubRepoId("datasets--acme--d"), std::nullopt);
  EXPECT_EQ(HubRepoId("models--" + std::string(97, 'a')), std::nullopt);
}

TEST(HubCacheTest, ServesTheRepoIdAtMainEveryOtherRefAndEverySnapshot) {
  const std::string cache = testing::MakeScratchDir("hub");
  HubRepo repo(cache, "models--acme--tiny");
  repo.Add(kC1, "model.safetensors", "b1", Tiny(1));
  repo.Add(kC1, "config.json", "cfg1", "{}");
  // c2: sharded, with an extra checkpoint file in a sub-folder.
  repo.Add(kC2, "model-00001-of-00002.safetensors", "s1", Tiny(2, "a"));
  repo.Add(kC2, "model-00002-of-00002.safetensors", "s2", Tiny(3, "b"));
  repo.Add(kC2, "model.safetensors.index.json", "idx",
           Index({{"a", "model-00001-of-00002.safetensors"}, {"b", "model-00002-of-00002.safetensors"}}));
  repo.Add(kC2, "original/consolidated.safetensors", "cons", Tiny(4));
  repo.Add(kC2, "tokenizer.json", "tok", "{}");
  repo.Ref("main", std::string(kC2) + "\n");
  repo.Ref("v1.0", kC1);
  repo.Ref("refs/pr/1", kC1);

  HubRepoScan scan = ScanHubRepo(repo.dir());
  EXPECT_THAT(scan.errors, IsEmpty());
  EXPECT_THAT(Names(scan), UnorderedElementsAre("acme/tiny", "acme/tiny/original/consolidated", "acme/tiny@v1.0",
                                                "acme/tiny@refs/pr/1", std::string("acme/tiny@") + kC1,
                                                std::string("acme/tiny@") + kC2,
                                                std::string("acme/tiny@") + kC2 + "/original/consolidated"));

  CheckpointRegistry registry({.models_dir = cache});
  ScanReport report = registry.Rescan();
  EXPECT_THAT(report.errors, IsEmpty());
  EXPECT_EQ(ValueOf(registry, "acme/tiny", "a"), 2);
  EXPECT_EQ(ValueOf(registry, "acme/tiny", "b"), 3);
  EXPECT_EQ(ValueOf(registry, "acme/tiny/original/consolidated"), 4);
  EXPECT_EQ(ValueOf(registry, "acme/tiny@v1.0"), 1);
  EXPECT_EQ(ValueOf(registry, std::string("acme/tiny@") + kC1), 1);
  EXPECT_EQ(registry.List().size(), 7u);  // shards, blobs and configs are not checkpoints
}

TEST(HubCacheTest, ACacheInASubFolderBesideOtherCheckpointsIsServedByRepoId) {
  const std::string models = testing::MakeScratchDir("models");
  testing::WriteFileOrDie(models + "/local.safetensors", Tiny(7));
  HubRepo repo(models + "/hf/hub", "models--gpt2");
  repo.Add(kC1, "pytorch_model.bin", "bin", "not read by the scan");
  repo.Add(kC1, "model.safetensors", "st", Tiny(5));
  repo.Ref("main", kC1);
  CheckpointRegistry registry({.models_dir = models});
  registry.Rescan();
  EXPECT_THAT(Names(registry), ElementsAre("gpt2", std::string("gpt2@") + kC1, "local"));
  EXPECT_EQ(ValueOf(registry, "gpt2"), 5);  // SafeTensors before pytorch_model.bin, as transformers looks
}

TEST(HubCacheTest, WhenMainMovesTheRepoIdIsReplacedByTheNewSnapshot) {
  const std::string cache = testing::MakeScratchDir("hub");
  HubRepo repo(cache, "models--acme--tiny");
  repo.Add(kC1, "model.safetensors", "b1", Tiny(1));
  repo.Ref("main", kC1);
  CheckpointRegistry registry({.models_dir = cache});
  registry.Rescan();
  const std::string before = registry.Get("acme/tiny")->version();
  repo.Add(kC2, "model.safetensors", "b2", Tiny(2));
  repo.Ref("main", kC2);
  ScanReport report = registry.Rescan();
  EXPECT_THAT(report.replaced, ElementsAre("acme/tiny"));
  EXPECT_THAT(report.added, ElementsAre(std::string("acme/tiny@") + kC2));
  EXPECT_EQ(ValueOf(registry, "acme/tiny"), 2);
  EXPECT_NE(registry.Get("acme/tiny")->version(), before);
  EXPECT_EQ(ValueOf(registry, std::string("acme/tiny@") + kC1), 1);  // the old snapshot stays
}

TEST(HubCacheTest, BadEntriesAreReportedByPathAndTheRestOfTheCacheIsServed) {
  const std::string cache = testing::MakeScratchDir("hub");
  const std::string outside = testing::MakeScratchDir("outside") + "/evil.safetensors";
  testing::WriteFileOrDie(outside, Tiny(9));
  HubRepo good(cache, "models--acme--good");
  good.Add(kC1, "model.safetensors", "b", Tiny(1));
  good.Ref("main", kC1);
  HubRepo bad(cache, "models--acme--bad");
  bad.Link(kC1, "model.safetensors", "missing-blob");                 // dangling
  bad.LinkTo(kC2, "model.safetensors", outside);                      // out of the cache
  bad.Add("3333", "model.safetensors", "ok", Tiny(3));                // fine
  bad.Add("4444", "model-00001-of-00001.safetensors", "s", Tiny(4));  // a shard links out
  bad.Add("4444", "model.safetensors.index.json", "i", Index({{"w", "model-00001-of-00001.safetensors"}}));
  fs::remove(bad.dir() + "/snapshots/4444/model-00001-of-00001.safetensors");
  bad.LinkTo("4444", "model-00001-of-00001.safetensors", "../../../models--acme--good/blobs/b");
  bad.Ref("main", "5555");                                          // no such snapshot
  bad.Ref("dev", std::string(300, 'a'));                            // no commit id
  bad.Ref("up", "..");                                              // not a folder name
  fs::create_symlink("/etc/hostname", bad.dir() + "/refs/linked");  // refs are not followed
  fs::create_directories(bad.dir() + "/snapshots/..hidden");
  testing::WriteFileOrDie(bad.dir() + "/snapshots/not-a-folder", "x");

  HubRepoScan scan = ScanHubRepo(bad.dir());
  EXPECT_THAT(Names(scan), ElementsAre("acme/bad@3333"));
  auto has = [&](const std::string& a, const std::string& b) {
    return Contains(::testing::AllOf(HasSubstr(a), HasSubstr(b)));
  };
  EXPECT_THAT(scan.errors, has(std::string(kC1) + "/model.safetensors", "dangling link"));
  EXPECT_THAT(scan.errors, has(std::string(kC2) + "/model.safetensors", "outside its repo"));
  EXPECT_THAT(scan.errors, has("4444/model-00001-of-00001.safetensors", "outside its repo"));
  EXPECT_THAT(scan.errors, has("refs/main", "'5555', which is not in the cache"));
  EXPECT_THAT(scan.errors, has("refs/dev", "no commit id"));
  EXPECT_THAT(scan.errors, has("refs/up", "no commit id"));
  EXPECT_THAT(scan.errors, has("refs/linked", "not a regular file"));
  EXPECT_THAT(scan.errors, has("snapshots/not-a-folder", "not a snapshot folder"));
  EXPECT_THAT(scan.errors, Not(Contains(HasSubstr("hidden"))));

  CheckpointRegistry registry({.models_dir = cache});
  ScanReport report = registry.Rescan();
  EXPECT_THAT(Names(registry), ElementsAre("acme/bad@3333", "acme/good", std::string("acme/good@") + kC1));
  EXPECT_EQ(report.errors.size(), scan.errors.size());
}

TEST(HubCacheTest, DatasetsAndSpacesAreNotServedNorWalked) {
  const std::string cache = testing::MakeScratchDir("hub");
  HubRepo data(cache, "datasets--acme--d");
  data.Add(kC1, "train.safetensors", "b", Tiny(1));
  data.Ref("main", kC1);
  HubRepo space(cache, "spaces--acme--s");
  space.Add(kC1, "model.safetensors", "b", Tiny(1));
  CheckpointRegistry registry({.models_dir = cache});
  ScanReport report = registry.Rescan();
  EXPECT_THAT(Names(registry), IsEmpty());
  EXPECT_THAT(report.errors, IsEmpty());
}

TEST(HubCacheTest, SnapshotsAndRefsBeyondTheBoundsAreReportedNotRead) {
  const std::string cache = testing::MakeScratchDir("hub");
  HubRepo repo(cache, "models--acme--many");
  for (int i = 0; i < 5; ++i) {
    repo.Add("c" + std::to_string(i), "model.safetensors", "b" + std::to_string(i), Tiny(i));
    repo.Ref("r" + std::to_string(i), "c" + std::to_string(i));
  }
  HubRepoScan scan = ScanHubRepo(repo.dir(), {.max_refs = 2, .max_snapshots = 3});
  EXPECT_THAT(scan.errors, Contains(HasSubstr("more than 3 snapshots")));
  EXPECT_THAT(scan.errors, Contains(HasSubstr("more than 2 refs")));
  EXPECT_LE(scan.checkpoints.size(), 5u);
}

}  // namespace
}  // namespace weightstore

// Checkpoints written at test time by real PyTorch (Debian's python3-torch):
// strided and transposed tensors, shared views, tied weights, every dtype,
// empty and scalar tensors, legacy, TAR, protocol 4 and deflated archives, plus
// files that must be refused without running anything.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "core/checkpoint.h"
#include "tests/util/expectations.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

class TorchWrittenTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing::MakeScratchDir("torch-cases"));
    std::string output;
    const std::string command = absl::StrCat(testing::ShellQuote(testing::TorchPython()), " ",
                                             testing::ShellQuote(testing::TestDataDir() + "/make_torch_cases.py"), " ",
                                             testing::ShellQuote(*dir_));
    if (testing::RunCommand(command, &output) != 0) {
      // Failed here, a fatal failure would only skip the tests (and ctest
      // counts skips apart from failures): each test fails in SetUp instead.
      failure_ = new std::string("PyTorch case generator failed:\n" + output);
      return;
    }
    std::ifstream in(*dir_ + "/expected.json");
    expected_ = new nlohmann::json(nlohmann::json::parse(in));
  }
  void SetUp() override { ASSERT_EQ(failure_, nullptr) << *failure_; }
  static std::string* dir_;
  static std::string* failure_;
  static nlohmann::json* expected_;
};
std::string* TorchWrittenTest::dir_ = nullptr;
std::string* TorchWrittenTest::failure_ = nullptr;
nlohmann::json* TorchWrittenTest::expected_ = nullptr;

TEST_F(TorchWrittenTest, EveryCaseReadsExactlyWhatTorchReads) {
  ASSERT_NE(expected_, nullptr);
  int checked = 0;
  for (const auto& [name, want] : expected_->items()) {
    if (!want.contains("tensors")) continue;
    SCOPED_TRACE(name);
    OpenOptions options;
    std::string file = want.value("file", name);
    options.top_level_key = want.value("top_level_key", "");
    ASSERT_OK_AND_ASSIGN(auto c, Checkpoint::Open(*dir_ + "/" + file + ".pt", options));
    testing::ExpectMatchesTorch(*c, want, name);
    ++checked;
  }
  EXPECT_GE(checked, 13);
}

TEST_F(TorchWrittenTest, HostileAndUnsupportedFilesAreRefusedWithTheirReason) {
  ASSERT_NE(expected_, nullptr);
  int checked = 0;
  for (const auto& [name, want] : expected_->items()) {
    if (!want.contains("refuse")) continue;
    SCOPED_TRACE(name);
    absl::StatusOr<std::shared_ptr<const Checkpoint>> c = Checkpoint::Open(*dir_ + "/" + name + ".pt");
    ASSERT_FALSE(c.ok()) << name << " was accepted";
    EXPECT_THAT(std::string(c.status().message()), ::testing::HasSubstr(want["refuse"].get<std::string>()));
    EXPECT_THAT(std::string(c.status().message()), ::testing::HasSubstr(name + ".pt"));
    ++checked;
  }
  EXPECT_GE(checked, 5);
  EXPECT_FALSE(std::filesystem::exists(*dir_ + "/PWNED")) << "the __reduce__ payload ran";
}

TEST_F(TorchWrittenTest, TiedWeightsShareOneStorageAndStridedTensorsAreGathered) {
  ASSERT_OK_AND_ASSIGN(auto tied, Checkpoint::Open(*dir_ + "/tied.pt"));
  EXPECT_EQ(tied->Find("embed.weight")->layout.storage, tied->Find("lm_head.weight")->layout.storage);
  ASSERT_OK_AND_ASSIGN(auto strided, Checkpoint::Open(*dir_ + "/strided.pt"));
  EXPECT_FALSE(Checkpoint::IsZeroCopy(*strided->Find("transposed")));
  EXPECT_FALSE(Checkpoint::IsZeroCopy(*strided->Find("channels_last")));
}

}  // namespace
}  // namespace weightstore

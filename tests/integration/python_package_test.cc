// Runs the `weightstore` package's Python tests (tests/python/test_*.py) against
// a real weightstored serving the fixtures over gRPC and its same-host socket,
// in the test environment (scripts/python-env.sh: torch 2.13, safetensors,
// transformers, from PyPI): from the build tree, and installed with pip into a
// fresh venv as a user would. The package's own tests run once more on Debian's
// /usr/bin/python3 with its torch 1.13, loading the same extension.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <iostream>

#include "absl/strings/str_cat.h"
#include "tests/util/daemon.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using testing::ShellQuote;

// Runs tests/python/`file` with `python` (and `env` before it) against a daemon
// of its own (with `flags` too); expects every test to pass and none to be
// skipped. The tests find the shared fixtures at $WS_FIXTURES.
void RunPackageTests(const std::string& env, const std::string& python, const std::string& cwd,
                     const std::string& file = "test_package.py", std::vector<std::string> flags = {}) {
  const std::string models = testing::MakeFixtureModelsDir();
  const std::string socket = testing::MakeScratchDir("sock") + "/ws.sock";
  for (const char* flag : {"--socket", socket.c_str(), "--metrics-listen", "127.0.0.1:0"}) flags.push_back(flag);
  testing::Daemon daemon(models, flags);
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  ASSERT_NE(daemon.metrics_port(), 0) << daemon.log();
  const std::string command = absl::StrCat(
      "cd ", ShellQuote(cwd), " && ", env, " WS_ADDRESS=", daemon.address(), " WS_SOCKET=", ShellQuote(socket),
      " WS_MODELS=", ShellQuote(models), " WS_METRICS=127.0.0.1:", daemon.metrics_port(),
      " WS_CLI=", ShellQuote(WEIGHTSTORE_CLI_PATH), " WS_DAEMON=", ShellQuote(testing::DaemonPath()),
      " WS_FIXTURES=", ShellQuote(testing::FixturesDir()), " ", ShellQuote(python), " ",
      ShellQuote(absl::StrCat(WEIGHTSTORE_PYTHON_TESTS_DIR, "/", file)));
  std::string output;
  const int status = testing::RunCommand(command, &output);
  EXPECT_EQ(status, 0) << output;
  EXPECT_THAT(output, ::testing::HasSubstr("OK"));
  EXPECT_THAT(output, ::testing::Not(::testing::HasSubstr("skipped")));
  std::cout << output;  // the measured Ctrl-C latencies, in ctest -V
}

// Its gRPC fetches over the daemon's data lane; the run on Debian's Python
// below has them on the stream.
TEST(PythonPackageTest, TheBuildTreesPackageServesEveryStore) {
  RunPackageTests(absl::StrCat("PYTHONPATH=", ShellQuote(WEIGHTSTORE_PYTHON_BUILD_DIR)), testing::TorchPython(),
                  testing::MakeScratchDir("py-cwd"), "test_package.py",
                  {"--data-listen", "127.0.0.1:0", "--data-lane-handshake-timeout", "60"});
}

TEST(PythonPackageTest, TheExtensionBuiltForTheTestEnvironmentServesDebiansPythonAndTorch113) {
  // Both are CPython 3.11: one extension serves pyenv's (the test environment's
  // base) and Debian's interpreter alike.
  RunPackageTests(absl::StrCat("PYTHONPATH=", ShellQuote(WEIGHTSTORE_PYTHON_BUILD_DIR)), "/usr/bin/python3",
                  testing::MakeScratchDir("py-cwd"));
}

TEST(PythonPackageTest, SafeOpenMatchesTheSafetensorsLibraryOverEveryStore) {
  RunPackageTests(absl::StrCat("PYTHONPATH=", ShellQuote(WEIGHTSTORE_PYTHON_BUILD_DIR)), testing::TorchPython(),
                  testing::MakeScratchDir("py-cwd"), "test_safe_open.py");
}

TEST(PythonPackageTest, TheReferenceLibrariesAgreeWithWhatWeightstoreReadsAndWrites) {
  RunPackageTests(absl::StrCat("PYTHONPATH=", ShellQuote(WEIGHTSTORE_PYTHON_BUILD_DIR)), testing::TorchPython(),
                  testing::MakeScratchDir("py-cwd"), "test_oracles.py");
}

TEST(PythonPackageTest, EveryFloatCastsAndNarrowsBitForBitAsTorchDoesOverEveryStore) {
  RunPackageTests(absl::StrCat("PYTHONPATH=", ShellQuote(WEIGHTSTORE_PYTHON_BUILD_DIR)), testing::TorchPython(),
                  testing::MakeScratchDir("py-cwd"), "test_dtypes.py");
}

TEST(PythonPackageTest, QuantizedWeightsShardWithTheirScalesAsNumpyCutsThemOverEveryStore) {
  RunPackageTests(absl::StrCat("PYTHONPATH=", ShellQuote(WEIGHTSTORE_PYTHON_BUILD_DIR)), testing::TorchPython(),
                  testing::MakeScratchDir("py-cwd"), "test_quantized.py");
}

TEST(PythonPackageTest, BurnRecordsServeTheTensorsAnIndependentDecoderReadsOverEveryStore) {
  // The daemon reads the bincode records it scans (.bin.gz) with Burn 0.21's
  // MNIST layout; test_burn_records.py gzips that fixture into the models folder.
  RunPackageTests(absl::StrCat("PYTHONPATH=", ShellQuote(WEIGHTSTORE_PYTHON_BUILD_DIR)), testing::TorchPython(),
                  testing::MakeScratchDir("py-cwd"), "test_burn_records.py",
                  {"--record-layout", testing::FixturesDir() + "/burn-records/mnistweb_0.21.layout.json"});
}

TEST(PythonPackageTest, TransformersModelsLoadFromAHubCacheWithTheSameLogitsOverEveryStore) {
  RunPackageTests(absl::StrCat("PYTHONPATH=", ShellQuote(WEIGHTSTORE_PYTHON_BUILD_DIR)), testing::TorchPython(),
                  testing::MakeScratchDir("py-cwd"), "test_transformers.py");
}

TEST(PythonPackageTest, ATransformersModelFollowedThroughTiersLoadsWithFromPretrainedFromEveryNode) {
  // Starts a trainer's daemon, a regional one and two nodes of its own.
  RunPackageTests(absl::StrCat("PYTHONPATH=", ShellQuote(WEIGHTSTORE_PYTHON_BUILD_DIR)), testing::TorchPython(),
                  testing::MakeScratchDir("py-cwd"), "test_following.py");
}

TEST(PythonPackageTest, ANodeFollowingS3FetchesOnlyTheTensorsWhoseDigestsTheSafetensorsHeaderSaysChanged) {
  // Starts moto's S3 server in the test's process and a node of its own.
  RunPackageTests(absl::StrCat("PYTHONPATH=", ShellQuote(WEIGHTSTORE_PYTHON_BUILD_DIR)), testing::TorchPython(),
                  testing::MakeScratchDir("py-cwd"), "test_s3_ranges.py");
}

TEST(PythonPackageTest, HostileArgumentsToEveryCallRaiseAndNeverCrashOrHang) {
  RunPackageTests(absl::StrCat("PYTHONPATH=", ShellQuote(WEIGHTSTORE_PYTHON_BUILD_DIR)), testing::TorchPython(),
                  testing::MakeScratchDir("py-cwd"), "test_api_fuzz.py");
}

TEST(PythonPackageTest, PipBuildsAWheelThatInstallsIntoAFreshVenvOfflineAndItsTestsPassThere) {
  // The fresh venv sees the test environment's packages (torch, grpcio)
  // through a .pth file, rather than installing them again; the build folder
  // the tests were built in is reused, so pip only packages the extension
  // (scripts/check-wheel.sh builds one from nothing).
  const std::string dir = testing::MakeScratchDir("venv");
  std::string output;
  const std::string python = testing::InstallPackageOver(testing::TorchPython(), dir, WEIGHTSTORE_PACKAGE_SOURCE,
                                                         WEIGHTSTORE_CMAKE_BINARY_DIR, &output);
  ASSERT_NE(python, "") << output;
  // From a folder away from the sources, with no PYTHONPATH: the installed package.
  RunPackageTests("env -u PYTHONPATH", python, dir);
}

TEST(PythonPackageTest, SendsTheBearerTokenItIsGiven) {
  const std::string models = testing::MakeFixtureModelsDir();
  const std::string tokens = testing::MakeScratchDir("tokens") + "/tokens";
  testing::WriteFileOrDie(tokens, "read python-package-token-0123\n");
  testing::Daemon daemon(models, {"--tokens-file", tokens});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  const std::string script =
      "import os, sys\n"
      "import weightstore\n"
      "try:\n"
      "    weightstore.connect(sys.argv[1]).list()\n"
      "    sys.exit('no token: allowed')\n"
      "except weightstore.Error as e:\n"
      "    assert e.code == 'UNAUTHENTICATED', e\n"
      "store = weightstore.connect(sys.argv[1], token='python-package-token-0123')\n"
      "assert 'burnpack/mnist' in [c['name'] for c in store.list()]\n"
      "assert len(store.tensors('burnpack/mnist')) == 18\n"
      "os.environ['WEIGHTSTORE_TOKEN'] = 'python-package-token-0123'\n"
      "assert len(weightstore.connect(sys.argv[1]).list()) > 0\n"
      "print('token ok')\n";
  const std::string file = testing::MakeScratchDir("py") + "/token_check.py";
  testing::WriteFileOrDie(file, script);
  std::string output;
  const int status = testing::RunCommand(
      absl::StrCat("env -u WEIGHTSTORE_TOKEN PYTHONPATH=", ShellQuote(WEIGHTSTORE_PYTHON_BUILD_DIR), " ",
                   ShellQuote(testing::TorchPython()), " ", ShellQuote(file), " ", daemon.address()),
      &output);
  EXPECT_EQ(status, 0) << output;
  EXPECT_THAT(output, ::testing::HasSubstr("token ok"));
}

}  // namespace
}  // namespace weightstore

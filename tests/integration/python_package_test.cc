// Runs the `weightstore` package's tests (tests/python/test_package.py, on
// Debian's python3 with torch and numpy) against a real weightstored serving the
// fixtures over gRPC and its same-host socket: once from the build tree, and
// once installed with pip into a fresh venv, offline, as a user would.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <iostream>

#include "absl/strings/str_cat.h"
#include "tests/util/daemon.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

using testing::ShellQuote;

// Runs test_package.py with `python` (and `env` before it) against a daemon of
// its own; expects every test to pass and none to be skipped.
void RunPackageTests(const std::string& env, const std::string& python, const std::string& cwd) {
  const std::string models = testing::MakeFixtureModelsDir();
  const std::string socket = testing::MakeScratchDir("sock") + "/ws.sock";
  testing::Daemon daemon(models, {"--socket", socket});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  const std::string command = absl::StrCat("cd ", ShellQuote(cwd), " && ", env, " WS_ADDRESS=", daemon.address(),
                                           " WS_SOCKET=", ShellQuote(socket), " WS_MODELS=", ShellQuote(models), " ",
                                           ShellQuote(python), " ", ShellQuote(WEIGHTSTORE_PACKAGE_TEST));
  std::string output;
  const int status = testing::RunCommand(command, &output);
  EXPECT_EQ(status, 0) << output;
  EXPECT_THAT(output, ::testing::HasSubstr("OK"));
  EXPECT_THAT(output, ::testing::Not(::testing::HasSubstr("skipped")));
  std::cout << output;  // the measured Ctrl-C latencies, in ctest -V
}

TEST(PythonPackageTest, TheBuildTreesPackageServesEveryStore) {
  RunPackageTests(absl::StrCat("PYTHONPATH=", ShellQuote(WEIGHTSTORE_PYTHON_BUILD_DIR)), testing::TorchPython(),
                  testing::MakeScratchDir("py-cwd"));
}

TEST(PythonPackageTest, PipBuildsAWheelThatInstallsIntoAFreshVenvOfflineAndItsTestsPassThere) {
  const std::string dir = testing::MakeScratchDir("venv");
  std::string output;
  ASSERT_EQ(testing::RunCommand(absl::StrCat(ShellQuote(testing::TorchPython()), " -m venv --system-site-packages ",
                                             ShellQuote(dir + "/venv")),
                                &output),
            0)
      << output;
  // The build folder the tests were built in is reused: the extension is
  // already built there, so pip only packages it. (scripts/check-wheel.sh
  // builds one from nothing.)
  const std::string pip = ShellQuote(dir + "/venv/bin/pip");
  ASSERT_EQ(testing::RunCommand(absl::StrCat("WEIGHTSTORE_CMAKE_BUILD_DIR=", ShellQuote(WEIGHTSTORE_CMAKE_BINARY_DIR),
                                             " WEIGHTSTORE_PY_SCRATCH=", ShellQuote(dir + "/scratch"), " ", pip,
                                             " wheel --no-index --no-build-isolation --no-deps --quiet -w ",
                                             ShellQuote(dir + "/dist"), " ", ShellQuote(WEIGHTSTORE_PACKAGE_SOURCE)),
                                &output),
            0)
      << output;
  ASSERT_EQ(testing::RunCommand(
                absl::StrCat(pip, " install --no-index --quiet ", ShellQuote(dir), "/dist/weightstore-*.whl"), &output),
            0)
      << output;
  // From a folder away from the sources, with no PYTHONPATH: the installed package.
  RunPackageTests("env -u PYTHONPATH", dir + "/venv/bin/python", dir);
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

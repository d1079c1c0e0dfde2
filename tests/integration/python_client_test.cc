// Runs the Python client's tests (tests/python/test_client.py, on Debian's
// python3 with grpcio, numpy and torch) against a real weightstored serving the
// fixtures over gRPC and its same-host socket.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/util/daemon.h"
#include "tests/util/test_env.h"

namespace weightstore {
namespace {

TEST(PythonClientTest, LoadsIntoNumpyTorchAndModulesThroughSocketAndGrpc) {
  const std::string models = testing::MakeFixtureModelsDir();
  const std::string socket = testing::MakeScratchDir("sock") + "/ws.sock";
  testing::Daemon daemon(models, {"--socket", socket});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  const std::string command = absl::StrCat(
      "WS_ADDRESS=", daemon.address(), " WS_SOCKET=", testing::ShellQuote(socket),
      " WS_MODELS=", testing::ShellQuote(models), " PYTHONPATH=", testing::ShellQuote(WEIGHTSTORE_PYTHON_CLIENT_DIR),
      " WEIGHTSTORE_PYTHON_STUBS=", testing::ShellQuote(WEIGHTSTORE_PYTHON_STUBS_DIR), " ",
      testing::ShellQuote(testing::TorchPython()), " ", testing::ShellQuote(WEIGHTSTORE_PYTHON_TEST));
  std::string output;
  const int status = testing::RunCommand(command, &output);
  EXPECT_EQ(status, 0) << output;
  EXPECT_THAT(output, ::testing::HasSubstr("OK"));
  EXPECT_THAT(output, ::testing::Not(::testing::HasSubstr("skipped")));
}

TEST(PythonClientTest, SendsTheBearerTokenItIsGiven) {
  const std::string models = testing::MakeFixtureModelsDir();
  const std::string tokens = testing::MakeScratchDir("tokens") + "/tokens";
  testing::WriteFileOrDie(tokens, "read python-client-token-0123\n");
  testing::Daemon daemon(models, {"--tokens-file", tokens});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  const std::string script =
      "import sys\n"
      "from weightstore_client import RemoteClient, WeightStoreError\n"
      "try:\n"
      "    RemoteClient(sys.argv[1]).list_checkpoints()\n"
      "    sys.exit('no token: allowed')\n"
      "except WeightStoreError as e:\n"
      "    assert e.code == 'UNAUTHENTICATED', e\n"
      "names = [c.name for c in RemoteClient(sys.argv[1], token='python-client-token-0123').list_checkpoints()]\n"
      "assert 'burnpack/mnist' in names, names\n"
      "assert len(RemoteClient(sys.argv[1], token='python-client-token-0123').fetch('burnpack/mnist')) == 18\n"
      "print('token ok')\n";
  const std::string file = testing::MakeScratchDir("py") + "/token_check.py";
  testing::WriteFileOrDie(file, script);
  std::string output;
  const int status = testing::RunCommand(
      absl::StrCat("PYTHONPATH=", testing::ShellQuote(WEIGHTSTORE_PYTHON_CLIENT_DIR),
                   " WEIGHTSTORE_PYTHON_STUBS=", testing::ShellQuote(WEIGHTSTORE_PYTHON_STUBS_DIR), " ",
                   testing::ShellQuote(testing::TorchPython()), " ", testing::ShellQuote(file), " ", daemon.address()),
      &output);
  EXPECT_EQ(status, 0) << output;
  EXPECT_THAT(output, ::testing::HasSubstr("token ok"));
}

}  // namespace
}  // namespace weightstore

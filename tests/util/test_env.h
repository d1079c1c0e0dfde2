// Paths and helpers shared by tests: fixtures (read in place from ../shared),
// a scratch folder per test, SHA-256, and running the PyTorch helper scripts.
#ifndef WEIGHTSTORE_TESTS_UTIL_TEST_ENV_H_
#define WEIGHTSTORE_TESTS_UTIL_TEST_ENV_H_

#include <string>

#include "absl/strings/string_view.h"

namespace weightstore::testing {

// Folder of the shared conformance fixtures (../shared/fixtures).
std::string FixturesDir();
// Folder of the bundled example models (deploy/models).
std::string ExampleModelsDir();
// Folder of this project's test scripts (tests/testdata).
std::string TestDataDir();
// The `weightstore` CLI binary.
std::string CliPath();
// Folder of test tools (tests/tools: the reflection client).
std::string ToolsDir();
// Python interpreter with torch (Debian's /usr/bin/python3 by default).
std::string TorchPython();

// Returns a fresh, empty folder under the system temp dir, removed at exit.
std::string MakeScratchDir(absl::string_view tag);

// Returns lowercase hex SHA-256 of `data`.
std::string Sha256Hex(absl::string_view data);

// Reads a whole file; returns "" if it cannot be read.
std::string ReadFileOrEmpty(const std::string& path);
// Writes a whole file (test setup; aborts the test binary on failure).
void WriteFileOrDie(const std::string& path, absl::string_view data);

// GET http://127.0.0.1:<port><path>; returns the body ("" on failure).
std::string HttpGet(int port, const std::string& path);

// Runs `command` through /bin/sh; returns its exit status and captures stdout
// (and stderr, when `merge_stderr`) into `*output`.
int RunCommand(const std::string& command, std::string* output, bool merge_stderr = true);

// Quotes `s` for /bin/sh.
std::string ShellQuote(absl::string_view s);

// Makes a venv in `dir`/venv that sees `base_python`'s packages (a .pth file
// names its site-packages) and has the `weightstore` package installed into
// it from a wheel: the package at `package_source`, its extension taken from
// the CMake build folder `cmake_build_dir` (built there already), packaged
// by the test environment's pip. Returns the venv's interpreter, or "" with
// what failed in `*output`.
std::string InstallPackageOver(const std::string& base_python, const std::string& dir,
                               const std::string& package_source, const std::string& cmake_build_dir,
                               std::string* output);

}  // namespace weightstore::testing

#endif  // WEIGHTSTORE_TESTS_UTIL_TEST_ENV_H_

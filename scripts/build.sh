#!/usr/bin/env bash
# Configures and builds all of weightstore into ./build (Release with debug
# info): the daemon, the CLI, the Python extension, tests and benchmarks.
# Extra arguments go to CMake, e.g. scripts/build.sh -DWEIGHTSTORE_WERROR=ON
# (the quick start builds only the daemon and the CLI in the same folder; the
# options below turn the rest back on).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWEIGHTSTORE_BUILD_TESTS=ON \
  -DWEIGHTSTORE_BUILD_BENCHMARKS=ON -DWEIGHTSTORE_WITH_PYTHON=AUTO -DWEIGHTSTORE_WITH_TORCH=AUTO \
  -DWEIGHTSTORE_WITH_CUDA=AUTO -DWEIGHTSTORE_UNITY_BUILD=ON "$@" > /dev/null
ninja -C build

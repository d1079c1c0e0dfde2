#!/usr/bin/env bash
# Configures and builds weightstore into ./build (Release with debug info).
# Extra arguments go to CMake, e.g. scripts/build.sh -DWEIGHTSTORE_WERROR=ON
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
ninja -C build

#!/usr/bin/env bash
# Quick start, command 2 (and CI's .ci/run): installs the dependencies, builds
# with warnings as errors, runs the fuzz targets briefly, then the whole CTest
# suite (unit, conformance over ../shared/fixtures, CLI).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh -DWEIGHTSTORE_WERROR=ON
scripts/run-fuzzers.sh "${WEIGHTSTORE_FUZZ_SECONDS:-10}"
cd build
ctest --output-on-failure -j"$(nproc)"

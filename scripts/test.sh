#!/usr/bin/env bash
# Quick start, command 2 (and CI's .ci/run): installs the dependencies, builds
# with warnings as errors, runs the fuzz targets briefly, the whole CTest suite
# (unit, conformance over ../shared/fixtures, CLI, integration), then checks the
# deployment files (deploy/validate) and the container recipe (docker/check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh -DWEIGHTSTORE_WERROR=ON
scripts/run-fuzzers.sh "${WEIGHTSTORE_FUZZ_SECONDS:-10}"
(cd build && ctest --output-on-failure -j"$(nproc)")
deploy/validate/validate.sh build
docker/check.sh build-docker

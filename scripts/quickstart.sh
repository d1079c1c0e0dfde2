#!/usr/bin/env bash
# Quick start, command 1: installs what the daemon and the CLI need (and no
# more: scripts/install-deps.sh --daemon), builds only those two, and runs
# weightstored in the foreground on the bundled example models (deploy/models),
# listening on 127.0.0.1:50051 (set WEIGHTSTORE_LISTEN to change it), with its
# same-host socket in /tmp/weightstore.sock and metrics on 127.0.0.1:9464.
# Ctrl-C stops it. scripts/test.sh later builds the rest in the same folder.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh --daemon
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWEIGHTSTORE_BUILD_TESTS=OFF \
  -DWEIGHTSTORE_BUILD_BENCHMARKS=OFF -DWEIGHTSTORE_WITH_PYTHON=OFF -DWEIGHTSTORE_WITH_TORCH=OFF \
  -DWEIGHTSTORE_WITH_CUDA=OFF -DWEIGHTSTORE_UNITY_BUILD=ON > /dev/null
ninja -C build weightstored weightstore
listen="${WEIGHTSTORE_LISTEN:-127.0.0.1:50051}"
socket="${WEIGHTSTORE_SOCKET:-/tmp/weightstore.sock}"
metrics="${WEIGHTSTORE_METRICS_LISTEN:-127.0.0.1:9464}"
cat <<MSG

weightstored is starting on ${listen}, serving deploy/models. In another terminal:
  build/client/weightstore ls --server ${listen}
  build/client/weightstore inspect --server ${listen} tiny-mlp-torch --top-level-key model_state_dict
  build/client/weightstore fetch --server ${listen} tiny-mlp /tmp/tiny-mlp.bpk
  build/client/weightstore inspect --socket ${socket} tiny-mlp --dtype f16
  curl -s http://${metrics}/metrics | head

MSG
exec build/server/weightstored --listen "${listen}" --socket "${socket}" --metrics-listen "${metrics}"

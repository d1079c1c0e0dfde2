#!/usr/bin/env bash
# Quick start, command 1: installs the dependencies, builds, and runs weightstored
# in the foreground on the bundled example models (deploy/models), listening on
# 127.0.0.1:50051 (set WEIGHTSTORE_LISTEN to change it), with its same-host
# socket in /tmp/weightstore.sock and metrics on 127.0.0.1:9464. Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
listen="${WEIGHTSTORE_LISTEN:-127.0.0.1:50051}"
socket="${WEIGHTSTORE_SOCKET:-/tmp/weightstore.sock}"
metrics="${WEIGHTSTORE_METRICS_LISTEN:-127.0.0.1:9464}"
cat <<MSG

weightstored is starting on ${listen}, serving deploy/models. In another terminal:
  build/client/weightstore ls --server ${listen}
  build/client/weightstore inspect --server ${listen} tiny-mlp-torch --top-level-key model_state_dict
  build/client/weightstore fetch --server ${listen} tiny-mlp /tmp/tiny-mlp.bpk
  build/client/weightstore inspect --socket ${socket} tiny-mlp --dtype f16
  /usr/bin/python3 tests/tools/grpc_reflect.py ${listen} list
  curl -s http://${metrics}/metrics | head

MSG
exec build/server/weightstored --listen "${listen}" --socket "${socket}" --metrics-listen "${metrics}"

#!/usr/bin/env bash
# Quick start, command 1: installs the dependencies, builds, and runs weightstore
# on the bundled example models (deploy/models). Until the daemon lands, this
# inspects, converts and compares them with the CLI.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
ws=build/client/weightstore
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
set -x
"$ws" inspect --top-level-key model_state_dict deploy/models/tiny-mlp-torch.pt
"$ws" inspect deploy/models/tiny-mlp-burn.bpk
"$ws" convert --top-level-key model_state_dict deploy/models/tiny-mlp-torch.pt "$out/tiny-mlp.safetensors"
"$ws" diff --exit-code "$out/tiny-mlp.safetensors" deploy/models/tiny-mlp-burn.bpk

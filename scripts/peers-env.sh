#!/usr/bin/env bash
# Makes the peers' environment for tests/bench/peers_bench.py: a venv in
# build-tools/peers-venv with exactly tests/bench/peers-requirements.txt
# (torch 2.13 CPU, safetensors, Run:ai's model streamer, fastsafetensors,
# tensorizer), from PyPI (scripts/make-venv.sh). Prints the venv's
# interpreter. Safe to run again. The weightstore package comes from the
# build tree (PYTHONPATH=build/python), built for the same interpreter.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
exec "$root/scripts/make-venv.sh" "$root/build-tools/peers-venv" "$root/tests/bench/peers-requirements.txt"

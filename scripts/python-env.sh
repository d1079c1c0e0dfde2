#!/usr/bin/env bash
# Makes the Python test environment: a venv in build-tools/venv with exactly
# tests/python/requirements.txt (torch 2.13 CPU, safetensors, transformers,
# huggingface_hub, numpy, grpcio), from PyPI (scripts/make-venv.sh). Prints
# the venv's interpreter. Safe to run again: it reinstalls only when the
# requirements file changed.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
exec "$root/scripts/make-venv.sh" "$root/build-tools/venv" "$root/tests/python/requirements.txt"

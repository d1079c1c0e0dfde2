#!/usr/bin/env bash
# Makes the Python test environment: a venv in build-tools/venv with exactly
# tests/python/requirements.txt (torch 2.13 CPU, safetensors, transformers,
# huggingface_hub, numpy, grpcio), from PyPI. Prints the venv's interpreter.
# Safe to run again: it reinstalls only when the requirements file changed.
# The base interpreter is $WEIGHTSTORE_BASE_PYTHON, else the first python3 on
# PATH (pyenv's 3.11 here; Debian's /usr/bin/python3 on a bare Debian 12).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/build-tools/venv"
requirements="$root/tests/python/requirements.txt"
base="${WEIGHTSTORE_BASE_PYTHON:-$(command -v python3)}"
want="$(sha256sum "$requirements" | cut -d' ' -f1) $("$base" -c 'import sys; print(sys.version.split()[0])')"
stamp="$venv/.weightstore-requirements"
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2> /dev/null)" = "$want" ]; then
  echo "$venv/bin/python"
  exit 0
fi
rm -rf "$venv"
mkdir -p "$root/build-tools"
"$base" -m venv "$venv" >&2
# --no-deps: the file lists every package, so the resolver never picks one
# (nor a CUDA torch) by itself; pip check then proves the list is whole.
# (pip's warnings about this machine's extra index folders are left out.)
"$venv/bin/pip" install --quiet --no-deps -r "$requirements" 2>&1 | { grep -v "^WARNING: Location" || true; } >&2
"$venv/bin/pip" check >&2
echo "$want" > "$stamp"
echo "$venv/bin/python"

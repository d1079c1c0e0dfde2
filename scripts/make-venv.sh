#!/usr/bin/env bash
# Makes a venv with exactly the packages a requirements file lists, installed
# from PyPI with --no-deps (the file lists every package, so the resolver
# never picks one, nor a CUDA torch, by itself), then proves the list whole
# with pip check. Prints the venv's interpreter. Safe to run again: it
# reinstalls only when the file (or the base interpreter) changed.
#   scripts/make-venv.sh VENV REQUIREMENTS [PACKAGE...]
# PACKAGEs are left out on purpose: pip check may find them missing. The base
# interpreter is $WEIGHTSTORE_BASE_PYTHON, else the first python3 on PATH
# (pyenv's 3.11 here; Debian's /usr/bin/python3 on a bare Debian 12).
# What uses it: scripts/python-env.sh and scripts/vllm-env.sh.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 VENV REQUIREMENTS [PACKAGE-LEFT-OUT...]" >&2
  exit 2
fi
venv="$1" requirements="$2"
shift 2
base="${WEIGHTSTORE_BASE_PYTHON:-$(command -v python3)}"
want="$(sha256sum "$requirements" | cut -d' ' -f1) $("$base" -c 'import sys; print(sys.version.split()[0])')"
stamp="$venv/.weightstore-requirements"
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2> /dev/null)" = "$want" ]; then
  echo "$venv/bin/python"
  exit 0
fi
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
"$base" -m venv "$venv" >&2
# (pip's warnings about this machine's extra index folders are left out.)
"$venv/bin/pip" install --quiet --no-deps -r "$requirements" 2>&1 | { grep -v "^WARNING: Location" || true; } >&2
left_out="$(printf '%s|' "$@")"
problems="$("$venv/bin/pip" check 2>&1 | grep -v "^No broken requirements found" || true)"
if [ $# -gt 0 ]; then
  problems="$(echo "${problems}" | grep -v -E "requires (${left_out%|}), which is not installed" || true)"
fi
if [ -n "${problems}" ]; then
  echo "${problems}" >&2
  exit 1
fi
echo "$want" > "$stamp"
echo "$venv/bin/python"

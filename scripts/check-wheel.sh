#!/usr/bin/env bash
# Runs the README's Python install line as a user would, from nothing: a fresh
# venv, pip building the extension with a CMake folder of its own (no build
# tree reused, setuptools from PyPI). Then imports the installed package from
# another folder and checks it against torch.load on the fixtures, twice: in
# the venv, with the test environment's torch 2.13 (seen through a .pth file,
# not installed again), and from Debian's /usr/bin/python3 with its torch 1.13,
# loading the same built extension. Takes a few minutes on 2 cores.
#   scripts/check-wheel.sh [PYTHON]   PYTHON: the test environment's
#                                     interpreter (default: scripts/python-env.sh's)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${1:-$("$root/scripts/python-env.sh")}"
fixtures="${WEIGHTSTORE_FIXTURES_DIR:-$root/../shared/fixtures}/burn"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

cd "$root"
"$python" -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet ./client/python 2>&1 | grep -v "^WARNING: Location" >&2 || true
"$work/venv/bin/python" -c 'import weightstore' 2> /dev/null || {
  echo "check-wheel: pip install ./client/python failed" >&2
  "$work/venv/bin/pip" install ./client/python
  exit 1
}
site="$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/test-environment.pth"

cat > "$work/check.py" <<'PY'
import glob, os, sys
import torch
import weightstore

fixtures, installed = sys.argv[1], sys.argv[2]
assert weightstore.__file__.startswith(installed), weightstore.__file__  # the installed copy
store = weightstore.connect("file:" + fixtures)
checked = 0
for path in sorted(glob.glob(os.path.join(fixtures, "pytorch-models", "*.pt"))):
    loaded = torch.load(path, map_location="cpu")
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        continue
    got = store.tensors(os.path.relpath(path, fixtures)[:-3])
    assert set(got) == set(loaded), path
    assert all(torch.equal(got[k], v.contiguous()) for k, v in loaded.items()), path
    checked += 1
assert checked > 3, checked
print(f"check-wheel: Python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__}: "
      f"{checked} fixtures match torch.load (CUDA paths built in: {weightstore._native.has_cuda})")
PY
cd "$work"
env -u PYTHONPATH "$work/venv/bin/python" check.py "$fixtures" "$site"
if [ -x /usr/bin/python3 ] && /usr/bin/python3 -c 'import torch' 2> /dev/null; then
  env PYTHONPATH="$site" /usr/bin/python3 -s check.py "$fixtures" "$site"
else
  echo "check-wheel: no /usr/bin/python3 with torch; Debian's interpreter not checked" >&2
  exit 1
fi

#!/usr/bin/env bash
# Runs the README's Python install line as a user would, from nothing: a fresh
# venv, pip building the extension with a CMake folder of its own (no build
# tree reused), offline, with Debian's packages only. Then imports the installed
# package from another folder and checks it against torch.load on a fixture.
# (The package's full tests run in CTest, PythonPackageTest, against a wheel
# packaged from the test build.) Takes a few minutes on 2 cores.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
fixtures="${WEIGHTSTORE_FIXTURES_DIR:-$root/../shared/fixtures}/burn"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

cd "$root"
/usr/bin/python3 -m venv --system-site-packages "$work/venv"
"$work/venv/bin/pip" install --no-index --no-build-isolation --quiet ./client/python

cd "$work"
env -u PYTHONPATH "$work/venv/bin/python" - "$fixtures" <<'PY'
import glob, os, sys
import torch
import weightstore

fixtures = sys.argv[1]
assert weightstore.__file__.startswith(sys.prefix), weightstore.__file__  # the installed copy
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
print(f"check-wheel: pip built and installed weightstore from nothing; {checked} fixtures match torch.load "
      f"(CUDA paths built in: {weightstore._native.has_cuda})")
PY

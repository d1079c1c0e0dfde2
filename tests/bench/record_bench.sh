#!/usr/bin/env bash
# Usage: tests/bench/record_bench.sh [BUILD_DIR] [RUNS]
# Migrating a Burn record (issue 29): `weightstore convert` of a 256 MB record
# (64 F32 tensors of 4 MiB, random) to Burnpack from its three common forms,
# each against the baseline that moves the same bytes, in the same run:
#   .mpk     (NamedMpkFileRecorder)  against dd of the .mpk into a file
#   .mpk.gz  (NamedMpkGzFileRecorder) against zcat of it into a file
#   .json.gz (JsonGzFileRecorder)    against zcat of it into a file
# Every output is fsynced (weightstore's writer does; dd conv=fsync), the page
# cache is warm (each input is read once first), and each figure is the median
# of RUNS (default 5). The records are written by the msgpack package and
# Python's gzip, as Burn writes them (rmp-serde's compact encoding; gzip level
# 6; serde_json's integer arrays for bytes), not by weightstore.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
B="$(cd "${1:-$here/build}" && pwd)"; RUNS="${2:-5}"
PY="$here/build-tools/venv/bin/python"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT

"$PY" - "$W" <<'PY'
import gzip, os, sys
import msgpack, numpy as np
w = sys.argv[1]
rng = np.random.default_rng(29)
n, per = 64, (4 << 20) // 4
tensors = [rng.standard_normal(per, dtype=np.float32) for _ in range(n)]
meta = {"float": "f32", "int": "i32",
        "format": "burn_core::record::file::NamedMpkFileRecorder<burn_core::record::settings::FullPrecisionSettings>",
        "version": "0.21.0", "settings": "FullPrecisionSettings"}
def param(i, t):
    return {"id": f"{i:013d}", "param": {"bytes": t.tobytes(), "shape": [per], "dtype": "F32"}}
record = {"metadata": meta, "item": {"layers": [{"weight": param(i, t)} for i, t in enumerate(tensors)]}, "_b": []}
data = msgpack.packb(record, use_bin_type=True)
open(os.path.join(w, "model.mpk"), "wb").write(data)
open(os.path.join(w, "model.mpk.gz"), "wb").write(gzip.compress(data, 6))

def json_bytes(t):
    """serde_json's array of integers for bytes, built without a Python int per byte."""
    b = np.frombuffer(t.tobytes(), dtype=np.uint8)
    digits = 1 + (b >= 10) + (b >= 100)
    ends = np.cumsum(digits + 1)  # each value and its comma
    out = np.empty(int(ends[-1]), dtype=np.uint8)
    starts = ends - digits - 1
    hundreds, tens, ones = b // 100, (b // 10) % 10, b % 10
    three, two = digits == 3, digits >= 2
    out[starts[three]] = 48 + hundreds[three]
    out[(starts + digits - 2)[two]] = 48 + tens[two]
    out[starts + digits - 1] = 48 + ones
    out[ends - 1] = ord(",")
    return b"[" + out[:-1].tobytes() + b"]"

import json
with gzip.open(os.path.join(w, "model.json.gz"), "wb", compresslevel=6) as f:
    f.write(b'{"metadata":' + json.dumps(meta, separators=(",", ":")).encode() + b',"item":{"layers":[')
    for i, t in enumerate(tensors):
        f.write((b"," if i else b"") + b'{"weight":{"id":"' + f"{i:013d}".encode() + b'","param":{"bytes":')
        f.write(json_bytes(t))
        f.write(b',"shape":[' + str(per).encode() + b'],"dtype":"F32"}}}')
    f.write(b']},"_b":null}')
PY

median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
seconds() { local t0 t1; t0=$(date +%s.%N); "$@" >/dev/null 2>&1; t1=$(date +%s.%N); echo "$t1 - $t0" | bc; }
to_file() { zcat "$1" | dd of="$2" bs=4M conv=fsync status=none; }
for f in "$W"/model.*; do cat "$f" >/dev/null; done  # a warm page cache
bytes=$(stat -c %s "$W/model.mpk")
printf "record: %d tensor bytes; .mpk %s B, .mpk.gz %s B, .json.gz %s B (JSON inflated: %s B)\n" \
  $((64 << 22)) "$bytes" "$(stat -c %s "$W/model.mpk.gz")" "$(stat -c %s "$W/model.json.gz")" \
  "$(zcat "$W/model.json.gz" | wc -c)"
printf "%-9s %10s %10s %8s %10s\n" form convert baseline ratio "GB/s"
for form in mpk mpk.gz json.gz; do
  conv=(); base=()
  for _ in $(seq "$RUNS"); do
    rm -f "$W/out.bpk" "$W/out.raw"
    conv+=("$(seconds "$B/client/weightstore" convert --no-progress "$W/model.$form" "$W/out.bpk")")
    if [ "$form" = mpk ]; then
      base+=("$(seconds dd if="$W/model.mpk" of="$W/out.raw" bs=4M conv=fsync status=none)")
    else
      base+=("$(seconds to_file "$W/model.$form" "$W/out.raw")")
    fi
  done
  c=$(printf "%s\n" "${conv[@]}" | median); b=$(printf "%s\n" "${base[@]}" | median)
  printf "%-9s %9.3fs %9.3fs %7.0f%% %10.2f\n" "$form" "$c" "$b" "$(echo "100 * $b / $c" | bc -l)" \
    "$(echo "$bytes / $c / 1000000000" | bc -l)"
done
"$B/client/weightstore" inspect "$W/out.bpk" | head -4

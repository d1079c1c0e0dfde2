#!/usr/bin/env bash
# Runs each libFuzzer target (built with clang 14 under ASan + UBSan into
# build-asan/ by scripts/build-sanitized.sh, which this calls unless
# WEIGHTSTORE_SKIP_BUILD is set) for a short time, seeded from ../shared/fixtures
# (copied into the build folder, never into the project) and, for request_fuzz,
# from the requests of issue 11's attacks. Usage: scripts/run-fuzzers.sh [SECONDS_PER_TARGET]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-20}"
build=build-asan
fixtures="${WEIGHTSTORE_FIXTURES_DIR:-$(pwd)/../shared/fixtures}"

[ -n "${WEIGHTSTORE_SKIP_BUILD:-}" ] || scripts/build-sanitized.sh

seed() {  # seed TARGET FILES...
  local dir="$build/corpus/$1"; shift
  mkdir -p "$dir"
  for f in "$@"; do cp -f "$f" "$dir/" 2>/dev/null || true; done
}
seed safetensors_fuzz "$fixtures"/burn/safetensors/*
seed burnpack_fuzz "$fixtures"/burn/burnpack/*
seed zip_fuzz "$fixtures"/burn/pytorch-reader/float32.pt "$fixtures"/burn/pytorch-models/*.pt
seed pytorch_fuzz "$fixtures"/burn/pytorch-reader/*.pt
seed burn_record_fuzz "$fixtures"/burn-records/*.mpk "$fixtures"/burn-records/*.bin
# Burn's gzip and JSON records, which no public repository had: gzip of the
# fixtures (flate2's level 6, one member), and a small record in each JSON
# form with both tensor layouts and a Bool(U32) store.
python3 - "$fixtures/burn-records" "$build/corpus/burn_record_fuzz" <<'PY'
import gzip, json, os, sys
src, out = sys.argv[1], sys.argv[2]
for name in ("connect4_0.16.1.mpk", "mnistweb_0.21.bin"):
    with open(os.path.join(src, name), "rb") as f:
        data = f.read()
    with open(os.path.join(out, name + ".gz"), "wb") as f:
        f.write(gzip.compress(data, 6, mtime=0))
meta = {"float": "f32", "int": "i32", "format": "seed", "version": "0.16.0", "settings": "FullPrecisionSettings"}
param = lambda i, p: {"id": i, "param": p}
item = {
    "layers": [{"weight": param("0400000000000", {"bytes": [0, 0, 128, 63, 0, 0, 0, 64], "shape": [2], "dtype": "F32"})}],
    "old": param("5c0b5a1e-8f0a-4e55-9a6c-2f4d0e8b7c11", {"value": [1.0, -2.5], "shape": [2]}),
    "mask": param("0800000000000", {"bytes": [1, 0, 0, 0], "shape": [1], "dtype": {"Bool": "U32"}}),
    "dropout": None,
}
record = {"metadata": meta, "item": item, "_b": None}
with open(os.path.join(out, "small.json"), "w") as f:
    json.dump(record, f, indent=2)
with open(os.path.join(out, "small.json.gz"), "wb") as f:
    f.write(gzip.compress(json.dumps(record, separators=(",", ":")).encode(), 6, mtime=0))
PY
# A file of every SafeTensors dtype (safetensors 0.8's 22; issue 27), each a
# [2, 4] tensor of random bits next to an F32.
python3 - "$build/corpus/safetensors_fuzz" <<'PY'
import json, os, struct, sys
bits = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
        "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
        "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
for dtype, b in bits.items():
    data = os.urandom(8 * b // 8)
    header = json.dumps({"f": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "t": {"dtype": dtype, "shape": [2, 4], "data_offsets": [8, 8 + len(data)]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(os.path.join(sys.argv[1], "dtype_" + dtype.lower()), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + bytes(8) + data)
PY
# .pt files of torch 2.13's newer dtypes, read and refused, where the Python
# test environment is (scripts/python-env.sh).
if [ -x build-tools/venv/bin/python ]; then
  build-tools/venv/bin/python - "$build/corpus/pytorch_fuzz" "$build/corpus/zip_fuzz" <<'PY'
import os, sys, torch
for d in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "complex64", "complex128",
          "bits8", "uint16"):
    t = torch.zeros(4, dtype=torch.uint8).view(getattr(torch, d)) if "float" in d or "bits" in d else \
        torch.zeros(2, dtype=getattr(torch, d))
    for out in sys.argv[1:]:
        torch.save({"fine": torch.ones(2), "t": t}, os.path.join(out, f"dtype_{d}.pt"))
PY
fi
mkdir -p "$build/corpus/chunk_fuzz"
# A seed chunk stream: one tensor "w" (F32 [2]) in one chunk, with its CRC32C.
printf '\x2b\x00\x0a\x0f\x0a\x01w\x12\x03F32\x1a\x01\x02\x20\x08\x10\x00\x18\x00\x28\x01\x35\x00\x00\x00\x00\x3a\x02v1\x22\x08\x00\x00\x80\x3f\x00\x00\x00\x40' \
  > "$build/corpus/chunk_fuzz/one_tensor"
# A regression: an empty tensor's null destination reached memcpy (UBSan).
echo 'KwAgCBAAGAAo/DQAKwAKDwoBdxIDRjMyGgUCIAArCCEAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAYAAgQNQAEAAAAQA==' \
  | base64 -d > "$build/corpus/chunk_fuzz/empty_tensor_memcpy"
# The codec's golden chunks as one stream, and the attack of a description
# after the data it would place (fixed in ChunkAssembler; see its tests).
python3 - tests/testdata/tensor_chunks.golden.json "$build/corpus/chunk_fuzz" <<'PY'
import json, struct, sys
golden, out = sys.argv[1], sys.argv[2]
record = lambda b: struct.pack("<H", len(b)) + b
chunks = [bytes.fromhex(c["hex"]) for c in json.load(open(golden))]
open(out + "/golden_stream", "wb").write(b"".join(record(c) for c in chunks))
info = lambda name, n: b"\x0a" + bytes([len(name)]) + name + b"\x12\x02U8\x1a\x01" + bytes([n]) + b"\x20" + bytes([n])
field = lambda tag, b: bytes([tag, len(b)]) + b
begin = field(0x0a, info(b"w", 6))
attack = b"\x18\x00" + field(0x22, b"abcdef") + field(0x0a, info(b"x", 1))
overflow = b"\x18\x06" + field(0x22, b"z" * 64)
open(out + "/info_after_data", "wb").write(record(begin) + record(attack) + record(overflow))
PY
mkdir -p "$build/corpus/pickle_fuzz"
python3 - "$fixtures" "$build/corpus/pickle_fuzz" <<'PY'
import sys, zipfile, glob, os
src, out = sys.argv[1], sys.argv[2]
for p in glob.glob(os.path.join(src, "burn", "pytorch-*", "*.pt")):
    if zipfile.is_zipfile(p):
        with zipfile.ZipFile(p) as z:
            for n in z.namelist():
                if n.endswith("data.pkl"):
                    open(os.path.join(out, os.path.basename(p) + ".pkl"), "wb").write(z.read(n))
PY

mkdir -p "$build/corpus/element_patch_fuzz"
# A positions patch and a runs patch of 8 two-byte elements: the fuzzer's
# header (encoding, element size, elements, changed), then the body.
printf '\x01\x01\x08\x00\x02\x00\x02\x01\x03abcd' >"$build/corpus/element_patch_fuzz/positions"
printf '\x02\x01\x08\x00\x03\x00\x01\x02\x02abcdef' >"$build/corpus/element_patch_fuzz/runs"

mkdir -p "$build/corpus/request_fuzz"
"$build/tests/fuzz/request_fuzz_seeds" "$build/corpus/request_fuzz" >/dev/null

# request_fuzz runs a whole daemon in the process: larger inputs (a target
# schema), a per-input time limit, and no leak check at exit (gRPC's threads).
declare -A extra=([request_fuzz]="-max_len=1048576 -timeout=20 -detect_leaks=0"
                  [burn_record_fuzz]="-max_len=2097152")  # the fixtures: up to 1.9 MB
status=0
for target in safetensors_fuzz burnpack_fuzz pickle_fuzz zip_fuzz pytorch_fuzz burn_record_fuzz element_patch_fuzz chunk_fuzz request_fuzz; do
  echo "== $target (${seconds}s)"
  # shellcheck disable=SC2086
  if ! "$build/tests/fuzz/$target" -max_total_time="$seconds" -rss_limit_mb=2048 -max_len=65536 \
       ${extra[$target]:-} -artifact_prefix="$build/$target-" -print_final_stats=1 "$build/corpus/$target" \
       2>"$build/$target.log"; then
    echo "$target FAILED; last lines of $build/$target.log:"; tail -40 "$build/$target.log"; status=1
  else
    grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$build/$target.log" | tr '\n' ' '; echo
  fi
done
exit $status

#!/usr/bin/env bash
# Usage: tests/bench/origin_s3_bench.sh [BUILD_DIR]
# A node pulling a 1 GiB checkpoint from a local S3-protocol server (npm's
# s3rver, on loopback) with K parallel ranges, against one `curl` GET of the
# same object in the same run; then how long 4 processes on the node, started
# together once it is pulled, take to map it through the socket
# (tests/tools/shm_probe), as processes of another uid that get the files
# themselves (--socket-file-segments always; a peer that could write the file
# would get a sealed copy instead). Needs s3rver in
# build-tools/ (scripts/install-deps.sh) and python3-numpy.
set -u
here="$(cd "$(dirname "$0")/../.." && pwd)"
B="$(cd "${1:-$here/build}" && pwd)"
BUF="$here/build-tools/node_modules/.bin/buf"
S3RVER="$here/build-tools/node_modules/.bin/s3rver"
W="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$W"' EXIT
mkdir -p "$W/s3" "$W/src"
W="$W" /usr/bin/python3 - <<'PY'
import numpy as np, json, struct, os
n = 64; per = (1 << 30) // n // 4
hdr = {}; off = 0
for i in range(n):
    hdr[f"w.{i}"] = {"dtype": "F32", "shape": [per], "data_offsets": [off, off + per * 4]}; off += per * 4
h = json.dumps(hdr).encode(); h += b" " * ((8 - len(h) % 8) % 8)
with open(os.environ["W"] + "/src/big.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(h))); f.write(h)
    rng = np.random.default_rng(0)
    for i in range(n): f.write(rng.standard_normal(per, dtype=np.float32).tobytes())
PY
dd if=/dev/zero of="$W/warm" bs=1M count=3072 status=none; rm -f "$W/warm"
"$S3RVER" --directory "$W/s3" --address 127.0.0.1 --port 45690 --silent --configure-bucket models > "$W/s3rver.log" 2>&1 &
sleep 2
url=http://127.0.0.1:45690/models/big.safetensors
# An unsigned PUT (s3rver accepts it) puts the object there.
curl -sf -T "$W/src/big.safetensors" -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" "$url" > /dev/null ||
  { echo "upload failed"; cat "$W/s3rver.log"; exit 1; }
export AWS_ENDPOINT_URL=http://127.0.0.1:45690 AWS_ACCESS_KEY_ID=S3RVER AWS_SECRET_ACCESS_KEY=S3RVER AWS_REGION=us-east-1
for k in 1 4 8; do
  for run in 1 2; do
    t0=$(date +%s.%N); curl -sf -o "$W/curl.out" "$url"; t1=$(date +%s.%N); rm -f "$W/curl.out"
    get=$(echo "$t1 - $t0" | bc)
    mkdir -p "$W/n"
    "$B/server/weightstored" --models "$W/n" --listen 127.0.0.1:45691 --socket "$W/ws.sock" \
      --origin s3://models --origin-parallel-reads $k --socket-file-segments always 2> "$W/node.log" &
    NP=$!
    sleep 1.5
    t0=$(date +%s.%N)
    out=$("$BUF" curl --protocol grpc --http2-prior-knowledge -d '{"name":"big"}' \
      http://127.0.0.1:45691/weightstore.v1.WeightStore/PullCheckpoint)
    t1=$(date +%s.%N)
    probes=()
    for p in 1 2 3 4; do
      "$B/tests/shm_probe" "$W/ws.sock" big > "$W/probe$p.log" 2>&1 &
      probes+=($!)
    done
    wait "${probes[@]}"
    pull=$(echo "$t1 - $t0" | bc)
    # Each probe's connect + map (before it reads the bytes), the slowest of 4.
    map_ms=$(grep -h -o "loaded_ms=[0-9.]*" "$W"/probe*.log | cut -d= -f2 | sort -n | tail -1)
    echo "K=$k run $run: curl GET ${get}s ($(echo "1.073741824 / $get" | bc -l | cut -c1-5) GB/s);" \
      "node pull ${pull}s ($(echo "1.073741824 / $pull" | bc -l | cut -c1-5) GB/s, $(echo "$get / $pull" | bc -l | cut -c1-5)x the GET);" \
      "then 4 processes at once each mapped it in at most ${map_ms} ms ($(grep -l loaded_ms "$W"/probe*.log | wc -l)/4 probes)"
    echo "$out" | grep -q '"checkpoint"' || { echo "pull failed: $out"; cat "$W/node.log"; }
    kill $NP; wait $NP 2>/dev/null
    rm -rf "$W/n" "$W/ws.sock"
  done
done

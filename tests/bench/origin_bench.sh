#!/usr/bin/env bash
# Usage: tests/bench/origin_bench.sh [BUILD_DIR]
# A node pulling 1 GiB from an upstream weightstored (PullCheckpoint), against a
# single-client gRPC fetch of the same checkpoint into a file, in the same run.
# Both write 1 GiB to the same disk; each run removes what it wrote, so both
# write into memory the guest has touched before (on a VM, first-touched
# memory costs several times more: the first pwrite of 1 GiB took 1.3 s here,
# the next 0.2 s).
set -u
here="$(cd "$(dirname "$0")/../.." && pwd)"
B="$(cd "${1:-$here/build}" && pwd)"; BUF="$here/build-tools/node_modules/.bin/buf"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
mkdir -p $W/o
W="$W" /usr/bin/python3 - <<'PY'
import numpy as np, json, struct
n=64; per=(1<<30)//n//4
hdr={}; off=0
for i in range(n):
    hdr[f"w.{i}"]={"dtype":"F32","shape":[per],"data_offsets":[off,off+per*4]}; off+=per*4
h=json.dumps(hdr).encode(); h+=b" "*((8-len(h)%8)%8)
import os
with open(os.environ["W"] + "/o/big.safetensors","wb") as f:
    f.write(struct.pack("<Q",len(h))); f.write(h)
    rng=np.random.default_rng(0)
    for i in range(n): f.write(rng.standard_normal(per,dtype=np.float32).tobytes())
PY
# Touch 3 GiB of page cache once, so no run pays for memory first.
dd if=/dev/zero of=$W/warm bs=1M count=3072 status=none; rm -f $W/warm
$B/server/weightstored --models $W/o --listen 127.0.0.1:50601 2>$W/origin.log & OP=$!
sleep 2
for run in 1 2 3 4 5; do
  rm -f $W/out.safetensors; sync
  t0=$(date +%s.%N); $B/client/weightstore fetch big $W/out.safetensors --server 127.0.0.1:50601 --no-progress >/dev/null; t1=$(date +%s.%N)
  fetch=$(echo "$t1 - $t0" | bc)
  rm -rf $W/n$run; mkdir -p $W/n$run
  $B/server/weightstored --models $W/n$run --listen 127.0.0.1:5061$run --origin grpc://127.0.0.1:50601 2>$W/node$run.log & NP=$!
  sleep 1.5
  t0=$(date +%s.%N)
  out=$($BUF curl --protocol grpc --http2-prior-knowledge -d '{"name":"big"}' http://127.0.0.1:5061$run/weightstore.v1.WeightStore/PullCheckpoint)
  t1=$(date +%s.%N)
  pull=$(echo "$t1 - $t0" | bc)
  echo "run $run: fetch into a file ${fetch}s ($(echo "1.073741824 / $fetch" | bc -l | cut -c1-5) GB/s); node pull ${pull}s ($(echo "1.073741824 / $pull" | bc -l | cut -c1-5) GB/s), pull/fetch speed $(echo "$fetch / $pull" | bc -l | cut -c1-5); server-side $(echo "$out" | grep seconds)"
  kill $NP; wait $NP 2>/dev/null
  rm -rf $W/n$run $W/out.safetensors
done
kill $OP; wait $OP 2>/dev/null


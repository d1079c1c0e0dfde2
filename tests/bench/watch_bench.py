"""watch_bench: what idle watchers cost weightstored when a large checkpoint
is republished (issue 26, findings 1 and 5).

A checkpoint of --tensors tensors (one F32 each, names of --name-bytes) is
served by a fresh weightstored; --watchers WatchCheckpoints streams follow it
and never read. The checkpoint is then republished --versions times with its
first --changed tensors changed: a REPLACED event names them (20,000 names of
48 bytes: just under the 1 MiB of names an event lists).
Printed: the daemon's RSS before and after (and its peak), the time each
Rescan call took to publish (the watchers' events are made after it returns),
and the same with no watchers, in the same run.

Usage: build-tools/venv/bin/python tests/bench/watch_bench.py [--build build] [--tensors 100000]
       [--watchers 256] [--versions 5] [--changed 20000]
"""
import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time

from bench_daemon import rss_kib

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def write_checkpoint(path, names, seed, changed):
    """A SafeTensors file of one F32 per name: `seed` in tensors [0, changed),
    0 in the rest; written and renamed as a trainer publishes."""
    header = {n: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i, n in enumerate(names)}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    data = b"".join(struct.pack("<f", float(seed if i < changed else 0)) for i in range(len(names)))
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    os.replace(path + ".tmp", path)



def run(args, watchers):
    sys.path.insert(0, os.path.join(args.build, "python"))
    import grpc
    from weightstore.v1 import weight_store_pb2 as pb, weight_store_pb2_grpc as pb_grpc

    work = tempfile.mkdtemp(prefix="weightstore-watch-bench-")
    models = os.path.join(work, "models")
    os.makedirs(models)
    names = [f"model.layers.{i}.mlp." + "w" * max(0, args.name_bytes - 24) for i in range(args.tensors)]
    path = os.path.join(models, "big.safetensors")
    write_checkpoint(path, names, 0, 0)
    port_file = os.path.join(work, "port")
    daemon = subprocess.Popen([os.path.join(args.build, "server", "weightstored"), "--models", models, "--listen",
                               "127.0.0.1:0", "--port-file", port_file, "--max-watches", str(max(watchers, 1) + 8),
                               "--max-watches-per-peer", str(max(watchers, 1) + 8), "--log-level", "error"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            time.sleep(0.05)
        address = "127.0.0.1:" + open(port_file).read().strip()
        # Connections of their own (grpcio shares one per target otherwise),
        # each under the daemon's streams per connection.
        local = [("grpc.use_local_subchannel_pool", 1)]
        channels = [grpc.insecure_channel(address, options=local) for _ in range(max(1, watchers // 64 + 1))]
        calls = []
        for i in range(watchers):  # streams opened, never read
            stub = pb_grpc.WeightStoreStub(channels[i % len(channels)])
            calls.append(stub.WatchCheckpoints(pb.WatchCheckpointsRequest(name="big")))
        admin = pb_grpc.WeightStoreStub(grpc.insecure_channel(address, options=local))
        time.sleep(1.0)  # the streams are open and have their first events
        before = rss_kib(daemon.pid, "VmRSS")
        publish = []
        for v in range(1, args.versions + 1):
            write_checkpoint(path, names, v, args.changed)
            start = time.perf_counter()
            admin.Rescan(pb.RescanRequest(), timeout=600)
            publish.append(time.perf_counter() - start)
        time.sleep(2.0)  # the events are made
        after, peak = rss_kib(daemon.pid, "VmRSS"), rss_kib(daemon.pid, "VmHWM")
        for call in calls:
            call.cancel()
        time.sleep(2.0)
        left = rss_kib(daemon.pid, "VmRSS")
        return before, after, peak, left, publish
    finally:
        daemon.terminate()
        daemon.wait(timeout=120)
        shutil.rmtree(work, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--tensors", type=int, default=100000)
    parser.add_argument("--name-bytes", type=int, default=48)
    parser.add_argument("--watchers", type=int, default=256)
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--changed", type=int, default=20000)
    args = parser.parse_args()
    print(f"watch_bench: {args.tensors} tensors (names of {args.name_bytes} bytes), {args.changed} changed per "
          f"version, {args.versions} versions; this run's daemon at {args.build}")
    for watchers in (0, args.watchers):
        before, after, peak, left, publish = run(args, watchers)
        print(f"  {watchers:4d} idle watchers: RSS {before / 1024:.0f} -> {after / 1024:.0f} MiB (peak "
              f"{peak / 1024:.0f}, {left / 1024:.0f} after they left); publish (Rescan) median "
              f"{statistics.median(publish) * 1e3:.0f} ms, max {max(publish) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()

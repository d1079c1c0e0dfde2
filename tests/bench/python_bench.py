"""python_bench: loading a 1 GiB checkpoint into framework tensors from a running
weightstored, beside torch.load of the same weights saved as .pt, in one run.

Rows: torch.load; the Python client through the same-host socket (zero-copy
torch tensors) and over gRPC; a C++ process (tests/shm_probe) through the
socket and over gRPC. The daemon serves the very .pt file torch.load reads.
The page cache is warm for every row. Medians of --repeat runs.

Usage: /usr/bin/python3 tests/bench/python_bench.py [--build build] [--gb 1] [--repeat 3]
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--gb", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("WEIGHTSTORE_PYTHON_STUBS", os.path.join(args.build, "python"))
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))
    from weightstore_client import RemoteClient, SocketClient

    work = tempfile.mkdtemp(prefix="weightstore-py-bench-")
    models, socket_path, port_file = f"{work}/models", f"{work}/ws.sock", f"{work}/port"
    os.makedirs(models)
    count = (args.gb << 30) // (4 << 20)
    state = {f"layers.{i}.weight": torch.full((1024, 1024), float(i)) for i in range(count)}
    path = f"{models}/big.pt"
    torch.save(state, path)
    del state
    with open(path, "rb") as f:  # warm the page cache
        while f.read(64 << 20):
            pass
    daemon = subprocess.Popen([f"{args.build}/server/weightstored", "--models", models, "--listen", "127.0.0.1:0",
                               "--socket", socket_path, "--socket-file-segments", "always",  # trusted: maps the files
                               "--port-file", port_file], stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            if os.path.exists(port_file):
                break
            time.sleep(0.05)
        address = "127.0.0.1:" + open(port_file).read().strip()
        probe = f"{args.build}/tests/shm_probe"

        def timed(fn):
            runs = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                result = fn()
                runs.append((time.perf_counter() - start) * 1e3)
                del result
            return statistics.median(runs)

        def probe_ms(*extra):
            runs = []
            for _ in range(args.repeat):
                out = subprocess.run([probe, socket_path, "big", *extra], check=True, capture_output=True, text=True)
                line = [l for l in out.stdout.splitlines() if l.startswith("loaded_ms=")][0]
                runs.append(float(line.split()[0].split("=")[1]))
            return statistics.median(runs)

        SocketClient(socket_path).fetch("big")  # the daemon's first request computes checksums once
        rows = [
            ("torch.load(.pt)", timed(lambda: torch.load(path))),
            ("Python, socket: SocketClient.fetch (zero-copy)", timed(lambda: SocketClient(socket_path).fetch("big"))),
            ("Python, gRPC: RemoteClient.fetch", timed(lambda: RemoteClient(address).fetch("big"))),
            ("C++, socket: MapTensors (shm_probe)", probe_ms()),
            ("C++, gRPC: FetchAll (shm_probe --remote)", probe_ms("--remote", address)),
        ]
    finally:
        daemon.terminate()
        daemon.wait()
        shutil.rmtree(work)
    size_mib = count * 4
    print(f"python_bench: {size_mib} MiB in {count} F32 tensors of 4 MiB (.pt, zip), page cache warm, "
          f"median of {args.repeat}\n")
    baseline = rows[0][1]
    print(f"{'path':52} {'ms':>10} {'GB/s':>8} {'vs torch.load':>14}")
    for label, ms in rows:
        print(f"  {label:50} {ms:10.2f} {size_mib / 1024 * 1.073741824 / (ms / 1e3):8.2f} {baseline / ms:13.1f}x")


if __name__ == "__main__":
    main()

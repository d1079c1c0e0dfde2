"""python_bench: loading a 1 GiB checkpoint into framework tensors from a running
weightstored, beside torch.load of the same weights saved as .pt, in one run.

Rows: a plain TCP loopback stream of the same bytes into fresh memory (4 KiB
pages and huge pages: "vs raw TCP" is against the faster); torch.load; the `weightstore` package (the C++ client's extension, from
<build>/python) through the same-host socket (zero-copy torch tensors) and over
gRPC, its bytes on the stream and over the daemon's data lane; a C++ process
(tests/shm_probe) through the socket and over gRPC (with the lane). The
last line is this process's peak RSS. The daemon serves the very .pt file torch.load reads.
The page cache is warm for every row. Medians of --repeat runs.

Usage: build-tools/venv/bin/python tests/bench/python_bench.py [--build build] [--gb 1] [--repeat 3]
"""
import argparse
import mmap
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def raw_tcp(size, huge):
    """A plain TCP loopback stream of `size` bytes into fresh private memory
    (advised for huge pages, or not), 4 MiB per recv_into: what the wire
    gives before any protocol. Returns the memory."""
    listener = socket.create_server(("127.0.0.1", 0))
    chunk = bytes(range(256)) * (16 << 10)  # 4 MiB, warm

    def send():
        with socket.create_connection(listener.getsockname()) as out:
            for at in range(0, size, len(chunk)):
                out.sendall(memoryview(chunk)[:min(len(chunk), size - at)])

    writer = threading.Thread(target=send)
    writer.start()
    conn, _ = listener.accept()
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        buffer.madvise(mmap.MADV_HUGEPAGE)
    view, got = memoryview(buffer), 0
    while got < size:
        n = conn.recv_into(view[got:], min(len(chunk), size - got))
        if n == 0:
            raise RuntimeError(f"raw TCP: the stream ended after {got} of {size} bytes")
        got += n
    writer.join()
    conn.close()
    listener.close()
    view.release()
    return buffer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--gb", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(args.build, "python"))  # the package as built (or pip-install it)
    import weightstore

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
                               "--data-listen", "127.0.0.1:0", "--port-file", port_file], stderr=subprocess.DEVNULL)
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

        weightstore.connect("unix:" + socket_path).tensors("big")  # the daemon computes checksums once
        rows = [("torch.load(.pt)", timed(lambda: torch.load(path)))]
        size = count * (4 << 20)
        tcp = [("raw TCP loopback into fresh 4 KiB pages", timed(lambda: raw_tcp(size, huge=False))),
               ("raw TCP loopback into fresh huge pages", timed(lambda: raw_tcp(size, huge=True)))]
        weightstore.tune_allocator_for_streaming()  # as the C++ probe does (after torch.load's row)
        rows += [
            ("Python, socket: weightstore tensors() (zero-copy)",
             timed(lambda: weightstore.connect("unix:" + socket_path).tensors("big"))),
            ("Python, gRPC: weightstore tensors(), stream only",
             timed(lambda: weightstore.connect(address, data_lane=False).tensors("big"))),
            ("Python, gRPC: weightstore tensors(), data lane",
             timed(lambda: weightstore.connect(address).tensors("big"))),
            ("C++, socket: MapTensors (shm_probe)", probe_ms()),
            ("C++, gRPC: FetchAll (shm_probe --remote)", probe_ms("--remote", address)),
        ]
        # Peak RSS of a fresh Python process that fetches everything over gRPC.
        # (VmHWM, not ru_maxrss: that one carries the forking parent's peak across exec.)
        script = ("import sys, torch, weightstore\n"
                  "def hwm():\n"
                  "    return int([l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1])\n"
                  "before = hwm()\n"
                  "t = weightstore.connect(sys.argv[1]).tensors('big')\n"
                  "print(before, hwm())\n")
        out = subprocess.run([sys.executable, "-c", script, address], check=True, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": os.path.join(args.build, "python")})
        rss_before_kib, rss_peak_kib = map(int, out.stdout.split())
    finally:
        daemon.terminate()
        daemon.wait()
        shutil.rmtree(work)
    size_mib = count * 4
    print(f"python_bench: {size_mib} MiB in {count} F32 tensors of 4 MiB (.pt, zip), page cache warm, "
          f"median of {args.repeat}\n")
    baseline = rows[0][1]
    wire = min(ms for _, ms in tcp)  # the faster of the two: the wire's speed here
    print(f"{'path':52} {'ms':>10} {'GB/s':>8} {'vs torch.load':>14} {'vs raw TCP':>11}")
    for label, ms in tcp + rows:
        print(f"  {label:50} {ms:10.2f} {size_mib / 1024 * 1.073741824 / (ms / 1e3):8.2f} {baseline / ms:13.1f}x"
              f" {'-' if 'socket' in label else f'{100 * wire / ms:.0f}%':>11}")
    print(f"\npeak RSS of a Python process fetching all {size_mib} MiB over gRPC: {rss_peak_kib / 1024:.0f} MiB "
          f"({rss_before_kib / 1024:.0f} MiB after importing torch and weightstore; the fetch added "
          f"{(rss_peak_kib - rss_before_kib) / 1024 / size_mib:.2f}x the checkpoint)")


if __name__ == "__main__":
    main()

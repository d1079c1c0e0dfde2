"""peers_bench: weightstore against the loaders a user picks instead, in one run.

Writes --gb GiB of BF16 weights (tensors of --tensor-mb MiB) with the
`safetensors` library, the same state dict with torch.save and with
tensorizer's TensorSerializer, warms the page cache, starts weightstored on
127.0.0.1 port 0 with --socket over the SafeTensors file, then times, in a
fresh process per row (tests/bench/loader_child.py), rows taking turns in a new
order each round (--runs rounds, medians printed):

  the limits        the file's bytes into fresh private memory on every usable
                    core (at most 8), advised for huge pages or not
  safetensors       load_file (its default: views of a mapping of the file) and
                    load_file(backend="pread")
  torch.load        of the .pt, mmap=True (views of a mapping)
  Run:ai            runai_model_streamer's SafetensorsStreamer: its default
                    (O_DIRECT reads through io_uring or libaio where it can),
                    and buffered reads on 16 threads
                    (RUNAI_STREAMER_FS_STRATEGY=sync_buffered,
                    RUNAI_STREAMER_FS_QUEUE_DEPTH=16)
  fastsafetensors   SafeTensorsFileLoader(nogds=True) on the CPU, its two I/O
                    modes: O_DIRECT pread and buffered pread
                    (FASTSAFETENSORS_ODIRECT=1 / 0)
  tensorizer        TensorDeserializer(device="cpu") of the .tensors file
  weightstore       store.tensors over the same-host socket (views of the
                    daemon's shared memory, and each cloned), over gRPC, and
                    from the file (file:); connect() inside the timing
  torch copy_       of the mapped file into one buffer, one thread

InstantTensor is not a row: it loads onto CUDA devices only (its safe_open
asserts a CUDA device).

Every row that makes tensors is checked equal to load_file's (a digest of
every name, dtype, shape and byte), and says whether its tensors own their
memory or view a mapping. Peak RSS is the child's.

Usage (the peers' venv: scripts/peers-env.sh):
  PYTHONPATH=build/python build-tools/peers-venv/bin/python tests/bench/peers_bench.py [--gb 1] [--runs 5]
"""
import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile

import bench_daemon

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LOADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "loader_child.py")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--gb", type=float, default=1)
    parser.add_argument("--tensor-mb", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    import torch
    from safetensors.torch import save_file
    from tensorizer import TensorSerializer

    work = tempfile.mkdtemp(prefix="weightstore-peers-bench-")
    daemon = None
    try:
        models, other = os.path.join(work, "models"), os.path.join(work, "other")
        os.makedirs(models)
        os.makedirs(other)
        path = os.path.join(models, "m.safetensors")
        pt, tz = os.path.join(other, "m.pt"), os.path.join(other, "m.tensors")
        elements = args.tensor_mb << 19  # BF16
        count = max(1, int(args.gb * 1024) // args.tensor_mb)
        g = torch.Generator().manual_seed(1)
        state = {f"layers.{i}.weight": torch.randn(elements, generator=g).to(torch.bfloat16) for i in range(count)}
        save_file(state, path)
        torch.save(state, pt)
        serializer = TensorSerializer(tz)
        serializer.write_state_dict(state)
        serializer.close()
        del state
        size = os.path.getsize(path)
        for f in (path, pt, tz):  # warm the page cache
            with open(f, "rb") as file:
                while file.read(64 << 20):
                    pass

        daemon, grpc, socket = bench_daemon.start(args.build, models, work)

        runai_buffered = {"RUNAI_STREAMER_FS_STRATEGY": "sync_buffered", "RUNAI_STREAMER_FS_QUEUE_DEPTH": "16"}
        rows = [  # label, mode, file, url, environment
            ("limit: copy into fresh huge pages, every core", "limit-huge", path, "", {}),
            ("limit: copy into fresh 4 KiB pages, every core", "limit-4k", path, "", {}),
            ("safetensors load_file (default)", "safetensors", path, "", {}),
            ("safetensors load_file(backend='pread')", "safetensors-pread", path, "", {}),
            ("torch.load(.pt, mmap=True)", "torch-mmap", pt, "", {}),
            ("Run:ai streamer 0.17, default", "runai", path, "", {}),
            ("Run:ai streamer 0.17, buffered, 16 threads", "runai", path, "", runai_buffered),
            ("fastsafetensors 0.5 nogds, O_DIRECT pread", "fastsafetensors", path, "", {"FASTSAFETENSORS_ODIRECT": "1"}),
            ("fastsafetensors 0.5 nogds, buffered pread", "fastsafetensors", path, "", {"FASTSAFETENSORS_ODIRECT": "0"}),
            ("tensorizer 2.12 (.tensors)", "tensorizer", tz, "", {}),
            ("weightstore socket: tensors", "weightstore", path, socket, {}),
            ("weightstore socket: tensors, each cloned", "weightstore-clone", path, socket, {}),
            ("weightstore gRPC: tensors", "weightstore-grpc", path, grpc, {}),
            ("weightstore file: tensors", "weightstore", path, "", {}),
            ("torch copy_ of the mapped file, 1 thread", "plain", path, "", {}),
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.path.join(args.build, "python") + os.pathsep + env.get("PYTHONPATH", "")
        times = {label: [] for label, *_ in rows}
        rss = {label: 0 for label, *_ in rows}
        digests, owned = {}, {}
        # New order each round: on this VM a process that fills fresh memory
        # right after another freed as much is much faster than one that
        # follows a process that held little (owned_copy_bench.py).
        for round_ in range(args.runs):
            order = list(rows)
            random.Random(round_).shuffle(order)
            for label, mode, file, url, extra in order:
                out = subprocess.run([sys.executable, LOADER, mode, file, url], env={**env, **extra}, check=True,
                                     capture_output=True, text=True).stdout.split()
                times[label].append(float(out[0]))
                rss[label] = max(rss[label], int(out[2]))
                owned[label] = out[3]
                if out[1] != "-":
                    if digests.setdefault(label, out[1]) != out[1]:
                        sys.exit(f"{label}: tensors differ between runs")
            print(f"  round {round_ + 1} of {args.runs} done", file=sys.stderr, flush=True)
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait()
        shutil.rmtree(work, ignore_errors=True)

    reference = digests["safetensors load_file (default)"]
    for label, value in digests.items():
        if value != reference:
            sys.exit(f"{label}: tensors differ from load_file's")

    import safetensors
    import tensorizer
    from importlib.metadata import version
    print(f"peers_bench: {size / 2**30:.2f} GiB of BF16 in {count} tensors of {args.tensor_mb} MiB, page cache "
          f"warm; {os.cpu_count()} CPUs; medians of {args.runs}, rows in a new order each round")
    print(f"torch {torch.__version__}, safetensors {safetensors.__version__}, runai-model-streamer "
          f"{version('runai-model-streamer')}, fastsafetensors {version('fastsafetensors')}, tensorizer "
          f"{tensorizer.__version__}")
    print("InstantTensor: not run, it loads onto CUDA devices only\n")
    # The limit is the faster of the two: on a VM whose balloon reports free
    # pages, 4 KiB pages fill faster than fresh huge ones (owned_copy_bench.py).
    limit = min(statistics.median(times[rows[0][0]]), statistics.median(times[rows[1][0]]))
    runai = statistics.median(times["Run:ai streamer 0.17, buffered, 16 threads"])
    print(f"  {'':<50} {'median':>9} {'GB/s':>6} {'x limit':>8} {'x Run:ai':>9}  {'tensors':<7} {'peak RSS':>9}")
    for label, *_ in rows:
        median = statistics.median(times[label])
        kind = "-" if label not in digests else owned[label]
        print(f"  {label:<50} {median * 1000:6.0f} ms {size / median / 1e9:6.2f} {median / limit:7.2f}x "
              f"{median / runai:8.2f}x  {kind:<7} {rss[label] / 2**20:5.0f} MiB")
    print("\nx limit: the row's time over the faster limit's; x Run:ai: over Run:ai's buffered row's "
          "(below 1: faster). tensors: 'owned' memory of the process's own, 'view' of a mapping.")


if __name__ == "__main__":
    main()

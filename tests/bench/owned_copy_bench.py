"""owned_copy_bench: a local SafeTensors file into memory the process owns, in one run.

Writes --gb GiB of BF16 weights (tensors of --tensor-mb MiB) with the
`safetensors` library, warms the page cache, then times, in child processes
taking turns (--runs each, medians printed):
  - weightstore `file:` store.tensors with one copying thread
    (WEIGHTSTORE_COPY_THREADS=1, what it did before), and with its default
    (every usable core, at most 8);
  - safetensors 0.8's load_file: its default (tensors that view a mapping of
    the file: no copy, not owned), and backend="pread" (owned);
  - torch.empty + copy_ of the mmapped file's bytes into one fresh buffer
    (one thread);
  - weightstore's default threads with WEIGHTSTORE_HUGE_PAGES=1 and =0
    (huge pages forced, and 4 KiB pages; the default picks one: 4 KiB on a VM
    that reports free pages to its hypervisor, as this one does);
  - weightstore's default with WEIGHTSTORE_PREFAULT=0 (each piece's pages
    faulted one at a time by the copy, not in one madvise first);
  - the limits: the file's bytes copied into fresh private memory, advised
    for huge pages or not, in 4 MiB pieces on every usable core (at most 8),
    as weightstore copies; and 4 KiB pages with each piece prefaulted
    (MADV_POPULATE_WRITE) first, as weightstore does.
Each child (tests/bench/loader_child.py) digests its tensors, checked equal to
load_file's, and reports its peak RSS.

Usage: build-tools/venv/bin/python tests/bench/owned_copy_bench.py [--build build] [--gb 1] [--runs 5] [--touch-gb 12]
"""
import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

LOADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "loader_child.py")  # one load per process

TOUCH = r"""
import mmap, sys
touched = mmap.mmap(-1, int(sys.argv[1]))
touched.madvise(mmap.MADV_HUGEPAGE)
for at in range(0, len(touched), 4096):
    touched[at] = 1
"""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--gb", type=float, default=1)
    parser.add_argument("--tensor-mb", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--touch-gb", type=float, default=0,
                        help="first touch (and free) this much fresh memory, so that the hypervisor backs it: "
                             "on this VM a page the guest never touched costs ~3 s/GiB at its first fault, "
                             "which falls on huge pages (taken from memory nobody touched yet) far more than on "
                             "4 KiB ones (recycled)")
    args = parser.parse_args()
    if args.touch_gb > 0:  # in a child: the rows' children would inherit this process's peak RSS
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", TOUCH, str(int(args.touch_gb * 2**30))], check=True)
        print(f"touched {args.touch_gb:g} GiB of fresh memory first in {time.perf_counter() - t0:.1f} s")

    import torch
    from safetensors.torch import save_file

    folder = tempfile.mkdtemp(prefix="owned-copy-bench-")
    path = os.path.join(folder, "m.safetensors")
    elements = args.tensor_mb << 19  # BF16
    count = max(1, int(args.gb * 1024) // args.tensor_mb)
    g = torch.Generator().manual_seed(1)
    save_file({f"layers.{i}.weight": torch.randn(elements, generator=g).to(torch.bfloat16) for i in range(count)}, path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:  # warm the page cache
        while f.read(64 << 20):
            pass

    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(args.build, "python") + os.pathsep + env.get("PYTHONPATH", "")
    rows = [
        ("weightstore file: store.tensors, 1 copying thread", "weightstore", {"WEIGHTSTORE_COPY_THREADS": "1"}),
        ("weightstore file: store.tensors, default threads", "weightstore", {}),
        ("safetensors load_file (views of a mapping)", "safetensors", {}),
        ("safetensors load_file(backend='pread')", "safetensors-pread", {}),
        ("torch copy_ of the mapped file, 1 thread", "plain", {}),
        ("weightstore file: default threads, huge pages", "weightstore", {"WEIGHTSTORE_HUGE_PAGES": "1"}),
        ("weightstore file: default threads, 4 KiB pages", "weightstore", {"WEIGHTSTORE_HUGE_PAGES": "0"}),
        ("weightstore file: default threads, no prefault", "weightstore", {"WEIGHTSTORE_PREFAULT": "0"}),
        ("limit: copy into fresh 4 KiB pages, prefaulted", "limit-4k-prefault", {}),
        ("limit: copy into fresh huge pages, every core", "limit-huge", {}),
        ("limit: copy into fresh 4 KiB pages, every core", "limit-4k", {}),
    ]
    times = {label: [] for label, _, _ in rows}
    rss = {label: 0 for label, _, _ in rows}
    checks = {}
    # The rows take turns in a new order each round: a process that fills
    # fresh memory right after another freed as much is served from pages
    # the kernel has at hand, much faster on this VM than one that comes
    # after a process that held little, so no row may always follow the same
    # one. Each time is printed with the row that ran just before it.
    before = {label: [] for label, _, _ in rows}
    previous = "-"
    for round_ in range(args.runs):
        order = list(rows)
        random.Random(round_).shuffle(order)
        for label, mode, extra in order:
            before[label].append(previous)
            previous = mode
            out = subprocess.run([sys.executable, LOADER, mode, path], env={**env, **extra}, check=True,
                                 capture_output=True, text=True).stdout.split()
            times[label].append(float(out[0]))
            rss[label] = max(rss[label], int(out[2]))
            if not mode.startswith("limit") and mode != "plain":
                checks.setdefault(label, out[1])
    reference = checks["safetensors load_file (views of a mapping)"]
    for label, value in checks.items():
        if value != reference:
            sys.exit(f"{label}: tensors differ from load_file's ({value} != {reference})")

    print(f"{size / 2**30:.2f} GiB of BF16 in {count} tensors; {os.cpu_count()} CPUs; medians of {args.runs}")
    base = statistics.median(times[rows[0][0]])
    limit = statistics.median(times[rows[-2][0]])
    for label, _, _ in rows:
        median = statistics.median(times[label])
        print(f"  {label:<52} {median * 1000:8.1f} ms  {size / median / 1e9:5.2f} GB/s  "
              f"{base / median:4.2f}x of 1 thread  {median / limit:4.2f}x the huge-page limit's time  "
              f"peak RSS {rss[label] / 2**20:6.0f} MiB  "
              f"(runs, after: {', '.join(f'{t * 1000:.0f} {b}' for t, b in zip(times[label], before[label]))})")


if __name__ == "__main__":
    main()

"""rl_update_bench: an RL worker's torch module following a trainer, in one run.

The trainer's policy is --gb GiB of BF16 Linear layers; each step changes 1% of
every weight's elements at random, as RL steps do, and is published as a
SafeTensors file renamed over the last one (the daemon rescans on SIGHUP).
The worker calls store.update(module, since=...) over gRPC: the changed
elements arrive as element patches and are written into the module's
parameters in one native call with the GIL released. Each step is also
fetched whole into the module (store.update with since=None), the per-tensor
delta's cost when every tensor changed. Prints bytes received and times per
step, and their medians.

With --push the trainer publishes by store.push(name, trainer, base=last)
instead (only the changed elements, as element patches against its copy of
what it pushed last), taking turns with a push without a base (the changed
tensors whole), and the worker follows each; prints both pushes' times and
the worker's updates.

Usage: build-tools/venv/bin/python tests/bench/rl_update_bench.py [--build build] [--gb 1] [--steps 5] [--push]
"""
import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--gb", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--push", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(args.build, "python"))
    import weightstore

    torch.manual_seed(0)
    layers = (args.gb << 30) // (2048 * 2048 * 2)
    trainer = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(layers)]).to(torch.bfloat16)
    worker = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(layers)]).to(torch.bfloat16)
    total = sum(p.numel() * p.element_size() for p in trainer.parameters())
    work = tempfile.mkdtemp(prefix="weightstore-rl-bench-")
    models, port_file = f"{work}/models", f"{work}/port"
    os.makedirs(models)
    path = f"{models}/policy.safetensors"

    def publish():
        save_file({n: p.detach() for n, p in trainer.state_dict().items()}, path + ".next")
        os.replace(path + ".next", path)

    publish()
    daemon = subprocess.Popen([f"{args.build}/server/weightstored", "--models", models, "--listen", "127.0.0.1:0",
                               "--port-file", port_file], stderr=subprocess.DEVNULL)
    try:
        for _ in range(400):
            if os.path.exists(port_file) and open(port_file).read().strip():
                break
            time.sleep(0.05)
        store = weightstore.connect("127.0.0.1:" + open(port_file).read().strip())
        held = store.update(worker, "policy")
        print(f"rl_update_bench: {total >> 20} MiB of BF16 in {layers} weights [2048, 2048], 1% of each changed "
              f"per step, gRPC on loopback, torch {torch.__version__}")
        if args.push:
            run_pushes(store, trainer, worker, held, total, layers, args.steps)
            return
        patched_s, whole_s, fractions = [], [], []
        for step in range(args.steps):
            with torch.no_grad():
                for p in trainer.parameters():
                    flat = p.view(-1)
                    flat[torch.randint(0, flat.numel(), (flat.numel() // 100,))] += 0.01
            publish()
            daemon.send_signal(signal.SIGHUP)
            while store.info("policy")["version"] == held.version:  # the rescan (digests, diffs) is done
                time.sleep(0.01)
            start = time.perf_counter()
            update = store.update(worker, "policy", since=held.version)
            patched_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            store.update(worker, "policy")  # the whole checkpoint into the same module
            whole_s.append(time.perf_counter() - start)
            same = all(torch.equal(a, b) for a, b in zip(worker.parameters(), trainer.parameters()))
            fractions.append(update.fetched_bytes / total)
            print(f"step {step + 1}: {len(update.patched)} of {layers} weights patched, "
                  f"{100 * fractions[-1]:.2f}% of the bytes, {patched_s[-1]:.3f} s; whole {whole_s[-1]:.3f} s; "
                  f"equal to the trainer's: {same}")
            held = update
        print(f"median: {100 * statistics.median(fractions):.2f}% of the bytes; update with patches "
              f"{statistics.median(patched_s):.3f} s, whole {statistics.median(whole_s):.3f} s: "
              f"{100 * statistics.median(patched_s) / statistics.median(whole_s):.1f}% of the time")
    finally:
        daemon.terminate()
        daemon.wait()
        shutil.rmtree(work)


def rl_step(module):
    """1% of every weight's elements move, at random."""
    with torch.no_grad():
        for p in module.parameters():
            flat = p.view(-1)
            flat[torch.randint(0, flat.numel(), (flat.numel() // 100,))] += 0.01


def run_pushes(store, trainer, worker, held, total, layers, steps):
    """--push: steps pushed with a base (patches) and without one (whole), in turns."""
    last = {n: t.detach().clone() for n, t in trainer.state_dict().items()}
    times = {"patches": [], "whole": []}
    copy_s, sent = [], {"patches": [], "whole": []}
    for step in range(2 * steps):
        kind = "patches" if step % 2 == 0 else "whole"
        rl_step(trainer)
        start = time.perf_counter()
        pushed = store.push("policy", trainer, base=last if kind == "patches" else None)
        times[kind].append(time.perf_counter() - start)
        sent[kind].append(pushed.sent_bytes / total)
        start = time.perf_counter()
        for n, t in trainer.state_dict().items():  # the trainer's copy of what it pushed
            last[n].copy_(t)
        copy_s.append(time.perf_counter() - start)
        update = store.update(worker, "policy", since=held.version)
        same = all(torch.equal(a, b) for a, b in zip(worker.parameters(), trainer.parameters()))
        print(f"push {step + 1} ({kind}): {len(pushed.patched)} patched, {len(pushed.whole)} whole of {layers}, "
              f"{100 * sent[kind][-1]:.2f}% of the bytes sent, {times[kind][-1]:.3f} s; the worker's update "
              f"{100 * update.fetched_bytes / total:.2f}% of the bytes, {len(update.patched)} patched; "
              f"equal to the trainer's: {same}")
        held = update
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"median push: with a base {med['patches']:.3f} s ({100 * statistics.median(sent['patches']):.2f}% of the "
          f"bytes), without {med['whole']:.3f} s ({100 * statistics.median(sent['whole']):.2f}%): "
          f"{100 * med['patches'] / med['whole']:.1f}% of the time; the base's copy_ "
          f"{statistics.median(copy_s):.3f} s")


if __name__ == "__main__":
    main()

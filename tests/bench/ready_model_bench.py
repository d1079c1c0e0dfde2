"""ready_model_bench: time to a ready model, the same Llama-style models loaded
every way in one run.

A "ready" model is a transformers LlamaForCausalLM (bf16, on the CPU) whose
parameters hold the checkpoint's values, ready for forward. Rows:

  transformers from_pretrained   AutoModelForCausalLM.from_pretrained(dir) of
                                 what save_pretrained wrote (SafeTensors, and
                                 an index with shards for the largest model)
  safetensors load_file          safetensors.torch.load_file of every shard,
                                 then model.load_state_dict
  torch.load(mmap=True)          of the same state dict saved with torch.save
                                 (.pt), then model.load_state_dict
  weightstore <transport>        the `weightstore` package (PYTHONPATH=<build>/python)
                                 from a weightstored this script starts on
                                 127.0.0.1 port 0 with --socket and
                                 --data-listen, serving the same SafeTensors
                                 files: the same-host socket ("unix:"), gRPC
                                 over loopback ("127.0.0.1:P") with the bytes
                                 on the data lane (the default where a daemon
                                 has one) and on the stream alone
                                 (data_lane=False), and local files read in
                                 this process ("file:"):
      load_into                  connect + store.load_into(model, name)
      tensors + load_state_dict  connect + store.tensors(name) + model.load_state_dict
      (socket only) ... (assign=True)  the same, with the parameters assigned,
                                 not copied: they view the daemon's memory,
                                 as from_pretrained's view the files
      tensors only               connect + store.tensors(name): tensors, no model

What is inside the timing: everything from nothing to a ready model, in this
process. Every row that loads into a model builds it inside the timing, from
the config, in the same way: AutoModelForCausalLM.from_config under
transformers' no_init_weights (parameters allocated, not initialized, as
from_pretrained does for weights it is about to load); the first row shows what
that construction alone takes. from_pretrained builds its own model. Every
repeat gets a fresh model; none is reused. The "tensors only" rows build no
model and are not ready models: they are what the fetch alone costs.

The page cache is warm for every row: every file is read once before any row,
and each row runs once untimed first (which also lets the daemon compute its
checksums once). That untimed run is checked: its logits on a fixed input equal
from_pretrained's exactly (the tensors-only rows: every tensor equals
load_file's). Then --repeats rounds, the rows interleaved within each round;
the table shows medians. Ratios are the row's speed against safetensors
load_file's in the same run (above 1: faster). After the table: where each
ready model's parameters live (memory of its own, or a mapping), and the
peak RSS of this process while the rows ran (VmHWM, reset after the
checkpoints are written) and of the daemon.

The daemon runs with its defaults besides --socket and --data-listen: a socket client that could
write the files itself (as here, the same user) gets a sealed shared-memory
copy of each checkpoint (--socket-file-segments auto), made once and kept. Every row runs in this one process, so glibc's heap
may hand a repeat memory an earlier repeat freed (already faulted in), as it
would to any long-lived loader; torch runs on --threads intra-op threads.

Usage: PYTHONPATH=build/python python tests/bench/ready_model_bench.py [--repeats 5] [--quick]
"""
import argparse
import gc
import glob
import os
import shutil
import statistics
import sys
import tempfile
import time

import bench_daemon

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# Llama-style configs (bf16): about 10, 100 and 500 MB of weights. The largest
# is saved in shards, as checkpoints of that kind usually are.
MODELS = [
    ("llama-10m", dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=4)),
    ("llama-100m", dict(vocab_size=16384, hidden_size=768, intermediate_size=2048, num_hidden_layers=4,
                        num_attention_heads=12, num_key_value_heads=4)),
    ("llama-500m", dict(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=6,
                        num_attention_heads=12, num_key_value_heads=4)),
]
SHARD_SIZE = "200MB"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="the two smaller models, 2 repeats: a smoke run")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's intra-op threads (1: on 2 shared cores, 2 threads made a 10 MB "
                             "load_state_dict take 1.5-250 ms, as OpenMP waited for a busy core)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args()
    if args.quick:
        args.repeats = min(args.repeats, 2)
    models = MODELS[:2] if args.quick else MODELS
    sys.path.insert(0, os.path.join(args.build, "python"))  # the package as built (or pip-install it)

    import torch
    import transformers
    import safetensors
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.initialization import no_init_weights
    import weightstore

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()  # its bars would be drawn inside the timing
    torch.manual_seed(0)
    work = tempfile.mkdtemp(prefix="weightstore-ready-bench-")
    root, pt_dir = f"{work}/models", f"{work}/pt"
    os.makedirs(pt_dir)
    daemon = None
    try:
        # The checkpoints: save_pretrained into <models>/<name>/ (served as
        # <name>/model), the same state dict with torch.save outside the
        # models folder.
        configs, sizes, files = {}, {}, {}
        for name, shape in models:
            config = LlamaConfig(**shape, max_position_embeddings=512, tie_word_embeddings=False)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            model.save_pretrained(f"{root}/{name}", max_shard_size=SHARD_SIZE)
            state = model.state_dict()
            torch.save(state, f"{pt_dir}/{name}.pt")
            sizes[name] = sum(t.numel() * t.element_size() for t in state.values())
            configs[name] = transformers.AutoConfig.from_pretrained(f"{root}/{name}")
            del model, state
            files[name] = sorted(glob.glob(f"{root}/{name}/*.safetensors"))
        for path in glob.glob(f"{root}/*/*") + glob.glob(f"{pt_dir}/*"):  # warm the page cache
            with open(path, "rb") as f:
                while f.read(64 << 20):
                    pass

        daemon, grpc, socket = bench_daemon.start(args.build, root, work, extra=("--data-listen", "127.0.0.1:0"))
        # transport -> (url, connect()'s keywords)
        transports = {"socket": (socket, {}), "gRPC, data lane": (grpc, {}),
                      "gRPC, stream only": (grpc, {"data_lane": False}), "file": ("file:" + root, {})}
        served = {c["name"] for c in weightstore.connect(grpc).list()}
        missing = [f"{n}/model" for n, _ in models if f"{n}/model" not in served]
        if missing:
            raise SystemExit(f"weightstored does not serve {missing} (it serves {sorted(served)})")

        def build(name):
            with no_init_weights():
                return AutoModelForCausalLM.from_config(configs[name], dtype=torch.bfloat16)

        def rows_for(name):
            directory, checkpoint, pt = f"{root}/{name}", f"{name}/model", f"{pt_dir}/{name}.pt"

            def safetensors_row():
                model = build(name)
                state = {}
                for path in files[name]:
                    state.update(load_file(path))
                model.load_state_dict(state)
                return model

            def torch_load_row():
                model = build(name)
                model.load_state_dict(torch.load(pt, mmap=True, weights_only=True))
                return model

            rows = [
                ("build the model (no init)", lambda: build(name)),
                ("transformers from_pretrained(dir)",
                 lambda: AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)),
                ("safetensors load_file + load_state_dict", safetensors_row),
                ("torch.load(.pt, mmap=True) + load_state_dict", torch_load_row),
            ]
            for transport, (url, kw) in transports.items():
                def connect(url=url, kw=kw):
                    return weightstore.connect(url, **kw)

                def load_into(connect=connect):
                    model = build(name)
                    result = connect().load_into(model, checkpoint)
                    if result.errors or result.missing:
                        raise RuntimeError(f"load_into {checkpoint}: {result}")
                    return model

                def tensors_state_dict(connect=connect):
                    model = build(name)
                    model.load_state_dict(connect().tensors(checkpoint))
                    return model

                if transport == "socket":
                    def tensors_assign(connect=connect):
                        model = build(name)
                        model.load_state_dict(connect().tensors(checkpoint), assign=True)
                        return model
                    rows.append((f"weightstore {transport}: tensors + load_state_dict(assign=True)", tensors_assign))
                rows += [(f"weightstore {transport}: load_into", load_into),
                         (f"weightstore {transport}: tensors + load_state_dict", tensors_state_dict),
                         (f"weightstore {transport}: tensors only", lambda connect=connect: connect().tensors(
                             checkpoint))]
            return rows

        tokens = torch.randint(0, 4096, (1, 16), generator=torch.Generator().manual_seed(1))

        def logits(model):
            with torch.no_grad():
                return model.eval()(tokens).logits

        def backing(model):
            """Bytes of the model's parameters and buffers by what holds them: memory of this process's own, or
            a mapping (of a file, or of the daemon's shared memory)."""
            regions = []
            with open("/proc/self/maps") as f:
                for line in f:
                    fields = line.split(maxsplit=5)
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    path = fields[5].strip() if len(fields) > 5 else ""
                    if not path or path.startswith("["):
                        kind = "own memory"
                    elif "memfd:" in path or path.startswith("/dev/shm"):
                        kind = "a mapping of the daemon's shared memory"
                    else:
                        kind = f"a mapping of the {os.path.splitext(path.replace(' (deleted)', ''))[1]} file(s)"
                    regions.append((start, end, kind))
            out = {}
            for t in list(model.parameters()) + list(model.buffers()):
                ptr = t.data_ptr()
                kind = next((k for a, b, k in regions if a <= ptr < b), "?")
                out[kind] = out.get(kind, 0) + t.numel() * t.element_size()
            return out

        import ctypes
        libc = ctypes.CDLL(None)

        def status_kib(field):
            with open("/proc/self/status") as f:
                return int([l for l in f if l.startswith(field + ":")][0].split()[1])

        def reset_peak():
            """VmHWM back to the current RSS; False where the kernel does not let it."""
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                return True
            except OSError:
                return False

        gc.collect()
        rss_reset = reset_peak()  # the peak RSS from here on, not the writing of the checkpoints'
        overall_kib = 0
        peaks = {}  # row label -> peak RSS above its start, bytes (the largest model's checked run)
        times = {}  # (row label, model name) -> [ms]
        held_in = {}  # row label -> backing() of its checked model, the last (largest) model's
        labels = []
        for name, _ in models:
            rows = rows_for(name)
            labels = [label for label, _ in rows]
            # The untimed first run of every row, checked.
            reference_logits = reference_tensors = None
            measure = rss_reset and name == models[-1][0]
            for label, fn in rows:
                if measure:
                    # Freed heap memory goes back to the kernel first, so
                    # the row's memory is faulted afresh and counted.
                    gc.collect()
                    libc.malloc_trim(0)
                    start_kib = status_kib("VmRSS")
                    overall_kib = max(overall_kib, status_kib("VmHWM"))  # the whole run's, kept across resets
                    reset_peak()
                result = fn()
                if measure:
                    peaks[label] = (status_kib("VmHWM") - start_kib) * 1024
                if label.startswith("build"):
                    pass
                elif isinstance(result, dict):
                    if reference_tensors is None:
                        reference_tensors = {}
                        for path in files[name]:
                            reference_tensors.update(load_file(path))
                    if result.keys() != reference_tensors.keys() or not all(
                            torch.equal(result[k], reference_tensors[k]) for k in result):
                        raise SystemExit(f"{name}, {label}: the tensors differ from load_file's")
                else:
                    got = logits(result)
                    held_in[label] = backing(result)
                    if reference_logits is None:
                        reference_logits = got
                    elif not torch.equal(got, reference_logits):
                        raise SystemExit(f"{name}, {label}: logits differ from from_pretrained's "
                                         f"(max diff {(got.float() - reference_logits.float()).abs().max()})")
                del result
                gc.collect()
            del reference_tensors
            gc.collect()
            for _ in range(args.repeats):
                for label, fn in rows:
                    start = time.perf_counter()
                    result = fn()
                    elapsed = (time.perf_counter() - start) * 1e3
                    times.setdefault((label, name), []).append(elapsed)
                    del result
                    gc.collect()
            print(f"  {name}: done", file=sys.stderr, flush=True)

        daemon_hwm_kib = 0
        try:
            with open(f"/proc/{daemon.pid}/status") as f:
                daemon_hwm_kib = int([l for l in f if l.startswith("VmHWM:")][0].split()[1])
        except (OSError, IndexError):
            pass
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait()
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)

    # The table.
    medians = {key: statistics.median(v) for key, v in times.items()}
    baseline = "safetensors load_file + load_state_dict"
    print(f"ready_model_bench: time to a ready LlamaForCausalLM (bf16, CPU), torch {torch.__version__}, "
          f"transformers {transformers.__version__}, safetensors {safetensors.__version__}, "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    print(f"median of {args.repeats} (rows interleaved), page cache warm; inside the timing: build the model "
          f"from its config (no init) + connect + load; 'tensors only' builds no model")
    print("cells: median ms, GB/s of checkpoint bytes, speed against safetensors load_file (above 1: faster)\n")
    for name, _ in models:
        shards = len(files[name])
        print(f"  {name}: {sizes[name] / 1e6:.1f} MB, {shards} SafeTensors "
              f"file{'s' if shards > 1 else ''}")
    width = 64
    head = f"\n{'':{width}}" + "".join(f"{f'{n} ({sizes[n] / 1e6:.0f} MB)':>28}" for n, _ in models)
    print(head)
    for label in labels:
        cells = []
        for name, _ in models:
            ms = medians[(label, name)]
            gbs = sizes[name] / 1e9 / (ms / 1e3)
            ratio = medians[(baseline, name)] / ms
            cells.append(f"{ms:9.1f} ms" + (" " * 15 if label == labels[0] else f" {gbs:6.2f} {ratio:6.2f}x"))
        print(f"  {label:{width - 2}}" + "".join(f"{c:>28}" for c in cells))
    with open("/proc/self/status") as f:
        hwm_kib = max(overall_kib, int([l for l in f if l.startswith("VmHWM:")][0].split()[1]))
    print(f"\nwhere the parameters and buffers of each ready {models[-1][0]} live:")
    for label, kinds in held_in.items():
        total = sum(kinds.values())
        parts = [f"{100 * b / total:.0f}% {k}" if b >= total / 100 else f"<1% {k}"
                 for k, b in sorted(kinds.items(), key=lambda kv: -kv[1])]
        print(f"  {label:{width - 2}}" + ", ".join(parts))
    if peaks:
        big = models[-1][0]
        print(f"\npeak RSS above each row's start, {big}'s checked run (the result held at the end counts; "
              f"mapped pages count too), as a multiple of its {sizes[big] / 1e6:.0f} MB:")
        for label, peak in peaks.items():
            print(f"  {label:{width - 2}}{peak / 2 ** 20:8.0f} MiB {peak / sizes[big]:6.2f}x")
    since = "while the rows ran" if rss_reset else "since it started, writing the checkpoints included"
    print(f"\npeak RSS of this process {since}: {hwm_kib / 1024:.0f} MiB; of the daemon: "
          f"{daemon_hwm_kib / 1024:.0f} MiB")


if __name__ == "__main__":
    main()

